"""Tables a newcomer reads in a terminal show each value whole: a long one wraps, none is cut short.

`inv env.topology` printed "0 GPU(s), 0 RDMA NIC(s), 1 other NIC(s), 1 NU..." (the preflight table
cut values at 48 characters), and the fan-out's table of every host cut them at 40.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from runtime.jobs import fanout
from runtime.preflight import CheckResult, table
from runtime.cluster.results import HostResult
from helpers.program import REPO, INV

LONG = ("0 GPU(s), 0 RDMA NIC(s), 1 other NIC(s), 1 NUMA node(s); "
        "/sys/devices/pci0000:00/0000:00:03.0/net/eth0/device/numa_node says -1")


def column(text: str, header: str, next_header: str) -> list[str]:
    """The cells of one column of a tabulate "simple" table, read back by the header's position."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if header in line and next_header in line)
    start, end = lines[head].index(header), lines[head].index(next_header)
    body = lines[head + 2:]
    body = body[:body.index("")] if "" in body else body     # the table ends at its first blank line
    return [line[start:end].strip() for line in body]


def same_text(cells: list[str], value: str, width: int) -> bool:
    """The cells' lines hold `value` whole: every character, in order, and every word that fits the
    column (`width`) unbroken (a longer one may be broken anywhere)."""
    shown = " ".join(cell for cell in cells if cell)
    words = {word for cell in cells for word in cell.split()}
    return ("".join(shown.split()) == "".join(value.split())
            and all(word in words for word in value.split() if len(word) <= width))


def test_inv_env_topology_shows_each_value_whole():
    env = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": "/nonexistent-runs"}
    shown = subprocess.run([str(INV), "env.topology", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    values = [str(c["value"]) for c in json.loads(shown.stdout)["checks"]]
    text = subprocess.run([str(INV), "env.topology"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120).stdout
    assert "..." not in text and "…" not in text
    assert same_text(column(text, "value", "reason / fix"), " ".join(values), 48)


def test_the_preflight_table_wraps_a_long_value_at_its_spaces():
    text = table([CheckResult("topology.map", "PASS", LONG, "from sysfs", ""),
                  CheckResult("gpu.count", "FAIL", 7, "7 of 8 GPUs", "reseat GPU 3")])
    cells = column(text, "value", "reason / fix")
    assert all(len(cell) <= 48 for cell in cells) and len(cells) > 2
    assert same_text(cells, f"{LONG} 7", 48)
    assert "fix: reseat GPU 3" in text


def test_the_fan_out_table_wraps_a_long_value_at_its_spaces():
    payload = {"checks": [{"name": "topology.map", "status": "PASS", "value": LONG, "reason": "from sysfs"}]}
    report = fanout.merge([HostResult(host="n1", exit_code=0, stdout=json.dumps(payload), payload=payload)])
    text = fanout.render(report)
    assert "…" not in text
    assert same_text(column(text, "value", "reason / fix"), LONG, 40)

"""`inv -H` for real: the installed inv fans out over SSH to hosts in network
namespaces (tests/cluster.py), each running this same checkout's inv, as on
a cluster with a shared home.

SSH settings travel the way a user passes them: the key with -i, the rest in
a runner settings file given with -f (remote_path, remote_inv,
connect_timeout, runs_dir), which the runner forwards to the hosts.
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns]


@dataclass
class Fanout:
    inv: Path
    repo: Path
    settings: Path
    key: str
    up: list[str]        # addresses with sshd
    down: str            # an address in our namespace with no sshd (refused)
    work: Path

    def run(self, hosts: list[str], *task: str, timeout: float = 180) -> subprocess.CompletedProcess:
        argv = [str(self.inv), "-f", str(self.settings), "-i", self.key, "-H", ",".join(hosts), *task]
        return subprocess.run(argv, cwd=self.repo, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.fixture
def fanout(netns_cluster, inv_bin, repo, tmp_path) -> Fanout:
    settings = json.loads(netns_cluster.invoke_yaml(repo, connect_timeout=5))
    del settings["anvil"]["key_filename"]          # the key comes with -i
    settings["anvil"]["runs_dir"] = str(tmp_path / "runs")
    path = tmp_path / "anvil-hosts.yaml"
    path.write_text(json.dumps(settings))
    return Fanout(inv=inv_bin, repo=repo, settings=path, key=netns_cluster.key_file,
                  up=[h.address for h in netns_cluster.hosts],
                  down=netns_cluster.down_hosts[0].address, work=tmp_path)


def listed(result: subprocess.CompletedProcess, label: str) -> list[str]:
    """The host list after 'passing hosts:' / 'failing hosts:' in the text report."""
    match = re.search(rf"^{label} hosts: (.*)$", result.stdout, re.M)
    assert match, f"no '{label} hosts:' line in:\n{result.stdout}"
    return [] if match.group(1) == "(none)" else match.group(1).split(",")


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


# ---- a plain task: per-host JSON comes back --------------------------------------------------

def test_plain_task_runs_on_every_host_and_returns_its_json(fanout):
    result = fanout.run(fanout.up, "env.detect", "--json")
    assert result.returncode == 0, explain(result)
    report = json.loads(result.stdout)
    assert report["task"] == "env.detect"
    assert report["passing"] == fanout.up and report["failing"] == []
    for host in fanout.up:
        entry = report["hosts"][host]
        assert entry["exit_code"] == 0 and entry["error"] is None
        assert entry["output"]["vendor"] == "cpu"      # each host ran detection for real
        assert entry["output"]["count"] == 0


def test_unreachable_host_is_reported_and_the_others_finish(fanout):
    hosts = [*fanout.up, fanout.down]
    result = fanout.run(hosts, "env.detect")
    assert result.returncode != 0, explain(result)
    assert listed(result, "passing") == fanout.up, explain(result)
    assert listed(result, "failing") == [fanout.down], explain(result)
    down_row = next(line for line in result.stdout.splitlines() if line.startswith(fanout.down + " "))
    assert "UNREACHABLE" in down_row and "Unable to connect to port 22" in down_row, down_row
    for host in fanout.up:      # their own output still came back, each with exit 0
        assert f"=== {host} (exit 0) ===" in result.stdout, explain(result)
    assert "Traceback" not in result.stdout + result.stderr

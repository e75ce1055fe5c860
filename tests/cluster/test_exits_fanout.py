"""SIGTERM to an `inv -H` fan-out (a scheduler ends inv alone) stops it as Ctrl-C does: every host's
task is stopped and recorded, the fan-out run says interrupted, exit 143 (SIGTERM's 128+N).
It used to kill inv at once: the hosts' tasks went on unwatched and the run stayed "running"."""
from __future__ import annotations

import json
import os
import re
import signal

import pytest

from test_fanout_netns import _alive, _remote_pids, _start_long_gemm, fanout  # noqa: F401 (fanout: the fixture)

pytestmark = [pytest.mark.netns]


def test_sigterm_stops_the_task_on_every_host_and_records_it(fanout):  # noqa: F811
    proc, runs = _start_long_gemm(fanout)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err and "interrupted: stopping the task on 2 host(s)" in err, err
    for host in fanout.up:
        assert re.search(rf"^{re.escape(host)}\s+INTERRUPTED\s", err, re.M), err
    (run,) = fanout.runs.glob("*_bench.gemm")
    metadata = json.loads((run / "metadata.json").read_text())
    assert (metadata["status"], metadata["exit_code"], metadata["error"]) == ("interrupted", 143,
                                                                              "interrupted (SIGTERM)")
    for host, own in runs.items():               # each host's run ended as at a Ctrl-C there
        assert json.loads((own / "metadata.json").read_text())["status"] == "interrupted", host
    assert not any(_alive(pid) for pid in _remote_pids(runs))

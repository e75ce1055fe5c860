"""runtime.cluster.slurm.nodetask: one node's part of each_node under Slurm always leaves its record and
exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from helpers.processes import signal_until_exit


def _nodetask(tmp_path, *command, options=()):
    env = {**os.environ, "SLURMD_NODENAME": "n7", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2"}
    return subprocess.Popen([sys.executable, "-m", "runtime.cluster.slurm.nodetask", str(tmp_path), *options, "--",
                             *command], env=env, cwd=os.getcwd(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_the_task_result_is_recorded_under_the_node_name(tmp_path):
    proc = _nodetask(tmp_path, sys.executable, "-c", "import sys; print('hi'); sys.exit(5)")
    assert proc.wait(timeout=60) == 0                        # a failed task is a result, not a failed step
    record = json.loads((tmp_path / "n7.json").read_text())
    assert record["host"] == "n7" and record["exit_code"] == 5 and record["stdout"] == "hi\n"


def test_the_command_gets_its_node_and_a_timeout_ends_it(tmp_path):
    proc = _nodetask(tmp_path, sys.executable, "-c", "import os, time; print(*(os.environ[n] for n in ('ANVIL_HOST', "
                     "'ANVIL_NODE_RANK', 'ANVIL_NNODES', 'ANVIL_NODE_RUNS_DIR')), flush=True); time.sleep(60)",
                     options=("--timeout", "2"))
    started = time.monotonic()
    assert proc.wait(timeout=60) == 0 and time.monotonic() - started < 30
    record = json.loads((tmp_path / "n7.json").read_text())
    assert record["stdout"] == f"n7 1 2 {tmp_path / 'n7'}\n" and record["error"] == "command timed out after 2 s"


def test_signals_go_on_to_the_task_and_late_ones_do_not_lose_the_record(tmp_path):
    """scancel signals again and again: the first reaches the task, none kills the node's part."""
    started = tmp_path / "started"
    proc = _nodetask(tmp_path, sys.executable, "-c",
                     f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(60)")
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:   # the task runs: nodetask passes signals on
        time.sleep(0.01)
    assert signal_until_exit(proc, signal.SIGTERM) == 0, proc.stderr.read().decode()[-2000:]
    assert json.loads((tmp_path / "n7.json").read_text())["exit_code"] == -signal.SIGTERM

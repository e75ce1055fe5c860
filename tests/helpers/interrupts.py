"""Stopping inv with a signal as a terminal (the whole process group) or a scheduler (inv alone) does,
and what every stopped task must leave: its exit 128+N, its run recorded interrupted, no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers.processes import wait_until
from helpers.program import assert_no_traceback, metadata, runs

# How inv names each stop signal in what it says ("interrupted (SIGTERM)").
SIGNAL_NAME = {signal.SIGTERM: "SIGTERM", signal.SIGUSR2: "SIGUSR2", signal.SIGINT: "Ctrl-C", signal.SIGHUP: "SIGHUP"}
# A GEMM benchmark that takes hours on a CPU: a task well under way whenever a test stops it.
LONG_GEMM = ("bench.gemm", "-M", "512", "--dtype", "fp32", "--iters", "10000000")


def send(proc: subprocess.Popen, signum: int, group: bool = True) -> None:
    """`signum` to proc's process group (a terminal, Slurm) or to proc alone (a scheduler ending inv)."""
    (os.killpg if group else os.kill)(proc.pid, signum)


def ended(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of proc once it ended; fails the test (and kills its group) if it
    is still running after `timeout` seconds."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running {timeout} s after the signal:\n{err[-3000:]}")
    return proc.returncode, out, err


def group_gone(pgid: int, timeout: float = 30) -> bool:
    """Every process of the group (workers, agent, ranks) has ended."""
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
            return False
        except ProcessLookupError:
            return True
    return wait_until(gone, timeout=timeout)


def interrupted_run(proc: subprocess.Popen, work: Path, task: str, signum: int) -> tuple[Path, str]:
    """(the run, stderr) of a task a stop signal ended: exit 128+N, "TASK interrupted (SIGX)" said, the
    run recorded interrupted with that status, and nothing of its process group left."""
    code, out, err = ended(proc)
    assert_no_traceback(out, err)
    (run,) = runs(work)
    assert code == 128 + signum and f"{task} interrupted ({SIGNAL_NAME[signum]})" in err, err[-3000:]
    md = metadata(run)
    assert md["status"] == "interrupted" and md["exit_code"] == code
    assert group_gone(proc.pid)
    return run, err


def sleeping_hook(folder: Path, kind: str) -> tuple[Path, Path]:
    """(a --patch hook of `kind` py or sh, the file it makes when it starts): a hook that says it started
    and then waits, to hold a run in its pre hooks."""
    started = folder / "hook-started"
    hook = folder / f"wait.{kind}"
    if kind == "sh":
        hook.write_text(f"touch {started}\nsleep 120\n")
    else:
        hook.write_text(f"import time\nfrom pathlib import Path\n\ndef hook(ctx):\n"
                        f"    Path({str(started)!r}).touch()\n    time.sleep(120)\n")
    return hook, started

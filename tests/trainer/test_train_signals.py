"""train.pretrain stopped by a signal, through the installed inv, as a terminal (the whole process group)
or a scheduler (inv alone) sends it: before its first step (inv starting, its pre hooks, the ranks
building the model) it says "interrupted (SIGX) before the first step" with the exit of the README's table
(3 for SIGTERM and SIGUSR2, 130 for SIGINT and SIGHUP), never "rank 0 failed first"; after it, it
checkpoints (exit 3). Other tasks stopped by a signal: data/test_data_resume.py, bench/, runner/.
"""
from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

import pytest

from helpers.interrupts import SIGNAL_NAME, ended, group_gone, send, sleeping_hook
from helpers.processes import wait_until
from helpers.program import assert_no_traceback, metadata, runs, sets, start_inv
from helpers.training import QUIET, TINY_MODEL

# 400 steps: still training whenever a signal lands.
LONG_RUN = [*TINY_MODEL, "data.seq_len=64", "data.batch_size=4", "train.steps=400", "train.log_interval=1",
            "train.val_batches=0", "checkpoint.interval=0", *QUIET]
# About 103 M parameters: the ranks take seconds to build it (and say so), a window before the trainer's
# own signal handler is in place.
SLOW_TO_BUILD = ["model.dim=1024", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8",
                 "model.ffn_dim=2816", "data.seq_len=64", "data.batch_size=1"]
TRAINING_EXIT = {signal.SIGTERM: 3, signal.SIGUSR2: 3, signal.SIGINT: 130, signal.SIGHUP: 130}


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` yet (Linux: /proc/PID/status SigCgt). inv sets
    its handlers for the four stop signals together, first thing (runtime/program/interrupts.py)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_inv_starts_is_an_interruption_before_the_first_step(tmp_path, dataset, signum):
    """It used to end inv silently: exit 143 or 129, or exit 1 for a Ctrl-C (Invoke's)."""
    proc = start_inv(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *LONG_RUN))
    # inv's handlers come all at once; SIGTERM's tells (Python handles SIGINT from its first moment,
    # and a Ctrl-C before inv's own handler is Python's: a traceback out of its site module)
    assert wait_until(lambda: catches(proc.pid, signal.SIGTERM), proc, timeout=60, pause=0.005)
    send(proc, signum)
    code, out, err = ended(proc)
    assert_no_traceback(out, err)
    assert code == TRAINING_EXIT[signum], err[-3000:]
    assert f"train.pretrain interrupted ({SIGNAL_NAME[signum]}) before the first step" in err, err[-3000:]
    for run in runs(tmp_path):      # (one may exist: the signal may land once the run directory is made)
        assert metadata(run)["status"] == "interrupted" and metadata(run)["exit_code"] == code
    assert group_gone(proc.pid)


@pytest.mark.parametrize("hook_kind, signum", [("sh", signal.SIGTERM), ("py", signal.SIGUSR2),
                                               ("sh", signal.SIGHUP)])
def test_a_signal_in_the_pre_hooks_records_the_run_interrupted(tmp_path, dataset, hook_kind, signum):
    """A Python hook used to turn it into "hook ... failed: KeyboardInterrupt" and a failed run."""
    hook, started = sleeping_hook(tmp_path, hook_kind)
    proc = start_inv(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *LONG_RUN), "--patch", str(hook))
    assert wait_until(started.exists, proc, timeout=120)
    send(proc, signum)
    code, out, err = ended(proc)
    assert_no_traceback(out, err)
    (run,) = runs(tmp_path)
    assert code == TRAINING_EXIT[signum] and metadata(run)["exit_code"] == code, err[-3000:]
    assert metadata(run)["status"] == "interrupted"
    said = f"train.pretrain interrupted ({SIGNAL_NAME[signum]}) before the first step"
    assert said in err and f"run directory: {run}" in err and "failed" not in err, err[-3000:]
    assert group_gone(proc.pid)


@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, True), (signal.SIGTERM, False), (signal.SIGHUP, True),
                                           (signal.SIGUSR2, True), (signal.SIGINT, True)])
def test_a_signal_while_the_ranks_build_the_model_is_no_rank_failure(tmp_path, dataset, signum, group):
    """SIGTERM before the trainer's handler is in place ends the rank at once: it used to read
    "train.pretrain failed: rank 0 on HOST failed first (signal 15)", exit 143, status failed.
    `group`: to the whole process group (a terminal, Slurm), or to inv alone (which passes it on)."""
    proc = start_inv(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *LONG_RUN, *SLOW_TO_BUILD))

    def building() -> bool:
        logs = [run / "logs" / "rank0.log" for run in runs(tmp_path)]
        return any(log.is_file() and "building model" in log.read_text() for log in logs)
    assert wait_until(building, proc, timeout=180, pause=0.02), "the ranks never said they build the model"
    send(proc, signum, group)
    code, out, err = ended(proc)
    assert_no_traceback(out, err)
    (run,) = runs(tmp_path)
    assert code == TRAINING_EXIT[signum], err[-3000:]
    assert (f"train.pretrain interrupted ({SIGNAL_NAME[signum]}) before the first step: nothing to checkpoint" in err
            and "failed first" not in err), err[-3000:]
    md = metadata(run)
    assert md["status"] == "interrupted" and md["exit_code"] == code
    assert not list(run.glob("checkpoints/step_*")) and not (run / "summary.json").exists()
    agent = json.loads((run / "logs" / "agent-0.json").read_text())
    assert agent["exit_code"] == code and agent["first_failure"] is None
    assert re.search(r"building model tiny: 10\d,\d{3},\d{3} parameters on cpu; a model this size takes a while",
                     (run / "logs" / "rank0.log").read_text())     # said while it builds
    assert group_gone(proc.pid)


def test_after_the_first_step_a_signal_still_checkpoints(tmp_path, dataset):
    """The line between the two: once a step is done, SIGTERM checkpoints and says so (exit 3)."""
    proc = start_inv(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *LONG_RUN))

    def stepped() -> bool:
        return any((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()
                   for run in runs(tmp_path))
    assert wait_until(stepped, proc, timeout=180)
    send(proc, signal.SIGTERM)
    code, out, err = ended(proc)
    assert_no_traceback(out, err)
    (run,) = runs(tmp_path)
    assert code == 3 and "stopped on a signal after checkpointing" in err, err[-3000:]
    assert metadata(run)["status"] == "preempted" and list(run.glob("checkpoints/step_*"))
    typed = shlex.join(["train.pretrain", *sets(f"data.path={dataset}", *LONG_RUN)])   # the hint: the command as typed
    assert f"continue where it ran with `inv {typed} --resume {run}`" in err, err[-3000:]

"""Restart inside the job (health.max_restarts; runtime/jobs/restarts.py) with the direct runtime: `inv
train.pretrain --nproc 2`, gloo on CPU, the real agent, faults put in from outside (tests/helpers/faults.py).

Covers: a rank SIGKILLed mid-run -> the run ends ok after one restart from the newest checkpoint, the steps
run twice have the same losses (the curve continues from the checkpoint step), the restart is recorded
(metadata.json, metrics.jsonl, the console, the report) and the first attempt's reports are set aside; a rank frozen
with SIGSTOP -> found by the hang watchdog, restarted, ok; a rank killed in every attempt -> as many restarts
as allowed, then one line that says so; a NaN that goes away on a rerun (health.on_nonfinite=rerun) -> exit 5
naming the rank, its host and the fault report, not restarted on one node without a spare; a fault before
any checkpoint -> no restart, as before.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.faults import environ_with_fault
from helpers.processes import rank_process
from helpers.program import INV, REPO, failure_line, metadata, run_inv, runs
from helpers.training import TINY_RUN, records, train_losses

pytestmark = pytest.mark.slow

RESTARTABLE = [*TINY_RUN, "train.log_interval=1", "train.val_interval=0", "train.steps=12", "checkpoint.interval=4",
               "checkpoint.async_save=false"]


def pretrain(tmp_path: Path, dataset: Path, name: str, *sets: str, fault: str | None = None, rank: int = 1,
             times: int | None = None) -> subprocess.CompletedProcess:
    argv = [str(INV), "train.pretrain", "--nproc", "2", "--name", name]
    for item in [f"data.path={dataset}", *RESTARTABLE, *sets]:
        argv += ["--set", item]
    return subprocess.run(argv, cwd=REPO, env=environ_with_fault(tmp_path, fault, rank=rank, times=times),
                          capture_output=True, text=True, timeout=600)


def test_a_killed_rank_costs_one_restart_from_the_checkpoint_and_the_curve_goes_on(tmp_path, dataset):
    proc = pretrain(tmp_path, dataset, "killed", fault="kill:7", times=1)      # rank 1 dies in step 7, once
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(tmp_path)
    md = metadata(run)
    assert md["status"] == "ok"
    (restart,) = md["restarts"]
    host = md["hosts"][0]
    assert (restart["attempt"], restart["step"], restart["host"], restart["rank"], restart["blamed_for"]) == \
        (1, 4, host, 1, "failed")
    assert restart["checkpoint"].endswith("checkpoints/step_4") and restart["lost_s"] >= 0
    assert "rank 1 on" in restart["why"] and "signal 9" in restart["why"]
    assert f"restart 1 of 2 (rank 1 on {host}, failed): rank 1 on {host} failed first (signal 9" in proc.stderr
    # The steps after the checkpoint ran twice: the second time from step 4's weights, the same numbers.
    trained = records(run, "train")
    steps = [r["step"] for r in trained]
    assert steps[:steps.index(4) + 1] == [1, 2, 3, 4] and steps[-8:] == list(range(5, 13)), steps
    redone = [s for s in set(steps) if steps.count(s) == 2]
    assert redone and min(redone) == 5, steps
    for step in redone:
        first, again = [r["loss"] for r in trained if r["step"] == step]
        assert abs(first - again) <= 1e-6 * max(1.0, abs(first)), (step, first, again)
    (marked,) = records(run, "restart")
    assert marked["step"] == 4 and marked["attempt"] == 1
    resumed = [r for r in records(run, "resume")]
    assert [r["step"] for r in resumed] == [4]                                  # the plot's and report's mark
    assert (run / "logs" / "attempts" / "1" / "agent-0.json").is_file()          # the first attempt's report
    assert json.loads((run / "logs" / "agent-0.json").read_text())["exit_code"] == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 12
    report = run_inv("snapshot.report", run, runs=tmp_path / "runs")        # the report's run table says it
    assert report.returncode == 0, report.stderr
    page = Path(report.stdout.strip()).read_text()
    assert "restart 1" in page and "from step 4: rank 1 on" in page


def test_a_frozen_rank_is_found_by_the_watchdog_and_restarted(tmp_path, dataset):
    # 50 ms steps (rank 0 is slowed, rank 1 waits for it), a checkpoint every 40: the SIGSTOP lands between
    # saves (inside one the watchdog waits as long as a collective may: parallel.timeout_minutes).
    sets = [f"data.path={dataset}", *RESTARTABLE, "train.steps=70", "checkpoint.interval=40",
            "health.hang_timeout_s=5", "parallel.timeout_minutes=1"]
    proc = subprocess.Popen([str(INV), "train.pretrain", "--nproc", "2", "--name", "frozen",
                             *[a for item in sets for a in ("--set", item)]],
                            cwd=REPO, env={**environ_with_fault(tmp_path, "slow:0.05", rank=0), "ANVIL_AGENT_GRACE": "2"},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            found = runs(tmp_path)
            if found and (found[0] / "metrics.jsonl").is_file() and len(records(found[0], "train")) >= 45:
                break
            time.sleep(0.1)
        victim = rank_process(proc.pid, 1)
        assert victim is not None, "rank 1 not found"
        victim.send_signal(signal.SIGSTOP)          # frozen: the peer's watchdog finds it
        out, err = proc.communicate(timeout=400)
    finally:
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    (run,) = runs(tmp_path)
    (restart,) = metadata(run)["restarts"]
    assert restart["blamed_for"] == "hung" and "stopped first" in restart["why"] and restart["step"] == 40
    assert list((run / "logs" / "attempts" / "1").glob("hang-rank*.json"))
    assert max(train_losses(run)) == 70 and metadata(run)["status"] == "ok"


def test_restarts_run_out_and_the_line_says_so(tmp_path, dataset):
    proc = pretrain(tmp_path, dataset, "doomed", "health.max_restarts=1", fault="kill:7")   # every attempt dies
    assert proc.returncode == 137, proc.stderr[-3000:]
    line = failure_line(proc.stderr)
    assert "rank 1 on" in line and "failed first (signal 9" in line, line
    assert line.endswith("after 1 restart(s); not restarted: no restarts left (health.max_restarts=1)"), line
    (run,) = runs(tmp_path)
    assert len(metadata(run)["restarts"]) == 1 and metadata(run)["status"] == "failed"


def test_a_nan_gone_on_a_rerun_names_the_rank_its_host_and_exits_5(tmp_path, dataset):
    proc = pretrain(tmp_path, dataset, "flip", "health.on_nonfinite=rerun", fault="nan:6", rank=0, times=1)
    assert proc.returncode == 5, proc.stderr[-3000:]
    (run,) = runs(tmp_path)
    host = metadata(run)["hosts"][0]
    line = failure_line(proc.stderr)
    assert f"rank 0 on {host} failed first (status 5): error: step 6: loss is nan, but not when run again from the " \
           "same weights" in line and "the hardware is suspect, rank(s) 0 (logs/fault-rank*.json)" in line, line
    assert line.endswith(f"not restarted: {host} failed for a faulty GPU and there is no spare node to take its "
                         "place (health.spares), nor a layout without it that keeps the global batch"), line
    (report,) = [json.loads(p.read_text()) for p in (run / "logs").glob("fault-rank*.json")]
    assert (report["rank"], report["host"], report["step"]) == (0, host, 6)


def test_a_fault_before_the_first_checkpoint_is_not_restarted(tmp_path, dataset):
    proc = pretrain(tmp_path, dataset, "early", fault="kill:2", times=1)
    assert proc.returncode == 137, proc.stderr[-3000:]
    line = failure_line(proc.stderr)
    assert "failed first (signal 9" in line and "restart" not in line, line
    assert "restarts" not in metadata(runs(tmp_path)[0])

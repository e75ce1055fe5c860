"""trainer.health: a slow rank is named, a hung rank is found, dumped, ended and named in one line.

The fast tests drive the watchdog, the straggler detector, the failure summary and the
launcher in-process or with a stub worker. The slow ones run the real thing - `inv
train.pretrain --nproc 2`, gloo on CPU, the agent - with a fault put in from outside the
product (tests/helpers/faults.py) or SIGSTOP sent to one rank's process.
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from runtime.launch import LaunchSpec, launch
from runtime.runs import diagnose, outcome
from trainer import health, ranklog
from trainer.config import ConfigError, load
from core.signals import EXIT_HUNG
from helpers.program import INV, REPO, failure_line, inv_environ
from helpers.faults import environ_with_fault
from helpers.processes import rank_process
from helpers.training import TINY_RUN



def _log(run_dir: Path, rank: int = 0, host: str = "nodeA"):
    return ranklog.setup(run_dir, rank=rank, local_rank=rank, host=host, name=f"anvil.test.health.{rank}")


# --------------------------------------------------------------------------- watchdog

def stuck_in_a_data_read(done, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_watchdog_dumps_stacks_writes_the_report_and_ends_the_rank(tmp_path):
    log = _log(tmp_path, rank=3, host="nodeX")
    exits: list[int] = []
    dog = health.HangWatchdog(0.3, run_dir=tmp_path, rank=3, host="nodeX", log=log, startup_timeout_s=0.3,
                              exit=exits.append)
    dog.start(step=6)
    dog.beat(7)
    started = time.monotonic()
    stuck_in_a_data_read(lambda: exits)
    dog.stop()
    assert exits == [EXIT_HUNG]
    assert 0.3 <= time.monotonic() - started < 3
    report = json.loads((tmp_path / "logs" / "hang-rank3.json").read_text())
    assert report["rank"] == 3 and report["host"] == "nodeX" and report["pid"] == os.getpid()
    assert report["step"] == 8 and report["last_step"] == 7 and report["phase"] == "training"
    assert report["stalled_s"] >= 0.3 and report["limit_s"] == 0.3
    assert re.fullmatch(r"time\.sleep\(\.\.\.\) at tests/trainer/test_health\.py:\d+", report["where"]), report["where"]
    assert report["frames"][0].startswith("stuck_in_a_data_read (tests/trainer/test_health.py:")
    text = (tmp_path / "logs" / "rank3.log").read_text()
    assert "hang watchdog: no progress for 0 s (limit 0 s) in step 8" in text
    assert "(most recent call first)" in text and "in stuck_in_a_data_read" in text   # every thread's stack
    assert re.search(r"\[ERROR\] hung: no training step for \d+ s \(in step 8, at time\.sleep", text)
    assert text.rstrip().endswith(f"exiting with status {EXIT_HUNG}")


def test_watchdog_is_quiet_while_steps_finish_and_during_long_checkpoints(tmp_path):
    exits: list[int] = []
    dog = health.HangWatchdog(0.3, run_dir=tmp_path, log=_log(tmp_path), startup_timeout_s=3.0, exit=exits.append)
    (tmp_path / "logs" / "hang-rank0.json").write_text("{}")   # a previous attempt's report
    dog.start(step=0)
    assert not (tmp_path / "logs" / "hang-rank0.json").exists()
    time.sleep(0.6)                 # startup (model build, first compile): the long limit
    for step in range(1, 6):
        time.sleep(0.1)
        dog.beat(step)
    with dog.busy("checkpoint"):    # a save longer than hang_timeout_s is not a hang
        time.sleep(0.6)
    dog.beat(6)
    time.sleep(0.1)
    dog.stop()
    assert exits == [] and dog.fired is None


def test_hang_timeout_default_and_its_checks():
    assert health.hang_timeout_s(load()) == 300                                   # 30 min collectives
    assert health.hang_timeout_s(load(None, ["parallel.timeout_minutes=4"])) == 120
    assert health.hang_timeout_s(load(None, ["health.hang_timeout_s=0"])) == 0     # off
    with pytest.raises(ConfigError, match=r"health\.hang_timeout_s: expected .*collective timeout .*240 s"):
        load(None, ["parallel.timeout_minutes=4", "health.hang_timeout_s=240"])
    with pytest.raises(ConfigError, match=r"health\.straggler_margin: expected a positive number"):
        load(None, ["health.straggler_margin=0"])
    with pytest.raises(ConfigError, match=r"health\.straggler_interval: expected an integer >= 0"):
        load(None, ["health.straggler_interval=-5"])


def test_flight_recorder_is_switched_on_for_distributed_runs_only(tmp_path, monkeypatch):
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "WORLD_SIZE", "SLURM_NTASKS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    health.prepare_env(load(), tmp_path)                           # one process: nothing to record
    assert not any(os.environ.get(n) for n in names)
    monkeypatch.setenv("WORLD_SIZE", "2")
    health.prepare_env(load(None, ["health.hang_timeout_s=0"]), tmp_path)   # watchdog off
    assert not any(os.environ.get(n) for n in names[:5])
    health.prepare_env(load(), tmp_path)
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    dump = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    assert int(size) > 0 and dump == str(tmp_path / "logs" / "nccl-trace-rank")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")       # the user's own value wins
    health.prepare_env(load(), tmp_path)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7" and not os.environ.get("TORCH_FR_BUFFER_SIZE")


# --------------------------------------------------------------------------- stragglers

def test_straggler_named_once_then_every_tenth_check_then_cleared(tmp_path):
    log = _log(tmp_path)
    det = health.StragglerDetector(50, 0.2, rank=0, world_size=4, run_dir=tmp_path, log=log,
                                   hosts=["n0", "n1", "n2", "n3"])
    slow = [[0.100, 0.09, 0.01, 50], [0.104, 0.094, 0.01, 50], [0.098, 0.088, 0.01, 50], [0.150, 0.14, 0.01, 50]]
    for check in range(1, 11):
        found = det.flag(check * 50, slow, (check * 50 - 49, check * 50))
        assert [r["rank"] for r in found] == [3]
    assert det.flag(550, [[0.1, 0.09, 0.01, 50]] * 4, (501, 550)) == []
    text = (tmp_path / "logs" / "rank0.log").read_text()
    warnings = [line for line in text.splitlines() if "[WARNING] straggler:" in line]
    assert len(warnings) == 2                                   # the first check and the tenth
    assert "straggler: rank 3 on n3: 150.0 ms/step of its own work (forward 140.0 + data 10.0 ms) vs " \
           "median 102.0 ms (+47%), steps 1-50" in warnings[0]
    assert warnings[1].endswith("10 checks in a row")
    assert "straggler: rank 3 on n3 is back within 20% of the median after 10 check(s)" in text
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in written if r["kind"] == "straggler"]
    assert len(records) == 10 and {(r["kind"], r["rank"], r["host"]) for r in records} == {("straggler", 3, "n3")}
    assert records[0]["step_time"] == 0.150 and records[0]["median"] == pytest.approx(0.102)
    spreads = [r for r in written if r["kind"] == "rank_times"]     # every check, the last one too
    assert [r["step"] for r in spreads] == list(range(50, 551, 50))
    assert spreads[0]["step_time"] == [0.100, 0.104, 0.098, 0.150] and spreads[0]["steps"] == [1, 50]


def test_straggler_margin_and_timer_noise():
    det = health.StragglerDetector(10, 0.2, world_size=2)
    assert det.flag(10, [[0.010, 0.01, 0, 10], [0.0119, 0.0119, 0, 10]], (1, 10)) == []   # +9% of the median
    assert det.flag(20, [[0.0002, 0, 0, 10], [0.0009, 0, 0, 10]], (11, 20)) == []         # < 1 ms: noise
    assert [r["rank"] for r in det.flag(30, [[0.010, 0, 0, 10], [0.020, 0, 0, 10]], (21, 30))] == [1]
    assert det.flag(40, [[0.010, 0, 0, 10], [0.020, 0, 0, 0]], (31, 40)) == []            # a rank with no data


class SleepyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(0.02)
        return self.linear(x).sum()


def test_straggler_times_training_forwards_and_data_but_not_eval():
    model = SleepyModel()
    det = health.StragglerDetector(1000, 0.2, world_size=2, device=torch.device("cpu")).watch(model)
    for step in range(1, 4):
        with det.data_time():
            time.sleep(0.01)
        model(torch.ones(2, 4)).backward()
        model(torch.ones(2, 4)).backward()             # two micro batches: their sum
        with torch.no_grad():
            model(torch.ones(2, 4))                    # not a training forward
        model.eval()
        model(torch.ones(2, 4))                        # nor is evaluation
        model.train()
        assert det.step(step) == []                    # no check before the interval
    total, forward, data, n = det._local()
    assert n == 3 and 0.04 <= forward < 0.2 and 0.01 <= data < 0.1 and 0.05 <= total < 0.3
    det.close()
    assert not model._forward_hooks and not model._forward_pre_hooks


# --------------------------------------------------------------------------- the one line

def _agent(run_dir: Path, ranks: dict, host="nodeA", start=1000.0, node_rank=0):
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"agent-{node_rank}.json").write_text(json.dumps(
        {"host": host, "node_rank": node_rank, "exit_code": EXIT_HUNG, "ranks": ranks, "start": start,
         "end": start + 60, "first_failure": {"rank": 0, "host": host, "exit_code": EXIT_HUNG, "time": start + 50}}))


def _hang(run_dir: Path, rank: int, host: str, enqueued: int | None, pending=False, where="x(...) at trainer/train.py:1",
          progress=1040.0, when=1050.0, step=5):
    coll = None if enqueued is None else {"last_enqueued": enqueued, "last_completed": enqueued - pending,
                                          "last_op": "nccl:all_reduce", "pending": pending}
    (run_dir / "logs" / f"hang-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": host, "step": step, "last_step": step - 1, "stalled_s": 300.4, "where": where,
         "collectives": coll, "last_progress_time": progress, "time": when, "log": f"logs/rank{rank}.log"}))


def test_failure_summary_names_the_rank_the_others_wait_for(tmp_path):
    _agent(tmp_path, {"0": 4, "1": 4}, host="nodeA")
    _agent(tmp_path, {"2": 4, "3": 4}, host="nodeB", node_rank=1)
    _hang(tmp_path, 0, "nodeA", 22, pending=True, where="dist.all_reduce(...) at core/signals.py:102")
    _hang(tmp_path, 2, "nodeB", 21, where="optim.clip_grad_norm(...) at trainer/train.py:268", progress=1041.0)
    _hang(tmp_path, 3, "nodeB", 22, pending=True, progress=1039.0)
    _hang(tmp_path, 1, "nodeA", 3, when=900.0)          # left by an earlier attempt in this run directory
    assert outcome.failure_summary(tmp_path, expected_nodes=2) == (
        "rank 2 on nodeB stopped first at step 5 in optim.clip_grad_norm(...) at trainer/train.py:268 "
        "(no step for 300 s); stacks in logs/rank2.log; rank(s) 0, 3 hung after it")


def test_failure_summary_without_collective_counts_takes_the_oldest_progress(tmp_path):
    _agent(tmp_path, {"0": 4, "1": 4})
    _hang(tmp_path, 0, "nodeA", None, progress=1040.0)
    _hang(tmp_path, 1, "nodeA", None, progress=1030.0, step=9)
    assert outcome.failure_summary(tmp_path).startswith("rank 1 on nodeA stopped first at step 9 in ")


def test_failure_summary_names_a_silent_rank_that_a_collective_waits_for(tmp_path):
    _agent(tmp_path, {"0": 4, "1": -9})
    _hang(tmp_path, 0, "nodeA", 57, pending=True, where="backward(...) at trainer/train.py:266")
    assert outcome.failure_summary(tmp_path) == (
        "rank 1 on nodeA stopped first and wrote no hang report (stopped, or stuck where Python cannot run): "
        "rank 0 on nodeA waited for it at step 5 in a collective (nccl:all_reduce) in backward(...) at "
        "trainer/train.py:266 (no step for 300 s); stacks in logs/rank0.log")


def test_failure_summary_without_collective_counts_names_a_rank_that_ignored_sigterm(tmp_path):
    _agent(tmp_path, {"0": 4, "1": -9, "2": 1})        # rank 2 ended when its peer went away
    _hang(tmp_path, 0, "nodeA", None, where="distributed.all_reduce_mean(...) at trainer/train.py:298")
    assert outcome.failure_summary(tmp_path) == (
        "rank 1 on nodeA stopped first and wrote no hang report (stopped, or stuck where Python cannot run): "
        "rank 0 on nodeA waited for it at step 5 in distributed.all_reduce_mean(...) at trainer/train.py:298 "
        "(no step for 300 s); stacks in logs/rank0.log")


def test_diagnose_knows_hangs_and_stragglers():
    found = diagnose.scan_text(
        "[t][n1 r1/l1][ERROR] hung: no training step for 300 s (in step 8, at x) ...\n"
        "[t][n1 r0/l0][WARNING] straggler: rank 3 on gpu07: 150.0 ms/step of its own work ...\n")
    assert [f.signature for f in found] == ["hang", "straggler"]
    assert "hang-rank<R>.json" in found[0].advice and "--exclude" in found[1].advice


HUNG_WORKER = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    sys.exit(4)
time.sleep(120)               # a peer blocked in a collective: the agent must stop it
"""


def test_agent_treats_a_hung_rank_as_the_failure_and_stops_the_rest(tmp_path):
    (tmp_path / "hung_worker.py").write_text(HUNG_WORKER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "ANVIL_AGENT_GRACE": "2"}
    err = io.StringIO()
    started = time.monotonic()
    code = launch(LaunchSpec(module="hung_worker", nproc=2, workdir=str(tmp_path)), env=env,
                  run_dir=tmp_path / "run", stdout=io.StringIO(), stderr=err)
    assert code == EXIT_HUNG and time.monotonic() - started < 30
    assert "rank 1 on" in err.getvalue() and "exited with status 4 (hung: no training step in time; " \
                                              "logs/hang-rank1.json)" in err.getvalue()


# --------------------------------------------------------------------------- the real launcher

SHORT = [*TINY_RUN, "train.log_interval=1", "train.val_interval=0"]


def pretrain_argv(dataset: Path, name: str, *sets: str) -> list[str]:
    argv = [str(INV), "train.pretrain", "--nproc", "2", "--name", name]
    for item in [f"data.path={dataset}", *SHORT, *sets]:
        argv += ["--set", item]
    return argv


def the_run(tmp_path: Path) -> Path:
    (run,) = sorted((tmp_path / "runs").iterdir())
    return run


def rank_host(run: Path, rank: int) -> str:
    match = re.search(rf"\]\[(\S+) r{rank}/l\d+\]", (run / "logs" / f"rank{rank}.log").read_text())
    return match.group(1)


@pytest.mark.slow
def test_slow_rank_is_named_in_the_log_and_in_metrics(tmp_path, dataset):
    proc = subprocess.run(pretrain_argv(dataset, "slow", "train.steps=20", "health.straggler_interval=5",
                                        "checkpoint.save_final=false"),
                          cwd=REPO, env=environ_with_fault(tmp_path, "slow:0.03"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = the_run(tmp_path)
    host = rank_host(run, 1)
    warning = re.search(rf"\[WARNING\] straggler: rank 1 on {re.escape(host)}: ([\d.]+) ms/step of its own work "
                        rf"\(forward [\d.]+ \+ data [\d.]+ ms\) vs median ([\d.]+) ms \(\+\d+%\), steps 1-5",
                        (run / "logs" / "rank0.log").read_text())
    assert warning, (run / "logs" / "rank0.log").read_text()[-3000:]
    assert "straggler: rank 1 on" in proc.stderr                      # rank 0's console too
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    flagged = [r for r in records if r["kind"] == "straggler"]
    assert [r["step"] for r in flagged] == [5, 10, 15, 20]            # every check, and only rank 1
    assert {(r["rank"], r["host"]) for r in flagged} == {(1, host)}
    assert all(r["step_time"] > 0.03 and r["slower"] > 0.2 for r in flagged)
    # What the detector sees and plain step time does not: both ranks' steps take the same time.
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 21))


@pytest.mark.slow
def test_hung_rank_is_found_dumped_ended_and_named_in_one_line(tmp_path, dataset):
    started = time.monotonic()
    proc = subprocess.run(pretrain_argv(dataset, "hang", "train.steps=200", "health.hang_timeout_s=5"),
                          cwd=REPO, env=environ_with_fault(tmp_path, "hang:4"), capture_output=True, text=True,
                          timeout=300)
    ended, wall = time.time(), time.monotonic() - started
    assert proc.returncode == EXIT_HUNG, proc.stderr[-3000:]
    run = the_run(tmp_path)
    host = rank_host(run, 1)
    line = failure_line(proc.stderr)
    assert re.fullmatch(rf"train\.pretrain failed: rank 1 on {re.escape(host)} stopped first at step 4 in "
                        rf"optim\.clip_grad_norm\(\.\.\.\) at trainer/train\.py:\d+ \(no step for \d+ s\); "
                        rf"stacks in logs/rank1\.log(; rank\(s\) 0 hung after it)?", line), line
    assert "known problem [hang]:" in proc.stderr
    report = json.loads((run / "logs" / "hang-rank1.json").read_text())
    assert report["rank"] == 1 and report["host"] == host and report["step"] == 4 and report["stalled_s"] >= 5
    assert any(f.startswith("faulty_clip (") for f in report["frames"])   # the innermost frames
    if report["collectives"] is not None:                               # gloo's flight recorder (recent torch)
        assert report["collectives"]["pending"] is False
        assert (run / "logs" / report["collectives"]["file"]).is_file()
    log = (run / "logs" / "rank1.log").read_text()
    assert "Python stacks of every thread follow" in log and "in faulty_clip" in log and "in _train" in log
    assert json.loads((run / "logs" / "agent-0.json").read_text())["exit_code"] == EXIT_HUNG
    assert json.loads((run / "metadata.json").read_text())["status"] == "failed"
    detected = min(json.loads(Path(p).read_text())["time"] for p in glob.glob(str(run / "logs" / "hang-rank*.json")))
    print(f"hang: whole job {wall:.1f} s; detection -> inv returned {ended - detected:.1f} s")
    assert wall < 60 and ended - detected < 20


@pytest.mark.slow
def test_stopped_rank_is_named_by_the_peer_that_waits_for_it(tmp_path, dataset):
    started = time.monotonic()
    proc = subprocess.Popen(pretrain_argv(dataset, "stop", "train.steps=5000", "health.hang_timeout_s=5"),
                            cwd=REPO, env=environ_with_fault(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    victim = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            runs = sorted((tmp_path / "runs").glob("*_stop/metrics.jsonl"))
            if runs and len(runs[0].read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        victim = rank_process(proc.pid, 1)
        assert victim is not None, "rank 1 not found"
        victim.send_signal(signal.SIGSTOP)          # frozen: not even its watchdog thread runs
        stopped = time.time()
        out, err = proc.communicate(timeout=120)
    finally:
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGCONT)
            victim.kill()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    ended, wall = time.time(), time.monotonic() - started
    assert proc.returncode == EXIT_HUNG, err[-3000:]
    run = the_run(tmp_path)
    agent = json.loads((run / "logs" / "agent-0.json").read_text())
    line = failure_line(err)
    assert line.startswith(f"train.pretrain failed: rank 1 on {agent['host']} stopped first and wrote no hang report "
                           f"(stopped, or stuck where Python cannot run): rank 0 on "), line
    assert "waited for it at step" in line and "in a collective (gloo:" in line and "stacks in logs/rank0.log" in line
    assert not (run / "logs" / "hang-rank1.json").exists()
    assert agent["ranks"]["1"] == -signal.SIGKILL        # the agent's SIGTERM waits; its SIGKILL does not
    print(f"stopped rank: whole job {wall:.1f} s; SIGSTOP -> inv returned {ended - stopped:.1f} s")
    assert ended - stopped < 30 and wall < 90

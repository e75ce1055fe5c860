"""`inv train.launch --backend command`: a torchrun-style program of the tests' own (launch_program.py, two
processes on this machine) under the runner.

Covers: the rank environment, rank logs, the JSON metric lines in metrics.jsonl (unreadable ones counted,
never fatal), summary.json, snapshot.show, train.plot and snapshot.report; SIGUSR2 -> checkpoint, exit 3,
then --resume (ANVIL_RESUME) on the same curve with the summary naming the checkpoint; a killed rank and a
failing rank named with their host (and the program's own error line, with its log); --metrics-regex; no
progress for --hang-timeout names the silent ranks; --max-restarts starts a killed program again from its
checkpoint; a replay of the program needs --trust-run; bad input is
one line before any run directory.
"""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from helpers.processes import waited_for
from helpers.program import ONE_THREAD, explain, inv, metadata, one_line_error, run_inv, runs, start_inv
from helpers.training import last_step, train_losses

PROGRAM = Path(__file__).resolve().with_name("launch_program.py")
#: Two ranks of the program here: one thread each, an agent that waits 3 s for its ranks to end.
TWO = ["train.launch", "--backend", "command", "--nproc", "2"]
QUIET_AGENT = {**ONE_THREAD, "ANVIL_AGENT_GRACE": "3"}


def launched(work: Path, *options: str, program=(), grace: int = 3, timeout: float = 300
             ) -> subprocess.CompletedProcess:
    """`inv train.launch --backend command --nproc 2 OPTIONS -- launch_program.py PROGRAM` in `work`, its
    agent waiting `grace` seconds for the ranks to end."""
    return inv(work, *TWO, *options, "--", str(PROGRAM), *program,
               env={**QUIET_AGENT, "ANVIL_AGENT_GRACE": str(grace)}, timeout=timeout)


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """(work, result, run) of six steps of the program, two of its metric lines unreadable."""
    work = tmp_path_factory.mktemp("launch")
    result = launched(work, "--name", "six", program=["--steps", "6", "--garbage"])
    assert result.returncode == 0, explain(result)
    (run,) = runs(work)
    return work, result, run


def test_a_program_trains_under_the_runner_with_rank_logs_metrics_summary_and_report(six_steps):
    work, result, run = six_steps
    md = metadata(run)
    assert (md["task"], md["status"], md["world_size"], md["backend"], md["runtime"]) == \
        ("train.launch", "ok", 2, "command", "direct")
    host = md["hosts"][0]
    for rank in (0, 1):   # torchrun's variables, and every line of the rank in its own log with host and rank
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"[{host} r{rank}/l{rank}][ERR] launch_program: RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 " \
               "LOCAL_WORLD_SIZE=2 MASTER=127.0.0.1:" in log, log
    assert f"[{host} r0/l0][OUT] {{\"step\": 6," in (run / "logs" / "rank0.log").read_text()
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]
    shown = [json.loads(line) for line in result.stderr.splitlines() if line.startswith('{"step": ') and line[-1] == "}"]
    assert {r["step"]: r["loss"] for r in shown if isinstance(r.get("loss"), float)} == losses   # rank 0's console
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["final_loss"], summary["backend"]) == (6, losses[6], "command")
    assert (summary["unreadable_lines"], summary["metric_lines"], summary["unreadable_in"]) == (2, 6, "logs/rank0.log")
    assert "unreadable metric lines  2" in result.stdout and f"run directory: {run}" in result.stdout
    assert json.loads((run / "env.json").read_text())["vars"]          # the environment and where each value came from
    assert "20_gpus_idle.py (ok)" in (run / "hooks" / "pre.log").read_text()   # the preflight gate's hook

    shown = inv(work, "snapshot.show", run)
    assert shown.returncode == 0 and "backend" in shown.stdout and "final train loss" in shown.stdout, explain(shown)
    plot = inv(work, "train.plot", run)
    assert plot.returncode == 0 and Path(plot.stdout.strip()).is_file(), explain(plot)
    report = inv(work, "snapshot.report", run)
    assert report.returncode == 0, explain(report)
    page = Path(report.stdout.strip()).read_text()
    assert "train.launch" in page and "Loss (train and validation)" in page and "Throughput" in page


def test_sigusr2_checkpoints_exits_3_and_resume_goes_on_the_same_curve(tmp_path, six_steps):
    reference = train_losses(six_steps[2])
    proc = start_inv(tmp_path, *TWO, "--name", "pre", "--", str(PROGRAM), "--steps", "6", "--sleep", "1.5",
                     **QUIET_AGENT)
    try:
        waited_for(lambda: runs(tmp_path) and last_step(runs(tmp_path)[0]) >= 2, 120, "two steps")
        proc.send_signal(signal.SIGUSR2)          # as a scheduler's preemption warning to inv
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out + err
    (run,) = runs(tmp_path)
    assert metadata(run)["status"] == "preempted"
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step_"), saved
    line = one_line_error(subprocess.CompletedProcess([], 3, out, err), "train.launch preempted: stopped (SIGUSR2)",
                          f"{run}/checkpoints/{saved[0]}", "--resume", code=3)
    assert line.rstrip("`").endswith(f"-- {PROGRAM} --steps 6 --sleep 1.5")   # the program as typed, last

    again = inv(tmp_path, *TWO, "--name", "pre", "--resume", "auto", "--", str(PROGRAM), "--steps", "6",
                env=QUIET_AGENT)
    assert again.returncode == 0, explain(again)
    resumed = runs(tmp_path)[-1]
    step = int(saved[0].split("_")[1])
    first = json.loads((resumed / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["kind"], first["step"], first["checkpoint"]) == ("resume", step, str(run / "checkpoints" / saved[0]))
    rank0 = (resumed / "logs" / "rank0.log").read_text()
    assert f"resumed from {run / 'checkpoints' / saved[0]} at step {step}" in rank0   # ANVIL_RESUME, ANVIL_RESUME_FROM
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / saved[0]) and "resumed from" in again.stdout
    losses = train_losses(resumed)
    assert sorted(losses) == list(range(step + 1, 7))
    assert all(abs(losses[s] - reference[s]) <= 1e-6 * max(1.0, abs(reference[s])) for s in losses), (losses, reference)


def test_a_killed_rank_and_a_failing_rank_are_named_with_their_host(tmp_path):
    killed = launched(tmp_path, "--name", "killed", program=["--kill-rank", "1", "--kill-at", "2"])
    host = metadata(runs(tmp_path)[0])["hosts"][0]
    line = one_line_error(killed, f"rank 1 on {host} failed first (signal 9, SIGKILL", code=137)
    assert line.startswith("train.launch failed:") and metadata(runs(tmp_path)[0])["status"] == "failed", line

    failing = launched(tmp_path, "--name", "failing", program=["--fail-rank", "0", "--fail-at", "2"])
    run = runs(tmp_path)[-1]
    line = one_line_error(failing, "rank 0 on ", "failed first (status 1)", code=1)
    assert "ValueError: launch_program: rank 0 fails at step 2 as asked" in line, line   # its own words
    assert f"rank 0 on {host} " in line and f"({run}/logs/rank0.log)" in line and metadata(run)["status"] == "failed"


def test_max_restarts_starts_a_killed_program_again_from_its_checkpoint(tmp_path, six_steps):
    """--max-restarts 1: rank 1 killed in step 4, after the step-3 checkpoint; the agents start every rank
    again, resuming there (ANVIL_RESUME), and the run ends ok on the uninterrupted curve."""
    result = launched(tmp_path, "--name", "again", "--max-restarts", "1",
                      program=["--save-every", "3", "--kill-rank", "1", "--kill-at", "4"])
    assert result.returncode == 0, explain(result)
    (run,) = runs(tmp_path)
    (restart,) = metadata(run)["restarts"]
    assert (restart["step"], restart["rank"], restart["blamed_for"]) == (3, 1, "failed"), restart
    assert restart["checkpoint"].endswith("step_3") and metadata(run)["status"] == "ok"
    assert "resumed from" in (run / "logs" / "rank0.log").read_text()
    assert train_losses(run) == train_losses(six_steps[2])          # the same curve, steps 4-6 run again


def test_metrics_regex_reads_other_lines(tmp_path):
    result = launched(tmp_path, "--metrics-regex", r"it (?P<step>\d+) loss=(?P<loss>\S+)",
                      program=["--steps", "3", "--plain"])
    assert result.returncode == 0, explain(result)
    assert sorted(train_losses(runs(tmp_path)[0])) == [1, 2, 3]


def test_no_progress_for_the_hang_timeout_names_the_silent_ranks(tmp_path):
    result = launched(tmp_path, "--hang-timeout", "2", program=["--steps", "6", "--hang-at", "2"], grace=1)
    line = one_line_error(result, "no progress line for ", "after step 2", code=4)
    assert "silent: rank " in line and " on " in line and "logs/rank*.log" in line, line
    run = runs(tmp_path)[0]
    assert metadata(run)["status"] == "failed" and sorted(p.name for p in (run / "logs").glob("hang-rank*.json")) == \
        ["hang-rank0.json", "hang-rank1.json"]


def test_a_replay_runs_the_program_only_with_trust_run(six_steps):
    work, _, run = six_steps
    refused = inv(work, "snapshot.replay", run)
    line = one_line_error(refused, "replay refused", f"the program {PROGRAM}", "--trust-run")
    assert "--backend command" in line
    dry = inv(work, "snapshot.replay", run, "--dry-run")
    assert dry.returncode == 0 and f"the program {PROGRAM}" in dry.stdout, explain(dry)
    trusted = inv(work, "snapshot.replay", run, "--trust-run", env=QUIET_AGENT, timeout=300)
    assert trusted.returncode == 0, explain(trusted)
    again = [p for p in runs(work) if p != run and metadata(p).get("replay_of") == str(run)]
    assert len(again) == 1 and train_losses(again[0]) == train_losses(run)
    diff = inv(work, "snapshot.diff", run, again[0])
    assert diff.returncode == 0 and "final train loss" not in diff.stdout, explain(diff)   # the same losses


def test_bad_input_is_one_line_before_any_run_directory(tmp_path):
    """A case of each kind, through inv (each backend's own refusals, one by one: test_launch_backends.py)."""
    cases = [
        (["--backend", "deepspeed", "--", "x.py"], ["--backend 'deepspeed': expected command | megatron | torchtitan"]),
        (["--backend", "command"], ["runs the program after --"]),
        (["--backend", "command", "--", "torchrun", "--nproc_per_node", "2", "x.py"], ["starts the ranks itself"]),
        (["--backend", "megatron", "--", "pretrain_gpt.py"], ["needs a Megatron-LM checkout", "anvil.megatron_path"]),
        (["--backend", "torchtitan"], ["needs --config"]),
        (["--backend", "command", "--metrics-regex", "(", "--", str(PROGRAM)], ["not a regular expression"]),
        (["--backend", "command", "--resume", str(tmp_path / "gone"), "--", str(PROGRAM)], ["no such run directory"]),
        (["--backend", "command", "--resume", str(tmp_path), "--", str(PROGRAM)], ["no command checkpoint there"]),
        (["--backend", "command", "--nodes", "2", "--", str(PROGRAM)], ["--nodes", "need --runtime slurm"]),
    ]
    for options, fragments in cases:
        result = inv(tmp_path, "train.launch", *options, timeout=120)
        one_line_error(result, "train.launch: ", *fragments)
    assert not runs(tmp_path)


def test_the_task_is_listed_with_its_options():
    shown = run_inv("--help", "train.launch")
    assert shown.returncode == 0 and "--backend" in shown.stdout and "--metrics-regex" in shown.stdout

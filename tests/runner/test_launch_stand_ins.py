"""train.launch --backend megatron and --backend torchtitan end to end on this machine, two ranks each, with
stand-ins of the tests' own for Megatron-LM's pretrain_gpt.py and torchtitan's train.py (megatron_stand_in.py,
torchtitan_stand_in.py: their command lines, checkpoint folders, signal behaviour and log lines).

Covers: Megatron-LM gets --exit-signal-handler, --save and, to resume, --load; a SIGUSR2 to the whole job
reaches it as SIGTERM only, it saves and exits 0, and the run ends preempted (exit 3) naming its checkpoint;
--resume loads it there. torchtitan gets its TOML config (kept in the run directory), the run directory as
its dump folder and checkpointing on; SIGTERM ends it where it is (said beforehand), and the resumed run
goes on from its last periodic checkpoint. Each one's metric lines reach metrics.jsonl and the summary; a
config or argument it refuses fails the run in one line with its own error and the log's path.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from helpers.processes import waited_for
from helpers.program import ONE_THREAD, explain, inv, metadata, one_line_error, runs, start_inv
from helpers.training import last_step, train_losses

HERE = Path(__file__).resolve().parent
STAND_IN_ENV = {**ONE_THREAD, "ANVIL_AGENT_GRACE": "3"}


def _stopped(proc: subprocess.Popen, work: Path, steps: int, signum: int, group: bool) -> tuple[str, str]:
    """Wait for `steps` logged steps, then send `signum` to inv (group: to its whole process group, as a
    scheduler signals every process of a job); inv's (stdout, stderr)."""
    try:
        waited_for(lambda: runs(work) and last_step(runs(work)[0]) >= steps, 120, f"{steps} steps")
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_megatron_saves_on_its_exit_signal_is_requeued_and_loads_where_it_stopped(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron").mkdir(parents=True)
    shutil.copy(HERE / "megatron_stand_in.py", checkout / "pretrain_gpt.py")
    args = ["--", "pretrain_gpt.py", "--train-iters", "12", "--seq-length", "64", "--global-batch-size", "8"]
    launch = ["train.launch", "--backend", "megatron", "--megatron", str(checkout), "--nproc", "2", "--name", "mg"]
    proc = start_inv(tmp_path, *launch, *args, "--sleep", "0.5", **STAND_IN_ENV)
    out, err = _stopped(proc, tmp_path, 2, signal.SIGUSR2, group=True)
    assert proc.returncode == 3, out + err
    (run,) = runs(tmp_path)
    (saved,) = (run / "checkpoints").glob("iter_*")
    step = int(saved.name.split("_")[1])
    one_line_error(subprocess.CompletedProcess([], 3, out, err), "train.launch preempted: stopped (SIGUSR2)",
                   f"its newest checkpoint is {saved} (step {step})", code=3)
    for rank in (0, 1):   # SIGTERM from the agent, once; the group's SIGUSR2 ignored (it would have killed them)
        assert "exiting program after receiving SIGTERM." in (run / "logs" / f"rank{rank}.log").read_text()
    command = json.loads((run / "logs" / "agent-0.json").read_text())["program"]["command"]
    assert command[1] == str(checkout / "pretrain_gpt.py")
    assert command[-3:] == ["--exit-signal-handler", "--save", str(run / "checkpoints")] and "--load" not in command
    assert metadata(run)["status"] == "preempted"

    again = inv(tmp_path, *launch, "--resume", str(run), *args, env=STAND_IN_ENV)
    assert again.returncode == 0, explain(again)
    resumed = runs(tmp_path)[-1]
    assert f"successfully loaded checkpoint from {run / 'checkpoints'}" in (resumed / "logs" / "rank1.log").read_text()
    losses = train_losses(resumed)
    assert sorted(losses) == list(range(step + 1, 13)) and abs(losses[12] - 10.0 / 12) < 1e-6   # its last rank
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {**records[0], "kind": "resume", "step": step, "checkpoint": str(saved)}
    assert records[1]["tokens_per_s"] == 8 * 64 / 0.5 and records[1]["lr"] == 1e-4
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["backend"], summary["resumed_from"], summary["steps"]) == ("megatron", str(saved), 12)

    refused = inv(tmp_path, *launch, "--", "pretrain_gpt.py", "--fail", "unrecognized arguments: --bogus",
                  env=STAND_IN_ENV)
    line = one_line_error(refused, "failed first (status 1): AssertionError: unrecognized arguments: --bogus",
                          code=1)
    assert f"({runs(tmp_path)[-1]}/logs/rank" in line and metadata(runs(tmp_path)[-1])["status"] == "failed"


def test_torchtitan_runs_its_config_stops_on_sigterm_and_resumes_from_its_last_periodic_checkpoint(tmp_path):
    site = tmp_path / "site"
    (site / "torchtitan").mkdir(parents=True)
    (site / "torchtitan" / "__init__.py").write_text("")
    shutil.copy(HERE / "torchtitan_stand_in.py", site / "torchtitan" / "train.py")
    config = tmp_path / "debug_model.toml"
    config.write_text("[training]\nsteps = 9\n[checkpoint]\ninterval = 2\n")
    launch = ["train.launch", "--backend", "torchtitan", "--config", str(config), "--nproc", "2", "--name", "tt",
              "--env", f"PYTHONPATH={site}"]
    proc = start_inv(tmp_path, *launch, "--", "--training.sleep", "0.5", **STAND_IN_ENV)   # the resumed run at once
    out, err = _stopped(proc, tmp_path, 3, signal.SIGTERM, group=False)
    assert proc.returncode == 3, out + err
    assert "note: torchtitan saves no checkpoint on a signal: the requeued run goes on from its last periodic " \
           "checkpoint" in err
    (run,) = runs(tmp_path)
    assert (run / "configs" / "torchtitan.toml").read_text() == config.read_text()
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoint").glob("step-*"))
    one_line_error(subprocess.CompletedProcess([], 3, out, err), "train.launch preempted: stopped (SIGTERM)",
                   f"its newest checkpoint is {run / 'checkpoint' / f'step-{newest}'} (step {newest})", code=3)
    command = json.loads((run / "logs" / "agent-0.json").read_text())["program"]["command"]
    assert command[1:5] == ["-m", "torchtitan.train", "--job.config_file", str(config)]
    assert command[-3:] == ["--job.dump_folder", str(run), "--checkpoint.enable"]

    again = inv(tmp_path, *launch, "--resume", "auto", env=STAND_IN_ENV)
    assert again.returncode == 0, explain(again)
    resumed = runs(tmp_path)[-1]
    assert f"Loading the checkpoint from {run / 'checkpoint' / f'step-{newest}'}." in \
        (resumed / "logs" / "rank0.log").read_text()
    losses = train_losses(resumed)
    assert sorted(losses) == list(range(newest + 1, 10)) and abs(losses[9] - 8.0 / 9) < 1e-5
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoint" / f"step-{newest}") and summary["tokens_per_s"] == 2468

    config.write_text("[trainig]\nsteps = 2\n")
    refused = inv(tmp_path, *launch, env=STAND_IN_ENV)
    line = one_line_error(refused, "failed first (status 1): ValueError: Invalid field names in <class "
                          "'torchtitan.config.job_config.JobConfig'> data: {'trainig'}.", code=1)
    assert f"({runs(tmp_path)[-1]}/logs/rank" in line and metadata(runs(tmp_path)[-1])["status"] == "failed"

"""`inv train.pretrain` on a live two-node Slurm cluster (tests/helpers/cluster.py, slurm=True).

Real slurmctld and slurmd in network namespaces, real srun/sbatch, real ranks
over gloo between the two nodes. Covers: a run inside an allocation matching a
one-node run of the same world size; sbatch submit-and-follow; a preemption
signal (scancel --signal=USR2 --full) -> checkpoint, exit 3, requeue, resume,
with the loss curve of an uninterrupted run; a node whose ranks die (restarted inside the allocation
when there is a checkpoint); a node set DOWN (recorded as a node failure); bad input.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from core.files import seal
from helpers.cluster import kill_trainers
from helpers.processes import start_as_from_a_terminal, waited_for
from helpers.program import INV, REPO, inv_environ, run_inv, runs
from helpers.training import MOE_ARGS, assert_same_curve, last_step, steps_after_restart, train_args, train_losses

pytestmark = pytest.mark.slow


def training_environ(cluster, tmp_path, **extra):
    """inv's environment on the cluster's Slurm, its runs in tmp_path/runs, an agent that waits 3 s for ranks
    to end."""
    return inv_environ(tmp_path / "runs", {**cluster.slurm_env(), "ANVIL_AGENT_GRACE": "3", **extra})


def _only_run(tmp_path) -> Path:
    (run,) = runs(tmp_path)
    return run


def test_two_nodes_in_an_allocation_train_like_one_node(slurm_cluster, dataset, tmp_path, four_process_losses):
    started = time.monotonic()
    proc = subprocess.run(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                           "--nproc", "2", "--name", "two", *train_args(dataset)],
                          cwd=REPO, env=training_environ(slurm_cluster, tmp_path), capture_output=True, text=True,
                          timeout=600)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = _only_run(tmp_path)
    md = json.loads((run / "metadata.json").read_text())
    assert md["status"] == "ok" and md["hosts"] == ["node1", "node2"] and md["world_size"] == 4
    # No warning a newcomer can't act on: runpy's about the step module, c10d's about the master's name
    assert "RuntimeWarning" not in proc.stderr and "[c10d]" not in proc.stderr, proc.stderr[-3000:]
    for rank, host in ((0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")):
        assert f"[{host} r{rank}/l{rank % 2}]" in (run / "logs" / f"rank{rank}.log").read_text()
    losses = train_losses(run)
    assert_same_curve(losses, four_process_losses)
    assert losses[16] < losses[1]
    print(f"2 nodes x 2 processes: {elapsed:.1f} s wall")

    # Replayed from outside the allocation, it runs on two nodes again (a batch job of --nodes 2), not one.
    replay = run_inv("snapshot.replay", str(run), env=training_environ(slurm_cluster, tmp_path), timeout=600)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-3000:]
    assert "note: added --nodes 2 (the run had 2 node(s), world size 4)" in replay.stdout, replay.stdout
    (again,) = [p for p in (tmp_path / "runs").iterdir() if p != run]
    md = json.loads((again / "metadata.json").read_text())
    assert (md["status"], md["hosts"], md["world_size"], md["replay_of"]) == ("ok", ["node1", "node2"], 4, str(run))
    assert train_losses(again) == losses




def _job_id(tmp_path):
    runs = tmp_path / "runs"
    for run in sorted(runs.iterdir()) if runs.is_dir() else []:
        path = run / "slurm" / "job_id"
        if path.is_file():
            return path.read_text().strip()
    return None


def _steps_done(tmp_path) -> int:
    """The last step the first run under tmp_path/runs logged (0 before it has one)."""
    found = runs(tmp_path)
    return last_step(found[0]) if found else 0


def test_sbatch_job_is_preempted_requeued_and_resumes_the_same_curve(slurm_cluster, dataset, tmp_path,
                                                                     four_process_losses):
    env = training_environ(slurm_cluster, tmp_path)
    proc = subprocess.Popen([str(INV), "train.pretrain", "--runtime", "slurm", "--nodes", "2", "--nproc", "2",
                             "--name", "pre", *train_args(dataset, steps=16)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = waited_for(lambda: _job_id(tmp_path), 60, "the job id")
        waited_for(lambda: _steps_done(tmp_path) >= 4, 300, "four steps")
        signalled = time.monotonic()
        subprocess.run(["scancel", "--signal=USR2", "--full", job], env=env, check=True, timeout=30)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    run = _only_run(tmp_path)
    slurm_log = (run / "logs" / f"slurm-{job}.out").read_text()
    assert "step exited with status 3" in slurm_log and f"job {job} start 1" in slurm_log
    assert "RUNNING" in err and "restart 1" in err                   # followed through the requeue (on stderr)
    rank0 = (run / "logs" / "rank0.log").read_text()
    assert "stopping after step" in rank0 and "resumed from" in rank0
    losses = train_losses(run)
    assert losses == four_process_losses or all(abs(losses[s] - l) < 1e-4 * max(1.0, abs(l))
                                                for s, l in four_process_losses.items())
    records = [json.loads(p.read_text()) for p in sorted((run / "logs").glob("agent-*.json"))]
    assert {r["host"] for r in records} == {"node1", "node2"} and {r["restart_count"] for r in records} == {1}
    print(f"preemption signal to finished requeued job: {time.monotonic() - signalled:.1f} s")


def test_a_job_submitted_without_waiting_records_its_own_end(slurm_cluster, dataset, tmp_path):
    """--no-wait returns once sbatch took the job; the run says "submitted" until the batch script
    writes the job's end into metadata.json (runtime.runs.jobend), and "resumed" while a requeued
    attempt runs."""
    env = training_environ(slurm_cluster, tmp_path)
    proc = run_inv("train.pretrain", "--runtime", "slurm", "--nodes", "2", "--nproc", "2", "--name", "nowait",
                   "--no-wait", *train_args(dataset, steps=8), env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = _only_run(tmp_path)
    job = _job_id(tmp_path)

    def metadata():
        return json.loads((run / "metadata.json").read_text())

    assert metadata()["status"] == "submitted" and metadata()["slurm_job_id"] == job
    assert f"squeue -j {job}" in proc.stderr
    # Preempted on the way (the USR2 warning): "requeued" while it waits, "resumed" once it runs again.
    waited_for(lambda: _steps_done(tmp_path) >= 3, 300, "three steps")
    slurm_cluster.slurm_run("scancel", "--signal=USR2", "--full", job, check=True)
    waited_for(lambda: metadata()["status"] == "resumed", 300, "the requeued job to run again")
    ended = waited_for(lambda: metadata()["status"] != "resumed" and metadata(), 300, "the job's end")
    assert ended["status"] == "ok" and ended["exit_code"] == 0 and ended["requeues"] == 1, ended
    assert ended["hosts"] == ["node1", "node2"] and ended["world_size"] == 4
    result = json.loads((run / "result.json").read_text())
    assert result["summary"]["steps"] == 8 and max(train_losses(run)) == 8


def test_a_node_whose_ranks_die_ends_the_job_and_is_named(slurm_cluster, dataset, tmp_path):
    env = training_environ(slurm_cluster, tmp_path)
    proc = subprocess.Popen(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                             "--nproc", "2", "--name", "dies", *train_args(dataset, steps=400)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waited_for(lambda: _steps_done(tmp_path) >= 3, 300, "three steps")
        killed = kill_trainers(slurm_cluster.hosts[1].netns)
        out, err = proc.communicate(timeout=240)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None)
    assert "on node2 failed first" in err, err[-3000:]
    assert err.count("Traceback") == 0
    assert ended < 180
    md = json.loads((_only_run(tmp_path) / "metadata.json").read_text())
    assert md["status"] == "failed"
    print(f"node death to job end: {ended:.1f} s")


def test_a_node_whose_ranks_die_is_restarted_inside_the_allocation(slurm_cluster, dataset, tmp_path):
    """With a checkpoint to start from, inv runs a new srun step in the same allocation: no requeue."""
    env = training_environ(slurm_cluster, tmp_path)
    proc = subprocess.Popen(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                             "--nproc", "1", "--name", "again",
                             *train_args(dataset, "--set", "checkpoint.interval=10", steps=30)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waited_for(lambda: steps_after_restart(tmp_path / "runs", "*_again", 0) >= 13, 300, "thirteen steps")
        kill_trainers(slurm_cluster.hosts[1].netns)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    md = json.loads((_only_run(tmp_path) / "metadata.json").read_text())
    (restart,) = md["restarts"]
    assert md["status"] == "ok" and (restart["host"], restart["step"]) == ("node2", 10), restart
    assert "restart 1 of 2 (rank 1 on node2" in err and max(train_losses(_only_run(tmp_path))) == 30


def test_a_node_set_down_mid_job_is_recorded_as_a_node_failure(slurm_cluster, dataset, tmp_path):
    """scontrol sets node2 DOWN while the batch job trains: Slurm ends the step and requeues the job, which
    resumes (ReturnToService=2 brings the node back) and finishes; the run records the node failure."""
    env = training_environ(slurm_cluster, tmp_path)
    proc = subprocess.Popen([str(INV), "train.pretrain", "--runtime", "slurm", "--nodes", "2", "--nproc", "1",
                             "--name", "down", *train_args(dataset, "--set", "checkpoint.interval=10", steps=30)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waited_for(lambda: _job_id(tmp_path), 60, "the job id")
        waited_for(lambda: _steps_done(tmp_path) >= 14, 300, "fourteen steps")
        subprocess.run(["scontrol", "update", "nodename=node2", "state=DOWN", "reason=anvil-test"], env=env,
                       check=True, timeout=30)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        subprocess.run(["scontrol", "update", "nodename=node2", "state=RESUME"], env=env, capture_output=True,
                       timeout=30)   # (back already, as it registered: then an error, which is fine)
    assert proc.returncode == 0, err[-3000:]
    md = json.loads((_only_run(tmp_path) / "metadata.json").read_text())
    assert md["status"] == "ok" and md["node_failures"] == ["node2"], md
    assert "slurm: node(s) node2 failed during the job (srun: Node failure); Slurm requeued it" in err
    assert max(train_losses(_only_run(tmp_path))) == 30


def test_bad_slurm_input_is_one_message(slurm_cluster, dataset, tmp_path):
    env = training_environ(slurm_cluster, tmp_path)
    # (--partition itself is checked before a run exists: test_hostile_runner_slurm.py; slurm_extra's is sbatch's)
    rejected = run_inv("train.pretrain", "--runtime", "slurm", "--nodes", "2", *train_args(dataset),
                       env={**env, "INVOKE_ANVIL_SLURM_EXTRA": "--partition=nosuchpart"}, timeout=120)
    assert rejected.returncode == 2 and "sbatch rejected the job" in rejected.stderr, rejected.stderr[-2000:]
    assert "Traceback" not in rejected.stderr
    too_many = subprocess.run(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                               "--nodes", "3", *train_args(dataset)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert too_many.returncode == 2 and "has only 2 node(s)" in too_many.stderr, too_many.stderr[-2000:]
    stranger = subprocess.run(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                               "--exclude", "node9", *train_args(dataset)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert stranger.returncode == 2 and "--exclude node9: not a node of this allocation" in stranger.stderr, \
        stranger.stderr[-2000:]
    everyone = subprocess.run(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                               "--exclude", "node1", "--exclude", "node2", *train_args(dataset)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert everyone.returncode == 2 and "every node of this allocation" in everyone.stderr, everyone.stderr[-2000:]
    never = run_inv("train.pretrain", "--runtime", "slurm", "--nodes", "5", *train_args(dataset), env=env,
                    timeout=120)   # the cluster has 2
    assert never.returncode == 2 and "Slurm will not start job" in never.stderr, never.stderr[-2000:]
    assert "so it was cancelled" in never.stderr and "Traceback" not in never.stderr
    assert slurm_cluster.slurm_run("squeue", "-h").stdout.strip() == ""      # nothing left pending
    no_slurm = run_inv("train.pretrain", "--runtime", "slurm", *train_args(dataset),
                       env={**env, "PATH": str(INV.parent) + ":/usr/bin/none"}, timeout=120)
    assert no_slurm.returncode == 2 and "`sbatch` not found" in no_slurm.stderr, no_slurm.stderr[-2000:]
    assert "Traceback" not in too_many.stderr + no_slurm.stderr
    assert not any((run / "metrics.jsonl").exists() for run in (tmp_path / "runs").glob("*"))


@contextlib.contextmanager
def _following(cluster, dataset, tmp_path, name: str, steps: int):
    """inv following a one-node batch job (no terminal): yields (proc, job id); kills what is left after."""
    proc = subprocess.Popen([str(INV), "train.pretrain", "--runtime", "slurm", "--nodes", "1", "--name", name,
                             *train_args(dataset, steps=steps)], cwd=REPO, env=training_environ(cluster, tmp_path),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = None
    try:
        job = waited_for(lambda: _job_id(tmp_path), 60, "the job id")
        yield proc, job
    finally:
        if proc.poll() is None:
            proc.kill()
        if job:
            cluster.slurm_run("scancel", job)


def test_ctrl_c_while_following_a_job_leaves_it_running_and_says_so(slurm_cluster, dataset, tmp_path):
    with _following(slurm_cluster, dataset, tmp_path, "fol", steps=400) as (proc, job):
        time.sleep(2)
        proc.send_signal(signal.SIGINT)            # Ctrl-C to inv only: no terminal, so no question
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, out[-2000:] + err[-2000:]
        assert f"stopped following Slurm job {job}; it keeps running" in err and "Traceback" not in err
        assert json.loads((_only_run(tmp_path) / "metadata.json").read_text())["status"] == "detached"
        state = slurm_cluster.slurm_run("scontrol", "show", "job", job).stdout
        assert "JobState=RUNNING" in state or "JobState=PENDING" in state, state


def test_scancel_of_a_followed_job_cancels_it_and_it_stays_cancelled(slurm_cluster, dataset, tmp_path):
    """scancel sends TERM, which the ranks take like a preemption (checkpoint, exit 3): the batch script
    must not requeue a cancelled job (it did, and the job trained on)."""
    with _following(slurm_cluster, dataset, tmp_path, "cancel", steps=400) as (proc, job):
        waited_for(lambda: _steps_done(tmp_path) >= 2, 300, "two steps")
        slurm_cluster.slurm_run("scancel", job)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-2000:] + err[-2000:]
        assert f"Slurm job {job} was cancelled" in err and "Traceback" not in err, err[-2000:]
        run = _only_run(tmp_path)
        typed = shlex.join(["train.pretrain", "--runtime", "slurm", "--nodes", "1", "--name", "cancel",
                            *train_args(dataset, steps=400)])
        assert f"continue where it ran with `inv {typed} --resume {run}`" in err, err[-2000:]   # not here, alone
        assert json.loads((run / "metadata.json").read_text())["status"] == "cancelled"
        log = run / "logs" / f"slurm-{job}.out"
        waited_for(lambda: "step exited with status" in log.read_text(), 60, "the batch script's end")
        time.sleep(3)                                 # a requeue would show as PENDING / Restarts=1 now
        state = slurm_cluster.slurm_run("scontrol", "show", "job", job).stdout
        assert "JobState=CANCELLED" in state and "Restarts=0" in state, state
        assert f"job {job} start 1" not in log.read_text()


def test_sigterm_to_the_follower_detaches_and_the_job_records_its_end(slurm_cluster, dataset, tmp_path):
    """A closed terminal or SSH session (SIGHUP) or SIGTERM to inv: the run said "running" for ever."""
    with _following(slurm_cluster, dataset, tmp_path, "hup", steps=8) as (proc, job):
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, out[-2000:] + err[-2000:]
        assert f"stopped following Slurm job {job} on SIGTERM; it keeps running" in err, err[-2000:]
        run = _only_run(tmp_path)

        def status():
            return json.loads((run / "metadata.json").read_text())["status"]
        assert status() == "detached"
        assert waited_for(lambda: status() not in ("detached", "running") and status(), 300, "the job's end") == "ok"


def test_a_job_killed_outright_is_recorded_when_runs_are_listed(slurm_cluster, dataset, tmp_path):
    """A batch shell killed with SIGKILL cannot run runtime.runs.jobend: the run said "submitted"
    for ever. Listing or showing runs asks Slurm (runtime.jobs.settle) and records the end."""
    env = training_environ(slurm_cluster, tmp_path)
    proc = run_inv("train.pretrain", "--runtime", "slurm", "--nodes", "1", "--name", "killed", "--no-wait",
                   *train_args(dataset, steps=400), env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run, job = _only_run(tmp_path), _job_id(tmp_path)

    def metadata():
        return json.loads((run / "metadata.json").read_text())

    def snapshot(*argv):
        return run_inv("snapshot." + argv[0], *argv[1:], env=env, timeout=120)

    try:
        waited_for(lambda: _steps_done(tmp_path) >= 2, 300, "two steps")
        running = snapshot("list")                   # a running job is left alone
        assert running.returncode == 0 and "recorded as" not in running.stderr, running.stderr[-2000:]
        assert metadata()["status"] == "submitted"
        slurm_cluster.slurm_run("scancel", "--batch", "--signal=KILL", job)
        waited_for(lambda: "JobState=RUNNING" not in slurm_cluster.slurm_run("scontrol", "show", "job", job).stdout
                  and "JobState=COMPLETING" not in slurm_cluster.slurm_run("scontrol", "show", "job", job).stdout,
                  120, "the job's end")
        assert metadata()["status"] == "submitted"   # the batch script could not record it
        end_time = re.search(r"EndTime=(\S+)", slurm_cluster.slurm_run("scontrol", "show", "job", job).stdout)[1]
        listed = snapshot("list")
    finally:
        slurm_cluster.slurm_run("scancel", job)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert f"{run.name}: Slurm job {job} ended FAILED" in listed.stderr, listed.stderr[-2000:]
    assert "signal 9 (SIGKILL)" in listed.stderr and "recorded as failed" in listed.stderr
    md = metadata()
    assert md["status"] == "failed" and md["exit_code"] == 137 and "never recorded the end" in md["error"]
    assert md["end"].startswith(end_time)              # when the job ended, not when it was listed
    (row,) = [line for line in listed.stdout.splitlines() if run.name in line]
    assert " failed " in row, listed.stdout
    again = snapshot("list")                          # recorded once
    assert again.returncode == 0 and "recorded as" not in again.stderr

    # The same run, as if slurmctld had forgotten its job (past MinJobAge, or a reinstalled
    # cluster): the id names no job, and show records it "lost".
    md.update(status="submitted", slurm_job_id="9999999", error=None)
    (run / "metadata.json").write_text(json.dumps(seal(md)))
    shown = snapshot("show", str(run))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "Slurm no longer knows job 9999999" in shown.stderr and "recorded as lost" in shown.stderr
    assert re.search(r"^status\s+lost$", shown.stdout, re.M), shown.stdout[:2000]
    assert metadata()["status"] == "lost"


@pytest.mark.parametrize("to_the_group", [True, False])
def test_ctrl_c_of_a_run_in_an_allocation_checkpoints_on_every_node(slurm_cluster, dataset, tmp_path, to_the_group):
    """`salloc -N2 inv train.pretrain --runtime slurm` (srun inside the allocation), then Ctrl-C: every rank
    finishes its step and checkpoints, 130, interrupted. srun read the terminal's SIGINT and the one inv passed
    on as a double Ctrl-C and killed the step (no checkpoint, 'failed'); one SIGINT to inv alone did nothing."""
    proc = start_as_from_a_terminal(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                                     "--name", "intr", *train_args(dataset, steps=100000)],
                                    cwd=REPO, env=training_environ(slurm_cluster, tmp_path), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    inv = None
    try:
        waited_for(lambda: _steps_done(tmp_path) >= 3, 300, "three steps")
        # salloc runs its command in a process group of its own, the terminal's foreground one: a Ctrl-C
        # there reaches inv and whatever inv started in its group (srun, before it got a session of its own).
        (inv,) = map(int, subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split())
        assert os.getpgid(inv) == inv
        (os.killpg if to_the_group else os.kill)(inv, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            for group in filter(None, (inv, proc.pid)):
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.communicate()
            slurm_cluster.slurm_run("scancel", "--user", "root")
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    run = _only_run(tmp_path)
    md = json.loads((run / "metadata.json").read_text())
    assert md["status"] == "interrupted" and md["hosts"] == ["node1", "node2"], md
    assert (run / "checkpoints").is_dir() and list((run / "checkpoints").glob("step_*/COMPLETE"))
    typed = shlex.join(["train.pretrain", "--runtime", "slurm", "--name", "intr", *train_args(dataset, steps=100000)])
    # --runtime slurm kept, and the allocation's node count pinned, as a replay pins it
    assert f"continue where it ran with `inv {typed} --resume {run} --nodes 2`" in err, err[-3000:]
    assert "CANCELLED" not in err and "Traceback" not in err
    # The allocation ends with salloc; its job may show CG (completing) for a few seconds while the
    # nodes' slurmd report back, longer on a loaded machine: it must leave the queue, not linger.
    waited_for(lambda: not slurm_cluster.slurm_run("squeue", "-h").stdout.strip(), 60,
              "the allocation to leave the queue")


def test_the_seed_model_trains_in_an_allocation_with_its_experts_split_and_resumes(slurm_cluster, dataset,
                                                                                   tmp_path):
    """The seed's second step: `salloc -N2 inv train.pretrain --runtime slurm` with DeepSeek-V2 in miniature,
    one rank a node, parallel.ep=2 (each node holds half the experts); the loss falls, and a resume from
    its middle checkpoint in a new allocation continues the same curve."""
    def train(name: str, *extra: str) -> Path:
        proc = subprocess.run(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                               "--nproc", "1", "--name", name, *MOE_ARGS, *extra], cwd=REPO,
                              env=training_environ(slurm_cluster, tmp_path), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (run,) = (tmp_path / "runs").glob(f"*_{name}")
        return run

    run = train("moe", *train_args(dataset, "--set", "checkpoint.interval=3", steps=6))
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1], losses
    md = json.loads((run / "metadata.json").read_text())
    assert md["hosts"] == ["node1", "node2"] and md["world_size"] == 2
    again = train("moe_resumed", *train_args(dataset, steps=6), "--resume", str(run / "checkpoints" / "step_3"))
    resumed = train_losses(again)
    assert sorted(resumed) == [4, 5, 6]
    assert all(abs(resumed[s] - losses[s]) <= 1e-4 * abs(losses[s]) for s in resumed), (resumed, losses)


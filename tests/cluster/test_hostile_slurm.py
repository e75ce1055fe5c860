"""Issue 44, the runner's Slurm items, on the live two-node testbed (tests/helpers/cluster.py, slurm=True):

3. A --partition Slurm does not have is one line naming it and the partitions there are, before any
   run directory (runtime.cluster.slurm.control.require_partition). sbatch refused it only once the
   run existed (a failed run directory), and srun inside an allocation ran the step anyway.
4. `salloc -N2 inv train.pretrain --runtime slurm`, then salloc and inv killed (kill -9): srun lived
   on without inv, and the ranks trained to the end unwatched while the run was recorded lost. Now
   srun gets SIGUSR2 from the kernel when inv dies and passes it to every node's agent: the ranks
   checkpoint and stop (3), and the next look at the runs records it, saying so.
   And `kill <inv>` (SIGTERM) alone: inv passed it to srun, which killed the ranks with nothing saved
   ("failed"); now the step's tasks get it (scancel --signal=TERM JOB.STEP), as at a preemption.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.processes import alive, waited_for
from helpers.cluster import trainer_pids
from helpers.training import train_args, train_losses
from helpers.program import REPO, INV

pytestmark = pytest.mark.slow


def _env(cluster, tmp_path, **extra):
    return {**os.environ, **cluster.slurm_env(), "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs"),
            "ANVIL_AGENT_GRACE": "3", **extra}


def _runs(tmp_path) -> list[Path]:
    folder = tmp_path / "runs"
    return sorted(folder.iterdir()) if folder.is_dir() else []




# ---------------------------------------------------------------- 3. a partition Slurm does not have

def test_a_partition_slurm_does_not_have_is_one_line_before_any_run_directory(slurm_cluster, dataset, tmp_path):
    env = _env(slurm_cluster, tmp_path)
    cases = [  # submitted (sbatch), in an allocation (srun: it ran the step anyway), a fan-out (the setting)
        ([str(INV), "train.pretrain", "--runtime", "slurm", "--nodes", "2", "--partition", "debug,nosuchpart"], env),
        (["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm", "--partition", "nosuchpart"],
         env),
        ([str(INV), "preflight.host", "--runtime", "slurm"], {**env, "INVOKE_ANVIL_SLURM_PARTITION": "nosuchpart"}),
    ]
    for argv, environ in cases:
        proc = subprocess.run([*argv, *(train_args(dataset) if "train.pretrain" in argv else [])], cwd=REPO,
                              env=environ, capture_output=True, text=True, timeout=120)
        task = argv[argv.index(str(INV)) + 1]
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{task}: ")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert lines == [f"{task}: Slurm partition (--partition, anvil.slurm_partition) nosuchpart: no such "
                         "partition on this cluster; its partitions: debug"], proc.stderr[-2000:]
        assert _runs(tmp_path) == [], argv
    assert slurm_cluster.slurm_run("squeue", "-h").stdout.strip() == ""      # nothing submitted


# ---------------------------------------------------------------- 4. salloc and inv killed

def test_ranks_whose_salloc_and_inv_are_killed_checkpoint_and_stop(slurm_cluster, dataset, tmp_path):
    env = _env(slurm_cluster, tmp_path)
    salloc = subprocess.Popen(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                               "--nproc", "2", "--name", "orphan", *train_args(dataset, steps=100000)],
                              cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    inv = None
    try:
        waited_for(lambda: _runs(tmp_path) and (_runs(tmp_path)[0] / "metrics.jsonl").is_file()
                  and max(train_losses(_runs(tmp_path)[0]) or [0]) >= 3, 300, "three steps")
        (inv,) = map(int, subprocess.run(["pgrep", "-P", str(salloc.pid)], capture_output=True,
                                         text=True).stdout.split())
        ranks = [pid for host in slurm_cluster.hosts for pid in trainer_pids(host.netns)]
        assert len(ranks) == 4, ranks
        os.kill(salloc.pid, signal.SIGKILL)             # the allocation stays (InactiveLimit=0), with no owner
        salloc.wait()
        os.kill(inv, signal.SIGKILL)
        killed = time.monotonic()
        waited_for(lambda: not any(alive(pid) for pid in ranks), 120, "the ranks to stop")
        stopped = time.monotonic() - killed
    finally:
        for pid in filter(None, (inv, salloc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        salloc.wait()
        slurm_cluster.slurm_run("scancel", "--user", "root")      # the allocation salloc left behind
    (run,) = _runs(tmp_path)
    last = max(train_losses(run))
    assert last < 100000 and (run / "checkpoints" / f"step_{last}" / "COMPLETE").is_file(), sorted(
        p.name for p in (run / "checkpoints").glob("*"))
    # every rank stops after the same step; rank 0 may hear of it from a peer before its own signal is read
    assert "stopping after step" in (run / "logs" / "rank0.log").read_text()
    assert "SIGUSR2: stopping after step" in "".join(p.read_text() for p in (run / "logs").glob("rank*.log"))
    # each node's agent writes its report once its ranks have exited: a moment after the test saw them go
    waited_for(lambda: len(list((run / "logs").glob("agent-*.json"))) == 2, 60, "both nodes' agent reports")
    reports = [json.loads(p.read_text()) for p in sorted((run / "logs").glob("agent-*.json"))]
    assert [(r["host"], r["exit_code"], r["signal"]) for r in reports] == [("node1", 3, "SIGUSR2"),
                                                                           ("node2", 3, "SIGUSR2")]
    assert json.loads((run / "metadata.json").read_text())["status"] == "running"   # no one recorded the end
    listed = subprocess.run([str(INV), "snapshot.list"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert f"{run.name}: its inv (pid {inv}) ended without recording the end" in listed.stderr, listed.stderr
    md = json.loads((run / "metadata.json").read_text())
    assert (md["status"], md["settled_by"], md["hosts"]) == ("lost", "pid", ["node1", "node2"]), md
    assert f"every rank then checkpointed and stopped (`inv train.pretrain --resume {run}` continues it)" in md["error"]
    print(f"inv killed to every rank stopped: {stopped:.1f} s")


def test_sigterm_to_inv_in_an_allocation_checkpoints_instead_of_killing_the_ranks(slurm_cluster, dataset, tmp_path):
    salloc = subprocess.Popen(["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm",
                               "--nproc", "2", "--name", "term", *train_args(dataset, steps=100000)],
                              cwd=REPO, env=_env(slurm_cluster, tmp_path), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        waited_for(lambda: _runs(tmp_path) and (_runs(tmp_path)[0] / "metrics.jsonl").is_file()
                  and max(train_losses(_runs(tmp_path)[0]) or [0]) >= 3, 300, "three steps")
        (inv,) = map(int, subprocess.run(["pgrep", "-P", str(salloc.pid)], capture_output=True,
                                         text=True).stdout.split())
        os.kill(inv, signal.SIGTERM)                    # `kill PID`: inv alone
        out, err = salloc.communicate(timeout=120)
    finally:
        if salloc.poll() is None:
            os.killpg(salloc.pid, signal.SIGKILL)
            salloc.communicate()
        slurm_cluster.slurm_run("scancel", "--user", "root")
    assert salloc.returncode == 3, err[-3000:]
    assert "SIGTERM: the ranks of Slurm step" in err and "Killed" not in err and "Traceback" not in err, err[-3000:]
    (run,) = _runs(tmp_path)
    md = json.loads((run / "metadata.json").read_text())
    assert md["status"] == "preempted" and md["hosts"] == ["node1", "node2"], md
    assert (run / "checkpoints" / f"step_{max(train_losses(run))}" / "COMPLETE").is_file()


"""`inv train.launch --backend command` across two SSH hosts (-H) and on the live two-node Slurm testbed,
with the tests' own torchrun-style program (tests/runner/launch_program.py), one rank a node.

Covers: the ranks of two hosts meet through torch.distributed (env://, gloo: torchrun's variables from each
host's agent), each rank's log says its host, the metrics and the summary come back; a rank SIGKILLed on
the second host is named with that host (its peer on the first fails on the closed connection at once, and
its node ends first); a Slurm batch job preempted with SIGUSR2 checkpoints, exits 3, is requeued, and its
next attempt resumes the program (ANVIL_RESUME) from that checkpoint on the curve of an uninterrupted run.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from helpers.processes import waited_for
from helpers.program import INV, ONE_THREAD, REPO, explain, inv, inv_environ, metadata, one_line_error, runs
from helpers.training import last_step, train_losses

pytestmark = [pytest.mark.slow]

PROGRAM = REPO / "tests" / "runner" / "launch_program.py"


def _first_job_id(tmp_path) -> str | None:
    found = [run / "slurm" / "job_id" for run in runs(tmp_path) if (run / "slurm" / "job_id").is_file()]
    return found[0].read_text().strip() if found else None


@pytest.mark.netns
def test_the_program_runs_across_two_ssh_hosts_and_a_killed_rank_is_named_with_its_host(netns_cluster, tmp_path):
    settings = json.loads(netns_cluster.invoke_yaml(REPO, connect_timeout=5))
    settings["anvil"]["runs_dir"] = str(tmp_path / "runs")
    path = tmp_path / "anvil-hosts.yaml"
    path.write_text(json.dumps(settings))
    up = [h.address for h in netns_cluster.hosts]
    environ = inv_environ(env={"ANVIL_AGENT_GRACE": "3", **ONE_THREAD}, clean=True)

    def launch(*program: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(INV), "-f", str(path), "-H", ",".join(up), "train.launch", "--backend", "command",
                               "--nproc", "1", "--", str(PROGRAM), *program], cwd=REPO, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=600, env=environ)

    result = launch("--steps", "4", "--gloo")      # torch.distributed's own meeting (env://, gloo) across the hosts
    assert result.returncode == 0, explain(result)
    (run,) = runs(tmp_path)
    md = metadata(run)
    assert (md["status"], md["runtime"], md["hosts"], md["world_size"], md["nodes"]) == ("ok", "ssh", up, 2, 2), md
    for rank, host in enumerate(up):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"[{host} r{rank}/l0][ERR] launch_program: RANK={rank} LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 " \
               f"MASTER={up[0]}:" in log, log
    assert sorted(train_losses(run)) == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4

    killed = launch("--steps", "4", "--kill-rank", "1", "--kill-at", "2")
    one_line_error(killed, f"rank 1 on {up[1]} failed first (signal 9, SIGKILL", code=137)
    assert metadata(runs(tmp_path)[-1])["status"] == "failed"


def test_a_preempted_batch_job_is_requeued_and_resumes_the_program_on_the_same_curve(slurm_cluster, tmp_path):
    reference_work = tmp_path / "here"
    reference_work.mkdir()
    here = inv(reference_work, "train.launch", "--backend", "command", "--nproc", "2", "--", str(PROGRAM),
               "--steps", "8", env=ONE_THREAD)
    assert here.returncode == 0, explain(here)
    reference = train_losses(runs(reference_work)[0])

    env = inv_environ(tmp_path / "runs", {**slurm_cluster.slurm_env(), "ANVIL_AGENT_GRACE": "3", **ONE_THREAD})
    proc = subprocess.Popen([str(INV), "train.launch", "--backend", "command", "--runtime", "slurm", "--nodes", "2",
                             "--nproc", "1", "--name", "pre", "--", str(PROGRAM), "--steps", "8", "--sleep", "1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = waited_for(lambda: _first_job_id(tmp_path), 60, "the job id")
        waited_for(lambda: runs(tmp_path) and last_step(runs(tmp_path)[0]) >= 2, 300, "two steps")
        subprocess.run(["scancel", "--signal=USR2", "--full", job], env=env, check=True, timeout=30)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    (run,) = runs(tmp_path)
    slurm_log = (run / "logs" / f"slurm-{job}.out").read_text()
    assert "step exited with status 3" in slurm_log and f"job {job} start 1" in slurm_log, slurm_log
    resumes = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if '"kind": "resume"' in line]
    assert len(resumes) == 1, resumes
    step, checkpoint = resumes[0]["step"], resumes[0]["checkpoint"]
    assert checkpoint == str(run / "checkpoints" / f"step_{step}")
    assert f"resumed from {checkpoint} at step {step}" in (run / "logs" / "rank0.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from"]) == (8, checkpoint)
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 9))
    assert all(abs(losses[s] - reference[s]) <= 1e-6 * max(1.0, abs(reference[s])) for s in reference)
    md = metadata(run)
    assert (md["status"], md["hosts"], md["world_size"]) == ("ok", ["node1", "node2"], 2), md


def test_an_unfollowed_batch_job_records_its_end_and_summary_itself(slurm_cluster, tmp_path):
    env = inv_environ(tmp_path / "runs", {**slurm_cluster.slurm_env(), **ONE_THREAD})
    submitted = subprocess.run([str(INV), "train.launch", "--backend", "command", "--runtime", "slurm", "--nodes",
                                "2", "--nproc", "1", "--no-wait", "--", str(PROGRAM), "--steps", "3"], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, explain(submitted)
    (run,) = runs(tmp_path)
    assert metadata(run)["status"] == "submitted"
    ended = waited_for(lambda: metadata(run)["status"] not in ("submitted", "running") and metadata(run), 300,
                       "the job's end")
    assert (ended["status"], ended["hosts"], ended["world_size"]) == ("ok", ["node1", "node2"], 2), ended
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["backend"]) == (3, "command")

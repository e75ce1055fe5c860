"""The Slurm cluster of tests/helpers/cluster.py for real: munged, slurmctld in the root
namespace and a slurmd per network-namespace host (node1, node2). These test
the cluster itself (what the Slurm runtime's tests stand on): scheduling across
both nodes, node names resolving on the nodes (torch's gloo rendezvous over
them), batch jobs, requeue, and a node failure.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from helpers.cluster import Cluster
from helpers.processes import alive
from helpers.program import explain

pytestmark = [pytest.mark.netns]


def wait_for_text(path: Path, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text, re.M):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout:.0f} s:\n{text}")


def submit(cluster: Cluster, *argv: str) -> str:
    result = cluster.slurm_run("sbatch", "--parsable", *argv)
    assert result.returncode == 0, explain(result)
    return result.stdout.strip().split(";")[0]


def test_sinfo_shows_two_idle_nodes(slurm_cluster):
    result = slurm_cluster.slurm_run("sinfo", "-N", "-h", "-o", "%N %P %t %c")
    assert result.returncode == 0, explain(result)
    rows = sorted(line.split() for line in result.stdout.splitlines())
    cpus = str(os.cpu_count())
    assert rows == [["node1", "debug*", "idle", cpus], ["node2", "debug*", "idle", cpus]], rows
    assert slurm_cluster.slurm_env() == {"SLURM_CONF": slurm_cluster.slurm_conf}


def test_srun_places_tasks_on_both_nodes_where_node_names_resolve(slurm_cluster):
    result = slurm_cluster.slurm_run(
        "srun", "-N2", "-n4", "bash", "-c",
        'echo "task $SLURM_PROCID node $SLURM_NODEID host $(hostname) '
        'node1=$(getent ahostsv4 node1 | head -1 | cut -d" " -f1) node2=$(getent ahostsv4 node2 | head -1 | cut -d" " -f1)"')
    # (ahostsv4: `getent hosts` answers ::ffff:10.x, the v4-mapped form, where the resolver prefers IPv6)
    assert result.returncode == 0, explain(result)
    tasks = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"task (\d) node (\d) host (\S+) node1=(\S+) node2=(\S+)", line.strip())
        assert match, f"unexpected line {line!r}\n{explain(result)}"
        tasks[int(match[1])] = match.groups()[1:]
    assert sorted(tasks) == [0, 1, 2, 3]
    hosts = {h.name: h.address for h in slurm_cluster.hosts}
    for node_id, host, node1, node2 in tasks.values():
        assert host == f"node{int(node_id) + 1}"           # SLURM_NODEID 0 is node1
        assert (node1, node2) == (hosts["node1"], hosts["node2"])
    assert sorted(t[1] for t in tasks.values()) == ["node1", "node1", "node2", "node2"]


_ALLREDUCE = """\
import os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
# One write per line: the two ranks of a node share the task's stdout.
os.write(1, f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()} "
            f"sum {value.item():g}\\n".encode())
dist.destroy_process_group()
"""


def test_torchrun_gloo_allreduce_across_the_two_nodes(slurm_cluster, repo, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(_ALLREDUCE)
    python = repo / ".venv" / "bin" / "python"
    # What the Slurm launcher does: one torchrun per node, master = first node's name.
    torchrun = (f"exec {python} -m torch.distributed.run --nnodes 2 --nproc-per-node 2 "
                f"--node-rank $SLURM_NODEID --master-addr node1 --master-port 29511 {script}")
    result = slurm_cluster.slurm_run("srun", "-N2", "--ntasks-per-node=1", "bash", "-c", torchrun,
                                     timeout=180)
    assert result.returncode == 0, explain(result)
    lines = sorted(re.findall(r"^rank (\d) of (\d) on (\S+) sum (\S+)$", result.stdout, re.M))
    assert lines == [("0", "4", "node1", "10"), ("1", "4", "node1", "10"),
                     ("2", "4", "node2", "10"), ("3", "4", "node2", "10")], explain(result)


def test_sbatch_job_runs_steps_on_both_nodes_and_writes_its_output(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    # Single quotes: the step's shell expands $SLURM_PROCID, not the batch shell.
    script.write_text("#!/bin/bash\n"
                      "echo batch on $(hostname) job $SLURM_JOB_ID nodes $SLURM_JOB_NODELIST\n"
                      "srun bash -c 'echo step task $SLURM_PROCID on $(hostname)'\n")
    result = slurm_cluster.slurm_run("sbatch", "--wait", "-N2", "--ntasks-per-node=1",
                                     f"--output={out}", str(script), timeout=60)
    assert result.returncode == 0, explain(result)
    job = re.search(r"Submitted batch job (\d+)", result.stdout)
    assert job, explain(result)
    text = out.read_text()
    assert f"batch on node1 job {job[1]} nodes node[1-2]" in text, text
    assert "step task 0 on node1" in text and "step task 1 on node2" in text, text


def test_scontrol_requeue_runs_a_running_batch_job_again(slurm_cluster, tmp_path):
    out = tmp_path / "requeue.out"
    script = tmp_path / "requeue.sh"
    script.write_text("#!/bin/bash\n"
                      "echo run ${SLURM_RESTART_COUNT:-0} on $(hostname)\n"
                      "[ \"${SLURM_RESTART_COUNT:-0}\" = 0 ] && exec sleep 300\n"
                      "echo finished\n")
    job = submit(slurm_cluster, "-N1", f"--output={out}", "--open-mode=append", str(script))
    try:
        wait_for_text(out, r"^run 0 on node\d$", timeout=20)
        result = slurm_cluster.slurm_run("scontrol", "requeue", job)
        assert result.returncode == 0, explain(result)
        # A requeued job waits AuthInfo cred_expire (10 s) + 1 before it starts again.
        text = wait_for_text(out, r"^finished$", timeout=40)
        assert re.search(r"^run 0 on node\d$.*^run 1 on node\d$", text, re.M | re.S), text
        assert "DUE TO JOB REQUEUE" in text, text
        shown = slurm_cluster.slurm_run("scontrol", "show", "job", job).stdout
        assert "Restarts=1" in shown, shown
    finally:
        slurm_cluster.slurm_run("scancel", job)


def test_killed_node_is_reported_down_and_returns_after_restart(slurm_prerequisites, tmp_path):
    # Its own cluster with short timeouts, so that a failure shows in seconds (the
    # shared one's SlurmdTimeout=30, MessageTimeout=10 take ~40 s) and the shared
    # cluster keeps both nodes. It runs beside the shared one: two Slurm clusters
    # coexist (own subnet, ports, munged, hosts file), more under pytest-xdist.
    with Cluster.start(tmp_path / "cluster", n_hosts=2, n_down=0, slurm=True,
                       slurm_settings={"SlurmdTimeout": 4, "MessageTimeout": 2}) as cluster:
        pid_file = tmp_path / "sleeper.pid"
        job = submit(cluster, "-w", "node2", f"--output={tmp_path / 'sleeper.out'}",
                     "--wrap", f"echo $$ > {pid_file}; exec sleep 300")
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()):
            if time.monotonic() > deadline:
                shown = cluster.slurm_run("scontrol", "show", "job", job).stdout
                nodes = cluster.slurm_run("sinfo", "-N", "-o", "%N %T %E").stdout
                pytest.fail(f"the job on node2 never started\n{shown}\n{nodes}")
            time.sleep(0.1)
        job_pid = int(pid_file.read_text())
        assert alive(job_pid)

        killed = time.monotonic()
        cluster.kill_node("node2")
        assert not alive(job_pid), "kill_node left the job's process running"
        states = cluster.wait_for_nodes(["node2"], states=("down*", "down"), timeout=40)
        took = time.monotonic() - killed
        assert states["node1"] in ("idle", "mix", "alloc"), states
        print(f"node2 DOWN {took:.1f} s after its slurmd was killed")   # -s shows it
        cluster.slurm_run("scancel", job)

        cluster.restart_node("node2")
        result = cluster.slurm_run("srun", "-w", "node2", "hostname", timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == "node2", explain(result)

"""Per-node tasks on a live two-node Slurm cluster (tests/helpers/cluster.py, slurm=True), and the exclude loop.

`inv preflight.all --runtime slurm` and the single-node benchmarks run once
on every node of the allocation (srun, one task per node) and report per node
as `inv -H` does, ending with the passing and failing node lists, which they
write into their run directory. A node made to fail a check on purpose (a
1 MiB tmpfs over its /dev/shm, in its own mount namespace) is named there, and
`inv train.pretrain --exclude-from RUN` then trains without it and records why.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.interrupts import LONG_GEMM
from helpers.processes import start_as_from_a_terminal, wait_until
from helpers.program import INV, ONE_THREAD, REPO, explain, inv_environ, run_inv
from runtime.runs.nodes import failing

pytestmark = pytest.mark.slow


def slurm_runtime_environ(cluster, tmp_path, **extra) -> dict[str, str]:
    """inv's environment on the cluster's Slurm, runtime slurm as the setting, its runs in tmp_path/runs."""
    return inv_environ(tmp_path / "runs", {**cluster.slurm_env(), "INVOKE_ANVIL_RUNTIME": "slurm", **ONE_THREAD,
                                           **extra})


def _salloc(cluster, tmp_path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["salloc", "-N2", "--quiet", str(INV), *argv], cwd=REPO,
                          env=slurm_runtime_environ(cluster, tmp_path), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def _run_of(tmp_path, task: str) -> Path:
    (run,) = sorted((tmp_path / "runs").glob(f"*_{task}"))
    return run


def test_preflight_runs_once_per_node_and_writes_the_node_lists(slurm_cluster, tmp_path):
    proc = _salloc(slurm_cluster, tmp_path, "preflight.all")
    assert proc.returncode == 0, explain(proc)
    assert "passing hosts: node1,node2" in proc.stdout and "failing hosts: (none)" in proc.stdout, explain(proc)
    run = _run_of(tmp_path, "preflight.all")
    assert (run / "nodes" / "pass.txt").read_text() == "node1\nnode2\n"
    assert failing(run) == {}
    metadata = json.loads((run / "metadata.json").read_text())
    assert metadata["fanout"] == "srun" and metadata["status"] == "ok" and metadata["hosts"] == ["node1", "node2"]
    report = json.loads((run / "report.json").read_text())
    shm = next(c for c in report["checks"] if c["name"] == "host.shm")
    assert set(shm["hosts"]) == {"node1", "node2"}
    # each node looked at itself: its own interface (named differently on node2), marked as differing
    ifaces = next(c for c in report["checks"] if c["name"] == "network.interfaces")
    assert ifaces["hosts"]["node1"]["value"] == "eth0" and ifaces["hosts"]["node2"]["value"] == "enp2s0"
    assert ifaces["differs"] is True
    for node in ("node1", "node2"):      # each node's own run, on the shared file system
        (own,) = (run / "hosts" / node).glob("*_preflight.all")
        assert json.loads((own / "preflight.json").read_text())["host"] == node


def test_a_node_failing_preflight_is_left_out_of_the_next_launch(slurm_cluster, dataset, tmp_path):
    slurm_cluster.node_tmpfs("node1", "/dev/shm", "1m")      # node1's /dev/shm: 1 MiB
    try:
        preflight = _salloc(slurm_cluster, tmp_path, "preflight.all")
        assert preflight.returncode == 1, explain(preflight)
        assert "failing hosts: node1" in preflight.stdout, explain(preflight)
        run = _run_of(tmp_path, "preflight.all")
        assert f"--exclude-from {run}" in preflight.stdout
        failed = failing(run)
        assert list(failed) == ["node1"] and "host.shm" in failed["node1"][0], failed
        assert (run / "nodes" / "pass.txt").read_text() == "node2\n"

        train = _salloc(slurm_cluster, tmp_path, "train.pretrain", "--nproc", "1", "--exclude-from", str(run),
                        "--set", f"data.path={dataset}", "--set", "train.steps=4", "--set", "data.seq_len=32",
                        "--set", "data.batch_size=4", "--set", "train.val_interval=0")
    finally:
        slurm_cluster.node_tmpfs("node1", "/dev/shm", None)
    assert train.returncode == 0, explain(train)
    assert "excluding 1 node(s) that failed preflight" in train.stderr and "node1 (host.shm" in train.stderr
    metadata = json.loads((_run_of(tmp_path, "train.pretrain_tiny") / "metadata.json").read_text())
    assert metadata["status"] == "ok" and metadata["hosts"] == ["node2"], metadata
    assert list(metadata["excluded_nodes"]) == ["node1"] and "host.shm" in metadata["excluded_nodes"]["node1"][0]


def test_benchmarks_run_once_per_node_with_a_row_each(slurm_cluster, tmp_path):
    gemm = _salloc(slurm_cluster, tmp_path, "bench.gemm", "-M", "64", "--iters", "3")
    assert gemm.returncode == 0, explain(gemm)
    report = json.loads((_run_of(tmp_path, "bench.gemm") / "report.json").read_text())
    (row,) = report["checks"]
    assert row["name"] == "gemm 64x64x64 bf16" and set(row["hosts"]) == {"node1", "node2"}
    assert all(row["hosts"][n]["value"].endswith("TFLOP/s") for n in ("node1", "node2"))
    assert "passing hosts: node1,node2" in gemm.stdout

    collective = _salloc(slurm_cluster, tmp_path, "bench.allreduce", "--sizes", "64K", "--iters", "3")
    assert collective.returncode == 0, explain(collective)
    report = json.loads((_run_of(tmp_path, "bench.allreduce") / "report.json").read_text())
    (row,) = report["checks"]
    assert row["name"].startswith("all_reduce 65536 B x 2") and set(row["hosts"]) == {"node1", "node2"}


def test_a_config_file_given_with_f_is_read_on_every_node(slurm_cluster, tmp_path):
    """`inv -f FILE TASK --runtime slurm`: each node's inv reads FILE too (here: where the hooks are)."""
    hook = tmp_path / "hooks" / "preflight" / "host" / "pre" / "10_mark.sh"
    hook.parent.mkdir(parents=True)
    hook.write_text(f'#!/bin/sh\ntouch "{tmp_path}/ran-on-$ANVIL_HOST"\n')
    hook.chmod(0o755)
    config = tmp_path / "site.yaml"
    config.write_text(json.dumps({"anvil": {"hooks_dir": str(tmp_path / "hooks")}}))
    proc = _salloc(slurm_cluster, tmp_path, "-f", str(config), "preflight.host")
    assert proc.returncode in (0, 1) and "passing hosts:" in proc.stdout, explain(proc)
    assert sorted(p.name for p in tmp_path.glob("ran-on-*")) == ["ran-on-node1", "ran-on-node2"], explain(proc)


def test_bad_per_node_input_is_one_message(slurm_cluster, dataset, tmp_path):
    too_many = _salloc(slurm_cluster, tmp_path, "preflight.host", "--nodes", "3")
    assert too_many.returncode == 2 and "has only 2 node(s)" in too_many.stderr, explain(too_many)

    env = slurm_runtime_environ(slurm_cluster, tmp_path, INVOKE_ANVIL_SLURM_PARTITION="nosuchpart")
    bad_partition = run_inv("preflight.host", env=env, timeout=120)
    assert bad_partition.returncode == 2, explain(bad_partition)
    # named with where it was set, and what this cluster has instead
    assert "nosuchpart: no such partition on this cluster; its partitions: debug" in bad_partition.stderr, \
        explain(bad_partition)
    # outside an allocation, more nodes than the cluster has: srun would wait for ever without a word
    runs_before = sorted((tmp_path / "runs").glob("*"))
    never = run_inv("preflight.host", "--runtime", "slurm", "--nodes", "5",
                    env=slurm_runtime_environ(slurm_cluster, tmp_path), timeout=120)
    assert never.returncode == 2 and "--nodes 5: Slurm cannot run this" in never.stderr, explain(never)
    assert sorted((tmp_path / "runs").glob("*")) == runs_before      # refused before a run directory

    direct = run_inv("preflight.host", "--runtime", "direct", "--nodes", "2",
                     env=slurm_runtime_environ(slurm_cluster, tmp_path), timeout=120)
    assert direct.returncode == 2 and "--nodes needs --runtime slurm" in direct.stderr, explain(direct)

    # A dead controller, as every client sees one: nobody answers on its address and port.
    conf = Path(slurm_cluster.slurm_conf).read_text().splitlines()
    dead = tmp_path / "dead-controller.conf"
    dead.write_text("\n".join(line if not line.startswith("SlurmctldPort=") else "SlurmctldPort=9"
                              for line in conf) + "\n")
    before = sorted(p.name for p in (tmp_path / "runs").glob("*"))
    for argv in (["preflight.all"], ["train.pretrain", "--set", f"data.path={dataset}"]):
        proc = run_inv(*argv, env={**env, "SLURM_CONF": str(dead)}, timeout=120)
        assert proc.returncode == 2 and "controller does not answer" in proc.stderr, explain(proc)
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "runs").glob("*")) == before   # no run directory was made
    for proc in (too_many, bad_partition, direct, never):
        assert "Traceback" not in proc.stderr


def test_ctrl_c_stops_the_task_on_every_node_and_records_it(slurm_cluster, tmp_path):
    """Outside an allocation, as typed on the login node: Ctrl-C reaches every node's task as SIGINT
    (through scancel: srun alone would end the step), each node's end is recorded, and no node is
    written down as failing for it."""
    proc = start_as_from_a_terminal([str(INV), *LONG_GEMM, "--nodes", "2"], cwd=REPO,
                                    env=slurm_runtime_environ(slurm_cluster, tmp_path),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL)

    def node_runs() -> list[Path]:
        return sorted((tmp_path / "runs").glob("*_bench.gemm/hosts/node*/*_bench.gemm/metadata.json"))
    assert wait_until(lambda: len(node_runs()) == 2, proc), proc.communicate(timeout=60)
    time.sleep(2)                 # well under way on both nodes
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err and "interrupted: stopping the task on 2 node(s)" in err, err
    assert re.search(r"^node1\s+INTERRUPTED\s", err, re.M) and re.search(r"^node2\s+INTERRUPTED\s", err, re.M), err
    run = _run_of(tmp_path, "bench.gemm")
    assert json.loads((run / "metadata.json").read_text())["status"] == "interrupted"
    assert not (run / "nodes").exists()
    for own in node_runs():      # each node's task ended as at a Ctrl-C there, and said so
        assert json.loads(own.read_text())["status"] == "interrupted", own
    for node in ("node1", "node2"):
        assert json.loads((run / "hosts" / f"{node}.json").read_text())["exit_code"] == 130
    assert slurm_cluster.slurm_run("squeue", "-h").stdout.strip() == ""     # the step and its job are gone

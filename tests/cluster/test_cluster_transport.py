"""A runtime of one's own (docs/extending.md, "A runtime"): the localnodes transport that page shows,
registered from a site folder (ANVIL_TASKS_PATH) with one decorator, runs through the installed inv
like the built-in ones: it trains two nodes like one and fans a per-node task out over them. Its
nodes are real local processes, each with its own environment."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.program import ONE_THREAD, REPO, run_inv, sets
from helpers.training import train_losses

# The marker in docs/extending.md before the block this file runs (it names the file where it used to be).
MARK = "<!-- the localnodes transport: tests/cluster/test_cluster_transport.py runs this block -->"
LOCAL_NODES_RUN = ["data.seq_len=32", "data.batch_size=4", "train.steps=6", "train.log_interval=1",
                   "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=2", "checkpoint.interval=0"]


def transport_source() -> str:
    """The python block right after the marker in docs/extending.md."""
    text = (REPO / "docs" / "extending.md").read_text()
    block = text.split(MARK, 1)[1].split("```python\n", 1)[1]
    return block.split("\n```", 1)[0] + "\n"


@pytest.fixture
def site(tmp_path) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "localnodes.py").write_text(transport_source())
    return folder


def inv_with_site(tmp_path, site, *argv, runs="runs") -> subprocess.CompletedProcess:
    """The installed inv with the site folder's tasks and transports (ANVIL_TASKS_PATH), none of this
    shell's settings, its run directories in tmp_path/`runs`."""
    return run_inv(*argv, runs=tmp_path / runs, clean=True, env={"ANVIL_TASKS_PATH": str(site), **ONE_THREAD},
                   timeout=600)


def test_one_registration_makes_a_runtime(site):
    from runtime.cluster import Runtime, registry

    spec = importlib.util.spec_from_file_location("anvil_test_localnodes", site / "localnodes.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        runtime = Runtime.parse("localnodes+container")
        assert (str(runtime), runtime.spans_nodes, runtime.scheduler) == ("localnodes+container", True, False)
        from runtime.cluster import Options
        results = Runtime.parse("localnodes").open(Options(nodes=3)).each_node(
            [sys.executable, "-c", "import os; print(os.environ['ANVIL_HOST'], os.environ['ANVIL_NODE_RANK'], "
             "os.environ['ANVIL_NNODES'])"])
        assert [(r.host, r.exit_code, r.stdout) for r in results] == [
            (f"lnode{n}", 0, f"lnode{n} {n} 3\n") for n in range(3)]
    finally:
        registry.TRANSPORTS.pop("localnodes", None)


def test_two_local_nodes_train_like_one_and_a_per_node_task_fans_out_over_them(site, dataset, tmp_path):
    run_sets = sets(*LOCAL_NODES_RUN, f"data.path={dataset}")
    reference = inv_with_site(tmp_path, site, "train.pretrain", "--nproc", "2", "--name", "ref", *run_sets, runs="ref")
    assert reference.returncode == 0, reference.stderr[-3000:]
    (ref_run,) = (tmp_path / "ref").iterdir()

    trained = inv_with_site(tmp_path, site, "train.pretrain", "--runtime", "localnodes", "--nproc", "1", "--name",
                            "two", *run_sets)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    md = json.loads((run / "metadata.json").read_text())
    assert (md["status"], md["runtime"], md["hosts"], md["world_size"]) == ("ok", "localnodes", ["lnode0", "lnode1"], 2)
    assert "[lnode1 r1/l0]" in (run / "logs" / "rank1.log").read_text()     # each node's own environment
    assert train_losses(run) == pytest.approx(train_losses(ref_run), rel=1e-4)

    fanned = inv_with_site(tmp_path, site, "preflight.host", "--runtime", "localnodes", runs="fan")
    assert fanned.returncode in (0, 1) and "passing hosts:" in fanned.stdout, fanned.stderr[-3000:]
    (fan,) = (tmp_path / "fan").iterdir()
    report = json.loads((fan / "report.json").read_text())
    assert sorted(report["hosts"]) == ["lnode0", "lnode1"]
    assert json.loads((fan / "metadata.json").read_text())["fanout"] == "localnodes"
    for node in ("lnode0", "lnode1"):      # each node ran the task itself, into its own run directory
        (own,) = (fan / "hosts" / node).glob("*_preflight.host")
        assert json.loads((own / "preflight.json").read_text())["host"] == node

    refused = inv_with_site(tmp_path, site, "train.pretrain", "--runtime", "localnodes", "--nodes", "2", *run_sets,
                            runs="no")
    assert refused.returncode == 2 and "need --runtime slurm (runtime is localnodes)" in refused.stderr

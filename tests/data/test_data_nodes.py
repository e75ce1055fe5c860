"""data.prepare on several nodes: the live two-node Slurm cluster and the SSH namespace hosts
(tests/helpers/cluster.py) share the work of one prepare, and the dataset is the one a single node makes.

Each node runs `python -m trainer.data.node` on its share of the units, in the checkout and on
the file system the nodes share (as a cluster's home); the inv that was started assembles it.
Covered: inside an allocation (salloc -N2), with --nodes 2 from outside one, over -H with the
SSH hosts, a node that cannot run its share named in one line with the other's parts kept and
made use of by the next run, and bad input before anything is written.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers.corpus import STDLIB, comparable_manifest
from helpers.program import INV, ONE_THREAD, REPO, explain, inv_environ, run_inv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Standard-library modules as one JSONL file of several MB and a folder of text files: several
    units, so both nodes get work."""
    root = tmp_path_factory.mktemp("nodes-corpus")
    with open(root / "modules.jsonl", "w") as f:
        for p in sorted(STDLIB.glob("*.py")):
            f.write(json.dumps({"text": p.read_text(encoding="utf-8")}) + "\n")
    (root / "email").mkdir()
    for p in sorted((STDLIB / "email").glob("*.py")):
        (root / "email" / p.name).write_text(p.read_text(encoding="utf-8"))
    return root


@pytest.fixture(scope="module")
def one_node(corpus, tmp_path_factory) -> dict:
    """The reference: the same prepare on this machine alone."""
    from trainer.data import prepare
    out = tmp_path_factory.mktemp("one") / "ds"
    return prepare([corpus], out, workers=1, progress=False)["manifest"]


def slurm_environ(cluster, tmp_path) -> dict[str, str]:
    """inv's environment for the cluster's Slurm (conftest's own_slurm keeps this shell's SLURM_* out)."""
    return inv_environ(tmp_path / "runs", {**cluster.slurm_env(), **ONE_THREAD}, clean=True)


def prepare_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    """data.prepare's arguments: `corpus` into `out`, one worker a node, the result as JSON."""
    return ["data.prepare", "--input", str(corpus), "--out", str(out), "--workers", "1", "--json", *extra]


def test_inside_an_allocation_both_nodes_make_parts_of_the_one_node_dataset(slurm_cluster, corpus, one_node,
                                                                         tmp_path):
    out = tmp_path / "ds"
    proc = subprocess.run(["salloc", "-N2", "--quiet", str(INV), *prepare_args(corpus, out, "--runtime", "slurm")],
                          cwd=REPO, env=slurm_environ(slurm_cluster, tmp_path), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, explain(proc)
    result = json.loads(proc.stdout)
    assert result["runtime"] == "slurm" and "making the parts on every node (srun)" in proc.stderr
    assert comparable_manifest(result["manifest"]) == comparable_manifest(one_node)   # the same shards, sha256, all
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == one_node["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir() if "ds" in p.name) == ["ds"]   # no work folder left


def test_nodes_from_outside_an_allocation(slurm_cluster, corpus, one_node, tmp_path):
    out = tmp_path / "ds"
    proc = subprocess.run([str(INV), *prepare_args(corpus, out, "--runtime", "slurm", "--nodes", "2")], cwd=REPO,
                          env=slurm_environ(slurm_cluster, tmp_path), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, explain(proc)
    assert comparable_manifest(json.loads(proc.stdout)["manifest"]) == comparable_manifest(one_node)


def test_a_node_that_fails_is_named_and_the_next_run_makes_only_what_is_missing(slurm_cluster, corpus, one_node,
                                                                            tmp_path):
    """node2 does not see the output's folder (a tmpfs over it in node2's own mount namespace: a work
    folder that is not on a shared file system): one line names node2; node1's parts are kept, and
    the same command on this machine alone finishes from them."""
    out = tmp_path / "ds"
    env = slurm_environ(slurm_cluster, tmp_path)
    slurm_cluster.node_tmpfs("node2", str(tmp_path), "1m")
    try:
        proc = subprocess.run(["salloc", "-N2", "--quiet", str(INV), *prepare_args(corpus, out, "--runtime", "slurm")],
                              cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=600)
    finally:
        slurm_cluster.node_tmpfs("node2", str(tmp_path), None)
    assert proc.returncode == 2, explain(proc)
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("data.prepare: the parts were not all made: node2:"), explain(proc)
    assert "a file system every node shares" in line and "the same command again makes the rest" in line
    assert not out.exists() and "Traceback" not in proc.stderr
    (folder,) = tmp_path.glob(".ds.parts-*")
    kept = [p for p in folder.glob("*.json") if p.name != "plan.json"]
    assert kept, "node1's parts were not kept"
    again = subprocess.run([str(INV), *prepare_args(corpus, out, "--runtime", "direct")], cwd=REPO, env=env,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert again.returncode == 0, explain(again)
    result = json.loads(again.stdout)
    assert result["resumed_parts"] == len(kept)
    assert comparable_manifest(result["manifest"]) == comparable_manifest(one_node)


def test_over_ssh_hosts_with_dash_h(netns_cluster, corpus, one_node, tmp_path, repo):
    settings = json.loads(netns_cluster.invoke_yaml(repo, connect_timeout=5))
    path = tmp_path / "anvil-hosts.yaml"
    path.write_text(json.dumps(settings))
    out = tmp_path / "ds"
    hosts = ",".join(h.address for h in netns_cluster.hosts)
    proc = run_inv("-f", path, "-H", hosts, *prepare_args(corpus, out), clean=True, timeout=600)
    assert proc.returncode == 0, explain(proc)
    result = json.loads(proc.stdout)
    assert result["runtime"] == "ssh" and comparable_manifest(result["manifest"]) == comparable_manifest(one_node)


def test_bad_input_is_one_line_before_anything_is_written(tmp_path, corpus):
    for extra, fragment in ((["--runtime", "slurm+container"], "--runtime slurm+container is not supported here"),
                            (["--nodes", "2"], "--nodes needs --runtime slurm (runtime is direct)"),
                            (["--runtime", "direct", "--hosts", "a,b"], "--runtime direct with --hosts a,b")):
        proc = run_inv(*prepare_args(corpus, tmp_path / "ds", *extra), clean=True, timeout=120)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
        assert not list(tmp_path.glob("*ds*"))

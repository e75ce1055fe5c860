"""Shared pytest fixtures, for every room of tests/ (pytest finds this file for the folders under it). Keep
it small: one section per concern, fixtures that more than one test file uses; the functions and values
the tests share are in tests/helpers/; helpers for a single file live in that file.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# tests/ for the package `helpers`; the checkout too, because tests/kernels/, tests/envs/ and tests/trainer/
# bear the names of the project's packages: with tests/ on sys.path (pytest puts this file's folder there
# anyway) they would be imported as empty namespace packages, the editable install's finder coming after
# sys.path; a package with an __init__.py in any sys.path entry wins over them. The checkout before
# site-packages also gives Anvil's kernels/ over Hugging Face's `kernels`, as every Anvil program does
# (core.checkout).
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import helpers.kernels  # noqa: E402,F401  (sets TRITON_INTERPRET=1 without a GPU before any test imports kernels:
#                         @triton.jit reads it when a kernel module is imported, and a helper jit function
#                         made before it was set cannot be called from an interpreted kernel)
from helpers.cluster import Cluster, ClusterUnavailable, missing_prerequisites  # noqa: E402
from helpers.program import INV, REPO, SHELL_CHOICES, explain, inv, run_inv, runs, sets  # noqa: E402
from helpers.project import make_project  # noqa: E402
from helpers.training import train_args, train_losses  # noqa: E402


# ---- no test reaches a Slurm it did not start -----------------------------------------------

# The suite's own Slurm configuration: a controller that is nowhere (a closed port on this machine), so a
# Slurm command a test reaches answers "down" at once. Without it srun and scontrol read
# /etc/slurm/slurm.conf, or ask DNS for a cluster (configless Slurm): a job step of the test suite would
# go to whatever cluster the machine running it belongs to.
NO_CLUSTER = """\
# tests/conftest.py: no cluster. Tests that need Slurm start their own (tests/helpers/cluster.py) and pass its
# SLURM_CONF; every other test sees this one.
ClusterName=anvil-tests-none
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=9
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket.none
MessageTimeout=2
NodeName=none CPUs=1 State=UNKNOWN
PartitionName=none Nodes=none Default=YES
"""
# Variables of a surrounding job (salloc, sbatch) or of the user's defaults for srun/sbatch/salloc.
SLURM_PREFIXES = ("SLURM_", "SRUN_", "SBATCH_", "SALLOC_")


@pytest.fixture(scope="session", autouse=True)
def own_slurm(tmp_path_factory):
    """Every test runs with the suite's own Slurm configuration (NO_CLUSTER) and outside any allocation:
    the shell running pytest may be inside salloc, or on a cluster's login node. A test that needs Slurm
    uses slurm_cluster, whose commands get that cluster's SLURM_CONF."""
    folder = tmp_path_factory.mktemp("no-slurm")
    conf = folder / "slurm.conf"
    conf.write_text(NO_CLUSTER.format(folder=folder))
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(SLURM_PREFIXES)}
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield conf
    finally:
        os.environ.pop("SLURM_CONF", None)
        os.environ.update(saved)


# ---- no test reads or makes the user's own run key -------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def own_run_key(tmp_path_factory):
    """Runs are sealed with a key of the user's (runtime.runs.trust.run_key: anvil/run-key under
    $XDG_CONFIG_HOME, made on first use): the suite's runs get a config folder of their own, never the
    real one. Through XDG_CONFIG_HOME, which the helpers that clear ANVIL_* for a child keep, so the
    suite and the inv it starts seal with the same key; a KEY_ENV of the shell would win over it."""
    from runtime.runs.trust import KEY_ENV
    saved = {name: os.environ.pop(name, None) for name in (KEY_ENV, "XDG_CONFIG_HOME")}
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))
    try:
        yield Path(os.environ["XDG_CONFIG_HOME"]) / "anvil" / "run-key"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- the installed program ----------------------------------------------------------------

@pytest.fixture(scope="session")
def repo() -> Path:
    """The checkout under test."""
    return REPO


@pytest.fixture(scope="session")
def inv_bin() -> Path:
    """The installed `inv` of this checkout's .venv (what ./bootstrap made)."""
    if not INV.exists():
        pytest.fail(f"{INV} missing: run ./bootstrap first")
    return INV


@pytest.fixture
def checked_inv(inv_bin, tmp_path):
    """checked_inv(*args, check=True): the installed inv run from the checkout as a user runs it, without
    this shell's GPU and network choices (SHELL_CHOICES), its run directories in tmp_path/runs. It never
    shows a traceback; with `check` it exits 0."""
    def run(*args, check=True, timeout=300):
        result = run_inv(*args, runs=tmp_path / "runs", unset=SHELL_CHOICES, timeout=timeout)
        assert "Traceback" not in result.stderr, result.stderr
        if check:
            assert result.returncode == 0, explain(result)
        return result
    return run


@pytest.fixture
def project(tmp_path) -> Path:
    """A throwaway Invoke project of the runner's own tasks in tmp_path/p (helpers/project.py)."""
    return make_project(tmp_path / "p")


# ---- the Triton kernels' tests --------------------------------------------------------------------

@pytest.fixture
def nan_filled_empty():
    """torch.empty inside a test is NaN-filled (helpers.kernels.uninitialized_memory_filled): an output
    element a kernel never writes shows up."""
    with helpers.kernels.uninitialized_memory_filled():
        yield


# ---- small real data, and runs made from it ----------------------------------------------------

@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """30 standard-library files, byte tokenizer: enough for a few dozen tiny training steps.
    Read-only for tests: one is made per session and shared."""
    import sysconfig

    from trainer.data import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib30"
    prepare(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30], out, progress=False)
    return out


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory) -> Path:
    """3000 documents of 3 to 40 words (the byte tokenizer: about 20 to 250 tokens each), so that most
    windows of 64 tokens cross a document's end. Read-only for tests: one per session, shared."""
    import json
    import random

    from trainer.data import prepare

    words = "the of and to in is was for on that with as by at from his her an which or be this are".split()
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("short")
    corpus = folder / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))})
                              + "\n" for _ in range(3000)))
    prepare([corpus], folder / "dataset", progress=False)
    return folder / "dataset"


@pytest.fixture
def small_corpus(tmp_path) -> Path:
    """tmp_path/corpus: three short text documents."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document number {i}\n" * 20)
    return folder


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, dataset) -> Path:
    """A tiny finished train.pretrain run (2 steps on CPU, a final checkpoint). Read-only for tests: one is
    made per session and shared."""
    work = tmp_path_factory.mktemp("finished")
    proc = inv(work, "train.pretrain", "--env", "OMP_NUM_THREADS=1",
               *sets(f"data.path={dataset}", "train.steps=2", "data.seq_len=64", "data.batch_size=4",
                     "train.val_interval=0", "train.log_interval=1", "checkpoint.interval=0"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(work)
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file() and (run / "metrics.jsonl").is_file()
    return run


@pytest.fixture(scope="session")
def four_process_losses(dataset, tmp_path_factory) -> dict[int, float]:
    """The reference of the multi-node runs: this machine alone, four processes, the same global batch
    (helpers.training.train_args); {step: train loss}."""
    work = tmp_path_factory.mktemp("ref")
    proc = run_inv("train.pretrain", "--nproc", "4", "--name", "ref", *train_args(dataset), runs=work / "runs",
                   clean=True, env={"ANVIL_AGENT_GRACE": "3"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(work)
    return train_losses(run)


# ---- network-namespace SSH hosts (tests/helpers/cluster.py) ----------------------------------------

def _unavailable(reason: str):
    # CI installs iproute2 and openssh-server and runs as root: there the
    # cluster must come up, and a skip would hide a broken setup.
    if os.environ.get("CI"):
        pytest.fail(f"namespace cluster unavailable in CI: {reason}")
    pytest.skip(f"namespace cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def netns_prerequisites() -> None:
    """Skip (fail in CI) where namespace hosts cannot be built."""
    reason = missing_prerequisites()
    if reason:
        _unavailable(reason)


def _session_cluster(workdir, **options):
    """Start a cluster for a fixture to yield; skip (fail in CI) where it cannot be built."""
    try:
        cluster = Cluster.start(workdir, **options)
    except ClusterUnavailable as exc:
        _unavailable(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def netns_cluster(netns_prerequisites, tmp_path_factory):
    """Two SSH hosts (cluster.hosts) and one down host (cluster.down_hosts),
    each in its own network namespace, for the whole session."""
    yield from _session_cluster(tmp_path_factory.mktemp("netns"), n_hosts=2, n_down=1)


# ---- a Slurm cluster on namespace hosts (tests/helpers/cluster.py, slurm=True) ------------------------

@pytest.fixture(scope="session")
def slurm_prerequisites() -> None:
    """Skip (fail in CI) where a Slurm cluster cannot be built: not root, or
    slurmctld/slurmd/slurm-client/munge missing."""
    reason = missing_prerequisites(slurm=True)
    if reason:
        _unavailable(reason)


@pytest.fixture(scope="session")
def slurm_cluster(slurm_prerequisites, tmp_path_factory):
    """Two Slurm nodes node1, node2 (cluster.hosts: 10.213.N.11/.12, also SSH hosts),
    partition debug, our own munged and slurmctld, for the whole session.
    Commands need cluster.slurm_env() ({"SLURM_CONF": ...}) in their environment,
    or use cluster.slurm_run("srun", ...). Node names resolve on the nodes."""
    yield from _session_cluster(tmp_path_factory.mktemp("slurm"), n_hosts=2, n_down=0, slurm=True)


# ---- a real headless Chromium for the HTML reports (tests/helpers/browser.py) ----------------------------

@pytest.fixture(scope="module")
def chromium():
    """A headless Chromium, 1400 x 900, for a test file's reports; skipped where chromium is not installed
    (failed in CI, which installs it)."""
    from helpers import browser

    if browser.chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with browser.Browser(1400, 900) as b:
        yield b


@pytest.fixture
def one_thread():
    """One intra-op thread for a test that trains in its own process: on a shared 2-core machine OpenMP
    spin-waits cost 10x."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""`runtime: container` for real: podman and Docker run the agent and the ranks in a container.

The image is built here, from nothing pulled: `podman import` / `docker import` of a root
file-system skeleton (merged-/usr symlinks and mount points), with this
machine's /usr, /etc and Python installation mounted read-only through the
`container_mounts` setting, as a site would mount a shared software stack.
The podman settings for this machine's kernel (cgroup v1, no
CAP_SYS_RESOURCE) go into a containers.conf of the test's own (runc with the
cgroupfs manager, the host's cgroup namespace, ulimits under the host's hard
limits); Docker is a dockerd of the test's own (its socket, data and exec roots in
the test's folder, vfs storage, no bridge or iptables: the launch uses the host's
network): the launch line Anvil builds is the stock one.

The seed model, directly and in each engine's container, gives the same losses bit
for bit; the agent's report says which engine it ran under. A missing engine,
image, interpreter or torch is one line before any run directory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from helpers.program import REPO, run_inv, sets
from helpers.training import train_losses

pytestmark = pytest.mark.slow

CONTAINERS_CONF = """\
[containers]
cgroupns = "host"
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
volumes = ["/sys/fs/cgroup:/sys/fs/cgroup"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""


def _skeleton(path: Path) -> Path:
    root = path / "rootfs"
    for folder in ("usr", "etc", "tmp", "proc", "sys", "dev", "root", "work"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
        (root / link).symlink_to(target)
    tar = path / "rootfs.tar"
    with tarfile.open(tar, "w") as archive:
        archive.add(root, arcname=".")
    return tar


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    """(env for inv, image) with a locally built image; skipped (failed in CI) where podman cannot run."""
    _engine_or_skip(("podman", "runc"), "podman")
    work = tmp_path_factory.mktemp("podman")
    (work / "containers.conf").write_text(CONTAINERS_CONF)
    (work / "storage.conf").write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/graph"\n'
                                       f'runroot = "{work}/run"\n')
    env = {**os.environ, "CONTAINERS_CONF": str(work / "containers.conf"),
           "CONTAINERS_STORAGE_CONF": str(work / "storage.conf")}
    image = f"localhost/anvil-test-rootfs:{os.getpid()}"
    made = subprocess.run(["podman", "import", "-q", str(_skeleton(work)), image], env=env, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    probe = subprocess.run(["podman", "run", "--rm", "-v", "/usr:/usr:ro", image, "true"], env=env,
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"podman cannot run a container here: {probe.stderr.strip()}")
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()}")
    yield {**env, "INVOKE_ANVIL_CONTAINER_ENGINE": "podman", "INVOKE_ANVIL_CONTAINER_IMAGE": image,
           "INVOKE_ANVIL_CONTAINER_MOUNTS": ",".join(_mounts()),
           "INVOKE_ANVIL_CONTAINER_PYTHON": str(REPO / ".venv" / "bin" / "python")}, image
    subprocess.run(["podman", "rmi", "-f", image], env=env, capture_output=True, timeout=120)
    shutil.rmtree(work / "graph", ignore_errors=True)


def _mounts() -> list[str]:
    """This machine's software, read-only, as a site mounts a shared stack into its images."""
    prefix = sys.base_prefix       # the interpreter the checkout's .venv points at
    return ["/usr:/usr:ro", "/etc:/etc:ro"] + ([] if prefix.startswith("/usr") else [f"{prefix}:{prefix}:ro"])


def _engine_or_skip(tools: tuple[str, ...], what: str) -> None:
    """Skip (fail in CI, which installs them) where the engine cannot run here."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        reason = f"needs root and {', '.join(missing)}" if missing else "needs root"
        if os.environ.get("CI"):
            pytest.fail(f"{what} test: {reason} (.ci/run installs them)")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    """(env for inv, image): a dockerd of the test's own and a locally imported image."""
    _engine_or_skip(("dockerd", "docker", "containerd", "runc"), "docker")
    work = tmp_path_factory.mktemp("docker")
    socket = work / "docker.sock"
    log = open(work / "dockerd.log", "w")
    daemon = subprocess.Popen(["dockerd", "--host", f"unix://{socket}", "--data-root", str(work / "data"),
                               "--exec-root", str(work / "exec"), "--pidfile", str(work / "dockerd.pid"),
                               "--storage-driver=vfs", "--iptables=false", "--ip6tables=false", "--bridge=none",
                               "--exec-opt", "native.cgroupdriver=cgroupfs"], stdout=log, stderr=log,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": f"unix://{socket}"}
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "version"], env=env, capture_output=True, timeout=30).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                reason = f"dockerd did not start: {(work / 'dockerd.log').read_text()[-1500:]}"
                if os.environ.get("CI"):
                    pytest.fail(reason)
                pytest.skip(reason)
            time.sleep(0.3)
        image = f"anvil-test-rootfs:{os.getpid()}"
        made = subprocess.run(["docker", "import", str(_skeleton(work)), image], env=env, capture_output=True,
                              text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        yield {**env, "INVOKE_ANVIL_CONTAINER_ENGINE": "docker", "INVOKE_ANVIL_CONTAINER_IMAGE": image,
               "INVOKE_ANVIL_CONTAINER_MOUNTS": ",".join(_mounts()),
               "INVOKE_ANVIL_CONTAINER_PYTHON": str(REPO / ".venv" / "bin" / "python")}, image
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        for folder in ("data", "exec"):
            shutil.rmtree(work / folder, ignore_errors=True)


def _train(env, tmp_path, dataset, runtime: str, *extra: str, name: str = "") -> subprocess.CompletedProcess:
    """train.pretrain, 6 tiny steps on 2 ranks, under `runtime`; `env`: the podman fixture's environment;
    `extra`: more of train.pretrain's options (another config)."""
    run_sets = sets(f"data.path={dataset}", "train.steps=6", "data.seq_len=32", "data.batch_size=4",
                    "train.log_interval=1", "train.val_interval=0", "checkpoint.interval=0")
    return run_inv("train.pretrain", "--runtime", runtime, "--nproc", "2", "--name", name or runtime, "--env",
                   "OMP_NUM_THREADS=1", *extra, *run_sets, runs=tmp_path / "runs", env=env, timeout=600)


def test_a_missing_engine_image_python_or_torch_is_one_line_before_any_run(podman, dataset, tmp_path):
    env, _image = podman
    no_docker = ":".join(p for p in env["PATH"].split(":") if not (Path(p) / "docker").exists())
    for change, said in (
            ({"INVOKE_ANVIL_CONTAINER_ENGINE": "docker", "PATH": no_docker}, "container engine docker: not found"),
            ({"INVOKE_ANVIL_CONTAINER_IMAGE": "localhost/anvil-no-such-image:0"},
             "container image localhost/anvil-no-such-image:0: not on this machine, and `podman pull` failed: "),
            ({"INVOKE_ANVIL_CONTAINER_PYTHON": "python9"}, "cannot run python9 in it ("),
            ({"INVOKE_ANVIL_CONTAINER_PYTHON": f"{sys.base_prefix}/bin/python3"},
             f"its {sys.base_prefix}/bin/python3 cannot import torch (ModuleNotFoundError: No module named 'torch')")):
        proc = _train({**env, **change}, tmp_path, dataset, "container")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith("train.pretrain: ")]
        assert said in line, line
        assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


MOE = ["--config", str(REPO / "configs" / "deepseek_v2_debug.yaml"), "--set", "parallel.ep=2"]


@pytest.fixture(scope="module")
def direct_losses(dataset, tmp_path_factory) -> dict[int, float]:
    """The seed model's losses, run directly: what each engine's container must give."""
    work = tmp_path_factory.mktemp("direct")
    direct = _train(os.environ, work, dataset, "direct", *MOE, name="moe_direct")
    assert direct.returncode == 0, direct.stderr[-3000:]
    (run,) = (work / "runs").glob("*_moe_direct")
    # (the direct run reports whatever this machine itself runs in: never podman; docker when it is a container)
    assert json.loads((run / "logs" / "agent-0.json").read_text())["container"] != "podman"
    return train_losses(run)


@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_the_seed_model_trains_in_a_container_as_it_does_directly(engine, request, dataset, tmp_path,
                                                                  direct_losses):
    """The seed's container step: DeepSeek-V2 in miniature, 2 ranks at parallel.ep=2, in the image and
    directly: the same losses bit for bit. (A dense model goes the same way: one run each is enough.)"""
    env, _image = request.getfixturevalue(engine)
    contained = _train(env, tmp_path, dataset, "container", *MOE, name="moe_container")
    assert contained.returncode == 0, contained.stdout[-2000:] + contained.stderr[-3000:]
    (run_c,) = (tmp_path / "runs").glob("*_moe_container")
    assert f"{engine} run --rm --network=host --ipc=host" in (run_c / "logs" / "launcher.log").read_text()
    agent = json.loads((run_c / "logs" / "agent-0.json").read_text())
    assert agent["container"] == engine and agent["world_size"] == 2 and agent["exit_code"] == 0
    contained_losses = train_losses(run_c)
    assert contained_losses == direct_losses and sorted(contained_losses) == list(range(1, 7))
    assert contained_losses[6] < contained_losses[1]


def test_a_program_of_train_launch_runs_in_a_podman_container(podman, tmp_path):
    """train.launch --runtime container: the agent and the program's ranks in the image, torchrun's
    variables there, the metric lines back in the run."""
    env, _image = podman
    program = REPO / "tests" / "runner" / "launch_program.py"
    proc = run_inv("train.launch", "--backend", "command", "--runtime", "container", "--nproc", "2", "--env",
                   "OMP_NUM_THREADS=1", "--", str(program), "--steps", "3", runs=tmp_path / "runs", env=env,
                   timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert "podman run --rm --network=host --ipc=host" in (run / "logs" / "launcher.log").read_text()
    agent = json.loads((run / "logs" / "agent-0.json").read_text())
    assert (agent["container"], agent["world_size"], agent["program"]["backend"]) == ("podman", 2, "command")
    assert "RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2" in (run / "logs" / "rank1.log").read_text()
    assert sorted(train_losses(run)) == [1, 2, 3]

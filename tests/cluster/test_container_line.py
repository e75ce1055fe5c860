"""The container line: the GPUs' flags for the machine Anvil detects, on every engine, and the variables
it passes in (the profile's, Anvil's, a job's, what anvil.container_env adds; not this machine's own).
Built the way production builds it (a detected machine: names.GPU stands in for the probe), read from the
dry run."""
from __future__ import annotations

import os
import subprocess

import pytest

from core import names

GPU_FLAGS = {  # (vendor's GPU, engine) -> what must be on the line
    ("MI300X:8", "docker"): ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video"],
    ("MI300X:8", "podman"): ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video"],
    ("MI300X:8", "apptainer"): ["--rocm"],
    ("H100:8", "docker"): ["--gpus=all"],
    ("H100:8", "podman"): ["--device=nvidia.com/gpu=all"],
    ("H100:8", "apptainer"): ["--nv"],
}
EVERY_FLAG = {flag for flags in GPU_FLAGS.values() for flag in flags}


def _dry_run(inv_bin, repo, gpu: str | None, engine: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INVOKE_", names.PREFIX))}
    env.update({names.setting_variable("container_engine"): engine,
                names.setting_variable("container_image"): "registry.example/train:1", **extra})
    if gpu:
        env[names.GPU] = gpu
    proc = subprocess.run([str(inv_bin), "train.pretrain", "--runtime", "container", "--dry-run",
                           "--set", "data.path=synthetic"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _engine_line(inv_bin, repo, gpu: str | None, engine: str, **extra: str) -> list[str]:
    proc = _dry_run(inv_bin, repo, gpu, engine, **extra)
    (line,) = [line for line in proc.stdout.splitlines() if line.lstrip().startswith(engine + " ")]
    return line.split()


@pytest.mark.parametrize("gpu, engine", sorted(GPU_FLAGS))
def test_a_detected_gpu_machine_gets_its_vendors_flags(inv_bin, repo, gpu, engine):
    argv = _engine_line(inv_bin, repo, gpu, engine)
    image = argv.index("registry.example/train:1")
    before_image = argv[:image]
    for flag in GPU_FLAGS[(gpu, engine)]:
        assert flag in before_image, (flag, argv)
    assert not (EVERY_FLAG - set(GPU_FLAGS[(gpu, engine)])) & set(before_image), argv   # none of the other vendor's


def test_a_machine_without_gpus_gets_no_gpu_flag(inv_bin, repo):
    assert not EVERY_FLAG & set(_engine_line(inv_bin, repo, None, "docker"))


def test_the_container_gets_the_jobs_variables_not_this_machines_own(inv_bin, repo):
    extra = {"SSL_CERT_FILE": "/etc/host-only.pem", "PIP_INDEX_URL": "https://pypi.example", "PYENV_ROOT": "/opt/py",
             "NCCL_DEBUG": "INFO", "HF_HOME": "/data/hf", "MY_SITE_FLAG": "1", "WANDB_API_KEY": "k",
             names.setting_variable("container_env"): "MY_SITE_FLAG,WANDB_*"}
    proc = _dry_run(inv_bin, repo, "H100:8", "docker", **extra)
    argv = _engine_line(inv_bin, repo, "H100:8", "docker", **extra)
    passed = {argv[i + 1] for i, arg in enumerate(argv) if arg == "-e"}
    assert {"NCCL_SOCKET_IFNAME", "PYTORCH_CUDA_ALLOC_CONF", names.RUN_DIR, "HF_HOME", "MY_SITE_FLAG",
            "WANDB_API_KEY"} <= passed, passed
    assert not {"SSL_CERT_FILE", "PIP_INDEX_URL", "PYENV_ROOT", "PATH", "HOME"} & passed, passed
    said = [line for line in proc.stdout.splitlines() if line.startswith("# ")]
    assert said[0].startswith("# into the container, by name: ") and "anvil.container_env: MY_SITE_FLAG, " \
           "WANDB_API_KEY" in said[0] and "a job's (HF_*): HF_HOME" in said[0], said
    assert said[1].startswith("# left out, this machine's own (") and "PIP_INDEX_URL" in said[1] and \
           "SSL_CERT_FILE" in said[1] and said[1].endswith("(anvil.container_env passes more: NAME or PREFIX*)")

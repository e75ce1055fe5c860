"""The container line carries the GPUs' flags for the machine Anvil detects, on every engine: built the
way production builds it (a detected machine: names.GPU stands in for the probe), read from the dry run."""
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


def _engine_line(inv_bin, repo, gpu: str | None, engine: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INVOKE_", names.PREFIX))}
    env.update({names.setting_variable("container_engine"): engine,
                names.setting_variable("container_image"): "registry.example/train:1"})
    if gpu:
        env[names.GPU] = gpu
    proc = subprocess.run([str(inv_bin), "train.pretrain", "--runtime", "container", "--dry-run",
                           "--set", "data.path=synthetic"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
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

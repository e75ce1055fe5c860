"""A container around any transport: runtime `container` (direct), `ssh+container`, `slurm+container`.

The transport places the agents as it always does; on each node the agent runs
in the image: docker / podman (``run --rm --network=host --ipc=host``; AMD GPUs
as /dev/kfd and /dev/dri, NVIDIA GPUs as docker's ``--gpus=all`` or podman's CDI device
``nvidia.com/gpu=all``; the checkout, the working directory and the run
directory mounted, variables passed by name with ``-e NAME`` so values never
appear in the process list: the environment profile's, Anvil's own, a job's by prefix and what
anvil.container_env adds, not this machine's own, which point at what the image lacks) or apptainer (``exec --rocm|--nv --bind``, which
passes the environment through). The interpreter inside is
ContainerOptions.python.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import IO, Mapping, Sequence

from core.vendor import Vendor
from core import names
from runtime.cluster import values
from runtime.cluster.options import ENGINES, ContainerOptions
from runtime.cluster.results import HostResult
from runtime.cluster.transport import Progress, Transport, Wrap
from runtime.launch.spec import CHECKOUT, LaunchError, LaunchSpec, Layout


def check(options: ContainerOptions) -> None:
    """The engine is one we know and every value of the container line can go on it (values.BadValue)."""
    if options.engine not in ENGINES:
        raise LaunchError(f"unknown container engine {options.engine!r} ({' | '.join(ENGINES)})")
    if not options.image:
        raise LaunchError("container runtime needs an image (the anvil.container_image setting, "
                          "e.g. INVOKE_ANVIL_CONTAINER_IMAGE=...)")
    values.word("container image (anvil.container_image)", options.image)
    values.word("interpreter inside the image (anvil.container_python)", options.python)
    for mount in options.mounts:
        values.line("container mount (anvil.container_mounts)", mount)
        if mount.startswith("-"):
            raise values.BadValue(f"container mount (anvil.container_mounts) {mount!r}: starts with '-', so it "
                                  "would be read as an option; expected SRC:DST[:ro] or a path")
    for option in options.extra:
        values.line("container option (anvil.container_extra)", option)


#: Variables of a training or benchmark job by their prefix: the collective libraries', torch's, the GPU
#: runtimes', the thread pools', Hugging Face's, a scheduler's. They pass into a container from this
#: machine; its other variables (SSL_CERT_FILE, PIP_*, PYENV_ROOT, ...) point at what the image lacks.
JOB_PREFIXES = ("NCCL_", "RCCL_", "GLOO_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "CUDA_", "CUBLAS", "CUDNN_",
                "NVTE_", "HIP_", "HSA_", "ROCR_", "ROCM_", "MIOPEN_", "HIPBLASLT_", "OMP_", "MKL_", "TRITON_",
                "HF_", "TRANSFORMERS_", "TOKENIZERS_", "SLURM_", "UCX_", "FI_", "MASTER_", "WANDB_")


def passed(names: Sequence[str], profile: Sequence[str] = (), extra: Sequence[str] = ()
           ) -> tuple[dict[str, str], list[str]]:
    """({name: why it passes}, [the names left out]) of the variables a launch would take into a container:
    the environment profile's (and --env's), Anvil's own, a job's by prefix (JOB_PREFIXES), and those the
    anvil.container_env setting names (NAME, or PREFIX*)."""
    from core.names import PREFIX

    profile = set(profile)
    wanted = [e for e in extra if not e.endswith("*")]
    prefixes = tuple(e[:-1] for e in extra if e.endswith("*") and len(e) > 1)
    kept, left = {}, []
    for name in dict.fromkeys(names):
        if name in profile:
            kept[name] = "environment profile"
        elif name.startswith(PREFIX):
            kept[name] = "Anvil's"
        elif name in wanted or (prefixes and name.startswith(prefixes)):
            kept[name] = "anvil.container_env"
        elif name.startswith(JOB_PREFIXES):
            kept[name] = "a job's (" + next(p for p in JOB_PREFIXES if name.startswith(p)) + "*)"
        else:
            left.append(name)
    return kept, left


def passing_text(kept: Mapping[str, str], left: Sequence[str]) -> str:
    """What a dry run says about the variables a container gets."""
    by_why: dict[str, list[str]] = {}
    for name, why in kept.items():
        by_why.setdefault(why, []).append(name)
    parts = [f"{why}: {', '.join(sorted(group))}" for why, group in sorted(by_why.items())]
    out = f"# into the container, by name: {'; '.join(parts) or 'none'}"
    if left:
        out += (f"\n# left out, this machine's own ({len(left)}): {', '.join(sorted(left))} (anvil.container_env "
                "passes more: NAME or PREFIX*)")
    return out


def command(options: ContainerOptions, vendor: Vendor, names: Sequence[str], workdir: str,
            run_dir: Path | None = None) -> list[str]:
    """The engine's command line up to the image; what runs inside follows it."""
    check(options)
    mounts = [str(CHECKOUT), workdir] + ([str(run_dir)] if run_dir else []) + list(options.mounts)
    binds = [mount if ":" in mount else f"{mount}:{mount}" for mount in dict.fromkeys(mounts)]
    if options.engine == "apptainer":
        cmd = ["apptainer", "exec", "--pwd", workdir]
        if vendor is Vendor.AMD:
            cmd.append("--rocm")
        elif vendor is Vendor.NVIDIA:
            cmd.append("--nv")
        for bind in binds:
            cmd += ["--bind", bind]
        return cmd + list(options.extra) + [options.image]   # apptainer passes the environment through
    # --ipc=host: the host's /dev/shm, so no --shm-size (podman refuses one with the host's IPC namespace).
    cmd = [options.engine, "run", "--rm", "--network=host", "--ipc=host", "-w", workdir]
    if vendor is Vendor.AMD:
        cmd += ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--security-opt=seccomp=unconfined"]
    elif vendor is Vendor.NVIDIA:
        cmd += ["--gpus=all"] if options.engine == "docker" else ["--device=nvidia.com/gpu=all"]
    for bind in binds:
        cmd += ["-v", bind]
    for name in sorted(dict.fromkeys(names)):
        cmd += ["-e", name]        # by name: the value comes from the engine's environment, not argv
    return cmd + list(options.extra) + [options.image]


#: What the probe of an image runs with its interpreter: Python and torch, and their versions.
_PROBE = "import sys, torch; print(sys.version.split()[0], torch.__version__)"


def check_image(options: ContainerOptions, env: Mapping[str, str], workdir: str) -> str:
    """Before a launch here: the engine is installed, the image is on this machine (docker and podman pull
    one that is not, as `run` would) and its interpreter imports torch; LaunchError (one line, exit 2)
    naming what is missing. Returns what the probe printed (Python and torch versions)."""
    import shutil
    import subprocess

    engine, image = options.engine, options.image
    if shutil.which(engine, path=env.get("PATH")) is None:
        raise LaunchError(f"container engine {engine}: not found on this machine (not on PATH); install it, or "
                          f"set anvil.container_engine to one that is ({' | '.join(ENGINES)})")

    def run(argv: list[str], timeout: float | None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"container image {image}: `{' '.join(argv[:3])} ...` did not answer in "
                              f"{timeout:.0f} s") from None

    def said(proc: subprocess.CompletedProcess) -> str:
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {proc.returncode}"

    if engine != "apptainer" and run([engine, "image", "inspect", image], 120).returncode != 0:
        print(f"{engine}: pulling {image} (not on this machine yet)", file=sys.stderr, flush=True)
        pulled = run([engine, "pull", image], None)
        if pulled.returncode != 0:
            raise LaunchError(f"container image {image}: not on this machine, and `{engine} pull` failed: "
                              f"{said(pulled)}")
    probe = run([*command(options, Vendor.CPU, [], workdir), options.python, "-c", _PROBE], 600)
    if probe.returncode != 0:
        why = said(probe)
        if "No module named 'torch'" in why or "No module named torch" in why:
            raise LaunchError(f"container image {image}: its {options.python} cannot import torch ({why}); use an "
                              "image with PyTorch (rocm/pytorch, nvcr.io/nvidia/pytorch, ...) or set "
                              "anvil.container_python to the interpreter that has it")
        raise LaunchError(f"container image {image}: cannot run {options.python} in it ({why}); set "
                          "anvil.container_python to the image's interpreter")
    return probe.stdout.strip()


class Container(Transport):
    """`inner` places the agents; each runs in the image."""

    def __init__(self, inner: Transport, options: ContainerOptions):
        super().__init__(inner.options)
        self.inner, self.container = inner, options
        self.name, self.via = inner.name, inner.via
        self.scheduler, self.spans_nodes = inner.scheduler, inner.spans_nodes

    def allocation(self, env: Mapping[str, str]) -> tuple[int, str] | None:
        return self.inner.allocation(env)

    def requeues(self, env: Mapping[str, str]) -> bool:
        return self.inner.requeues(env)

    def check(self, env: Mapping[str, str], *, each_node: bool = False) -> None:
        self.inner.check(env, each_node=each_node)
        if not self.spans_nodes and not each_node:   # (on other nodes, their engine says it as the launch starts)
            check(self.container)
            check_image(self.container, env, os.getcwd())

    def where(self, env: Mapping[str, str]) -> str:
        return self.inner.where(env)

    def nodes(self, env: Mapping[str, str]) -> list[str]:
        return self.inner.nodes(env)

    def inv(self) -> str:
        return self.inner.inv()

    def python(self) -> str:
        return self.inner.python()

    def _inside(self, spec: LaunchSpec) -> LaunchSpec:
        return dataclasses.replace(spec, python=spec.python or self.container.python)

    def layout(self, spec: LaunchSpec, env: Mapping[str, str]) -> Layout:
        check(self.container)
        return self.inner.layout(self._inside(spec), env)

    def launch(self, spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None, *,
               wrap: Wrap | None = None, nodes: Sequence[str] | None = None, log_name: str = names.LAUNCHER_LOG,
               dry_run: bool = False, masker=None, stdout: IO | None = None, stderr: IO | None = None,
               timeout: float | None = None) -> int:
        shown = []

        def in_image(names: Sequence[str]) -> list[str]:
            kept, left = passed(names, spec.profile, self.container.env)
            if dry_run and not shown:
                shown.append(passing_text(kept, left))
                print(shown[0], file=stdout or sys.stdout)
            return command(self.container, spec.vendor, list(kept), spec.workdir or os.getcwd(), run_dir)
        return self.inner.launch(self._inside(spec), env, run_dir, wrap=in_image, nodes=nodes, log_name=log_name,
                                 dry_run=dry_run, masker=masker, stdout=stdout, stderr=stderr, timeout=timeout)

    def each_node(self, command: list[str], env: Mapping[str, str] | None = None, *,
                  hosts_dir: Path | None = None, timeout: float | None = None, progress: Progress | None = None,
                  nodes: Sequence[str] | None = None) -> list[HostResult]:
        """The command runs on each node itself: a node's own check or measurement takes no container."""
        return self.inner.each_node(command, env, hosts_dir=hosts_dir, timeout=timeout, progress=progress,
                                    nodes=nodes)

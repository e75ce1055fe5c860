"""A container around any transport: runtime `container` (direct), `ssh+container`, `slurm+container`.

The transport places the agents as it always does; on each node the agent runs
in the image: docker / podman (``run --rm --network=host --ipc=host``; AMD GPUs
as /dev/kfd and /dev/dri, NVIDIA GPUs as docker's ``--gpus=all`` or podman's CDI device
``nvidia.com/gpu=all``; the checkout, the working directory and the run
directory mounted, variables passed by name with ``-e NAME`` so values never
appear in the process list) or apptainer (``exec --rocm|--nv --bind``, which
passes the environment through). The interpreter inside is
ContainerOptions.python.
"""
from __future__ import annotations

import dataclasses
import os
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
        def in_image(names: Sequence[str]) -> list[str]:
            return command(self.container, spec.vendor, names, spec.workdir or os.getcwd(), run_dir)
        return self.inner.launch(self._inside(spec), env, run_dir, wrap=in_image, nodes=nodes, log_name=log_name,
                                 dry_run=dry_run, masker=masker, stdout=stdout, stderr=stderr, timeout=timeout)

    def each_node(self, command: list[str], env: Mapping[str, str] | None = None, *,
                  hosts_dir: Path | None = None, timeout: float | None = None, progress: Progress | None = None,
                  nodes: Sequence[str] | None = None) -> list[HostResult]:
        """The command runs on each node itself: a node's own check or measurement takes no container."""
        return self.inner.each_node(command, env, hosts_dir=hosts_dir, timeout=timeout, progress=progress,
                                    nodes=nodes)

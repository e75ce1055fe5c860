"""What to launch, the same under every transport: the module (or a program), its arguments, the ranks per node.

    LaunchSpec(module="trainer", args=["--config", f"{RUN_DIR}/configs/train.yaml", "--run-dir", RUN_DIR],
               nproc=None, gpus=machine.count, vendor=machine.vendor, node_local=env.node_local())
    LaunchSpec(program=["/x/pretrain_gpt.py", "--num-layers", "2"], agent_args=["--backend", "megatron"], ...)

Where it runs (this machine, SSH hosts, a Slurm allocation, a container) is not
part of it: runtime.cluster takes a LaunchSpec and starts it on its nodes.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from core.vendor import Vendor
from core import checkout, names
from core.errors import UserError
# The trainer's exit statuses after a signal (3: checkpointed, requeue me; 130: Ctrl-C), the
# contract every launcher keeps.
from core.signals import EXIT_INTERRUPTED, EXIT_REQUEUE  # noqa: F401 (re-exported)

#: The checkout every node runs in (a shared file system, or the same path on every host).
CHECKOUT = checkout.ROOT
#: In LaunchSpec.args: the run directory, filled in when the command is built ("RUN_DIR" in a dry run).
RUN_DIR = "{run_dir}"
#: Signals that `inv` and the agent pass on to the ranks (and keep waiting): a scheduler's
#: preemption warning and termination, Ctrl-C, a closed terminal.
PASSED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

#: Names of the variables each node computes for itself (comma-separated), read by the agent.
NODE_LOCAL_VAR = names.NODE_LOCAL
#: The run directory, for the agent's per-node report.
RUN_DIR_VAR = names.RUN_DIR
#: The process that started the agent: the agent stops the ranks when that process dies.
LAUNCHER_PID_VAR = names.LAUNCHER_PID


class LaunchError(UserError):
    """A launch that cannot be built or started (bad --nproc, missing image, no srun, ...)."""


@dataclass
class LaunchSpec:
    module: str = ""                     # python -m MODULE on every rank, or
    args: list[str] = field(default_factory=list)   # RUN_DIR in them stands for the run directory
    program: list[str] = field(default_factory=list)   # a program and its arguments (train.launch): one that
    #                                      starts with a .py file or -m runs with the node's Python, as torchrun runs it
    agent_args: list[str] = field(default_factory=list)   # more options for the node agent (--backend NAME, ...)
    nproc: int | None = None             # processes per node; None = visible GPUs (1 on CPU)
    gpus: int | None = None              # GPUs detected on this node (envs.detect().count)
    vendor: Vendor = Vendor.CPU          # the GPUs' maker: container device flags, --gpus-per-node
    master_port: int = 0                 # 0: the transport picks one
    python: str = ""                     # interpreter ("" = this one; a container's own inside it)
    workdir: str = ""                    # "" = current directory
    node_local: list[str] = field(default_factory=list)  # variables each node computes for itself
    profile: list[str] = field(default_factory=list)     # the names the environment profile set (and --env):
    #                                      what a container gets besides Anvil's own (runtime.cluster.container)

    def __post_init__(self):
        self.vendor = Vendor.parse(self.vendor)

    def module_args(self, run_dir: Path | str | None) -> list[str]:
        """args with the run directory filled in (RUN_DIR where there is none: a dry run)."""
        where = str(run_dir) if run_dir is not None else "RUN_DIR"
        return [arg.replace(RUN_DIR, where) for arg in self.args]

    def rank_command(self, python: str, run_dir: Path | str | None) -> list[str]:
        """What every rank runs: python -m MODULE ARGS, or the program (with python before a .py or -m)."""
        if not self.program:
            return [python, "-m", self.module, *self.module_args(run_dir)]
        where = str(run_dir) if run_dir is not None else "RUN_DIR"
        argv = [arg.replace(RUN_DIR, where) for arg in self.program]
        return [python, *argv] if argv[0] == "-m" or argv[0].endswith(".py") else argv


@dataclass
class Layout:
    """How many nodes a launch takes and how many processes it starts on each."""
    nproc: int
    nodes: int = 1

    @property
    def world_size(self) -> int:
        return self.nproc * self.nodes


def visible_gpus(env: Mapping[str, str], detected: int | None) -> int:
    """GPUs this process may use: *_VISIBLE_DEVICES if set, else the detected count."""
    for name in VISIBLE_DEVICE_VARS:
        value = env.get(name)
        if value is not None:
            items = [v for v in value.split(",") if v.strip() and v.strip() != "-1"]
            return len(items)
    return int(detected or 0)


def processes_per_node(spec: LaunchSpec, env: Mapping[str, str]) -> int:
    if spec.nproc is not None:
        if spec.nproc < 1:
            raise LaunchError(f"--nproc must be >= 1, got {spec.nproc}")
        return int(spec.nproc)
    return max(1, visible_gpus(env, spec.gpus))

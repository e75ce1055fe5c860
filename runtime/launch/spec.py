"""What to launch: the spec, its runtime options, and the built command.

    LaunchSpec(module="trainer", args=[...], runtime="direct" | "slurm" | "container" | "slurm+container",
               nproc=None, gpus=machine.count, vendor=machine.vendor,
               slurm=SlurmOptions(nodes=2), container=ContainerOptions(engine="podman", image="x"))
"""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Mapping

from runtime.settings import RUNTIMES  # one list, also checked when settings load
from trainer.errors import UserError
# The trainer's exit statuses after a signal (3: checkpointed, requeue me; 130: Ctrl-C), the
# contract every launcher keeps.
from trainer.signals import EXIT_INTERRUPTED, EXIT_REQUEUE  # noqa: F401 (re-exported)

ENGINES = ("docker", "podman", "apptainer")
SLURM_MODES = ("auto", "srun", "sbatch")
#: Signals that `inv` and the agent pass on to the ranks (and keep waiting): a scheduler's
#: preemption warning and termination, Ctrl-C, a closed terminal.
PASSED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

#: Names of the variables each node computes for itself (comma-separated), read by the agent.
NODE_LOCAL_VAR = "ANVIL_NODE_LOCAL"
#: The run directory, for the agent's per-node report.
RUN_DIR_VAR = "ANVIL_RUN_DIR"
# RUN_DIR/<this>: JOB.STEP of a training step srun started (the agents write it; Ctrl-C signals it).
STEP_FILE = "logs/slurm-step"
# A direct run's inv: its agent stops the ranks when that process dies (runtime.launch.agent).
LAUNCHER_PID_VAR = "ANVIL_LAUNCHER_PID"


class LaunchError(UserError):
    """A launch that cannot be built or started (unknown runtime, missing image, no srun, ...)."""


@dataclass
class SlurmOptions:
    mode: str = "auto"                  # auto: srun inside an allocation, sbatch outside | srun | sbatch
    nodes: int | None = None            # None: the allocation's (SLURM_NNODES) or 1
    gpus_per_node: int | None = None    # None: LaunchSpec's process count on GPU machines
    signal: str = "USR2@120"            # preemption warning; sbatch sends it to the batch shell (B:)
    partition: str = ""
    account: str = ""
    time: str = ""                      # e.g. "02:00:00"
    job_name: str = "anvil"
    exclude: list[str] = field(default_factory=list)   # nodes to leave out (--exclude)
    extra: list[str] = field(default_factory=list)     # more srun/sbatch options, as given
    wait: bool = True                   # sbatch: follow the job until it ends


@dataclass
class ContainerOptions:
    engine: str = "docker"
    image: str = ""
    mounts: list[str] = field(default_factory=list)  # "src:dst" or a path mounted at itself
    extra: list[str] = field(default_factory=list)


@dataclass
class LaunchSpec:
    module: str                          # python -m MODULE on every rank
    args: list[str] = field(default_factory=list)
    runtime: str = "direct"
    nproc: int | None = None             # processes per node; None = visible GPUs (1 on CPU)
    gpus: int | None = None              # GPUs detected on this node (envs.detect().count)
    vendor: str = "cpu"                  # rocm | cuda | cpu: container device flags
    plain: bool = False                  # direct, one process, no agent (no rendezvous)
    master_port: int = 0                 # 0: a free port (single node) or one derived from the Slurm job id
    python: str = ""                     # interpreter ("" = this one; "python3" inside containers)
    workdir: str = ""                    # "" = current directory
    node_local: list[str] = field(default_factory=list)  # variables each node computes for itself
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    container: ContainerOptions = field(default_factory=ContainerOptions)


@dataclass
class Built:
    argv: list[str]                      # what to execute here
    script: str | None = None            # sbatch script text (mode sbatch)
    nproc: int = 1                       # processes per node
    nodes: int = 1


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

"""What the transports take: each one's options, and Options, the bundle a runtime opens with.

    options = settings.cluster_options(nodes=2, exclude=["n7"])    # from invoke.yaml, then the task's
    transport = runtime.open(options)                               # each transport reads its own part
"""
from __future__ import annotations

from dataclasses import dataclass, field

SLURM_MODES = ("auto", "srun", "sbatch")
ENGINES = ("docker", "podman", "apptainer")


@dataclass
class SlurmOptions:
    mode: str = "auto"                  # auto: srun inside an allocation, sbatch outside | srun | sbatch
    signal: str = "USR2@120"            # preemption warning; sbatch sends it to the batch shell (B:)
    partition: str = ""
    account: str = ""
    time: str = ""                      # e.g. "02:00:00"
    job_name: str = ""                  # "" = anvil-<run directory> (anvil without one)
    extra: list[str] = field(default_factory=list)     # more srun/sbatch options, as given
    wait: bool = True                   # sbatch: follow the job until it ends


@dataclass
class SshOptions:
    remote_path: str = ""               # the checkout on the hosts ("" = this one's path: a shared file system)
    remote_inv: str = ""                # the inv there ("" = the one running now); its python runs the agents
    user: str | None = None
    key_filename: list[str] = field(default_factory=list)
    connect_timeout: float = 10.0
    ssh_config: str | None = None       # -S FILE
    password: str | None = None
    passphrase: str | None = None


@dataclass
class ContainerOptions:
    engine: str = "docker"
    image: str = ""
    mounts: list[str] = field(default_factory=list)  # "src:dst" or a path mounted at itself
    python: str = "python3"             # the interpreter inside the image
    extra: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)    # more host variables to pass in: names, or PREFIX*


@dataclass
class Options:
    nodes: int = 0                      # a scheduler's node count (0: the allocation's, or 1)
    hosts: list[str] = field(default_factory=list)   # SSH: the hosts, node ranks in this order
    master: str = ""                    # SSH: the host of node rank 0 ("" = the first)
    exclude: list[str] = field(default_factory=list)  # nodes to leave out
    command_timeout: float = 0.0        # seconds for a command run on each node (each_node); 0 = none
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    ssh: SshOptions = field(default_factory=SshOptions)
    container: ContainerOptions = field(default_factory=ContainerOptions)

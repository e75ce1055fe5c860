"""srun: the one builder of its options, and what the surrounding allocation says.

    srun_options(options, nodes, warn=True)                 a training step: one agent per node
    srun_options(options, nodes, batch=True, job_name=...)  the #SBATCH lines of a batch job
    srun_options(options, nodes, kill_on_bad_exit=False)    a command on every node (each_node)
    srun_options(options, 2, nodelist=["n1", "n3"])         a step on chosen nodes of the allocation
    check_options(options, exclude)                          what srun_options checks, before a run exists
    in_allocation(env), allocated_nodes(env), step_nodes(options, nodes, exclude, env, mode)
    expand_hostlist("n[1-3],gpu7")                          without scontrol (on a node)
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from runtime.cluster import values
from runtime.cluster.options import SlurmOptions
from runtime.launch.spec import LaunchError

#: What srun sets per task, and a node's step reads (runtime.cluster.slurm.step): a container
#: between srun and the step gets them by name.
TASK_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NNODES", "SLURM_STEP_NUM_NODES",
             "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_RESTART_COUNT", "SLURM_STEP_ID")
#: RUN_DIR/<this>: JOB.STEP of a training step srun started (the nodes write it; Ctrl-C signals it). Here, not in
#: step.py: the transport that reads it must not import the module `python -m` runs on every node (runpy warns).
STEP_FILE = "logs/slurm-step"


# Slurm's time formats: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S; or no limit.
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|(?i:infinite|unlimited)")


def check_options(options: SlurmOptions, exclude: Sequence[str] = (), nodelist: Sequence[str] = ()) -> None:
    """Every value srun_options puts on an srun line or an #SBATCH line (values.BadValue, exit 2):
    partition, account and time from --partition/--account/--time, invoke.yaml or INVOKE_ANVIL_*,
    slurm_extra's options, the job name and the nodes named (--exclude, a node list's hosts)."""
    for name, value, where in (("partition", options.partition, "--partition, anvil.slurm_partition"),
                               ("account", options.account, "--account, anvil.slurm_account"),
                               ("time limit", options.time, "--time, anvil.slurm_time"),
                               ("job name", options.job_name, "the run's name")):
        if value:
            values.word(f"Slurm {name} ({where})", value)
    if options.time and not _TIME.fullmatch(options.time):
        raise values.BadValue(f"Slurm time limit (--time, anvil.slurm_time) {options.time!r}: expected minutes, "
                              "H:MM:SS or D-HH:MM:SS (Slurm's formats)")
    values.options("Slurm options (anvil.slurm_extra)", options.extra)
    for node in [*exclude, *nodelist]:
        values.word("Slurm node (--exclude, --exclude-from, a node list)", node)


def srun_options(options: SlurmOptions, nodes: int, *, nodelist: Sequence[str] = (), exclude: Sequence[str] = (),
                 gpus: int = 0, kill_on_bad_exit: bool = True, warn: bool = False, job_name: str = "",
                 batch: bool = False) -> list[str]:
    """One task (one agent, or one command) per node on `nodes` nodes, with the settings' partition,
    account, time limit and extra options. kill_on_bad_exit: one task failing ends the step (the
    agents turn a preemption into a clean exit on every node, so it never cuts a checkpoint short).
    warn: the preemption warning (options.signal); batch: the #SBATCH options of a requeueable job."""
    check_options(options, exclude, nodelist)
    out = [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if nodelist:
        out.append(f"--nodelist={','.join(nodelist)}")
    if not batch:
        out.append(f"--kill-on-bad-exit={int(kill_on_bad_exit)}")
    if warn and options.signal:
        batch_signal = options.signal if options.signal.startswith(("B:", "R:")) else "B:" + options.signal
        out.append(f"--signal={batch_signal if batch else options.signal}")
    if gpus:
        out.append(f"--gpus-per-node={gpus}")
    for name, value in (("partition", options.partition), ("account", options.account), ("time", options.time)):
        if value:
            out.append(f"--{name}={value}")
    if exclude:
        out.append(f"--exclude={','.join(exclude)}")
    if job_name:
        out.append(f"--job-name={values.word('Slurm job name', job_name[:60])}")
    if batch:
        out += ["--requeue", "--open-mode=append"]
    return out + list(options.extra)


def in_allocation(env: Mapping[str, str]) -> bool:
    """Inside salloc/sbatch (a job), but not already inside one of its steps."""
    return bool(env.get("SLURM_JOB_ID")) and not env.get("SLURM_STEP_ID")


def allocated_nodes(env: Mapping[str, str]) -> int:
    """How many nodes the surrounding Slurm job has (0 outside one)."""
    return int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 0)


def step_nodes(nodes: int, exclude: Sequence[str], env: Mapping[str, str], inside: bool) -> int:
    """Nodes for a step: `nodes`, else the allocation's less the excluded ones in it, else 1.
    inside: the step runs in the surrounding allocation (srun there), which bounds it."""
    from runtime.cluster.slurm.control import hostnames

    allocated = allocated_nodes(env) if inside else 0
    left_out: list[str] = []
    if allocated and exclude:
        members = hostnames(env.get("SLURM_JOB_NODELIST", ""), env)
        left_out = [n for n in members if n in set(exclude)]
        strangers = [n for n in exclude if n not in members]
        if strangers:   # srun would end the step with "Invalid node name specified", after a run directory
            raise LaunchError(f"--exclude {', '.join(strangers)}: not a node of this allocation (job "
                              f"{env.get('SLURM_JOB_ID')}: {', '.join(members)}); a preflight run over -H "
                              "names hosts as they were given to -H")
    usable = allocated - len(left_out)
    if allocated and left_out and usable == 0:
        raise LaunchError(f"every node of this allocation (job {env.get('SLURM_JOB_ID')}) is excluded: "
                          f"{', '.join(left_out)}")
    count = nodes or usable or 1
    if count < 1:
        raise LaunchError(f"--nodes must be >= 1, got {count}")
    if allocated and count > usable:
        excluded = f" once {', '.join(left_out)} are excluded" if left_out else ""
        raise LaunchError(f"--nodes {count}: this allocation (job {env.get('SLURM_JOB_ID')}) has only "
                          f"{usable} node(s){excluded}; ask salloc/sbatch for more, or run outside it to submit")
    return count


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list: "n[1-3,5],gpu07,x[01-02]" -> ["n1", "n2", ...] (no scontrol needed)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text or ""):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.extend(expand_hostlist(prefix + lo + suffix))
                continue
            for n in range(int(lo), int(hi) + 1):
                hosts.extend(expand_hostlist(f"{prefix}{str(n).zfill(len(lo))}{suffix}"))
    return hosts

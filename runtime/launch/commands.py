"""The command line for a launch, built as argument lists (user text is never pasted into shell).

- direct: ``python -m runtime.launch.agent --nproc N -- python -m MODULE ARGS``
  (``plain=True``: ``python -m MODULE ARGS``, one process, no agent).
- slurm: ``srun --nodes=M --ntasks-per-node=1 -K1 --signal=USR2@120 ...
  python -m runtime.launch.agent --slurm --nproc N -- python -m MODULE ARGS``:
  one agent per node, node rank and master from SLURM_* read in Python (no
  shell quoting of $SLURM_* anywhere). Outside an allocation (mode auto or
  sbatch) the same srun line goes into RUN_DIR/slurm/job.sbatch.
- container: docker / podman (``run --rm --network=host --ipc=host``, ROCm
  devices or ``--gpus all``, the checkout and run dir mounted, variables passed
  by name with ``-e NAME`` so values never appear in the process list) or
  apptainer (``exec --rocm|--nv --bind``); the agent runs inside.
- slurm+container: srun -> container -> agent -> ranks.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Mapping

from runtime.launch.spec import (ENGINES, LAUNCHER_PID_VAR, NODE_LOCAL_VAR, RUN_DIR_VAR, RUNTIMES, SLURM_MODES, Built,
                                 LaunchError, LaunchSpec, processes_per_node)
from runtime.settings import CHECKOUT

AGENT_MODULE = "runtime.launch.agent"


def _python(spec: LaunchSpec, in_container: bool) -> str:
    return spec.python or ("python3" if in_container else sys.executable)


def agent_command(spec: LaunchSpec, nproc: int, python: str, slurm: bool = False) -> list[str]:
    if spec.plain and not slurm:
        return [python, "-m", spec.module, *spec.args]
    options = ["--nproc", str(nproc)]
    if slurm:
        options.append("--slurm")
    if spec.master_port:
        options += ["--master-port", str(spec.master_port)]
    return [python, "-m", AGENT_MODULE, *options, "--", python, "-m", spec.module, *spec.args]


def in_allocation(env: Mapping[str, str]) -> bool:
    """Inside salloc/sbatch (a job), but not already inside one of its steps."""
    return bool(env.get("SLURM_JOB_ID")) and not env.get("SLURM_STEP_ID")


def slurm_mode(spec: LaunchSpec, env: Mapping[str, str]) -> str:
    mode = spec.slurm.mode
    if mode not in SLURM_MODES:
        raise LaunchError(f"unknown slurm mode {mode!r} ({' | '.join(SLURM_MODES)})")
    if mode == "auto":
        return "srun" if in_allocation(env) else "sbatch"
    return mode


def allocated_nodes(env: Mapping[str, str]) -> int:
    """How many nodes the surrounding Slurm job has (0 outside one)."""
    return int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 0)


def slurm_nodes(spec: LaunchSpec, env: Mapping[str, str], mode: str) -> int:
    """Nodes for the step: --nodes, else the allocation's less the excluded ones in it, else 1."""
    allocated = allocated_nodes(env) if mode == "srun" else 0
    left_out: list[str] = []
    if allocated and spec.slurm.exclude:
        from runtime.cluster.slurm.control import hostnames
        members = hostnames(env.get("SLURM_JOB_NODELIST", ""), env)
        left_out = [n for n in members if n in set(spec.slurm.exclude)]
        strangers = [n for n in spec.slurm.exclude if n not in members]
        if strangers:   # srun would end the step with "Invalid node name specified", after a run directory
            raise LaunchError(f"--exclude {', '.join(strangers)}: not a node of this allocation (job "
                              f"{env.get('SLURM_JOB_ID')}: {', '.join(members)}); a preflight run over -H "
                              "names hosts as they were given to -H")
    usable = allocated - len(left_out)
    if allocated and left_out and usable == 0:
        raise LaunchError(f"every node of this allocation (job {env.get('SLURM_JOB_ID')}) is excluded: "
                          f"{', '.join(left_out)}")
    nodes = spec.slurm.nodes or usable or 1
    if nodes < 1:
        raise LaunchError(f"--nodes must be >= 1, got {nodes}")
    if allocated and nodes > usable:
        excluded = f" once {', '.join(left_out)} are excluded" if left_out else ""
        raise LaunchError(f"--nodes {nodes}: this allocation (job {env.get('SLURM_JOB_ID')}) has only "
                          f"{usable} node(s){excluded}; ask salloc/sbatch for more, or run outside it to submit")
    return nodes


def slurm_options(spec: LaunchSpec, nproc: int, nodes: int, batch: bool) -> list[str]:
    opts = spec.slurm
    out = [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if not batch:
        # One agent per node; one agent failing ends the step (the agents themselves turn
        # a preemption into exit 3 on every node, so -K1 never cuts a checkpoint short).
        out += ["--kill-on-bad-exit=1"]
        if opts.signal:
            out.append(f"--signal={opts.signal}")
    elif opts.signal:
        out.append(f"--signal={opts.signal if opts.signal.startswith(('B:', 'R:')) else 'B:' + opts.signal}")
    gpus = opts.gpus_per_node if opts.gpus_per_node is not None else (nproc if spec.vendor != "cpu" else 0)
    if gpus:
        out.append(f"--gpus-per-node={gpus}")
    for name, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time)):
        if value:
            out.append(f"--{name}={value}")
    if opts.exclude:
        out.append(f"--exclude={','.join(opts.exclude)}")
    if batch:
        out += [f"--job-name={opts.job_name}", "--requeue", "--open-mode=append"]
    return out + list(opts.extra)


def container_prefix(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None) -> list[str]:
    opts = spec.container
    if opts.engine not in ENGINES:
        raise LaunchError(f"unknown container engine {opts.engine!r} ({' | '.join(ENGINES)})")
    if not opts.image:
        raise LaunchError("container runtime needs an image (the anvil.container_image setting, "
                          "e.g. INVOKE_ANVIL_CONTAINER_IMAGE=...)")
    workdir = spec.workdir or os.getcwd()
    mounts = [str(CHECKOUT), workdir] + ([str(run_dir)] if run_dir else []) + list(opts.mounts)
    binds = []
    for mount in dict.fromkeys(mounts):
        binds.append(mount if ":" in mount else f"{mount}:{mount}")
    if opts.engine == "apptainer":
        cmd = ["apptainer", "exec", "--pwd", workdir]
        if spec.vendor == "rocm":
            cmd.append("--rocm")
        elif spec.vendor == "cuda":
            cmd.append("--nv")
        for bind in binds:
            cmd += ["--bind", bind]
        return cmd + list(opts.extra) + [opts.image]   # apptainer passes the environment through
    # --ipc=host: the host's /dev/shm, so no --shm-size (podman refuses one with the host's IPC namespace).
    cmd = [opts.engine, "run", "--rm", "--network=host", "--ipc=host",
           "-w", workdir]
    if spec.vendor == "rocm":
        cmd += ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video",
                "--security-opt=seccomp=unconfined"]
    elif spec.vendor == "cuda":
        cmd += ["--gpus=all"]
    for bind in binds:
        cmd += ["-v", bind]
    for name in sorted(_container_env_names(env)):
        cmd += ["-e", name]        # by name: the value comes from our environment, not argv
    return cmd + list(opts.extra) + [opts.image]


_SLURM_NAMES = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NNODES",
                "SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_RESTART_COUNT")


def _container_env_names(env: Mapping[str, str]) -> list[str]:
    skip = {"PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "TERM", "LD_LIBRARY_PATH",
            "PYTHONPATH", "VIRTUAL_ENV", "SHELL", "USER", "LOGNAME"}
    names = [k for k in env if k not in skip and not k.startswith(("BASH_FUNC_", "SSH_", "XDG_", "LC_"))]
    return names + [n for n in _SLURM_NAMES if n not in names]   # set per task by srun, read by the agent


def launch_env(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None) -> dict[str, str]:
    """The environment the launch command gets: per-node values left for each node to compute."""
    out = dict(env)
    if run_dir is not None:
        out[RUN_DIR_VAR] = str(run_dir)
    if spec.runtime == "direct":    # the agent is this process's child
        out[LAUNCHER_PID_VAR] = str(os.getpid())
    if spec.runtime.startswith("slurm") and spec.node_local:
        for name in spec.node_local:
            out.pop(name, None)
        out[NODE_LOCAL_VAR] = ",".join(spec.node_local)
    return out


def build(spec: LaunchSpec, env: Mapping[str, str] | None = None, run_dir: Path | None = None) -> Built:
    """The command (and sbatch script) for spec, without running anything."""
    env = dict(os.environ if env is None else env)
    if spec.runtime not in RUNTIMES:
        raise LaunchError(f"unknown runtime {spec.runtime!r} ({' | '.join(RUNTIMES)})")
    nproc = processes_per_node(spec, env)
    in_container = "container" in spec.runtime
    # the names passed into the container are those of the environment the launch really gets
    wrap = container_prefix(spec, launch_env(spec, env, run_dir), run_dir) if in_container else []
    python = _python(spec, in_container)
    if spec.runtime in ("direct", "container"):
        return Built(wrap + agent_command(spec, nproc, python), nproc=nproc)
    mode = slurm_mode(spec, env)
    nodes = slurm_nodes(spec, env, mode)
    inner = wrap + agent_command(spec, nproc, python, slurm=True)
    if mode == "srun":
        return Built(["srun", *slurm_options(spec, nproc, nodes, batch=False), *inner], nproc=nproc, nodes=nodes)
    script = sbatch_script(spec, nproc, nodes, inner, run_dir)
    path = (Path(run_dir) if run_dir else Path.cwd()) / "slurm" / "job.sbatch"
    return Built(["sbatch", "--parsable", str(path)], script=script, nproc=nproc, nodes=nodes)


def sbatch_script(spec: LaunchSpec, nproc: int, nodes: int, inner: list[str], run_dir: Path | None) -> str:
    logs = (Path(run_dir) if run_dir else Path.cwd()) / "logs"
    step = ["srun", *slurm_options(spec, nproc, nodes, batch=False), *inner]
    stop_status = [sys.executable, "-m", "runtime.runs.outcome", str(run_dir or ".")]
    record = [sys.executable, "-m", "runtime.runs.jobend", str(run_dir)] if run_dir else []
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in slurm_options(spec, nproc, nodes, batch=True)]
    lines += [f"#SBATCH --output={logs}/slurm-%j.out", ""]
    lines += ["# Written by anvil (runtime/launch/commands.py). The agent reads SLURM_* itself, so",
              "# nothing below is expanded by this shell. The batch shell gets the preemption",
              "# signal (B:USR2) and passes it to the step; ranks checkpoint and exit 3, and the",
              "# job is requeued; a requeued job resumes from the run directory's checkpoint.",
              f"cd {shlex.quote(spec.workdir or os.getcwd())}",
              'echo "anvil: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"',
              "# the run's metadata.json gets each attempt's end when no inv follows the job (--no-wait)",
              f"record() {{ {shlex.join(record)} \"$@\"; }}" if record else "record() { :; }",
              '[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && record --resumed "$SLURM_RESTART_COUNT"',
              shlex.join(step) + " &",
              "step=$! got=",
              "trap 'got=USR2; kill -USR2 $step 2>/dev/null' USR2",
              "trap 'got=TERM; kill -TERM $step 2>/dev/null' TERM",
              "wait $step; code=$?",
              "while kill -0 $step 2>/dev/null; do wait $step; code=$?; done",
              "# a clean stop ends every srun task with 0; its status (3: requeue me) is in the agents' reports",
              f"if [ $code -eq 0 ]; then {shlex.join(stop_status)} --restart \"${{SLURM_RESTART_COUNT:-0}}\"; "
              "code=$?; fi",
              'echo "anvil: step exited with status $code"',
              "# Only the preemption warning (USR2) requeues: scancel and the time limit send TERM, and the",
              "# ranks checkpoint for those too, but the job is to end (it trained on after scancel before)",
              "if [ $code -eq 3 ] && [ \"$got\" = TERM ]; then record 3 --on-term; exit $code; fi",
              "# (recorded first: Slurm ends this script as it requeues the job)",
              "if [ $code -eq 3 ]; then record 3 --requeued; scontrol requeue \"$SLURM_JOB_ID\" && exit 0; fi",
              'record "$code"',
              "exit $code", ""]
    return "\n".join(lines)

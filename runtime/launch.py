"""Launchers: direct (torchrun), slurm (srun / sbatch), container, and compositions.

The same Python module runs the same way under every runtime; only the
command wrapped around it changes. Everything is built as argument lists;
the only shell text (Slurm's per-node torchrun line and the sbatch script) is
fixed text of ours, with user arguments passed as "$@" - never pasted in.

    from runtime.launch import LaunchSpec, SlurmOptions, ContainerOptions, launch

    spec = LaunchSpec(module="trainer", args=["--config", cfg, "--run-dir", str(run.path)],
                      runtime="direct",        # or "slurm", "container", "slurm+container"
                      nproc=None,              # None: one process per visible GPU, 1 on CPU
                      gpus=machine.count, vendor=machine.vendor)
    code = launch(spec, env=run.env, run_dir=run.path)   # streams output, returns the exit code

- direct: ``python -m torch.distributed.run --standalone --nproc-per-node N
  -m MODULE ARGS`` (``plain=True``: ``python -m MODULE ARGS``, one process).
- slurm: ``srun -K1 --signal=USR2@120 ... bash -c '<prelude>' ... torchrun``,
  one task per node, torchrun inside with node rank $SLURM_NODEID and the
  first host of the allocation as master (reference §3.1 topology A; the
  $SLURM_* are expanded by the per-task shell, never by ours), or
  ``topology="tasks"``: one Slurm task per GPU, RANK/LOCAL_RANK/WORLD_SIZE
  from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS. ``SlurmOptions(mode="sbatch")``
  writes RUN_DIR/slurm/job.sbatch (``--signal=B:USR2@120``, requeue on exit
  code 3) and submits it.
- container: docker / podman (``run --rm --network host --ipc host``, ROCm
  devices or ``--gpus all``, the checkout and run dir mounted, variables passed
  by name with ``-e NAME`` so values never appear in the process list) or
  apptainer (``exec --rocm|--nv --bind``).
- slurm+container: srun -> container -> torchrun -> module.

`launch` runs the command with ``env``, tees stdout/stderr to the console and
RUN_DIR/logs/launcher.log, forwards SIGTERM/SIGUSR1/SIGUSR2 to the child and
returns its exit code (the trainer's 3 = "stopped on a signal, requeue me").
`build(spec, env)` returns the command without running it (``--dry-run``).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping

from runtime.settings import CHECKOUT

RUNTIMES = ("direct", "slurm", "container", "slurm+container")
ENGINES = ("docker", "podman", "apptainer")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class LaunchError(ValueError):
    """A launch that cannot be built (unknown runtime, missing image, ...)."""


@dataclass
class SlurmOptions:
    mode: str = "srun"                  # srun (inside/creating an allocation) | sbatch (submit)
    nodes: int | None = None            # None: the allocation's (SLURM_NNODES) or 1
    gpus_per_node: int | None = None    # None: LaunchSpec's process count
    topology: str = "torchrun"          # torchrun: one task per node | tasks: one task per GPU
    signal: str = "USR2@120"            # preemption warning; sbatch sends it to the batch shell (B:)
    partition: str = ""
    account: str = ""
    time: str = ""                      # e.g. "02:00:00"
    job_name: str = "anvil"
    extra: list[str] = field(default_factory=list)   # more srun/sbatch options, as given


@dataclass
class ContainerOptions:
    engine: str = "docker"
    image: str = ""
    mounts: list[str] = field(default_factory=list)  # "src:dst" or a path mounted at itself
    extra: list[str] = field(default_factory=list)
    shm_size: str = "16g"


@dataclass
class LaunchSpec:
    module: str                          # python -m MODULE
    args: list[str] = field(default_factory=list)
    runtime: str = "direct"
    nproc: int | None = None             # processes per node; None = visible GPUs (1 on CPU)
    gpus: int | None = None              # GPUs detected on this node (envs.detect().count)
    vendor: str = "cpu"                  # rocm | cuda | cpu: container device flags
    plain: bool = False                  # direct without torchrun (one process)
    master_port: int = 29500
    python: str = ""                     # interpreter ("" = this one; "python3" inside containers)
    workdir: str = ""                    # "" = current directory
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    container: ContainerOptions = field(default_factory=ContainerOptions)


@dataclass
class Built:
    argv: list[str]                      # what to execute here
    script: str | None = None            # sbatch script text (mode sbatch)
    nproc: int = 1


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


def torchrun_supports_signals() -> bool:
    """Whether this torchrun has --signals-to-handle (pytorch#154849), read from its source."""
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return False
    source = Path(list(found.submodule_search_locations)[0]) / "distributed" / "run.py"
    try:
        return "--signals-to-handle" in source.read_text()
    except OSError:
        return False


def _python(spec: LaunchSpec, in_container: bool) -> str:
    return spec.python or ("python3" if in_container else sys.executable)


def _torchrun_options(nproc: int) -> list[str]:
    options = ["--nproc-per-node", str(nproc)]
    if torchrun_supports_signals():
        options += ["--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1,SIGUSR2"]
    return options


def direct_command(spec: LaunchSpec, nproc: int, in_container: bool = False) -> list[str]:
    python = _python(spec, in_container)
    if spec.plain:
        return [python, "-m", spec.module, *spec.args]
    return [python, "-m", "torch.distributed.run", "--standalone", *_torchrun_options(nproc),
            "-m", spec.module, *spec.args]


# Per-task prelude under Slurm. Fixed text: $SLURM_* are expanded by each
# task's own shell (never by ours or a batch shell, reference §3.1), then the
# real command arrives as "$@". Topology A hands torchrun its node rank and
# master through its PET_* environment (torchrun's env-backed options), so
# the same prelude works when a container sits between srun and torchrun.
_SLURM_NODE_ENV = ('export PET_NNODES="$SLURM_NNODES" PET_NODE_RANK="$SLURM_NODEID" '
                   'PET_MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)" '
                   'PET_MASTER_PORT={port}; exec "$@"')
_SLURM_TASK_ENV = ('export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" WORLD_SIZE="$SLURM_NTASKS" '
                   'LOCAL_WORLD_SIZE="$SLURM_NTASKS_PER_NODE" '
                   'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)" '
                   'MASTER_PORT={port}; exec "$@"')
SLURM_PASSED_VARS = {"torchrun": ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
                     "tasks": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                               "MASTER_PORT")}


def _slurm_inner(spec: LaunchSpec, nproc: int, python: str, wrap: list[str]) -> list[str]:
    """bash -c '<fixed prelude>' anvil-slurm [CONTAINER...] PYTHON ARGS..."""
    if spec.slurm.topology == "torchrun":
        text = _SLURM_NODE_ENV.format(port=int(spec.master_port))
        command = [python, "-m", "torch.distributed.run", *_torchrun_options(nproc), "-m", spec.module, *spec.args]
    elif spec.slurm.topology == "tasks":
        text = _SLURM_TASK_ENV.format(port=int(spec.master_port))
        command = [python, "-m", spec.module, *spec.args]
    else:
        raise LaunchError(f"unknown slurm topology {spec.slurm.topology!r} (torchrun | tasks)")
    return ["bash", "-c", text, "anvil-slurm", *wrap, *command]


def slurm_options(spec: LaunchSpec, nproc: int, env: Mapping[str, str], batch: bool) -> list[str]:
    opts = spec.slurm
    nodes = opts.nodes or int(env.get("SLURM_NNODES", 0) or 0) or 1
    per_node = 1 if opts.topology == "torchrun" else nproc
    signal_opt = opts.signal if not batch or opts.signal.startswith(("B:", "R:")) else f"B:{opts.signal}"
    out = [f"--nodes={nodes}", f"--ntasks-per-node={per_node}"]
    if not batch:
        out.append("-K1")           # one task dies -> kill the rest (reference §3.4)
    if opts.signal:
        out.append(f"--signal={signal_opt}")
    gpus = opts.gpus_per_node if opts.gpus_per_node is not None else (nproc if spec.vendor != "cpu" else 0)
    if gpus:
        out.append(f"--gpus-per-node={gpus}")
    for name, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time)):
        if value:
            out.append(f"--{name}={value}")
    if batch:
        out += [f"--job-name={opts.job_name}", "--requeue", "--open-mode=append"]
    return out + list(opts.extra)


def container_prefix(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None,
                     pass_names: tuple[str, ...] = ()) -> list[str]:
    opts = spec.container
    if opts.engine not in ENGINES:
        raise LaunchError(f"unknown container engine {opts.engine!r} ({' | '.join(ENGINES)})")
    if not opts.image:
        raise LaunchError("container runtime needs an image (anvil.container_image or --image)")
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
    cmd = [opts.engine, "run", "--rm", "--network=host", "--ipc=host", f"--shm-size={opts.shm_size}",
           "-w", workdir]
    if spec.vendor == "rocm":
        cmd += ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video",
                "--security-opt=seccomp=unconfined"]
    elif spec.vendor == "cuda":
        cmd += ["--gpus=all"]
    for bind in binds:
        cmd += ["-v", bind]
    for name in sorted(set(_container_env_names(env)) | set(pass_names)):
        cmd += ["-e", name]        # by name: the value comes from our environment, not argv
    return cmd + list(opts.extra) + [opts.image]


def _container_env_names(env: Mapping[str, str]) -> list[str]:
    skip = {"PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "TERM", "LD_LIBRARY_PATH",
            "PYTHONPATH", "VIRTUAL_ENV", "SHELL", "USER", "LOGNAME"}
    return [k for k in env if k not in skip and not k.startswith(("BASH_FUNC_", "SSH_", "XDG_", "LC_"))]


def build(spec: LaunchSpec, env: Mapping[str, str] | None = None, run_dir: Path | None = None) -> Built:
    """The command (and sbatch script) for spec, without running anything."""
    env = dict(os.environ if env is None else env)
    if spec.runtime not in RUNTIMES:
        raise LaunchError(f"unknown runtime {spec.runtime!r} ({' | '.join(RUNTIMES)})")
    nproc = processes_per_node(spec, env)
    in_container = "container" in spec.runtime
    passed = SLURM_PASSED_VARS.get(spec.slurm.topology, ()) if spec.runtime.startswith("slurm") else ()
    wrap = container_prefix(spec, env, run_dir, passed) if in_container else []
    if spec.runtime == "direct":
        return Built(direct_command(spec, nproc), nproc=nproc)
    if spec.runtime == "container":
        return Built(wrap + direct_command(spec, nproc, in_container=True), nproc=nproc)
    python = _python(spec, in_container)
    inner = _slurm_inner(spec, nproc, python, wrap)
    if spec.slurm.mode == "srun":
        return Built(["srun", *slurm_options(spec, nproc, env, batch=False), *inner], nproc=nproc)
    if spec.slurm.mode != "sbatch":
        raise LaunchError(f"unknown slurm mode {spec.slurm.mode!r} (srun | sbatch)")
    script = sbatch_script(spec, nproc, env, inner, run_dir)
    path = (Path(run_dir) if run_dir else Path.cwd()) / "slurm" / "job.sbatch"
    return Built(["sbatch", "--parsable", str(path)], script=script, nproc=nproc)


def sbatch_script(spec: LaunchSpec, nproc: int, env: Mapping[str, str], inner: list[str],
                  run_dir: Path | None) -> str:
    logs = (Path(run_dir) if run_dir else Path.cwd()) / "logs"
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in slurm_options(spec, nproc, env, batch=True)]
    lines += [f"#SBATCH --output={logs}/slurm-%j.out", ""]
    lines += ["# Written by anvil (runtime/launch.py). $SLURM_* below are expanded per task,",
              "# inside single quotes; the batch shell only forwards the preemption signal.",
              f"cd {shlex.quote(spec.workdir or os.getcwd())}",
              "srun -K1 " + shlex.join(inner) + " &",
              "step=$!",
              "trap 'kill -USR2 $step 2>/dev/null' USR2",
              "trap 'kill -TERM $step 2>/dev/null' TERM",
              "wait $step; code=$?",
              "while kill -0 $step 2>/dev/null; do wait $step; code=$?; done",
              "if [ $code -eq 3 ]; then scontrol requeue \"$SLURM_JOB_ID\"; fi",
              "exit $code", ""]
    return "\n".join(lines)


_WORKER_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def _pump(source: IO[bytes], sinks: list[IO], lock: threading.Lock, exit_codes: list[int]) -> None:
    for line in iter(source.readline, b""):
        text = line.decode("utf-8", "replace")
        match = _WORKER_EXIT.match(text)
        if match:
            exit_codes.append(int(match.group(1)))
        with lock:
            for sink in sinks:
                try:
                    sink.write(text)
                    sink.flush()
                except (OSError, ValueError):
                    pass
    source.close()


def run_streaming(argv: list[str], env: Mapping[str, str], log_path: Path | None = None,
                  cwd: str | None = None, stdout: IO | None = None, stderr: IO | None = None,
                  masker=None) -> int:
    """Run argv, tee output to console + log_path, forward signals; the exit code."""
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    if log and masker is not None:
        log = _MaskedFile(log, masker)
    try:
        proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    except OSError as exc:
        if log:
            log.close()
        raise LaunchError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def forward(signum, _frame):
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    lock = threading.Lock()
    worker_codes: list[int] = []
    pumps = [threading.Thread(target=_pump, daemon=True,
                              args=(proc.stdout, [stdout or sys.stdout] + ([log] if log else []), lock, worker_codes)),
             threading.Thread(target=_pump, daemon=True,
                              args=(proc.stderr, [stderr or sys.stderr] + ([log] if log else []), lock, worker_codes))]
    for pump in pumps:
        pump.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    finally:
        for pump in pumps:
            pump.join(timeout=5)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if log:
            log.close()
    # torchrun reports any failed worker as its own exit 1; keep the workers'
    # own code when those that exited by themselves agree (the trainer's 3
    # means "requeue me"); negative codes are workers torchrun then killed.
    exited = {c for c in worker_codes if c > 0}
    if code == 1 and len(exited) == 1:
        code = exited.pop()
    return code


class _MaskedFile:
    def __init__(self, handle, masker):
        self.handle, self.masker = handle, masker

    def write(self, text: str) -> None:
        self.handle.write(self.masker.text(text))

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def launch(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None,
           log_name: str = "launcher.log", dry_run: bool = False, masker=None,
           stdout: IO | None = None, stderr: IO | None = None) -> int:
    """Build and run spec with env; output to console and RUN_DIR/logs/<log_name>.

    With sbatch, writes RUN_DIR/slurm/job.sbatch and returns sbatch's exit
    code (the job id is printed). dry_run prints the command and returns 0.
    """
    built = build(spec, env, run_dir)
    if built.script is not None:
        script_path = Path(built.argv[-1])
        script_path.parent.mkdir(parents=True, exist_ok=True)
        script_path.write_text(built.script)
    if dry_run:
        print(shlex.join(built.argv), file=stdout or sys.stdout)
        return 0
    log_path = None
    if run_dir is not None:
        (Path(run_dir) / "logs").mkdir(parents=True, exist_ok=True)
        log_path = Path(run_dir) / "logs" / log_name
        with open(log_path, "a", encoding="utf-8") as handle:
            shown = masker.argv(built.argv) if masker is not None else built.argv
            handle.write(f"$ {shlex.join(shown)}\n")
    return run_streaming(built.argv, env, log_path, cwd=spec.workdir or None, stdout=stdout,
                         stderr=stderr, masker=masker)

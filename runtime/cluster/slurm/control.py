"""Slurm's client commands as Anvil asks them: is Slurm there (require, require_controller), what
does it know about a job (job_info, known_jobs, exit_status), which partitions it has (partitions,
require_partition), the hosts of a host list (hostnames), cancel and interrupt. Job state comes from `scontrol show job` (no accounting daemon needed).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
from typing import Mapping

from runtime.launch.spec import LaunchError

TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
POLL_S = 1.0


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise LaunchError(f"runtime slurm: `{tool}` not found on PATH - Slurm's client commands are not "
                          "installed here (run on a login node, or use --runtime direct)")
    return path


def _run(argv: list[str], env: Mapping[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    require(argv[0])
    try:
        return subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{' '.join(argv[:2])}` did not answer in {timeout:.0f} s: is slurmctld up "
                          "(`scontrol ping`)?") from None


def interrupt_step(step: str, srun: subprocess.Popen, env: Mapping[str, str], signum: int = signal.SIGINT) -> None:
    """A Ctrl-C (or SIGTERM, SIGHUP) for the tasks of a running srun: the signal to each (`scancel
    --signal=INT JOB.STEP`), as a terminal's Ctrl-C on their node would give it. srun alone passes SIGINT
    on only at a second one within a second, and without a terminal on its stdin ends the step
    instead; at SIGTERM or SIGHUP it kills the tasks. With no step yet (step ''), srun gets the
    signal and gives up its request."""
    if step:
        try:
            subprocess.run(["scancel", f"--signal={signal.Signals(signum).name.removeprefix('SIG')}", step],
                           env=dict(env), capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
            return
        except (OSError, subprocess.TimeoutExpired):
            pass
    srun.send_signal(signum)


def require_controller(env: Mapping[str, str]) -> None:
    """LaunchError unless slurmctld answers (`scontrol ping`: instant either way)."""
    proc = _run(["scontrol", "ping"], env)
    if proc.returncode != 0:
        said = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
        raise LaunchError(f"Slurm's controller does not answer ({said[0] if said else f'exit {proc.returncode}'}): "
                          "slurmctld is down or unreachable from here; nothing was submitted")


def partitions(env: Mapping[str, str]) -> list[str] | None:
    """The partitions slurmctld has, hidden ones too (`scontrol --all show partition -o`); None when it
    does not say."""
    proc = _run(["scontrol", "--all", "show", "partition", "-o"], env)
    if proc.returncode != 0:
        return None
    return [info["PartitionName"] for info in map(_job_fields, proc.stdout.splitlines()) if "PartitionName" in info]


def require_partition(partition: str, env: Mapping[str, str]) -> None:
    """LaunchError (one line, before a run directory) naming each partition of `partition` (one, or a
    comma-separated list as sbatch takes) that Slurm does not have, and the ones it has. Asked of
    slurmctld: sbatch said so only once the run existed, and srun inside an allocation not at all."""
    wanted = [name for name in partition.split(",") if name]
    known = partitions(env) if wanted else None
    missing = [name for name in wanted if known is not None and name not in known]
    if missing:
        raise LaunchError(f"Slurm partition (--partition, anvil.slurm_partition) {', '.join(missing)}: no such "
                          f"partition on this cluster; its partitions: {', '.join(known) or 'none'}")


def hostnames(nodelist: str, env: Mapping[str, str]) -> list[str]:
    """node[1-3],gpu7 -> [node1, node2, node3, gpu7] (scontrol show hostnames)."""
    if not nodelist:
        return []
    proc = _run(["scontrol", "show", "hostnames", nodelist], env)
    if proc.returncode != 0:
        raise LaunchError(f"scontrol show hostnames {nodelist}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.split()


def _job_fields(line: str) -> dict[str, str]:
    """One job of `scontrol show job -o` (KEY=VALUE tokens) as a dict; the first of a repeated key."""
    info: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key not in info:
            info[key] = value
    return info


def job_info(job_id: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """scontrol show job -o as a dict; None once slurmctld has forgotten the job."""
    proc = _run(["scontrol", "show", "job", "-o", job_id], env)
    if proc.returncode != 0:
        return None
    return _job_fields(proc.stdout)


def known_jobs(env: Mapping[str, str]) -> dict[str, dict[str, str]] | None:
    """Every job slurmctld still knows (running, pending, and ended ones for MinJobAge, 300 s by
    default), by job id; None when Slurm's client is not installed or its controller does not answer."""
    if shutil.which("scontrol") is None:
        return None
    try:
        proc = _run(["scontrol", "--all", "show", "job", "-o"], env, timeout=20)   # hidden partitions too
    except LaunchError:
        return None
    if proc.returncode != 0:
        return None
    jobs = (_job_fields(line) for line in proc.stdout.splitlines())
    return {info["JobId"]: info for info in jobs if "JobId" in info}


def exit_status(info: Mapping[str, str]) -> int:
    """ExitCode=X:Y -> X, or 128+Y when the batch shell died of signal Y."""
    code, _, sig = (info.get("ExitCode") or "0:0").partition(":")
    try:
        code_i, sig_i = int(code), int(sig or 0)
    except ValueError:
        return 1
    if sig_i:
        return 128 + sig_i
    if code_i == 0 and info.get("JobState") not in ("COMPLETED",):
        return 1   # cancelled / node failure / time limit with no status of its own
    return code_i


def cancel(job_id: str, env: Mapping[str, str]) -> None:
    _run(["scancel", job_id], env)



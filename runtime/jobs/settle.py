"""Record the end of a Slurm job that ended without recording it itself (and of a run whose inv
died on this machine: settle_dead_launchers, at the end).

A run nobody follows ("submitted" by --no-wait, "detached" by Ctrl-C, "requeued" while it
waits to resume) gets its end from its own batch script (runtime.runs.jobend). A batch shell
killed outright - SIGKILL, its node lost or rebooted - never gets that far, and the run would
say "submitted" for ever. So before runs are listed or shown, each such run's job is looked
up in Slurm, in one `scontrol show job` for all of them:

- pending or running: left alone;
- ended (still known to slurmctld, MinJobAge: 300 s by default): recorded as what Slurm says
  it ended as - cancelled, ok, or failed with the batch shell's signal - at its EndTime;
- forgotten by slurmctld (missing from the listing, and unknown when asked for by id), or its
  id now names another job (not named anvil-<run>): recorded "lost", at the time of the run's
  newest log line, since nothing says more.

The record says `settled_by: slurm`: it is Slurm's view from outside, so should the batch
script reach runtime.runs.jobend after all (a job hidden from this user's listing, a slow
requeue), the script's own record replaces it.

Nothing is written on a guess: where Slurm's client is missing or its controller does not
answer (a laptop reading a copied runs folder), every run keeps what it said; so does a run
whose files cannot be read or written. An ended job is
read twice, a poll apart, because a job requeuing itself shows its last attempt's end for a
moment before it is pending again (the same care runtime.cluster.slurm.batch.follow takes).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterable, Mapping

from core import names
from core.host import this_host
from runtime.cluster.slurm import batch
from runtime.cluster.slurm import control as slurm
from runtime.launch.spec import LaunchError
from runtime.runs import jobend, outcome, rundir

EXIT_UNKNOWN = 1   # a lost job's exit status: unknown, and not a success


@dataclass(frozen=True)
class Settled:
    run_dir: Path
    job_id: str
    status: str
    why: str


def _job_id(run_dir: Path, metadata: dict) -> str | None:
    return str(metadata.get("slurm_job_id") or "") or batch.submitted_job_id(run_dir)


def unfollowed(runs: Iterable[tuple[Path, dict]]) -> list[tuple[Path, str]]:
    """(run, job id) of the (run, metadata) pairs that still wait for their batch script to
    record their end."""
    found = []
    for run_dir, metadata in runs:
        try:
            job_id = _job_id(run_dir, metadata) if metadata.get("status") in jobend.UNFOLLOWED else None
        except OSError:
            continue   # slurm/job_id unreadable: shown as it was
        if job_id:
            found.append((Path(run_dir), job_id))
    return found


def _ours(run_dir: Path, info: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """Slurm's record of the job, unless the id now names another job (a reinstalled cluster
    counting from 1 again): train.pretrain names its job anvil-<run directory>."""
    if info is None:
        return None
    name = info.get("JobName")
    if name and name.startswith("anvil-") and name != f"anvil-{run_dir.name}"[:60]:
        return None
    return info


def _epoch(slurm_time: str | None) -> float | None:
    try:
        return datetime.fromisoformat(slurm_time or "").timestamp()   # Slurm prints local time
    except ValueError:
        return None   # "Unknown", "None"


def _last_sign_of_life(run_dir: Path) -> float | None:
    logs = run_dir / names.LOGS_DIR
    times = [p.stat().st_mtime for p in logs.iterdir() if p.is_file()] if logs.is_dir() else []
    return max(times, default=None)


def verdict(job_id: str, info: Mapping[str, str] | None) -> tuple[str, int, str]:
    """(status, exit status, why) of a job that ended unrecorded; info None: Slurm forgot it."""
    if info is None:
        return ("lost", EXIT_UNKNOWN,
                f"Slurm no longer knows job {job_id}, and its batch script never recorded the end "
                f"(killed outright, or its node lost); `sacct -j {job_id}` says how it ended where "
                "Slurm keeps accounting")
    state, code = info.get("JobState", "?"), slurm.exit_status(info)
    exit_code = info.get("ExitCode", "?")
    why = f"Slurm job {job_id} ended {state} (ExitCode {exit_code}) and its batch script never recorded the end"
    signal_no = exit_code.partition(":")[2]
    if signal_no.isdigit() and int(signal_no):
        why += f": the batch shell died of signal {signal_no}" + (" (SIGKILL)" if signal_no == "9" else "")
    status = "cancelled" if state == "CANCELLED" else jobend.status_of(code)
    return status, code, why


def _ended(known: Mapping[str, Mapping[str, str]], run_dir: Path, job_id: str) -> tuple[bool, Mapping | None]:
    info = _ours(run_dir, known.get(job_id))
    return info is None or info.get("JobState") in slurm.TERMINAL_STATES, info


def _forgotten(job_id: str, env: Mapping[str, str]) -> bool:
    """Missing from the listing, and Slurm says so when asked for this id alone."""
    try:
        return slurm.job_info(job_id, env) is None
    except LaunchError:
        return False


def settle(runs: list[tuple[Path, str]], env: Mapping[str, str] | None = None,
           poll_s: float = slurm.POLL_S) -> list[Settled]:
    """Record the end of each (run, job) whose job Slurm says has ended; what was recorded. The
    record says settled_by: slurm, so a batch script that does get to record its end still can."""
    if not runs:
        return []
    env = os.environ if env is None else env
    known = slurm.known_jobs(env)
    if known is None:
        return []
    ended = [(run_dir, job_id) for run_dir, job_id in runs if _ended(known, run_dir, job_id)[0]]
    if not ended:
        return []
    time.sleep(poll_s)
    again = slurm.known_jobs(env)
    if again is None:
        return []
    settled = []
    for run_dir, job_id in ended:
        first = _ours(run_dir, known.get(job_id))
        still, info = _ended(again, run_dir, job_id)
        if not still or (first or {}).get("Restarts") != (info or {}).get("Restarts"):
            continue   # requeued itself meanwhile
        if job_id not in again and not _forgotten(job_id, env):
            continue   # hidden from the listing (another user's, PrivateData): not a verdict
        status, code, why = verdict(job_id, info)
        try:
            when = _epoch(info.get("EndTime")) if info is not None else _last_sign_of_life(run_dir)
            if jobend.record(run_dir, code, environ=dict(env), status=status, why=why, ended=when):
                settled.append(Settled(run_dir, job_id, status, why))
        except (OSError, KeyError, rundir.RunDirError):
            continue   # unreadable or unwritable (a teammate's run), or damaged: shown as it was
    return settled


def settle_runs(runs_dir: Path, env: Mapping[str, str] | None = None) -> list[Settled]:
    """settle() every unfollowed run under runs_dir, and record the runs whose inv died here."""
    runs = list(rundir.iter_runs(runs_dir))
    return settle(unfollowed(runs), env) + settle_dead_launchers(runs)


def settle_run(run_dir: Path, env: Mapping[str, str] | None = None) -> Settled | None:
    """settle() one run, when it is unfollowed; or record it lost, when its inv died here."""
    try:
        metadata = rundir.metadata(run_dir)
    except (OSError, rundir.RunDirError):
        return None   # shown as damaged by the reader
    runs = [(Path(run_dir), metadata)]
    settled = settle(unfollowed(runs), env) + settle_dead_launchers(runs)
    return settled[0] if settled else None


# -- a run whose inv died on this machine (kill -9, the OOM killer, a crash) --------------------

QUIET_S = 60.0   # how long the logs of a run whose inv died stay unwritten before it is "lost"


def settle_dead_launchers(runs: Iterable[tuple[Path, dict]], host: str | None = None) -> list[Settled]:
    """Record "lost" for each run that says "running" though the inv that runs it (metadata pid, on this
    host) is gone: nothing else would ever record its end. Its ranks stop with it, after a checkpoint
    (a direct run's agent and an srun step hear of it from the kernel: runtime.launch.agent,
    runtime.cluster.slurm.transport); the record says so once every node's agent has reported. Until
    then a run whose logs were written in the last QUIET_S seconds is left "running": its ranks are
    still stopping, or training. Runs of other hosts, Slurm jobs and live processes are left alone."""
    host = host or this_host()
    settled = []
    for run_dir, metadata in runs:
        pid = metadata.get("pid")
        if (metadata.get("status") != "running" or metadata.get("slurm_job_id") or metadata.get("host") != host
                or not isinstance(pid, int) or _is_running(pid, metadata.get("start_ts"))):
            continue
        why = (f"its inv (pid {pid}) ended without recording the end: killed (kill -9, the OOM killer) or "
               f"crashed")
        try:
            report = outcome.read(Path(run_dir))
            expected = metadata.get("world_size")
            reported = bool(report.nodes) and report.world_size >= (expected if isinstance(expected, int) else 1)
            last = _last_sign_of_life(Path(run_dir))
            if not reported and last is not None and time.time() - last < QUIET_S:
                continue
            if reported and report.stop_status():
                why += ("; every rank then checkpointed and stopped"
                        + (f" (`inv {metadata.get('task')} --resume {run_dir}` continues it)"
                           if metadata.get("task") == "train.pretrain" else ""))
        except OSError:
            continue   # unreadable (a teammate's run): shown as it was
        try:
            if jobend.record(Path(run_dir), EXIT_UNKNOWN, status="lost", why=why,
                             ended=_last_sign_of_life(Path(run_dir)), settled_by="pid", waiting=("running",)):
                settled.append(Settled(Path(run_dir), "", "lost", why))
        except (OSError, KeyError, TypeError, rundir.RunDirError):
            continue   # unreadable or unwritable (a teammate's run), or damaged: shown as it was
    return settled


def _is_running(pid: int, started: float | None) -> bool:
    """Whether process `pid` lives and is the one that started at `started` (not a later one given the
    same pid). Unsure (another user's process, no /proc) counts as running: nothing is written on a guess."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        began = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return True
    return not isinstance(started, (int, float)) or began <= started + 2

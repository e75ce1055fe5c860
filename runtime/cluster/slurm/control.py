"""Slurm from outside an allocation: submit the sbatch script, follow the job to its end.

    code = submit_and_follow(built, env, run_dir, wait=True)

sbatch --parsable prints the job id; the id goes to RUN_DIR/slurm/job_id. While
following, job state changes are printed as one line each and the job's
output file (RUN_DIR/logs/slurm-<id>.out) is shown as it grows; a requeued job
(preemption, `scontrol requeue`) is followed through its restarts. The job's
exit status becomes ours. Ctrl-C while following asks before cancelling the
job (on a terminal; elsewhere the job is left running and the scancel line is
printed). Job state comes from `scontrol show job` (no accounting daemon needed).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Mapping

from runtime.launch.spec import EXIT_INTERRUPTED, Built, LaunchError
from trainer.errors import AnvilError
from trainer.files import write_atomic

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


def interrupt_step(step: str, srun: subprocess.Popen, env: Mapping[str, str]) -> None:
    """A Ctrl-C for the tasks of a running srun: SIGINT to each (`scancel --signal=INT JOB.STEP`), as a
    terminal's Ctrl-C on their node would give it. srun alone passes SIGINT on only at a second one
    within a second, and without a terminal on its stdin ends the step instead. With no step yet
    (step ''), srun gets the SIGINT and gives up its request."""
    if step:
        try:
            subprocess.run(["scancel", "--signal=INT", step], env=dict(env), capture_output=True, timeout=30,
                           stdin=subprocess.DEVNULL)
            return
        except (OSError, subprocess.TimeoutExpired):
            pass
    srun.send_signal(signal.SIGINT)


def require_controller(env: Mapping[str, str]) -> None:
    """LaunchError unless slurmctld answers (`scontrol ping`: instant either way)."""
    proc = _run(["scontrol", "ping"], env)
    if proc.returncode != 0:
        said = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
        raise LaunchError(f"Slurm's controller does not answer ({said[0] if said else f'exit {proc.returncode}'}): "
                          "slurmctld is down or unreachable from here; nothing was submitted")


def submit(script: Path, env: Mapping[str, str]) -> str:
    """sbatch the script; the job id. A rejected job is one LaunchError with sbatch's reason."""
    proc = _run(["sbatch", "--parsable", str(script)], env)
    if proc.returncode != 0:
        reason = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise LaunchError(f"sbatch rejected the job: {reason[-1] if reason else f'exit {proc.returncode}'}")
    return proc.stdout.strip().split(";")[0]


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


class _Tail:
    """Prints what a growing file gains (the job's output) since the last call."""

    def __init__(self, path: Path, out: IO):
        self.path, self.out, self.offset = path, out, 0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        if data:
            self.offset += len(data)
            self.out.write(data.decode("utf-8", "replace"))
            self.out.flush()


# Reasons a pending job gives when nothing but a change of the cluster's configuration would start it.
NEVER_STARTS = {
    "PartitionConfig": "it asks for more than the partition has (nodes, CPUs, memory or GPUs)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "it asks for more time than the partition allows",
    "BadConstraints": "no node matches its constraints",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
}


def follow(job_id: str, env: Mapping[str, str], log: Path | None, out: IO) -> int:
    """Follow the job until it ends; its exit status. A job Slurm will never start is cancelled: LaunchError."""
    tail = _Tail(log, out) if log else None
    last_state, last = None, None
    while True:
        info = job_info(job_id, env)
        if tail:
            tail.poll()
        if info is None:
            if last is None:
                raise LaunchError(f"job {job_id}: slurmctld does not know it (already purged?)")
            info = last
            break
        state = info.get("JobState", "?")
        shown = (state, info.get("Restarts"), info.get("NodeList"))
        if shown != last_state:
            where = f" on {info.get('NodeList')}" if state == "RUNNING" else ""
            why = f" ({info.get('Reason')})" if state == "PENDING" and info.get("Reason") not in (None, "None") else ""
            restarts = f", restart {info.get('Restarts')}" if info.get("Restarts", "0") != "0" else ""
            print(f"slurm: job {job_id} {state}{where}{why}{restarts}", file=out, flush=True)
            last_state = shown
        last = info
        if state == "PENDING" and info.get("Reason") in NEVER_STARTS:
            cancel(job_id, env)
            raise LaunchError(f"Slurm will not start job {job_id} ({info['Reason']}: "
                              f"{NEVER_STARTS[info['Reason']]}), so it was cancelled; `sinfo -s` shows the "
                              "partitions and their nodes")
        if state in TERMINAL_STATES:
            # A job requeued by its own batch script (`scontrol requeue`) can show the
            # killed attempt's end for a moment before it is PENDING again: look twice.
            time.sleep(POLL_S)
            again = job_info(job_id, env)
            if again is not None and (again.get("JobState") not in TERMINAL_STATES
                                      or again.get("Restarts") != info.get("Restarts")):
                continue
            break
        time.sleep(POLL_S)
    if tail:
        tail.poll()
    if info.get("JobState") == "CANCELLED":
        raise FollowStopped(f"Slurm job {job_id} was cancelled (scancel); its ranks checkpoint on the way out "
                            "when they can, and `inv train.pretrain --resume RUN` continues", "cancelled")
    return exit_status(info)


class FollowStopped(AnvilError):
    """Following a submitted job stopped: it was cancelled, or it keeps running unfollowed."""

    def __init__(self, message: str, status: str, exit_code: int = EXIT_INTERRUPTED):
        super().__init__(message, exit_code)
        self.status = status


class _Hangup(Exception):
    """SIGTERM or SIGHUP to the inv that follows a job (a closed terminal, a dropped SSH session)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _hang_up(signum, _frame):
    raise _Hangup(signum)


def _ask_cancel(job_id: str, env: Mapping[str, str], out: IO) -> None:
    if sys.stdin is not None and sys.stdin.isatty():
        try:
            answer = input(f"\ncancel Slurm job {job_id}? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        if answer.strip().lower() in ("y", "yes"):
            cancel(job_id, env)
            raise FollowStopped(f"Slurm job {job_id} cancelled (its ranks checkpoint on the way out when "
                                "they can; `inv train.pretrain --resume RUN` continues)", "cancelled")
    raise FollowStopped(f"stopped following Slurm job {job_id}; it keeps running (`scancel {job_id}` stops it, "
                        f"`scontrol show job {job_id}` shows it)", "detached")


def job_id_file(run_dir: Path | str) -> Path:
    return Path(run_dir) / "slurm" / "job_id"


def submitted_job_id(run_dir: Path | str) -> str | None:
    """The id of the batch job submitted for this run (written by submit_and_follow), or None."""
    path = job_id_file(run_dir)
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def submit_and_follow(built: Built, env: Mapping[str, str], run_dir: Path | None, wait: bool = True,
                      stdout: IO | None = None) -> int:
    out = stdout or sys.stdout
    script = Path(built.argv[-1])
    job_id = submit(script, env)
    if run_dir is not None:
        write_atomic(job_id_file(run_dir), job_id + "\n")
    print(f"slurm: submitted job {job_id} ({built.nodes} node(s) x {built.nproc} process(es)); "
          f"script {script}", file=out, flush=True)
    if not wait:
        return 0
    log = Path(run_dir) / "logs" / f"slurm-{job_id}.out" if run_dir is not None else None
    # Ctrl-C asks; SIGTERM and SIGHUP (the terminal or SSH session went away) detach: the run says so,
    # and the batch script records the job's end, instead of the run saying "running" for ever.
    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in caught}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _hang_up)
        signal.signal(signal.SIGHUP, _hang_up)
        return follow(job_id, env, log, out)
    except KeyboardInterrupt:
        _ask_cancel(job_id, env, out)       # raises FollowStopped
        raise
    except _Hangup as hangup:
        raise FollowStopped(f"stopped following Slurm job {job_id} on {signal.Signals(hangup.signum).name}; it "
                            f"keeps running (`scontrol show job {job_id}` shows it; the run records its end)",
                            "detached", 128 + hangup.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

"""Slurm from outside an allocation: the batch script, submitting it, following the job to its end.

    script = sbatch_script(step, header, run_dir, workdir)   # RUN_DIR/slurm/job.sbatch
    code = submit_and_follow(script_path, env, run_dir, what="2 node(s) x 4 process(es)", wait=True)

The script runs the step with srun, passes the preemption warning (B:USR2) on to
it, requeues the job when every rank stopped to be requeued (exit 3), and
records each attempt's end in the run's metadata.json when no inv follows the
job (runtime.runs.jobend). sbatch --parsable prints the job id; the id goes to
RUN_DIR/slurm/job_id. While following, job state changes are printed as one
line each and the job's output file (RUN_DIR/logs/slurm-<id>.out) is shown as
it grows; a requeued job (preemption, `scontrol requeue`) is followed through
its restarts. The job's exit status becomes ours. Ctrl-C while following asks
before cancelling the job (on a terminal; elsewhere the job is left running and
the scancel line is printed).
"""
from __future__ import annotations

import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

from core import names
from runtime.cluster import values
from runtime.cluster.slurm.control import (POLL_S, TERMINAL_STATES, _run, cancel, exit_status,
                                           job_info)
from runtime.launch.spec import EXIT_INTERRUPTED, LaunchError
from core.errors import AnvilError
from core.files import write_atomic


def sbatch_script(step: Sequence[str], header: Sequence[str], run_dir: Path | None, workdir: str) -> str:
    """The batch script running `step` (the srun line) with the #SBATCH `header` options."""
    logs = (Path(run_dir) if run_dir else Path.cwd()) / names.LOGS_DIR
    stop_status = [sys.executable, "-m", "runtime.runs.outcome", str(run_dir or ".")]
    record = [sys.executable, "-m", "runtime.runs.jobend", str(run_dir)] if run_dir else []
    lines = ["#!/bin/bash"]
    lines += [_directive(opt) for opt in [*header, f"--output={logs}/slurm-%j.out"]] + [""]
    lines += ["# Written by anvil (runtime/cluster/slurm/batch.py). Each node's step reads SLURM_* itself",
              "# (runtime.cluster.slurm.step), so nothing below is expanded by this shell.",
              "# The batch shell gets the preemption signal (B:USR2) and passes it to the step; ranks",
              "# checkpoint and exit 3, and the job is requeued; a requeued job resumes from the run",
              "# directory's checkpoint.",
              f"cd {shlex.quote(workdir)}",
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


def _directive(option: str) -> str:
    """One #SBATCH line. sbatch reads the directives up to the first line that is not one, and bash runs
    every other line: a newline in an option (or a space, which sbatch cuts the option at) has no place."""
    values.line("#SBATCH option", option)
    if any(ch.isspace() for ch in option):
        raise values.BadValue(f"#SBATCH option {option!r}: has whitespace, where sbatch would cut it (a run "
                              "directory or an option value with a space cannot go into the batch script)")
    return f"#SBATCH {option}"


def submit(script: Path, env: Mapping[str, str]) -> str:
    """sbatch the script; the job id. A rejected job is one LaunchError with sbatch's reason."""
    proc = _run(["sbatch", "--parsable", str(script)], env)
    if proc.returncode != 0:
        reason = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise LaunchError(f"sbatch rejected the job: {reason[-1] if reason else f'exit {proc.returncode}'}")
    return proc.stdout.strip().split(";")[0]


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
                            "when they can", "cancelled")   # (a training job's says how to continue it)
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
            raise FollowStopped(f"Slurm job {job_id} cancelled; its ranks checkpoint on the way out when "
                                "they can", "cancelled")
    raise FollowStopped(f"stopped following Slurm job {job_id}; it keeps running (`scancel {job_id}` stops it, "
                        f"`scontrol show job {job_id}` shows it)", "detached")


def job_id_file(run_dir: Path | str) -> Path:
    return Path(run_dir) / "slurm" / "job_id"


def submitted_job_id(run_dir: Path | str) -> str | None:
    """The id of the batch job submitted for this run (written by submit_and_follow), or None: none, or a
    file that holds no job id (edited: a later snapshot.list would ask Slurm about it)."""
    path = job_id_file(run_dir)
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").strip()
    return text if re.fullmatch(r"\d+(_\d+)?", text) else None


def submit_and_follow(script: Path, env: Mapping[str, str], run_dir: Path | None, what: str, wait: bool = True,
                      stdout: IO | None = None) -> int:
    """sbatch the script and follow the job to its end (wait=False: return once it is submitted).
    what: the job's size, for the line saying it was submitted."""
    out = stdout or sys.stdout
    job_id = submit(script, env)
    if run_dir is not None:
        write_atomic(job_id_file(run_dir), job_id + "\n")
    print(f"slurm: submitted job {job_id} ({what}); script {script}", file=out, flush=True)
    if not wait:
        return 0
    log = Path(run_dir) / names.LOGS_DIR / f"slurm-{job_id}.out" if run_dir is not None else None
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

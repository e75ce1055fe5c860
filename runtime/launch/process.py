"""Run a launch's command here: stream its output to the console and a log, pass signals on.

    code = launch(spec, env, run_dir)        # this machine's agent for spec (what runtime direct runs)
    code = run_logged(argv, env, run_dir)    # any launch command: `$ argv`, then its output, in the log

Output is teed to the console and RUN_DIR/logs/<log_name> (masked). SIGTERM,
SIGUSR1, SIGUSR2, SIGINT and SIGHUP reaching `inv` are passed to the child and
`inv` keeps waiting, so the ranks can finish their step and checkpoint (exit 3,
or 130 after Ctrl-C) instead of `inv` dying first. A negative return code (a
signal) becomes 128+N; a command still running at its `timeout` is ended
(SIGTERM, SIGKILL 15 s later) and returns 124.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from core import names
from core.signals import on_parent_death
from runtime.launch.commands import agent_command, launch_env
from runtime.launch.spec import LAUNCHER_PID_VAR, PASSED_SIGNALS, LaunchError, LaunchSpec, processes_per_node
from trainer.ranklog import PROGRESS_TTY_VAR

TIMED_OUT = 124          # a command ended at its timeout (coreutils timeout's status)
KILL_AFTER_S = 15        # after a timeout's SIGTERM, SIGKILL
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)   # what run_streaming's `interrupt` takes


def _pump(source: IO[bytes], sinks: list[IO], lock: threading.Lock) -> None:
    for line in iter(source.readline, b""):
        text = line.decode("utf-8", "replace")
        with lock:
            for sink in sinks:
                try:
                    sink.write(text)
                    sink.flush()
                except (OSError, ValueError):
                    pass
    source.close()


class MaskedFile:
    """A log file that masks what is written to it (core.secrets.Masker)."""

    def __init__(self, handle, masker):
        self.handle, self.masker = handle, masker

    def write(self, text: str) -> None:
        self.handle.write(self.masker.text(text) if self.masker is not None else text)

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class passing_signals:
    """While active (main thread only), the signals `inv` would pass on go to send(signum) instead of
    ending this process."""

    def __init__(self, send: Callable[[int], None]):
        self.send, self.previous, self.received = send, {}, []

    def _forward(self, signum, _frame) -> None:
        self.received.append(signum)
        try:
            self.send(signum)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "passing_signals":
        if threading.current_thread() is threading.main_thread():
            for signum in PASSED_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def open_log(run_dir: Path | None, log_name: str, argv: Sequence[str] | None = None, masker=None) -> Path | None:
    """RUN_DIR/logs/<log_name>, with a `$ argv` line (masked) when given; None without a run directory."""
    if run_dir is None:
        return None
    path = Path(run_dir) / names.LOGS_DIR / log_name
    path.parent.mkdir(parents=True, exist_ok=True)
    if argv is not None:
        shown = masker.argv(list(argv)) if masker is not None else list(argv)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"$ {shlex.join(shown)}\n")
    return path


def run_streaming(argv: list[str], env: Mapping[str, str], log_path: Path | None = None,
                  cwd: str | None = None, stdout: IO | None = None, stderr: IO | None = None,
                  masker=None, interrupt: Callable[[subprocess.Popen, int], None] | None = None,
                  timeout: float | None = None, orphaned: int | None = None) -> int:
    """Run argv, tee output to console + log_path, pass signals on; the exit status. `interrupt(proc,
    signum)` takes a Ctrl-C, SIGTERM or SIGHUP (INTERRUPTS) instead of the child (srun, which would end
    its step on them: runtime.cluster.slurm.control.interrupt_step).
    `orphaned`: the signal the child gets should this process die first (kill -9, the OOM killer),
    from the kernel (core.signals.on_parent_death)."""
    log = MaskedFile(open(log_path, "a", encoding="utf-8"), masker) if log_path else None
    arm = None
    if orphaned is not None and threading.current_thread() is threading.main_thread():
        # (the kernel sends it when the thread that started the child ends: only the main thread's is ours)
        arm = on_parent_death(orphaned, os.getpid())

    def preexec() -> None:
        if not arm():    # this process died while the child started: nothing would ever send it
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        # With `interrupt` (srun) the child gets a session of its own: a terminal's Ctrl-C reaches the whole
        # foreground group, and srun, its stdin not a terminal, aborts the step on it. Every signal it should
        # see comes through passing_signals.
        proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=interrupt is not None,
                                preexec_fn=preexec if arm is not None else None)
    except OSError as exc:
        if log:
            log.close()
        raise LaunchError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    lock = threading.Lock()
    pumps = [threading.Thread(target=_pump, daemon=True,
                              args=(proc.stdout, [stdout or sys.stdout] + ([log] if log else []), lock)),
             threading.Thread(target=_pump, daemon=True,
                              args=(proc.stderr, [stderr or sys.stderr] + ([log] if log else []), lock))]
    for pump in pumps:
        pump.start()

    def send(signum: int) -> None:
        if signum in INTERRUPTS and interrupt is not None:
            interrupt(proc, signum)
        else:
            proc.send_signal(signum)

    timed_out = False
    try:
        with passing_signals(send):
            timed_out = not _wait(proc, timeout)
    finally:
        for pump in pumps:
            pump.join(timeout=5)
        if log:
            log.close()
    code = proc.returncode
    return TIMED_OUT if timed_out else 128 - code if code < 0 else code


def _wait(proc: subprocess.Popen, timeout: float | None) -> bool:
    """Wait for proc; at the timeout end it (SIGTERM, then SIGKILL). False when it had to be ended."""
    if timeout is None:
        proc.wait()
        return True
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.terminate()                 # srun passes it on and ends the step; the agent stops its ranks
    try:
        proc.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return False


def run_logged(argv: list[str], env: Mapping[str, str], run_dir: Path | None = None, *,
               log_name: str = names.LAUNCHER_LOG, masker=None, **streaming) -> int:
    """run_streaming with RUN_DIR/logs/<log_name> as the log, which starts with `$ argv`."""
    log_path = open_log(run_dir, log_name, argv, masker)
    return run_streaming(argv, env, log_path, masker=masker, **streaming)


def launch(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None, *, wrap: Sequence[str] = (),
           log_name: str = names.LAUNCHER_LOG, dry_run: bool = False, masker=None, stdout: IO | None = None,
           stderr: IO | None = None, timeout: float | None = None) -> int:
    """This machine's agent for spec, output to console and RUN_DIR/logs/<log_name>; its exit status.

    wrap: what runs the agent (a container's command line). dry_run prints the command and returns 0."""
    argv = [*wrap, *agent_command(spec, processes_per_node(spec, env), run_dir=run_dir)]
    if dry_run:
        print(shlex.join(argv), file=stdout or sys.stdout)
        return 0
    child_env = launch_env(spec, env, run_dir)
    if not wrap:
        child_env[LAUNCHER_PID_VAR] = str(os.getpid())   # the agent is our child: it ends with us
        if sys.stderr.isatty() and not env.get("CI"):
            child_env[PROGRESS_TTY_VAR] = "1"   # rank 0's progress bar goes to this terminal, not to the logs
    return run_logged(argv, child_env, run_dir, log_name=log_name, masker=masker, cwd=spec.workdir or None,
                      stdout=stdout, stderr=stderr, timeout=timeout)

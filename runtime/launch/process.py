"""Run a built launch here: stream its output to the console and a log, pass signals on.

`launch(spec, env, run_dir)` builds the command (runtime.launch.commands), runs
it, tees stdout/stderr to the console and RUN_DIR/logs/<log_name>, and returns
its exit status. SIGTERM, SIGUSR1, SIGUSR2 and SIGINT reaching `inv` are passed
to the child and `inv` keeps waiting, so the ranks can finish their step and
checkpoint (exit 3, or 130 after Ctrl-C) instead of `inv` dying first.
With sbatch (Slurm, outside an allocation) it writes RUN_DIR/slurm/job.sbatch
and hands over to runtime.cluster.slurm.control (submit, follow).
"""
from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Callable, Mapping

from runtime.launch.commands import build, launch_env
from runtime.launch.spec import PASSED_SIGNALS, STEP_FILE, LaunchError, LaunchSpec
from trainer.ranklog import PROGRESS_TTY_VAR
from trainer.files import write_atomic


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


class _MaskedFile:
    def __init__(self, handle, masker):
        self.handle, self.masker = handle, masker

    def write(self, text: str) -> None:
        self.handle.write(self.masker.text(text))

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class passing_signals:
    """While active (main thread only), signals to this process go to `proc` instead; SIGINT goes to
    `interrupt(proc)` when one is given (srun: see interrupt_recorded_step)."""

    def __init__(self, proc: subprocess.Popen, interrupt: Callable[[subprocess.Popen], None] | None = None):
        self.proc, self.previous, self.received, self.interrupt = proc, {}, [], interrupt

    def _forward(self, signum, _frame) -> None:
        self.received.append(signum)
        try:
            if signum == signal.SIGINT and self.interrupt is not None:
                self.interrupt(self.proc)
            else:
                self.proc.send_signal(signum)
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


def interrupt_recorded_step(run_dir: Path, env: Mapping[str, str]) -> Callable[[subprocess.Popen], None]:
    """Ctrl-C of an `inv` running srun for a training run: SIGINT to the tasks of the step the agents
    recorded in RUN/logs/slurm-step (slurm.interrupt_step), so the ranks checkpoint and stop as after
    a Ctrl-C here. Passed on to srun, two SIGINTs within a second (the terminal's and ours), or one
    with no terminal on its stdin, ended the step instead, which lost the training."""
    def interrupt(proc: subprocess.Popen) -> None:
        from runtime.cluster.slurm.control import interrupt_step
        try:
            step = (Path(run_dir) / STEP_FILE).read_text().strip()
        except OSError:
            step = ""
        if step:
            print(f"interrupted: the ranks of Slurm step {step} checkpoint and stop", file=sys.stderr, flush=True)
        interrupt_step(step, proc, env)
    return interrupt


def run_streaming(argv: list[str], env: Mapping[str, str], log_path: Path | None = None,
                  cwd: str | None = None, stdout: IO | None = None, stderr: IO | None = None,
                  masker=None, interrupt: Callable[[subprocess.Popen], None] | None = None) -> int:
    """Run argv, tee output to console + log_path, pass signals on; the exit status."""
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    if log and masker is not None:
        log = _MaskedFile(log, masker)
    try:
        # With `interrupt` (srun) the child gets a session of its own: a terminal's Ctrl-C reaches the whole
        # foreground group, and srun, its stdin not a terminal, aborts the step on it. Every signal it should
        # see comes through passing_signals.
        proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=interrupt is not None)
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
    try:
        with passing_signals(proc, interrupt):
            code = proc.wait()
    finally:
        for pump in pumps:
            pump.join(timeout=5)
        if log:
            log.close()
    return 128 - code if code < 0 else code


def launch(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None,
           log_name: str = "launcher.log", dry_run: bool = False, masker=None,
           stdout: IO | None = None, stderr: IO | None = None) -> int:
    """Build and run spec with env; output to console and RUN_DIR/logs/<log_name>.

    dry_run prints the command (and the sbatch script) and returns 0.
    """
    built = build(spec, env, run_dir)
    child_env = launch_env(spec, env, run_dir)
    if spec.runtime == "direct" and sys.stderr.isatty() and not env.get("CI"):
        child_env[PROGRESS_TTY_VAR] = "1"   # rank 0's progress bar goes to this terminal, not to the logs
    out = stdout or sys.stdout
    if dry_run:
        if built.script is not None:
            print(f"# {built.argv[-1]}\n{built.script}", file=out)
        print(shlex.join(built.argv), file=out)
        return 0
    if built.script is not None:
        write_atomic(built.argv[-1], built.script)
        from runtime.cluster.slurm import control as slurm
        return slurm.submit_and_follow(built, child_env, run_dir, wait=spec.slurm.wait, stdout=out)
    log_path = None
    if run_dir is not None:
        (Path(run_dir) / "logs").mkdir(parents=True, exist_ok=True)
        log_path = Path(run_dir) / "logs" / log_name
        with open(log_path, "a", encoding="utf-8") as handle:
            shown = masker.argv(built.argv) if masker is not None else built.argv
            handle.write(f"$ {shlex.join(shown)}\n")
    interrupt = interrupt_recorded_step(run_dir, child_env) if spec.runtime.startswith("slurm") and run_dir else None
    return run_streaming(built.argv, child_env, log_path, cwd=spec.workdir or None, stdout=stdout,
                         stderr=stderr, masker=masker, interrupt=interrupt)

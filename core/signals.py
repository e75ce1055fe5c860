"""Stop cleanly on a signal: finish the step, checkpoint on every rank, then exit.

SIGTERM / SIGUSR2 (a scheduler's preemption warning) -> exit 3, "requeue me";
SIGINT (Ctrl-C) and SIGHUP (the terminal or SSH session closed) -> exit 130,
status "interrupted" (it checkpoints too, so `--resume` continues where it
stopped; without a handler SIGHUP killed the ranks with nothing saved).

Slurm sends SIGUSR2 (with `--signal=USR2@120`) before a time limit or preemption and SIGTERM
at it; torchrun forwards SIGTERM to its workers (and SIGUSR2 only when started with
`--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2`, then waits `--shutdown-timeout`
seconds, default 30, before SIGKILL). The handler only sets a flag; the loop asks
`should_stop(step)` at step boundaries, and the ranks all-reduce the flag (MAX) so that all
of them checkpoint and exit together even when the signal reached only some of them.

EXIT_REQUEUE (3) is the trainer's exit status for "stopped on a signal after checkpointing,
requeue me" (docs/run-flow.md). EXIT_HUNG (4) is a rank that trainer.health's watchdog ended
because no step finished in time (its report: RUN_DIR/logs/hang-rank<R>.json).

Outside the loop, `interrupting()` makes the same four signals raise `Interrupt`, a
KeyboardInterrupt: `inv` installs it for every task (runtime/program/interrupts.py), so everything
that cleans up after a Ctrl-C (a run directory recorded "interrupted", data.prepare's worker
pool, temporary folder and lock) does so after SIGTERM, SIGHUP and SIGUSR2 too. `exit_status`
is each signal's exit status: a training process's is the table's above (3 for SIGTERM and
SIGUSR2: requeue me; 130 for SIGINT and SIGHUP), any other task's 128+N, as a shell reports a
process that signal N ended (130 for Ctrl-C either way).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

from core import names

EXIT_REQUEUE = 3
EXIT_HUNG = 4            # no training step for health.hang_timeout_s: stacks dumped, rank ended
EXIT_FAULTY = 5          # a step's numbers changed when it ran again (health.on_nonfinite=rerun): hardware
EXIT_INTERRUPTED = 130
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT", "SIGHUP")
_USER_STOPS = (signal.SIGINT, signal.SIGHUP)     # the user ended it: interrupted, not preempted
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)


def exit_status(signum: int, training: bool = False) -> int:
    """The exit status of a process that stop signal `signum` ended (the module doc)."""
    if training:
        return EXIT_INTERRUPTED if signum in _USER_STOPS else EXIT_REQUEUE
    return 128 + int(signum)


def killed_outright(returncode: int | None) -> bool:
    """A process SIGKILL ended (the kernel's OOM killer, someone's kill -9): never what a rank does of itself
    when a peer fails, so among ranks that ended together it is the one to blame (runtime.launch.agent,
    runtime.runs.outcome); their peers, failing on the connection it closed, can end within milliseconds."""
    return returncode == -signal.SIGKILL


def signal_name(signum: int | None) -> str:
    """"Ctrl-C" for SIGINT (what the user pressed), else the signal's name ("SIGTERM")."""
    if signum is None or signum == signal.SIGINT:
        return "Ctrl-C"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupt(KeyboardInterrupt):
    """A stop signal outside the training loop; a KeyboardInterrupt, so every path that cleans up
    after a Ctrl-C cleans up after it. `training`: this process trains (its exit status follows the
    trainer's table)."""

    def __init__(self, signum: int, training: bool = False):
        super().__init__(signal_name(signum))
        self.signum, self.training = int(signum), training

    def __reduce__(self):   # (pickled across processes: by its signal, not by its message)
        return type(self), (self.signum, self.training)

    @property
    def name(self) -> str:
        return signal_name(self.signum)

    @property
    def exit_code(self) -> int:
        return exit_status(self.signum, self.training)

    @property
    def said(self) -> str:
        """"interrupted (SIGTERM)"; in a process that trains, where the loop's own handler was not
        in place (inv before it launched the ranks), "... before the first step"."""
        return f"interrupted ({self.name})" + (" before the first step" if self.training else "")


def interrupted_by(exc: BaseException) -> tuple[str, int]:
    """(what stopped it, exit status) of a KeyboardInterrupt: an Interrupt's signal, else Ctrl-C (130)."""
    if isinstance(exc, Interrupt):
        return exc.name, exc.exit_code
    return "Ctrl-C", EXIT_INTERRUPTED


class _Raise:
    """The handler `interrupting` installs: raise Interrupt for the signal."""

    def __init__(self, training: bool):
        self.training = training

    def __call__(self, signum, _frame):
        raise Interrupt(signum, self.training)


@contextmanager
def deferred():
    """Hold the stop signals back while the block runs (a record written whole, the two renames of a
    swap); one that came meanwhile is handed to its handler once the block is over (an Interrupt,
    a KeyboardInterrupt, raised then). Signals without a Python handler, and threads other than the
    main one (which cannot set handlers), are left as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler):
            previous[sig] = signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        previous[caught[0]](caught[0], None)


def ignoring() -> None:
    """Ignore the stop signals from now on: a process whose work is over (its end recorded) must not
    die of one while its interpreter finalizes, when Python puts SIG_DFL back for its handlers."""
    for sig in STOP_SIGNALS:
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_IGN)


def _interrupt_once(signum, _frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def ctrl_c_once() -> None:
    """From now on a Ctrl-C raises KeyboardInterrupt once and later ones are ignored: in a process a
    launcher started (a rank), which passes on the Ctrl-C the whole process group also got, a second
    one must not cut the first one's exit short. Only where Python's own handler is in place."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)


def interrupting(training: bool = False) -> None:
    """Make SIGINT, SIGTERM, SIGHUP and SIGUSR2 raise Interrupt in this process (main thread only).
    A signal that was ignored when the process started stays ignored: nohup's SIGHUP, the SIGINT of
    a command started with `&` by a script."""
    handler = _Raise(training)
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, handler)


class Stopper:
    """Flag set by the signal handler; collective agreement on it at step boundaries."""

    def __init__(self, signals=DEFAULT_SIGNALS, check_every: int | None = None):
        self.signals = [getattr(signal, s) if isinstance(s, str) else signal.Signals(s) for s in signals]
        env_every = os.environ.get(names.SIGNAL_CHECK_EVERY)
        self.check_every = max(1, int(check_every or env_every or 1))
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._group = None
        self._group_ready = False
        self.interrupted = False   # agreed: some rank got SIGINT/SIGHUP (the user) rather than a preemption
        # Also stop (agreed, in the same all-reduce) when this returns True on some rank: the
        # trainer sets it to its checkpointer's failed(), a background write that failed.
        self.failing = None
        self.failed = False        # agreed: some rank's `failing` said so

    # -- handler
    def _handle(self, signum, frame) -> None:
        if self.signum is None:  # keep the first one: it is the reason
            self.signum = signum

    def install(self) -> "Stopper":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._cpu_group()  # collective: create now, while every rank runs the same code
        return self

    def restore(self) -> None:
        """Put the previous handlers back, unless a stop was asked for: then the stop signals are
        ignored to the end of the process, so a follow-up signal (the launcher forwarding the one
        the scheduler also sent to the whole group, srun --kill-on-bad-exit once another node
        exited 3, scancel's TERM) cannot kill a rank that is shutting down after its checkpoint.
        Ignored, not our handler: Python puts SIG_DFL back for its own handlers while the
        interpreter finalizes, and a signal landing then killed the rank (exit -12 instead of 3).
        The launcher's grace and SIGKILL still bound the shutdown."""
        if self.signum is not None:
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "Stopper":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    # -- state
    @property
    def requested(self) -> bool:
        """This process received a stop signal (local view, no communication)."""
        return self.signum is not None

    @property
    def reason(self) -> str | None:
        if self.signum is None:
            return None
        return "signal on another rank" if self.signum < 0 else signal.Signals(self.signum).name

    def _cpu_group(self):
        """A gloo group for the flag, so agreeing never waits on the GPU stream (no host<->GPU
        sync); the default group when that is already gloo."""
        import torch.distributed as dist

        if self._group_ready or not (dist.is_available() and dist.is_initialized()):
            return self._group
        if dist.get_backend() == "gloo":
            self._group = None
        else:
            self._group = dist.new_group(backend="gloo")
        self._group_ready = True
        return self._group

    def should_stop(self, step: int) -> bool:
        """Same answer on every rank. Every rank must call it at every step (it is a
        collective on steps divisible by check_every)."""
        import torch
        import torch.distributed as dist

        local = 2 if self.signum in _USER_STOPS else 1 if self.requested else 0
        failing = int(bool(self.failing is not None and self.failing()))
        if not (dist.is_available() and dist.is_initialized()):
            self.interrupted, self.failed = local == 2, bool(failing)
            return self.requested or self.failed
        if step % self.check_every:
            return False
        flag = torch.tensor([local, failing], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        signalled, self.failed = int(flag[0]), bool(flag[1])
        if signalled and self.signum is None:
            self.signum = -1  # a peer was signalled; stop with it
        self.interrupted = signalled == 2
        return bool(signalled) or self.failed

    @property
    def status(self) -> str:
        return "interrupted" if self.interrupted else "preempted"

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.interrupted else EXIT_REQUEUE


def install(signals=DEFAULT_SIGNALS, check_every: int | None = None) -> Stopper:
    """Install the handlers (call after init_process_group, before the loop)."""
    return Stopper(signals, check_every).install()


def on_parent_death(signum: int, parent: int | None = None):
    """A function that asks the kernel to send `signum` to the process calling it when that
    process's parent thread ends (Linux PR_SET_PDEATHSIG) and returns whether its parent is still
    `parent` (True when None): a parent that died before the call sends nothing. None where there is
    no such call. Called in this process (the node agent) or in a child between fork and exec
    (Popen's preexec_fn, which must load no library: hence made beforehand)."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def arm() -> bool:
        prctl(pr_set_pdeathsig, int(signum), 0, 0, 0)
        return parent is None or os.getppid() == parent
    return arm

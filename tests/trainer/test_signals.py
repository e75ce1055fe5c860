"""core.signals: a rank that stopped for a signal is not killed by the next one while it exits."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers.processes import signal_until_exit
from core import signals

CHILD = """
import os, signal, sys, time
from core import signals
stopper = signals.install()
os.kill(os.getpid(), signal.SIGUSR2)       # the scheduler's warning
time.sleep(0.05)
assert stopper.should_stop(0) and stopper.exit_code == 3
stopper.restore()
print("stopping", flush=True)
sys.exit(stopper.exit_code)
"""


def test_restore_puts_the_previous_handlers_back_when_no_stop_was_asked():
    before = signal.getsignal(signal.SIGUSR2)
    stopper = signals.install(("SIGUSR2",))
    assert signal.getsignal(signal.SIGUSR2) == stopper._handle
    stopper.restore()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_restore_after_a_stop_ignores_the_stop_signals():
    before = signal.getsignal(signal.SIGUSR2)
    try:
        stopper = signals.install(("SIGUSR2",))
        stopper._handle(signal.SIGUSR2, None)
        stopper.restore()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_signals_arriving_while_the_rank_exits_keep_exit_3():
    """The launcher forwards the signal the whole group also got: the second copy may land while
    the interpreter finalizes, when Python has put SIG_DFL back for its own handlers."""
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, cwd=os.getcwd())
        assert proc.stdout.readline() == b"stopping\n"
        assert signal_until_exit(proc, signal.SIGUSR2, timeout=30, pause=0) == 3

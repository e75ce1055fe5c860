"""Shared helper for the tests of processes that must survive a scheduler's repeated signals."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def signal_until_exit(proc: subprocess.Popen, signum: int, timeout: float = 60.0, pause: float = 0.001) -> int:
    """Send `signum` to `proc` again and again until it exits, `pause` seconds apart (0: as fast as
    possible, to land copies while its interpreter finalizes); its exit status."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            break
        if pause:
            time.sleep(pause)
    return proc.wait(timeout=timeout)


def start_as_from_a_terminal(argv: list[str], **kwargs) -> subprocess.Popen:
    """Start argv as a shell on a terminal would: in its own process group, so that
    os.killpg(proc.pid, SIGINT) is a Ctrl-C, and with SIGINT handled (a suite started in the
    background, `cmd &` in a script, hands its children SIGINT ignored, and Python keeps it so)."""
    return subprocess.Popen(argv, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def wait_until(ready, proc: subprocess.Popen | None = None, timeout: float = 120.0, pause: float = 0.1) -> bool:
    """Poll ready() until it is true (True), the time is up or proc ended (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(pause)
    return False

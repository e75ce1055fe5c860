"""Shared helper for the tests of processes that must survive a scheduler's repeated signals."""
from __future__ import annotations

import os
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

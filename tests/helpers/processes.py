"""Processes in the tests: signalled again and again, started as from a terminal, waited for, alive or gone."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


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
    os.killpg(proc.pid, SIGINT) is a Ctrl-C, and with SIGINT and SIGHUP handled (a suite started in
    the background, `cmd &` in a script, hands its children SIGINT ignored, `nohup` SIGHUP, and
    Python keeps them so)."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_terminal_signals, **kwargs)


def _terminal_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


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


def alive(pid: int) -> bool:
    """The process `pid` exists and has not exited (a zombie waiting for its parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def waited_for(predicate, timeout: float, what: str):
    """`predicate()`'s first true value, asked every 0.2 s; an AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rank_process(pid: int, rank: int):
    """The psutil.Process of a trainer rank (python -m trainer with RANK=`rank`) under process `pid`, or None."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "trainer" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None

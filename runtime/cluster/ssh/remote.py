"""The far end of an SSH session of inv's: run one command on this host as inv asks over stdin.

    python -m runtime.cluster.ssh.remote [--timeout S] [--launcher] -- COMMAND...

stdin carries, in order (runtime.cluster.ssh.session.Control writes it):
1. the command's environment, one JSON line, laid over this host's own (so
   values travel inside the SSH connection, never in a command line);
2. the names of signals to pass on (SIGTERM, SIGUSR2, SIGINT, ..., SIGKILL),
   one a line: inv passes on what it gets, as srun does;
3. its end: inv was interrupted, or went away (killed, the connection
   dropped). The command gets SIGINT, as a terminal's Ctrl-C would give it.

COMMAND runs in a process group of its own, and signals go to that group (its
children too, as a terminal's would). --launcher: COMMAND is the agent, which
stops its ranks should this process die (names.LAUNCHER_PID). --timeout:
SIGTERM to the group after S seconds, SIGKILL 5 s later, exit 124 (coreutils
timeout's status). The exit status is COMMAND's (128+N when a signal ended it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

from runtime.launch.spec import LAUNCHER_PID_VAR, PASSED_SIGNALS

TIMED_OUT = 124
KILL_AFTER_S = 5


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _read_control(proc: subprocess.Popen) -> None:
    """Pass on the signals named on stdin; at its end, SIGINT (once)."""
    for line in sys.stdin:
        name = line.strip()
        if name.startswith("SIG") and hasattr(signal, name):
            _signal_group(proc, getattr(signal, name))
    _signal_group(proc, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.cluster.ssh.remote", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds; 0 = none")
    parser.add_argument("--launcher", action="store_true", help="COMMAND is the agent: it ends with this process")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    line = sys.stdin.readline()
    if not line:
        return 130          # inv went away before it said how to run the command: nothing started
    env = {**os.environ, **{str(k): str(v) for k, v in json.loads(line).items()}}
    if args.launcher:
        env[LAUNCHER_PID_VAR] = str(os.getpid())
    # A signal to this process (a scheduler's, kill) goes on to the command, which decides. The
    # handlers go in before the command starts: it then starts with these signals at their
    # defaults, even where this process inherited them ignored (a far end started from a script
    # with `&` ignores SIGINT), so the SIGINT that ends a session reaches it as a Ctrl-C would.
    started, pending = [], []

    def pass_on(signum, _frame):
        if started:
            _signal_group(started[0], signum)
        else:
            pending.append(signum)

    for signum in PASSED_SIGNALS:
        signal.signal(signum, pass_on)
    try:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        print(f"anvil: cannot start {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    started.append(proc)
    for signum in pending:     # one that came while it started
        _signal_group(proc, signum)
    threading.Thread(target=_read_control, args=(proc,), daemon=True).start()
    try:
        code = proc.wait(timeout=args.timeout or None)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + KILL_AFTER_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        return TIMED_OUT
    for signum in PASSED_SIGNALS:     # nothing left to pass on: a late signal must not change the status
        signal.signal(signum, signal.SIG_IGN)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())

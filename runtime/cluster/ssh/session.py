"""SSH sessions over Fabric: one command on one host, run by runtime.cluster.ssh.remote on the far end.

    sessions = Sessions(options)
    code, out, err, error = sessions.run(host, ["inv", "preflight.all"], env={names.HOST: host})
    sessions.signal(signal.SIGUSR2)     # passed on to every remote command
    sessions.stop()                     # every remote command stops as at a Ctrl-C (its stdin ends)
    sessions.abandon()                  # close the connections: stop waiting

Each host runs ``cd <remote_path> && exec <python> -m runtime.cluster.ssh.remote
-- COMMAND``, its environment and then the signals to pass on written to its
stdin (Control): values never appear in a command line. A dropped connection
ends that stdin too, so a remote command never outlives the inv that started
it unwatched. Errors (unreachable, refused keys, timeouts) come back as one
line, never as an exception.
"""
from __future__ import annotations

import json
import shlex
import signal
import threading
from pathlib import Path
from typing import IO, Mapping, Sequence

from runtime.cluster import values
from runtime.cluster.options import SshOptions
from runtime.cluster.transport import local_inv

REMOTE = "runtime.cluster.ssh.remote"
STOPPED_BEFORE = "interrupted before it started"
STOPPED_WAITING = "interrupted: stopped waiting for it (the task may still be ending there)"


class Control:
    """A remote command's stdin as Invoke reads it: its environment (one JSON line), then the names
    of the signals to pass on, one a line; its end once the command is to stop as at a Ctrl-C."""

    def __init__(self, env: Mapping[str, str]):
        self._lock = threading.Lock()
        self._pending = json.dumps({str(k): str(v) for k, v in env.items()}) + "\n"
        self._closed = False

    def send(self, signum: int) -> None:
        with self._lock:
            if not self._closed:
                self._pending += signal.Signals(signum).name + "\n"

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def read(self, _size: int = 1) -> str | None:
        """What is new (Invoke passes it on), None for nothing yet, '' for the end (Invoke closes stdin)."""
        with self._lock:
            if self._pending:
                out, self._pending = self._pending, ""
                return out
            return "" if self._closed else None


def remote_python(options: SshOptions) -> str:
    """The python beside the hosts' inv: it runs the remote end, and the agents."""
    return str(Path(options.remote_inv or local_inv()).with_name("python"))


def check_line(options: SshOptions) -> None:
    """What every SSH line of these options holds: the remote checkout and inv (anvil.remote_path,
    anvil.remote_inv) with no control character."""
    values.line("the hosts' checkout (anvil.remote_path)", options.remote_path)
    values.line("the hosts' inv (anvil.remote_inv)", options.remote_inv)


def remote_line(options: SshOptions, command: Sequence[str], *, timeout: float = 0.0, launcher: bool = False) -> str:
    """The shell line one host runs; every piece quoted, and none with a control character (a login shell
    other than a POSIX one, csh's, does not keep a newline inside quotes)."""
    check_line(options)
    for part in command:
        values.line("a word of the command sent over SSH", part)
    remote = [remote_python(options), "-m", REMOTE]
    if timeout:
        remote += ["--timeout", f"{timeout:g}"]
    if launcher:
        remote.append("--launcher")
    return f"cd {shlex.quote(options.remote_path)} && exec {shlex.join([*remote, '--', *command])}"


class Sessions:
    """The SSH sessions of one launch or one fan-out: one per host, all at once (one thread each)."""

    def __init__(self, options: SshOptions, config=None):
        self.options = options
        self.config = config
        self.asked = threading.Event()          # stop(): every remote command stops as at a Ctrl-C
        self.abandoned = threading.Event()      # abandon(): connections closed, no exit status
        self._controls: dict[str, Control] = {}
        self._connections: set = set()
        self._lock = threading.Lock()

    def _fabric_config(self):
        if self.config is None:
            _quiet_paramiko()
            self.config = fabric_config(self.options.ssh_config)
        return self.config

    def signal(self, signum: int, hosts: Sequence[str] | None = None) -> None:
        """Pass signum on to the remote commands (of `hosts`, default all)."""
        with self._lock:
            controls = [c for h, c in self._controls.items() if hosts is None or h in hosts]
        for control in controls:
            control.send(signum)

    def stop(self) -> None:
        self.asked.set()
        with self._lock:
            controls = list(self._controls.values())
        for control in controls:
            control.close()

    def abandon(self) -> None:
        self.abandoned.set()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the host's result says the rest
                pass

    def reach(self, hosts: Sequence[str]) -> dict[str, str]:
        """{host: why} for each host that cannot be logged in to (connect and authenticate, nothing run)."""
        from concurrent.futures import ThreadPoolExecutor

        from fabric import Connection

        def one(host: str) -> str | None:
            try:
                with Connection(host, user=_user(host, self.options), config=self._fabric_config(),
                                connect_timeout=self.options.connect_timeout,
                                connect_kwargs=_connect_kwargs(self.options)) as connection:
                    connection.open()
            except Exception as exc:  # noqa: BLE001 - any SSH trouble is this host's answer
                return describe(exc)
            return None

        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            found = dict(zip(hosts, pool.map(one, hosts)))
        return {host: why for host, why in found.items() if why}

    def run(self, host: str, command: Sequence[str], env: Mapping[str, str], *, timeout: float = 0.0,
            launcher: bool = False, out: IO | None = None, err: IO | None = None
            ) -> tuple[int | None, str, str, str | None]:
        """(exit status, stdout, stderr, error) of one command on one host; never raises. timeout: the
        remote end ends the command then (exit 124); out/err: stream the output there as it comes."""
        from fabric import Connection
        control = Control(env)
        with self._lock:
            self._controls[host] = control
        if self.asked.is_set():
            control.close()
        connection = None
        try:
            connection = Connection(host, user=_user(host, self.options), config=self._fabric_config(),
                                    connect_timeout=self.options.connect_timeout,
                                    connect_kwargs=_connect_kwargs(self.options))
            with self._lock:
                self._connections.add(connection)
            if self.asked.is_set():      # Ctrl-C came before this host's turn
                return None, "", "", STOPPED_BEFORE
            streams = {"out_stream": out, "err_stream": err, "hide": False} if out is not None else {"hide": True}
            ran = connection.run(remote_line(self.options, command, timeout=timeout, launcher=launcher), warn=True,
                                 timeout=timeout + 60 if timeout else None, in_stream=control, **streams)
            if self.abandoned.is_set():
                return None, ran.stdout, ran.stderr, STOPPED_WAITING
            return ran.exited, ran.stdout, ran.stderr, None
        except Exception as exc:  # noqa: BLE001 - any SSH trouble is this host's result, not a crash
            if self.abandoned.is_set():
                return None, "", "", STOPPED_WAITING
            return None, "", "", describe(exc)
        finally:
            if connection is not None:
                with self._lock:
                    self._connections.discard(connection)
                try:
                    connection.close()
                except Exception:  # noqa: BLE001
                    pass


def _connect_kwargs(options: SshOptions) -> dict:
    kwargs: dict = {}
    if options.key_filename:
        kwargs["key_filename"] = list(options.key_filename)
    if options.password:
        kwargs["password"] = options.password
    if options.passphrase:
        kwargs["passphrase"] = options.passphrase
    return kwargs


def describe(exc: BaseException) -> str:
    """An SSH error as the one line a report shows."""
    text = str(exc) or type(exc).__name__
    name = type(exc).__name__
    if name == "CommandTimedOut":
        return f"command timed out after {getattr(exc, 'timeout', '?')} s"
    if name in ("NoValidConnectionsError", "TimeoutError", "timeout", "socket.timeout") or "timed out" in text:
        return f"unreachable: {text}"
    if name == "gaierror":   # the name does not resolve: a typo, or not in this node's DNS / /etc/hosts
        return f"unreachable: no such host name ({getattr(exc, 'strerror', None) or text})"
    if name == "AuthenticationException":
        return f"SSH authentication failed: {text}"
    return f"{name}: {text}"


def fabric_config(ssh_config: str | None = None):
    """A Fabric Config (loads ~/.ssh/config, or the -S file), its commands run by _remote_runner()."""
    from fabric import Config as FabricConfig
    overrides = {"runners": {"remote": _remote_runner()}}
    return FabricConfig(runtime_ssh_path=ssh_config, overrides=overrides) if ssh_config else \
        FabricConfig(overrides=overrides)


def _remote_runner():
    """Fabric's Remote runner, but what Control passes on (a signal's name) to a command that has just ended is
    dropped: Invoke's stdin thread raised there (OSError: Socket is closed) and the host's exit status was lost
    in a ThreadException, its traceback the host's one-line result. It happens when one node fails and the
    launcher stops the others as one of them ends by itself."""
    from fabric.runners import Remote

    class Remote_(Remote):
        def _write_proc_stdin(self, data):
            try:
                return super()._write_proc_stdin(data)
            except OSError:
                if self.channel.closed or self.channel.exit_status_ready():
                    return None
                raise

    return Remote_


def _quiet_paramiko() -> None:
    # paramiko logs a traceback for every refused banner/handshake; the
    # per-host table reports the same error in one line.
    import logging
    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    logger.propagate = False


def _user(host: str, options) -> str | None:
    """The user to log in as: none from the settings where the host names its own (user@host wins, as
    with ssh; Fabric refuses both)."""
    return None if "@" in host else (options.user or None)

"""SSH transport of `inv -H a,b,c TASK`: run `inv TASK` on every host at once over Fabric.

Each host runs ``cd <remote_path> && ANVIL_HOST=<host> <remote_inv> TASK ARGS``
(Fabric Connections, one thread per host, so ten hosts take about as long as
one). The remote `inv` runs the task with its own pre and post tasks and
hooks, exactly as it would locally. Hosts that fail or cannot be reached are
results with their error (runtime.jobs.fanout merges and prints them).

Settings (invoke.yaml `anvil:`; -i / -t / -S on the command line win):
user, key_filename, remote_path (default: this checkout's path, i.e. a shared
file system), remote_inv (default: the same inv path as here), connect_timeout,
command_timeout.

    results = run_on_hosts(["n1", "n2"], ["preflight.all", "--json"], options)   # -> list[HostResult]
"""
from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from runtime import settings as settings_mod
from runtime.cluster import remote_stop
from runtime.cluster.results import HostResult, Interrupted, parse_json_output
from trainer.errors import UserError


@dataclass
class FanoutOptions:
    remote_path: str
    remote_inv: str = ""                 # "" = the program running now (shared file system)
    user: str | None = None
    key_filename: list[str] = field(default_factory=list)
    connect_timeout: float = 10.0
    command_timeout: float | None = None
    ssh_config: str | None = None
    password: str | None = None
    passphrase: str | None = None
    runtime_config: str | None = None    # -f FILE, forwarded (shared file system)


class FanoutError(UserError):
    """Bad fan-out input (no hosts, malformed host list)."""


def parse_hosts(value: str | Iterable[str], default_hosts: list[str] | None = None) -> list[str]:
    hosts = settings_mod.split_list(value)
    if hosts == ["@"]:
        hosts = list(default_hosts or [])
        if not hosts:
            raise FanoutError("-H @ needs anvil.hosts in invoke.yaml (or INVOKE_ANVIL_HOSTS)")
    if not hosts:
        raise FanoutError("no hosts given")
    bad = [h for h in hosts if any(ch.isspace() for ch in h) or h.startswith("-")]
    if bad:
        raise FanoutError(f"not a host name: {', '.join(map(repr, bad))}")
    seen, unique = set(), []
    for host in hosts:
        if host not in seen:
            seen.add(host)
            unique.append(host)
    return unique


def local_inv() -> str:
    """The absolute path of the inv running now (what a shared checkout has too)."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if program and os.path.basename(program) in ("inv", "anvil") and os.path.exists(program):
        return os.path.abspath(program)
    return str(Path(sys.executable).with_name("inv"))


def remote_command(host: str, argv: list[str], options: FanoutOptions, runs_dir: str | Path | None = None,
                   runtime: str = "") -> str:
    """The shell line run on one host; every piece quoted.

    runs_dir: where the host's own run directory goes (the fan-out's RUN/hosts/<host>; on a shared
    file system that is the same folder). runtime: the host's anvil.runtime when it must differ from
    the shared setting's (the node runs its part itself, not through Slurm). The remote inv stops as
    at a Ctrl-C when its stdin ends (runtime.cluster.remote_stop): that is how Ctrl-C here reaches it."""
    inv = [options.remote_inv or local_inv()]
    if options.runtime_config:
        inv += ["-f", options.runtime_config]
    env = {"ANVIL_HOST": host, remote_stop.ENV: "1"}
    if runs_dir:
        env["ANVIL_NODE_RUNS_DIR"] = str(Path(runs_dir) / host)
    if runtime:
        env["ANVIL_NODE_RUNTIME"] = runtime
    # NAME='value', not 'NAME=value': a quoted name is a command, not an assignment, to the shell
    assignments = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    return f"cd {shlex.quote(options.remote_path)} && {assignments} {shlex.join(inv + list(argv))}"


class Stopper:
    """Ctrl-C during `inv -H`: the first closes every remote task's stdin (the remote inv takes that
    for its own Ctrl-C and ends as it would here), the second closes the connections."""

    def __init__(self):
        self.asked = threading.Event()
        self.abandoned = threading.Event()      # the second Ctrl-C: connections closed, no exit status
        self._connections: set = set()
        self._lock = threading.Lock()

    def stdin(self) -> "_EndOnStop":
        return _EndOnStop(self.asked)

    def track(self, connection, open_: bool = True) -> None:
        with self._lock:
            (self._connections.add if open_ else self._connections.discard)(connection)

    def close_all(self) -> None:
        self.abandoned.set()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the host's result says the rest
                pass


class _EndOnStop:
    """A remote task's stdin as Invoke reads it: nothing yet (None), then end of file ("") once
    asked to stop, when Invoke closes the channel's stdin."""

    def __init__(self, asked: threading.Event):
        self.asked = asked

    def read(self, _size: int = 1) -> str | None:
        return "" if self.asked.is_set() else None


def _connect_kwargs(options: FanoutOptions) -> dict:
    kwargs: dict = {}
    if options.key_filename:
        kwargs["key_filename"] = list(options.key_filename)
    if options.password:
        kwargs["password"] = options.password
    if options.passphrase:
        kwargs["passphrase"] = options.passphrase
    return kwargs


def run_command(host: str, command: str, options: FanoutOptions, config, timeout: float | None = None,
                stopper: Stopper | None = None) -> tuple[int | None, str, str, str | None]:
    """(exit status, stdout, stderr, error) of one shell command on one host; never raises."""
    from fabric import Connection
    connection = None
    try:
        connection = Connection(host, user=options.user or None, config=config,
                                connect_timeout=options.connect_timeout, connect_kwargs=_connect_kwargs(options))
        if stopper is not None:
            stopper.track(connection)
            if stopper.asked.is_set():      # Ctrl-C came before this host's turn
                return None, "", "", STOPPED_BEFORE
        ran = connection.run(command, hide=True, warn=True, timeout=timeout,
                             in_stream=stopper.stdin() if stopper is not None else False)
        if stopper is not None and stopper.abandoned.is_set():
            return None, ran.stdout, ran.stderr, STOPPED_WAITING
        return ran.exited, ran.stdout, ran.stderr, None
    except Exception as exc:  # noqa: BLE001 - any SSH trouble is this host's result, not a crash
        if stopper is not None and stopper.abandoned.is_set():
            return None, "", "", STOPPED_WAITING
        return None, "", "", _describe(exc)
    finally:
        if connection is not None:
            if stopper is not None:
                stopper.track(connection, open_=False)
            try:
                connection.close()
            except Exception:  # noqa: BLE001
                pass


STOPPED_BEFORE = "interrupted before it started"
STOPPED_WAITING = "interrupted: stopped waiting for it (the task may still be ending there)"


def _run_one(host: str, command: str, options: FanoutOptions, config, stopper: Stopper | None = None
             ) -> HostResult:
    started = time.monotonic()
    code, out, err, error = run_command(host, command, options, config,
                                        timeout=options.command_timeout or None, stopper=stopper)
    result = HostResult(host, exit_code=code, stdout=out, stderr=err, error=error,
                        payload=parse_json_output(out) if error is None else None,
                        interrupted=stopper is not None and stopper.asked.is_set())
    result.seconds = round(time.monotonic() - started, 2)
    return result


def _describe(exc: BaseException) -> str:
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
    """A Fabric Config (loads ~/.ssh/config, or the -S file)."""
    from fabric import Config as FabricConfig
    return FabricConfig(runtime_ssh_path=ssh_config) if ssh_config else FabricConfig()


def _quiet_paramiko() -> None:
    # paramiko logs a traceback for every refused banner/handshake; the
    # per-host table reports the same error in one line.
    import logging
    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    logger.propagate = False


def run_on_hosts(hosts: list[str], argv: list[str], options: FanoutOptions, config=None, progress=None,
                 runs_dir: str | Path | None = None, runtime: str = "") -> list[HostResult]:
    """Run `inv ARGV` on every host concurrently; results in host order. runs_dir, runtime: see
    remote_command.

    Ctrl-C stops the task on every host and waits for them to end (results.Interrupted carries
    what each ended with); a second Ctrl-C stops waiting."""
    _quiet_paramiko()
    if config is None:
        config = fabric_config(ssh_config=options.ssh_config)
    stopper = Stopper()
    pool = ThreadPoolExecutor(max_workers=max(1, len(hosts)))
    try:
        futures = {pool.submit(_run_one, host, remote_command(host, argv, options, runs_dir, runtime), options,
                               config, stopper): host for host in hosts}
        if progress:
            for future in futures:
                future.add_done_callback(lambda f: f.cancelled() or progress(f.result()))
        try:
            wait(futures)
        except KeyboardInterrupt:
            stopper.asked.set()
            print(f"interrupted: stopping the task on {len(hosts)} host(s) (Ctrl-C again to stop waiting)",
                  file=sys.stderr, flush=True)
            try:
                wait(futures)
            except KeyboardInterrupt:
                stopper.close_all()
                wait(futures, timeout=options.connect_timeout + 5)
            raise Interrupted(_results_of(futures, hosts)) from None
        return _results_of(futures, hosts)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _results_of(futures: dict, hosts: list[str]) -> list[HostResult]:
    by_host = {}
    for future, host in futures.items():
        done = future.done() and not future.cancelled()
        by_host[host] = future.result() if done else HostResult(host, error=STOPPED_WAITING, interrupted=True)
    return [by_host[h] for h in hosts]


# Where `inv -H` leaves the SSH options of its flags for a task that reaches the nodes itself
# (run_task(takes_hosts=True)); such a task reads them with cli_options(c).
CLI_OPTIONS = "anvil_cli_ssh_options"


def cli_options(c) -> FanoutOptions | None:
    return c.config.get(CLI_OPTIONS)


def options_from(config, core) -> FanoutOptions:
    settings = settings_mod.load(_ConfigHolder(config))
    args = core[0].args
    keys = list(settings.key_filename) + [os.path.expanduser(k) for k in (args.identity.value or [])]
    timeout = args["connect-timeout"].value or settings.connect_timeout
    password = passphrase = None
    if args["prompt-for-login-password"].value:
        import getpass
        password = getpass.getpass("Enter login password for use with SSH auth: ")
    if args["prompt-for-passphrase"].value:
        import getpass
        passphrase = getpass.getpass("Enter passphrase for use unlocking SSH keys: ")
    runtime_config = args.config.value
    return FanoutOptions(
        remote_path=settings.remote_path or str(settings.root), remote_inv=settings.remote_inv,
        user=settings.user or None, key_filename=keys, connect_timeout=float(timeout),
        command_timeout=settings.command_timeout or None, ssh_config=args["ssh-config"].value,
        password=password, passphrase=passphrase,
        runtime_config=str(Path(runtime_config).resolve()) if runtime_config else None)


class _ConfigHolder:
    def __init__(self, config):
        self.config = config

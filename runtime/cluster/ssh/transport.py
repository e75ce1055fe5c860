"""Runtime ssh: hosts named with -H (or anvil.hosts), reached over SSH with Fabric.

A launch starts one agent per host at once, node ranks in host order from the
master (the first host, or the one Options.master names), each agent told its
place on its command line (--nnodes, --node-rank, --master-addr, --master-port)
and given the launch's environment over its SSH session's stdin
(runtime.cluster.ssh.session): values computed from this machine are left for
each node to compute, as under Slurm. Signals reaching inv (Ctrl-C, SIGTERM,
SIGUSR2, ...) are passed on to every node's agent; a dropped connection stops
a node's agent as a Ctrl-C would. When one node fails (or cannot be reached),
the others get SIGTERM and, NODE_GRACE_S later, SIGKILL: the launch ends in
bounded time, with the first failure's status.

each_node runs a command on every host at once (one thread each; ten hosts
take about as long as one): `inv -H a,b TASK` runs `inv TASK` there. A host
that fails or cannot be reached is a HostResult with its error.
"""
from __future__ import annotations

import queue
import random
import shlex
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO, Iterable, Mapping, Sequence

from core import names
from runtime.cluster.results import HostResult, Interrupted, parse_json_output, slurm_name
from runtime.cluster.ssh.session import STOPPED_WAITING, Sessions, check_line, remote_line, remote_python
from runtime.cluster.transport import HOST_VAR, Progress, Transport, Wrap, local_inv, node_env
from runtime.launch.commands import agent_command, launch_env, travelling
from runtime.launch.process import MaskedFile, open_log, passing_signals
from runtime.launch.spec import EXIT_INTERRUPTED, EXIT_REQUEUE, LaunchError, LaunchSpec, Layout, processes_per_node
from core.errors import UserError

NODE_GRACE_S = 30.0        # after one node failed: the others' SIGTERM, then this long until SIGKILL
UNREACHABLE = 255          # a node whose command never ran (ssh's own status for that)


class HostsError(UserError):
    """Bad host input (no hosts, a malformed host list)."""


def parse_hosts(value: str | Iterable[str], default_hosts: Sequence[str] = ()) -> list[str]:
    """'n1,n2' (or '@': anvil.hosts) -> ['n1', 'n2'], each once, in order; HostsError for nothing or a
    name that is not a host's."""
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    hosts = [h.strip() for h in items if h and h.strip()]
    if hosts == ["@"]:
        hosts = list(default_hosts)
        if not hosts:
            raise HostsError("-H @ needs anvil.hosts in invoke.yaml (or INVOKE_ANVIL_HOSTS)")
    if not hosts:
        raise HostsError("no hosts given")
    bad = [h for h in hosts if any(ch.isspace() or not ch.isprintable() for ch in h) or h.startswith("-")]
    if bad:
        raise HostsError(f"not a host name: {', '.join(map(repr, bad))}")
    for host in hosts:
        _check_port(host)
    return list(dict.fromkeys(hosts))


def _check_port(host: str) -> None:
    """user@host:PORT: a port SSH can use (Fabric takes 99999 as it is, and the socket layer then
    connects to another port than the one named)."""
    name = host.rpartition("@")[2]
    if name.count(":") != 1:      # no port, or an IPv6 address (with no port)
        return
    address, _, port = name.partition(":")
    if not address:
        raise HostsError(f"{host!r}: no host name before the port")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise HostsError(f"{host!r}: the port must be a number from 1 to 65535, got {port!r}")


class Ssh(Transport):
    name = via = "ssh"

    def hosts(self) -> list[str]:
        """The hosts a launch runs on, node rank 0 (the master) first, the excluded ones left out."""
        if not self.options.hosts:
            raise HostsError("runtime ssh needs hosts: -H a,b (or anvil.hosts in invoke.yaml)")
        hosts = parse_hosts(self.options.hosts)
        left_out = set(self.options.exclude)
        kept = [h for h in hosts if h not in left_out and slurm_name(h) not in left_out]
        if not kept:
            raise LaunchError(f"every host is excluded: {', '.join(hosts)}")
        master = self.options.master
        if master:
            named = [h for h in kept if master in (h, slurm_name(h))]
            if not named:
                raise LaunchError(f"--master {master}: not one of the hosts ({', '.join(kept)})")
            kept = named[:1] + [h for h in kept if h != named[0]]
        return kept

    def nodes(self, env: Mapping[str, str]) -> list[str]:
        return self.hosts()

    def check(self, env: Mapping[str, str], *, each_node: bool = False) -> None:
        """The hosts are named, and before a launch every one answers (a host that does not is one line
        naming it, exit 2); each_node reports such a host in its results instead."""
        hosts = self.hosts()
        check_line(self.options.ssh)
        if each_node:
            return
        unreachable = Sessions(self.options.ssh).reach(hosts)
        if unreachable:
            raise LaunchError("cannot reach " + "; ".join(f"{host} ({why})" for host, why in unreachable.items())
                              + ": nothing was started (--exclude HOST leaves a host out)")

    def where(self, env: Mapping[str, str]) -> str:
        hosts = self.hosts()
        return f"{len(hosts)} host(s): {', '.join(hosts)}"

    def inv(self) -> str:
        return self.options.ssh.remote_inv or local_inv()

    def python(self) -> str:
        return remote_python(self.options.ssh)

    def layout(self, spec: LaunchSpec, env: Mapping[str, str]) -> Layout:
        check_line(self.options.ssh)
        return Layout(processes_per_node(spec, env), len(self.hosts()))

    # ---- a launch: one agent per host
    def launch(self, spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None, *,
               wrap: Wrap | None = None, nodes: Sequence[str] | None = None, log_name: str = names.LAUNCHER_LOG,
               dry_run: bool = False, masker=None, stdout: IO | None = None, stderr: IO | None = None,
               timeout: float | None = None) -> int:
        hosts = list(nodes) if nodes else self.hosts()
        nproc = processes_per_node(spec, env)
        port = spec.master_port or random.randrange(20000, 40000)
        child_env = launch_env(spec, env, run_dir, spans_nodes=True)
        sent = {name: child_env[name] for name in travelling(child_env)}
        python = spec.python or remote_python(self.options.ssh)
        commands = {}
        for rank, host in enumerate(hosts):
            layout = ["--nnodes", str(len(hosts)), "--node-rank", str(rank), "--master-addr", slurm_name(hosts[0]),
                      "--master-port", str(port)]
            commands[host] = ((wrap(list(sent)) if wrap else [])
                              + agent_command(spec, nproc, python, run_dir, layout=layout))
        out, err = stdout or sys.stdout, stderr or sys.stderr
        if dry_run:
            for host, command in commands.items():
                print(f"{host}: {remote_line(self.options.ssh, command)}", file=out)
            return 0
        log_path = open_log(run_dir, log_name)
        log = MaskedFile(open(log_path, "a", encoding="utf-8"), masker) if log_path else None
        try:
            if log:
                for host, command in commands.items():
                    shown = masker.argv(command) if masker is not None else command
                    log.write(f"$ {host}: {shlex.join(shown)}\n")
            lock = threading.Lock()
            return _Launch(self.options.ssh, hosts, commands, sent, timeout, launcher=not wrap,
                           out=_Lines(out, log, lock), err=_Lines(err, log, lock)).run()
        finally:
            if log:
                log.close()

    # ---- a command on every host
    def each_node(self, command: list[str], env: Mapping[str, str] | None = None, *,
                  hosts_dir: Path | None = None, timeout: float | None = None, progress: Progress | None = None,
                  nodes: Sequence[str] | None = None) -> list[HostResult]:
        """Ctrl-C stops the command on every host and waits for them to end (results.Interrupted carries
        what each ended with); a second Ctrl-C stops waiting."""
        hosts = list(nodes) if nodes else self.hosts()
        limit = timeout or self.options.command_timeout or 0.0
        sessions = Sessions(self.options.ssh)

        def one(rank: int, host: str) -> HostResult:
            started = time.monotonic()
            code, stdout, stderr, error = sessions.run(host, command, node_env(env, host, rank, len(hosts), hosts_dir),
                                                       timeout=limit)
            if error is None and limit and code == 124:
                error = f"command timed out after {limit:g} s"
            result = HostResult(host, exit_code=code if error is None else None, stdout=stdout, stderr=stderr,
                                error=error, payload=parse_json_output(stdout) if error is None else None,
                                interrupted=sessions.asked.is_set())
            result.seconds = round(time.monotonic() - started, 2)
            return result

        pool = ThreadPoolExecutor(max_workers=max(1, len(hosts)))
        try:
            futures = {pool.submit(one, rank, host): host for rank, host in enumerate(hosts)}
            if progress:
                for future in futures:
                    future.add_done_callback(lambda f: f.cancelled() or progress(f.result()))
            try:
                wait(futures)
            except KeyboardInterrupt:
                sessions.stop()
                print(f"interrupted: stopping the task on {len(hosts)} host(s) (Ctrl-C again to stop waiting)",
                      file=sys.stderr, flush=True)
                try:
                    wait(futures)
                except KeyboardInterrupt:
                    sessions.abandon()
                    wait(futures, timeout=self.options.ssh.connect_timeout + 5)
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


class _Lines:
    """Output of many hosts' sessions, written whole lines at a time to the console and the log."""

    def __init__(self, console: IO, log, lock: threading.Lock):
        self.console, self.log, self.lock = console, log, lock
        self.partial = ""

    def write(self, text: str) -> None:
        with self.lock:
            self.partial += text
            if "\n" not in self.partial:
                return
            whole, _, self.partial = self.partial.rpartition("\n")
            for sink in filter(None, (self.console, self.log)):
                try:
                    sink.write(whole + "\n")
                    sink.flush()
                except (OSError, ValueError):
                    pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """What came after the last newline."""
        if self.partial:
            self.write("\n")


class _Launch:
    """One agent per host, watched from here until every one has ended."""

    def __init__(self, options, hosts: list[str], commands: dict[str, list[str]], env: dict[str, str],
                 timeout: float | None, launcher: bool, out: _Lines, err: _Lines):
        self.hosts, self.commands, self.env, self.timeout = hosts, commands, env, timeout or 0.0
        self.launcher, self.out, self.err = launcher, out, err
        self.sessions = Sessions(options)
        self.ended: queue.Queue = queue.Queue()
        self.lost: dict[str, str] = {}         # hosts whose agent ended without a status of its own

    def _run(self, rank: int, host: str) -> None:
        # the host as -H named it: hosts that share a host name are told apart in its ranks' logs and records
        env = {**self.env, HOST_VAR: host}
        code, _out, _err, error = self.sessions.run(host, self.commands[host], env, timeout=self.timeout,
                                                    launcher=self.launcher, out=self.out, err=self.err)
        if error is not None or code is None or code < 0:
            self.lost[host] = f"anvil: node {rank} ({host}): {error or 'the connection ended without a status'}"
            self.err.write(self.lost[host] + "\n")
            code = UNREACHABLE
        self.ended.put((rank, host, code))

    def run(self) -> int:
        threads = [threading.Thread(target=self._run, args=(rank, host), daemon=True)
                   for rank, host in enumerate(self.hosts)]
        for thread in threads:
            thread.start()
        codes: dict[str, int] = {}
        failure: tuple[str, int] | None = None
        kill_at = abandon_at = None
        with passing_signals(self.sessions.signal):
            while len(codes) < len(self.hosts):
                try:
                    rank, host, code = self.ended.get(timeout=0.2)
                except queue.Empty:
                    now = time.monotonic()
                    if kill_at is not None and now >= kill_at:
                        self.sessions.signal(signal.SIGKILL, [h for h in self.hosts if h not in codes])
                        kill_at, abandon_at = None, now + NODE_GRACE_S
                    elif abandon_at is not None and now >= abandon_at:
                        self.sessions.abandon()
                        abandon_at = None
                    continue
                codes[host] = code
                if code not in (0, EXIT_REQUEUE, EXIT_INTERRUPTED) and failure is None:
                    failure = (host, code)
                    others = [h for h in self.hosts if h not in codes]
                    if others:
                        self.err.write(f"anvil: node {rank} ({host}) exited with status {code}; stopping the "
                                       f"other {len(others)} node(s)\n")
                        self.sessions.signal(signal.SIGTERM, others)
                        kill_at = time.monotonic() + NODE_GRACE_S
        for thread in threads:
            thread.join(timeout=5)
        self.out.close()
        if failure is not None and failure[0] in self.lost:    # the last word: which node was lost (its agent
            self.err.write(self.lost[failure[0]] + "\n")      # wrote no report to say it)
        self.err.close()
        if failure is not None:
            return failure[1]
        return EXIT_INTERRUPTED if EXIT_INTERRUPTED in codes.values() else \
            EXIT_REQUEUE if EXIT_REQUEUE in codes.values() else 0

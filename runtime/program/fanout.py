"""`inv -H a,b,c TASK ARGS`: run TASK on every host at once and merge the results.

Each host runs ``cd <remote_path> && ANVIL_HOST=<host> <remote_inv> TASK ARGS
[--json]`` over SSH (Fabric Connections, one thread per host, so ten hosts
take about as long as one). The remote `inv` runs the task with its own pre
and post tasks and hooks, exactly as it would locally. `--json` is added when
the task has a ``json`` option; output shaped like
``{"checks": [{"name", "status", "value", "reason", "fix"}, ...]}`` is merged
into one table (check by check, host by host, values that differ between hosts
marked); anything else is shown per host with its exit status. Hosts that
fail or cannot be reached are reported with their error while the others
finish. The exit status is 1 if any host failed.

Settings (invoke.yaml `anvil:`; -i / -t / -S on the command line win):
user, key_filename, remote_path (default: this checkout's path, i.e. a shared
file system), remote_inv (default: the same inv path as here), connect_timeout,
command_timeout.

Python API (used by tests and other tasks):
    results = run_on_hosts(hosts, ["preflight.all"], options)    # -> list[HostResult]
    report = merge(results);  print(render(report))
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tabulate import tabulate

from runtime import settings as settings_mod
from trainer.errors import UserError

STATUSES = ("PASS", "WARN", "FAIL")
DIFFERS = "≠"


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


@dataclass
class HostResult:
    host: str
    exit_code: int | None = None         # None: never ran (unreachable / SSH error)
    stdout: str = ""
    stderr: str = ""
    error: str | None = None             # connection / SSH error text
    payload: Any = None                  # parsed JSON output, if any
    seconds: float = 0.0

    @property
    def reachable(self) -> bool:
        return self.error is None

    @property
    def failed_checks(self) -> list[str]:
        return [c.get("name", "?") for c in checks_of(self.payload) if c.get("status") == "FAIL"]

    @property
    def ok(self) -> bool:
        return self.reachable and self.exit_code == 0 and not self.failed_checks


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


def slurm_name(host: str) -> str:
    """node1 from user@node1:22 (what srun --exclude wants)."""
    host = host.rsplit("@", 1)[-1]
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def remote_command(host: str, argv: list[str], options: FanoutOptions) -> str:
    """The shell line run on one host; every piece quoted."""
    inv = [options.remote_inv or local_inv()]
    if options.runtime_config:
        inv += ["-f", options.runtime_config]
    return (f"cd {shlex.quote(options.remote_path)} && ANVIL_HOST={shlex.quote(host)} "
            f"{shlex.join(inv + list(argv))}")


def parse_json_output(text: str) -> Any:
    """The JSON document a task printed (whole stdout, else from its last '{' line)."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    lines = text.splitlines()
    for i in range(len(lines)):
        if lines[i].startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
    return None


def _connect_kwargs(options: FanoutOptions) -> dict:
    kwargs: dict = {}
    if options.key_filename:
        kwargs["key_filename"] = list(options.key_filename)
    if options.password:
        kwargs["password"] = options.password
    if options.passphrase:
        kwargs["passphrase"] = options.passphrase
    return kwargs


def _run_one(host: str, argv: list[str], options: FanoutOptions, config) -> HostResult:
    from fabric import Connection
    started = time.monotonic()
    result = HostResult(host)
    connection = None
    try:
        connection = Connection(host, user=options.user or None, config=config,
                                connect_timeout=options.connect_timeout,
                                connect_kwargs=_connect_kwargs(options))
        ran = connection.run(remote_command(host, argv, options), hide=True, warn=True, in_stream=False,
                             timeout=options.command_timeout or None)
        result.exit_code, result.stdout, result.stderr = ran.exited, ran.stdout, ran.stderr
        result.payload = parse_json_output(ran.stdout)
    except Exception as exc:  # noqa: BLE001 - any SSH trouble is this host's result, not a crash
        result.error = _describe(exc)
    finally:
        if connection is not None:
            try:
                connection.close()
            except Exception:  # noqa: BLE001
                pass
    result.seconds = round(time.monotonic() - started, 2)
    return result


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    name = type(exc).__name__
    if name == "CommandTimedOut":
        return f"command timed out after {getattr(exc, 'timeout', '?')} s"
    if name in ("NoValidConnectionsError", "TimeoutError", "timeout", "socket.timeout") or "timed out" in text:
        return f"unreachable: {text}"
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


def run_on_hosts(hosts: list[str], argv: list[str], options: FanoutOptions,
                 config=None, progress=None) -> list[HostResult]:
    """Run `inv ARGV` on every host concurrently; results in host order."""
    _quiet_paramiko()
    if config is None:
        config = fabric_config(ssh_config=options.ssh_config)
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        futures = {pool.submit(_run_one, host, argv, options, config): host for host in hosts}
        for future in futures:
            if progress:
                future.add_done_callback(lambda f: progress(f.result()))
        results = {futures[f]: f.result() for f in futures}
    return [results[h] for h in hosts]


# -- merging -----------------------------------------------------------------

def checks_of(payload: Any) -> list[dict]:
    if isinstance(payload, dict) and isinstance(payload.get("checks"), list):
        return [c for c in payload["checks"] if isinstance(c, dict)]
    return []


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


@dataclass
class MergedReport:
    hosts: list[str]
    results: dict[str, HostResult]
    checks: list[dict]        # [{"name", "rows": {host: check}, "differs": bool}]
    passing: list[str]
    failing: list[str]

    def to_json(self) -> dict:
        return {
            "hosts": {h: {"ok": r.ok, "exit_code": r.exit_code, "error": r.error, "seconds": r.seconds,
                          "failed_checks": r.failed_checks, "output": r.payload if r.payload is not None
                          else r.stdout}
                      for h, r in self.results.items()},
            "checks": [{"name": c["name"], "differs": c["differs"],
                        "hosts": {h: c["rows"].get(h) for h in self.hosts}} for c in self.checks],
            "passing": self.passing, "failing": self.failing,
        }


def merge(results: list[HostResult]) -> MergedReport:
    hosts = [r.host for r in results]
    by_host = {r.host: r for r in results}
    order: list[str] = []
    rows: dict[str, dict[str, dict]] = {}
    for r in results:
        for check in checks_of(r.payload):
            name = str(check.get("name", "?"))
            if name not in rows:
                rows[name] = {}
                order.append(name)
            rows[name][r.host] = check
    merged = []
    for name in order:
        values = {_cell(c.get("value")) for c in rows[name].values()}
        merged.append({"name": name, "rows": rows[name], "differs": len(values) > 1})
    passing = [h for h in hosts if by_host[h].ok]
    failing = [h for h in hosts if not by_host[h].ok]
    return MergedReport(hosts, by_host, merged, passing, failing)


def error_line(stderr: str, task: str = "") -> str:
    """The line that says what went wrong: a run's failure message names its task
    ("preflight.all failed: ...") and is followed by the run directory, so the last
    line alone would hide it."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if task and line.startswith(f"{task} "):
            return line
    return lines[-1] if lines else ""


def _short(text: str, width: int = 70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def host_status(r: HostResult) -> str:
    if not r.reachable:
        return "UNREACHABLE" if r.error.startswith("unreachable") else "ERROR"
    if r.failed_checks:
        return "FAIL"
    if r.exit_code != 0:
        return f"FAIL (exit {r.exit_code})"
    statuses = {c.get("status") for c in checks_of(r.payload)}
    return "WARN" if "WARN" in statuses else "PASS" if statuses else "OK"


def render(report: MergedReport, task: str = "") -> str:
    out: list[str] = []
    if report.checks:
        table = []
        for check in report.checks:
            first = True
            for host in report.hosts:
                c = check["rows"].get(host)
                if c is None:
                    if report.results[host].reachable:
                        table.append([check["name"] if first else "", host, "-", "(not reported)", ""])
                        first = False
                    continue
                value = _short(_cell(c.get("value")), 40)
                if check["differs"]:
                    value = f"{DIFFERS} {value}"
                note = c.get("reason") or ""
                if c.get("status") in ("WARN", "FAIL") and c.get("fix"):
                    note = f"{note} | fix: {c['fix']}" if note else f"fix: {c['fix']}"
                table.append([check["name"] if first else "", host, c.get("status", "?"), value, _short(note)])
                first = False
        out.append(tabulate(table, headers=["check", "host", "status", "value", "reason / fix"]))
        if any(c["differs"] for c in report.checks):
            out.append(f"{DIFFERS} = value differs between hosts")
        out.append("")
    else:
        for host in report.hosts:
            r = report.results[host]
            if not r.reachable:
                continue
            out.append(f"=== {host} (exit {r.exit_code}) ===")
            text = (r.stdout.rstrip() + ("\n" + r.stderr.rstrip() if r.exit_code and r.stderr.strip() else "")).strip()
            out.append(text or "(no output)")
            out.append("")
    summary = []
    for host in report.hosts:
        r = report.results[host]
        detail = r.error or (", ".join(r.failed_checks) and f"failed: {', '.join(r.failed_checks)}")
        if not detail and r.exit_code:
            detail = _short(error_line(r.stderr, task), 90)
        summary.append([host, host_status(r), f"{r.seconds:.1f}", _short(detail or "", 90)])
    out.append(tabulate(summary, headers=["host", "result", "seconds", "detail"]))
    out.append("")
    out.append(f"passing hosts: {','.join(report.passing) or '(none)'}")
    out.append(f"failing hosts: {','.join(report.failing) or '(none)'}")
    if report.failing:
        out.append(f"exclude them:  srun --exclude={','.join(slurm_name(h) for h in report.failing)} ...")
    return "\n".join(out)


# -- the CLI side (called by runtime.program.cli.AnvilExecutor) -------------------------

def task_argv(context) -> list[str]:
    """Rebuild `TASK --opt value ...` from a parsed task context (only options given)."""
    argv = [context.name]
    seen = set()
    for arg in context.args.values():
        if id(arg) in seen or not arg.got_value:
            continue
        seen.add(id(arg))
        flag = "--" + arg.name.replace("_", "-")
        value = arg.value
        if arg.kind is bool:
            argv.append(flag if value else f"--no-{arg.name.replace('_', '-')}")
        elif arg.kind is list:
            for item in value:
                argv += [flag, str(item)]
        elif arg.incrementable:
            argv += [flag] * int(value or 0)
        elif arg.optional and value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


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


def run_cli(collection, config, core, contexts) -> int:
    """Fan the requested tasks out; print merged results; return the exit status."""
    try:
        settings = settings_mod.load(_ConfigHolder(config))
        hosts = parse_hosts(core[0].args.hosts.value, settings.hosts)
        options = options_from(config, core)
    except (FanoutError, settings_mod.SettingsError) as exc:
        print(f"-H: {exc}", file=sys.stderr)
        return 2
    fab_config = fabric_config(options.ssh_config)
    code = 0
    for context in contexts:
        argv = task_argv(context)
        wants_json = context.args["json"].value if "json" in context.args else False
        if "json" in context.args and not wants_json:
            argv.append("--json")
        print(f"{context.name} on {len(hosts)} host(s): {', '.join(hosts)}", file=sys.stderr)
        results = run_on_hosts(hosts, argv, options, fab_config,
                               progress=lambda r: print(f"  {r.host}: {host_status(r)} ({r.seconds:.1f} s)",
                                                        file=sys.stderr, flush=True))
        report = merge(results)
        if wants_json:
            print(json.dumps({"task": context.name, **report.to_json()}, indent=2, default=str))
        else:
            print(render(report, context.name))
        if report.failing:
            code = 1
            break   # like Invoke: a failing task stops the ones after it
    return code

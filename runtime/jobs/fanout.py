"""Fanned-out tasks: run one task on many nodes at once, merge the results into one report.

Two ways to name the nodes, one report:
    inv -H a,b,c TASK ARGS                 the hosts, over SSH; any task
    inv TASK ARGS --runtime slurm          every node of a runtime that spans nodes (slurm: the
                                           allocation's; ssh: anvil.hosts); tasks marked per_node
Each node runs the same `inv TASK` locally (with --json where the task has
it), through the runtime's transport (runtime.cluster: Transport.each_node). Output shaped as checks or measurements (runtime.cluster.results) is
merged into one table, row by row and host by host: values that differ
between hosts are marked, and each measurement is shown as a share of the
hosts' median (under 90%: WARN, a straggler). Anything else is shown per
host with its exit status. Hosts that fail or cannot be reached are reported
with their error while the others finish; the exit status is 1 if any host
failed.

Each fan-out is a run of its own on this machine (runs/<time>_<task>/):
    report.json, report.txt     the merged report as JSON and as printed
    hosts/<host>.json           each host's exit status, output and error
    hosts/<host>/<run>/         each node's own run directory (on a shared file system)
    nodes/pass.txt, fail.txt, fail.json    the node lists (runtime.runs.nodes),
                                what `inv train.pretrain --exclude-from RUN` reads
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from core import names
from runtime import settings as settings_mod
from runtime.cluster import Runtime, Transport
from runtime.cluster.results import HostResult, Interrupted, checks_of, error_line, slurm_name
from runtime.runs.nodes import node_lists_footer
from runtime.settings import NODE_RUNTIME_VAR
from core.errors import UserError

STATUSES = ("PASS", "WARN", "FAIL")
DIFFERS = "≠"
SLOW_SHARE = 0.9      # a measurement under 90% of the hosts' median marks a straggler
NOTE_WIDTH = 64       # the reason / fix column wraps here
VALUE_WIDTH = 40      # and the value column here


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
        if all("measured" in c for c in rows[name].values()):
            rows[name] = _against_median(rows[name])
            merged.append({"name": name, "rows": rows[name], "differs": False})
            continue
        values = {_cell(c.get("value")) for c in rows[name].values()}
        merged.append({"name": name, "rows": rows[name], "differs": len(values) > 1})
    passing = [h for h in hosts if by_host[h].ok]
    failing = [h for h in hosts if not by_host[h].ok]
    return MergedReport(hosts, by_host, merged, passing, failing)


def _against_median(rows: dict[str, dict]) -> dict[str, dict]:
    """Each host's measurement as a share of the hosts' median; under SLOW_SHARE of it is a WARN.

    Two hosts have no majority to say which one is off: each is shown against
    the better one, without a verdict."""
    if len(rows) < 2:
        return rows
    values = [c["measured"] for c in rows.values()]
    judge = len(rows) >= 3
    base = statistics.median(values) if judge else max(values)
    out = {}
    for host, c in rows.items():
        share = c["measured"] / base if base else 1.0
        slow = judge and share < SLOW_SHARE
        of = f"the median of {len(rows)} hosts" if judge else "the better host"
        out[host] = {**c, "status": "WARN" if slow else c.get("status", "PASS"),
                     "reason": f"{share:.0%} of {of}" + (" (slow)" if slow else ""),
                     "fix": "screen this node (inv preflight.all) before training on it" if slow else None}
    return out


def _short(text: str, width: int = 70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def host_status(r: HostResult) -> str:
    if r.interrupted and not r.ok:
        return "INTERRUPTED"
    if not r.reachable:
        return "UNREACHABLE" if r.error.startswith("unreachable") else "ERROR"
    if r.failed_checks:
        return "FAIL"
    if r.exit_code != 0:
        return f"FAIL (exit {r.exit_code})"
    statuses = {c.get("status") for c in checks_of(r.payload)}
    return "WARN" if "WARN" in statuses else "PASS" if statuses else "OK"


def host_table(results: list[HostResult], task: str = "") -> str:
    """One row per host: its result, seconds and what went wrong."""
    rows = []
    for r in results:
        detail = r.error or (", ".join(r.failed_checks) and f"failed: {', '.join(r.failed_checks)}")
        if not detail and r.exit_code:
            detail = error_line(r.stderr, task)
        rows.append([r.host, host_status(r), f"{r.seconds:.1f}", _short(detail or "", 90)])
    return tabulate(rows, headers=["host", "result", "seconds", "detail"])


def render(report: MergedReport, task: str = "", run_dir: Path | str | None = None) -> str:
    out: list[str] = []
    if report.checks:
        table = []
        for check in report.checks:
            first, previous_note = True, None
            for host in report.hosts:
                c = check["rows"].get(host)
                if c is None:
                    if report.results[host].reachable:
                        table.append([check["name"] if first else "", host, "-", "(not reported)", ""])
                        first = False
                    continue
                value = _cell(c.get("value"))
                if check["differs"]:
                    value = f"{DIFFERS} {value}"
                note = " ".join(str(c.get("reason") or "").split())
                if c.get("status") in ("WARN", "FAIL") and c.get("fix"):
                    note = f"{note} | fix: {c['fix']}" if note else f"fix: {c['fix']}"
                shown = "(as above)" if note and note == previous_note else note
                table.append([check["name"] if first else "", host, c.get("status", "?"), value, shown])
                first, previous_note = False, note
        # The value, the reason and its fix are wrapped, not cut: the fix is what the reader came for.
        out.append(tabulate(table, headers=["check", "host", "status", "value", "reason / fix"],
                            maxcolwidths=[None, None, None, VALUE_WIDTH, NOTE_WIDTH]))
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
    out.append(host_table([report.results[h] for h in report.hosts], task))
    out.append("")
    out += node_lists_footer(report.passing, report.failing, run_dir)
    return "\n".join(out)


def task_argv(context, skip: tuple[str, ...] = ()) -> list[str]:
    """Rebuild `TASK --opt value ...` from a parsed task context (only options given, less `skip`)."""
    argv = [context.name]
    seen = set()
    for arg in context.args.values():
        if id(arg) in seen or not arg.got_value or arg.name in skip:
            continue
        seen.add(id(arg))
        # names[0] is the flag as typed (`set_` -> "set", `exclude_from` -> "exclude-from"); arg.name
        # is the Python name.
        long = arg.names[0]
        flag = ("-" if len(long) == 1 else "--") + long
        value = arg.value
        if arg.kind is bool:
            argv.append(flag if value else f"--no-{long}")
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


def per_node_options(context) -> tuple[str, int]:
    """(--runtime, --nodes) given to a per-node task ("" / 0 when not given)."""
    def value(name):
        return context.args[name].value if name in context.args else None
    return value("runtime") or "", int(value("nodes") or 0)


# -- the CLI side (called by runtime.program.cli.AnvilExecutor) ------------------------

def refused_input(results: list[HostResult]) -> str | None:
    """The error line when every host ran the task and exited 2 (a user error: the input, not the host)."""
    if not results or any(not r.reachable or r.exit_code != 2 for r in results):
        return None
    return error_line(results[0].stderr) or "the task refused its input (exit 2)"


def fan_out(config, context, transport: Transport, node_runtime: Runtime, config_file: str | None = None,
            skip: tuple[str, ...] = ()) -> int:
    """Run one task on every node of `transport`, record it as a run, print the merged report; exit
    status. node_runtime: how each node runs its part; config_file: inv's -f FILE, which each node's
    inv reads too (a shared file system); skip: the task's options the transport itself took."""
    from runtime.runs import nodes as nodes_mod
    from runtime.runs import run as run_mod

    argv = task_argv(context, skip=skip)
    wants_json = context.args["json"].value if "json" in context.args else False
    if "json" in context.args and not wants_json:
        argv.append("--json")
    command = [transport.inv(), *(["-f", str(Path(config_file).resolve())] if config_file else []), *argv]
    run = run_mod.create(_ConfigHolder(config), run_mod.RunSpec(task=context.name, hooks=False,
                                                                extra={"fanout": transport.via}))
    where = transport.where(os.environ)
    print(f"{context.name} on {where} (over {transport.via})", file=sys.stderr, flush=True)   # after "run directory"

    def progress(r: HostResult) -> None:
        print(f"  {r.host}: {host_status(r)} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)

    try:
        results = transport.each_node(command, {NODE_RUNTIME_VAR: str(node_runtime)}, hosts_dir=run.path / names.HOSTS_DIR,
                                      progress=progress)
    except Interrupted as stop:
        return _interrupted(run, context.name, stop.results, stop.__context__)
    except BaseException as exc:
        status, error, code = run_mod.ended_by(exc)
        run_mod.finish(run, status, error=error, exit_code=code)
        raise
    refused = refused_input(results)
    if refused:
        # Every host refused the same input (exit 2: a typo, a missing file): one line, and no node
        # is written down as failing for it (nodes/fail.json feeds --exclude-from).
        run_mod.finish(run, "failed", error=refused, exit_code=2)
        print(f"{context.name}: {refused} (every host refused the input; run directory {run.path})",
              file=sys.stderr, flush=True)
        return 2
    report = merge(results)
    _write_hosts(run, results)
    failing = {slurm_name(h): report.results[h].failure_reasons(context.name) for h in report.failing}
    nodes_mod.write(run.path, [slurm_name(h) for h in report.passing], failing)
    document = {"task": context.name, "run_dir": str(run.path), **report.to_json()}
    run.write_json(names.FANOUT_REPORT, document)
    text = render(report, context.name, run.path)
    run.write_text(names.FANOUT_TEXT, text + "\n")
    print(json.dumps(document, indent=2, default=str) if wants_json else text)
    run.update_metadata(hosts=report.hosts, passing=report.passing, failing=report.failing)
    if report.failing:
        run_mod.finish(run, "failed", error=f"{len(report.failing)} of {len(report.hosts)} host(s) failed: "
                       + ", ".join(report.failing), exit_code=1, result=document)
        return 1
    run_mod.finish(run, "ok", result=document)
    return 0


def _write_hosts(run, results: list[HostResult]) -> None:
    for r in results:
        run.write_json(Path("hosts") / f"{r.host}.json",
                       {"host": r.host, "exit_code": r.exit_code, "error": r.error, "seconds": r.seconds,
                        "interrupted": r.interrupted, "stdout": r.stdout, "stderr": r.stderr})


def _interrupted(run, task: str, results: list[HostResult], cause: BaseException | None = None) -> int:
    """Ctrl-C (or a stop signal: `cause`, what the transport caught): how each host ended is recorded
    and shown; no node is listed as passing or failing (nodes/fail.json feeds --exclude-from, and a
    stopped node did not fail)."""
    from runtime.runs import run as run_mod
    from core.signals import interrupted_by

    what, code = interrupted_by(cause if isinstance(cause, KeyboardInterrupt) else KeyboardInterrupt())

    _write_hosts(run, results)
    text = host_table(results, task) if results else "no node had started the task"
    run.write_text(names.FANOUT_TEXT, text + "\n")
    print(text, file=sys.stderr)
    print(f"{task}: interrupted; run directory {run.path}", file=sys.stderr, flush=True)
    run_mod.finish(run, "interrupted", error=f"interrupted ({what})", exit_code=code)
    return code


def over_hosts(config, context, hosts: str, config_file: str | None = None) -> int:
    """`inv -H a,b TASK`: TASK on every host over SSH (a task that reaches the hosts itself takes -H as
    its input instead: runtime.program.cli). A shared anvil.runtime of slurm is for this machine: each
    host runs its part itself (slurm+container: in the container)."""
    from runtime.cluster.ssh import HostsError, parse_hosts

    try:
        settings = settings_mod.load(_ConfigHolder(config))
        hosts_list = parse_hosts(hosts, settings.hosts)
        _no_scheduler_options(context)
        transport = Runtime("ssh").open(settings.cluster_options(hosts=hosts_list))
        transport.check(os.environ, each_node=True)    # what goes on the SSH line, before a run directory
    except (HostsError, UserError) as exc:
        print(f"-H: {exc}", file=sys.stderr)
        return 2
    return fan_out(config, context, transport, settings.runtime.on_node(), config_file)


def _no_scheduler_options(context) -> None:
    """-H names the hosts; --runtime slurm and --nodes would have Slurm choose them: one or the other."""
    runtime, nodes = per_node_options(context)
    scheduled = bool(runtime) and Runtime.parse(runtime).scheduler
    if scheduled or nodes:
        flag, value = ("--runtime", runtime) if scheduled else ("--nodes", nodes)
        raise UserError(f"{context.name} {flag} {value}: -H already says where it runs (over SSH, on the hosts "
                        f"named); drop -H to run it on Slurm's nodes, or {flag} to run it on the hosts")


def on_nodes(config, context, runtime: Runtime, config_file: str | None = None) -> int:
    """`inv TASK --runtime slurm` for a per-node task: TASK once on every node of the runtime (the
    allocation's, or --nodes of them; ssh: anvil.hosts). Each node runs its part directly."""
    import dataclasses

    settings = settings_mod.load(_ConfigHolder(config))
    _given, nodes = per_node_options(context)
    slurm = dataclasses.replace(settings.slurm_options(), job_name=f"anvil-{context.name}")
    transport = runtime.open(settings.cluster_options(nodes=nodes, slurm=slurm))
    transport.check(os.environ, each_node=True)        # before a run directory is made
    return fan_out(config, context, transport, Runtime("direct"), config_file, skip=("runtime", "nodes"))


class _ConfigHolder:
    """What settings.load and run.create read from a task context: `.config`."""

    def __init__(self, config):
        self.config = config

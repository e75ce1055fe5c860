"""What happened on every node of a launch, read back from the run directory.

Each node's agent (runtime.launch.agent) writes logs/agent-<node rank>.json:
its host, ranks, exit statuses and first failure. From those and the ranks'
logs this module answers the runner's questions: on which hosts did the run
run, how many ranks, and - when it failed - which rank on which host failed
first, and with what message (the rank log's last error line), so the user
reads one line instead of every rank's traceback.

A rank that trainer.health's watchdog ended as hung (exit 4) leaves
logs/hang-rank<R>.json. With those the line names the rank that stopped
first - the one that issued the fewest collectives (the others wait for it),
then the one whose last step is oldest - and where it stopped; a rank that
wrote no report while the others wait for it in a collective (stopped, or
stuck where Python cannot run) is named as the likely cause.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from core import names

#: Seconds apart that two nodes' first failures count as one event (the agents look every 50 ms; a peer's
#: failure on its closed connection takes milliseconds; the agents' grace before SIGKILL is seconds).
TOGETHER_S = 1.0
# A rank log line: "[time][host rR/lL][LEVEL] message"
_LOG_LINE = re.compile(r"^\[[^\]]*\]\[(?P<host>\S+) r(?P<rank>\d+)/l\d+\]\[(?P<level>[A-Z]+)\] (?P<msg>.*)$")


@dataclass
class NodeReport:
    host: str
    node_rank: int
    exit_code: int
    ranks: dict[int, int]
    first_failure: dict | None
    signal: str | None
    end: float = 0.0
    start: float = 0.0
    restart: int = 0            # SLURM_RESTART_COUNT of the job attempt that wrote it
    program: dict = field(default_factory=dict)   # train.launch: its backend, metric lines, what it resumed from


@dataclass
class Outcome:
    nodes: list[NodeReport] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in sorted(self.nodes, key=lambda n: n.node_rank)]

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    def stop_status(self, restart: int | None = None) -> int:
        """3 (checkpointed, requeue me) or 130 (Ctrl-C) when every node of the attempt stopped
        cleanly that way, else 0. Under srun an agent ends a clean stop with 0 (see
        runtime.cluster.slurm.step), so this is where inv and the batch script find it."""
        from core.signals import EXIT_INTERRUPTED, EXIT_REQUEUE

        nodes = [n for n in self.nodes if restart is None or n.restart == restart]
        codes = {n.exit_code for n in nodes}
        if not nodes or any(n.first_failure for n in nodes) or not codes <= {0, EXIT_REQUEUE, EXIT_INTERRUPTED}:
            return 0
        return EXIT_INTERRUPTED if EXIT_INTERRUPTED in codes else EXIT_REQUEUE if EXIT_REQUEUE in codes else 0

    def first_failure(self) -> dict | None:
        """The earliest node's first failure; but a rank SIGKILL ended within TOGETHER_S of it is the cause
        (core.signals.killed_outright): its peers on other nodes fail on their connection to it, and their
        agent may see that before its own agent looks."""
        from core.signals import killed_outright

        failures = [n.first_failure for n in self.nodes if n.first_failure]
        if not failures:
            return None
        earliest = min(f.get("time", 0) for f in failures)
        killed = [f for f in failures
                  if killed_outright(f.get("exit_code")) and f.get("time", 0) - earliest <= TOGETHER_S]
        return min(killed or failures, key=lambda f: f.get("time", 0))


def read(run_dir: Path) -> Outcome:
    out = Outcome()
    for path in sorted(Path(run_dir).glob("logs/agent-*.json")):
        try:
            rec = json.loads(path.read_text())
            out.nodes.append(NodeReport(host=str(rec["host"]), node_rank=int(rec["node_rank"]),
                                        exit_code=int(rec["exit_code"]),
                                        ranks={int(k): int(v) for k, v in rec.get("ranks", {}).items()},
                                        first_failure=rec.get("first_failure"), signal=rec.get("signal"),
                                        end=float(rec.get("end") or 0), start=float(rec.get("start") or 0),
                                        restart=int(rec.get("restart_count") or 0),
                                        program=rec["program"] if isinstance(rec.get("program"), dict) else {}))
        except (OSError, ValueError, KeyError, TypeError):
            continue   # a node killed mid-write leaves nothing readable: reported as missing
    return out


def stop_status(run_dir: Path, restart: int | None = None) -> int:
    """Outcome.stop_status of the run directory's reports."""
    return read(run_dir).stop_status(restart)


def main(argv: list[str] | None = None) -> int:
    """python -m runtime.runs.outcome RUN_DIR [--restart N]: exit with the attempt's stop status."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m runtime.runs.outcome", description=main.__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--restart", type=int, default=None)
    args = parser.parse_args(argv)
    return stop_status(Path(args.run_dir), args.restart)


def rank_error(run_dir: Path, rank: int) -> str | None:
    """The last ERROR/CRITICAL message of a rank's log (its first line), if any."""
    path = Path(run_dir) / names.LOGS_DIR / names.rank_log(rank)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        match = _LOG_LINE.match(line)
        if match and match.group("level") in ("ERROR", "CRITICAL"):
            return match.group("msg").strip()
    return None


# A Python exception's last line ("ValueError: bad key"), or a logger's error line ("... - ERROR - message").
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)|AssertionError)(?::\s|$)")
_LOGGED_ERROR = re.compile(r"\b(?:ERROR|CRITICAL|FATAL)\b\s*[-:|]\s*(.+)$")
# A line of another trainer's output in its rank log (runtime.launch.output): "[time][host rR/lL][ERR] text"
_PROGRAM_LINE = re.compile(r"^\[[^\]]*\]\[\S+ r\d+/l\d+\]\[(OUT|ERR)\] ?(.*)$")


def program_error(run_dir: Path, rank: int, last_words: bool = True) -> str | None:
    """Another trainer's own error in its rank log (train.launch): its exception's last line, else its last
    error log line, else (`last_words`: it exited with a status of its own, not by a signal) the last line
    it wrote on stderr."""
    path = Path(run_dir) / names.LOGS_DIR / names.rank_log(rank)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    said = [(m.group(1), m.group(2).strip()) for m in map(_PROGRAM_LINE.match, lines) if m and m.group(2).strip()]
    for _, text in reversed(said):
        if _EXCEPTION.match(text):
            return text[:300]
    for _, text in reversed(said):
        found = _LOGGED_ERROR.search(text)
        if found:
            return found.group(1).strip()[:300]
    errors = [text for stream, text in said if stream == "ERR"]
    return errors[-1][:300] if errors and last_words else None


def launcher_said(run_dir: Path) -> str | None:
    """The last line the launch command printed (logs/launcher.log), e.g. a container engine's error."""
    try:
        lines = (Path(run_dir) / names.LOGS_DIR / names.LAUNCHER_LOG).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.strip() and not line.startswith("$ "):
            return line.strip()[:300]
    return None


def hang_reports(run_dir: Path, since: float | None = None) -> list[dict]:
    """The watchdog's logs/hang-rank<R>.json reports that can be read (written at or after
    `since`, a launch's start: a requeued job reuses its run directory)."""
    reports = []
    for path in sorted((Path(run_dir) / names.LOGS_DIR).glob(names.HANG_REPORTS)):
        try:
            rec = json.loads(path.read_text())
            rec["rank"] = int(rec["rank"])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        if since is not None and _number(rec.get("time"), 0) < since:
            continue
        reports.append(rec)
    return reports


def _number(value, default=float("inf")):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _collectives(report: dict) -> dict:
    value = report.get("collectives")
    return value if isinstance(value, dict) else {}


def first_hung(reports: list[dict]) -> dict:
    """The rank that stopped first: fewest collectives issued (when every report counts them),
    then the oldest last progress."""
    counted = all(isinstance(_collectives(r).get("last_enqueued"), int) for r in reports)
    return min(reports, key=lambda r: (_collectives(r)["last_enqueued"] if counted else 0,
                                       _number(r.get("last_progress_time")), r["rank"]))


def hang_summary(run_dir: Path, outcome: Outcome | None = None, nodes: Sequence[str] = (), nproc: int = 0
                 ) -> str | None:
    """One line from the hang reports, or None when no rank was ended as hung. `nodes` (the hosts launched
    on, in node-rank order) and `nproc` (ranks per node) place the ranks of a node that left no report."""
    outcome = outcome if outcome is not None else read(run_dir)
    starts = [n.start for n in outcome.nodes if n.start]
    reports = hang_reports(run_dir, since=min(starts) if starts else None)
    if not reports:
        return None
    if all(r.get("source") == "agent" for r in reports):
        return silent_ranks(reports)
    first = first_hung(reports)
    step = first.get("step")
    at = f" at step {step}" if step is not None else ""
    where = first.get("where") or "unknown"
    stalled = _number(first.get("stalled_s"), None)
    waited = f"no step for {stalled:.0f} s" if stalled is not None else "no progress"
    host = first.get("host", "?")
    log = first.get("log") or f"logs/rank{first['rank']}.log"
    reported = {r["rank"] for r in reports}
    hosts = {rank: node.host for node in outcome.nodes for rank in node.ranks}
    codes = {rank: code for node in outcome.nodes for rank, code in node.ranks.items()}
    lost = unreported_ranks(outcome, nodes, nproc)   # a node that said nothing: stopped, frozen or lost
    hosts.update(lost)
    silent = sorted(set(hosts) - reported)
    coll = _collectives(first)
    if not coll.get("pending") and coll.get("last_enqueued") is None:
        # no collective counts: a silent rank that not even SIGTERM ended (the launcher's SIGKILL,
        # -9) was stuck as well, and said nothing
        silent = [r for r in silent if codes.get(r) == -9 or r in lost]
    elif not coll.get("pending"):
        silent = [r for r in silent if r in lost]
    if silent:   # the reporting rank waits for ranks that said nothing
        ranks = ", ".join(f"rank {r} on {hosts[r]}" for r in silent)
        op = f" ({coll['last_op']})" if coll.get("last_op") else ""
        waiting = f"in a collective{op} " if coll.get("pending") else ""
        return (f"{ranks} stopped first and wrote no hang report (stopped, or stuck where Python cannot "
                f"run): rank {first['rank']} on {host} waited for it{at} {waiting}in {where} "
                f"({waited}); stacks in {log}")
    line = f"rank {first['rank']} on {host} stopped first{at} in {where} ({waited}); stacks in {log}"
    others = sorted(reported - {first["rank"]})
    if others:
        line += f"; rank(s) {', '.join(map(str, others))} hung after it"
    return line


def silent_ranks(reports: list[dict]) -> str:
    """One line from the node agents' hang reports (train.launch --hang-timeout): no progress line for how
    long, after which step, and the ranks that printed nothing the longest (the silent ranks and hosts)."""
    stalled = max(_number(r.get("stalled_s"), 0) for r in reports)
    step = next((r.get("step") for r in reports if r.get("step") is not None), None)
    by_silence = sorted(reports, key=lambda r: (-_number(r.get("silent_s"), 0), r["rank"]))
    silent = [r for r in by_silence if _number(r.get("silent_s"), 0) >= stalled] or by_silence
    shown = ", ".join(f"rank {r['rank']} on {r.get('host', '?')} (nothing printed for {_number(r.get('silent_s'), 0):.0f} s)"
                      for r in silent[:8]) + (f" and {len(silent) - 8} more" if len(silent) > 8 else "")
    after = f" after step {step}" if step is not None else ""
    return (f"no progress line for {stalled:.0f} s{after} (--hang-timeout); silent: {shown}; their output is in "
            f"{names.LOGS_DIR}/{names.RANK_LOGS}")


#: What srun prints when Slurm declares a node of the step failed (set DOWN, or not responding).
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")


def node_failures(run_dir: Path) -> list[str]:
    """The nodes Slurm declared failed during the run, in the order it said so, from srun's own words in
    the launcher's log (an srun step) and the batch job's output (logs/slurm-<job>.out)."""
    logs = Path(run_dir) / names.LOGS_DIR
    found: list[str] = []
    for path in [logs / names.LAUNCHER_LOG, *sorted(logs.glob("slurm-*.out"))]:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found += [m.group(1) for m in _NODE_FAILURE.finditer(text)]
    return list(dict.fromkeys(found))


def faulty_gpu(run_dir: Path) -> dict | None:
    """The rank a rerun step blamed (trainer.numeric: every rank exits 5, in any order), as a first failure;
    None without a fault report."""
    from core.signals import EXIT_FAULTY
    from trainer.numeric import read_fault_reports

    reports = read_fault_reports(run_dir)
    if not reports:
        return None
    blamed = min(reports, key=lambda r: int(r.get("rank", 0)))
    return {"rank": int(blamed.get("rank", 0)), "host": blamed.get("host", "?"), "exit_code": EXIT_FAULTY,
            "time": blamed.get("time", 0)}


def unreported_ranks(outcome: Outcome, nodes: Sequence[str], nproc: int) -> dict[int, str]:
    """{rank: host} of the ranks on launched nodes whose agent left no report (none known without `nodes`
    and `nproc`)."""
    if not nodes or nproc <= 0:
        return {}
    seen = {n.node_rank for n in outcome.nodes}
    return {index * nproc + local: host for index, host in enumerate(nodes) if index not in seen
            for local in range(nproc)}


def failure_summary(run_dir: Path, expected_nodes: int | None = None, nodes: Sequence[str] = (),
                    nproc: int = 0) -> str | None:
    """One line: which rank on which host failed first, and why; None when nothing is known. `nodes` (the
    hosts launched on, in node-rank order; else `expected_nodes`, their count) and `nproc` name the hosts of
    nodes that left no report."""
    outcome = read(run_dir)
    first = faulty_gpu(run_dir) or outcome.first_failure()
    parts = []
    expected_nodes = len(nodes) or expected_nodes
    # A node that left no report (lost, or its launcher killed) comes first: its peers' errors follow from it.
    lost = bool(expected_nodes and len(outcome.nodes) < expected_nodes)
    hung = hang_summary(run_dir, outcome, nodes, nproc)
    if hung:
        parts.append(hung)   # the hang reports know more than which rank exited first
    elif first is not None:
        code = int(first.get("exit_code", 1))
        how = f"signal {-code}" if code < 0 else f"status {code}"
        if code == -9:   # nothing in the rank's log: say who sends SIGKILL unasked
            how += ", SIGKILL: often the kernel's OOM killer (`dmesg | grep -i oom`), or a kill -9"
        cause = rank_error(run_dir, int(first["rank"]))
        if cause is None:   # another trainer's own words (train.launch), with where the rest is
            said = program_error(run_dir, int(first["rank"]), last_words=code > 0)
            cause = f"{said} ({Path(run_dir) / names.LOGS_DIR / names.rank_log(int(first['rank']))})" if said else None
        parts.append(f"rank {first['rank']} on {first['host']} failed {'after it' if lost else 'first'} ({how})"
                     + (f": {cause}" if cause else ""))
    if lost:
        seen = {n.node_rank for n in outcome.nodes}
        missing = [f"{i} ({nodes[i]})" if nodes else str(i) for i in range(expected_nodes) if i not in seen]
        said = launcher_said(run_dir)
        gone = (f"node rank(s) {', '.join(missing)} left no report (the node or its launcher was killed"
                + (f"; the launch printed: {said}" if said else "") + ")")
        parts.insert(0 if not hung else len(parts), gone)
    failed_nodes = node_failures(run_dir)
    if failed_nodes:   # Slurm's verdict first: the ranks' errors follow from it
        parts.insert(0, f"Slurm declared node(s) {', '.join(failed_nodes)} failed (srun: Node failure)")
    if not parts:
        errors = []
        for rank in sorted({r for n in outcome.nodes for r in n.ranks} or {0}):
            cause = rank_error(run_dir, rank)
            if cause:
                errors.append(f"rank {rank}: {cause}")
        if errors:
            parts.append(errors[0])
    return "; ".join(parts) or None


if __name__ == "__main__":
    raise SystemExit(main())

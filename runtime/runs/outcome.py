"""What happened on every node of a launch, read back from the run directory.

Each node's agent (runtime.launch.agent) writes logs/agent-<node rank>.json:
its host, ranks, exit statuses and first failure. From those and the ranks'
logs this module answers the runner's questions: on which hosts did the run
run, how many ranks, and - when it failed - which rank on which host failed
first, and with what message (the rank log's last error line), so the user
reads one line instead of every rank's traceback.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class Outcome:
    nodes: list[NodeReport] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in sorted(self.nodes, key=lambda n: n.node_rank)]

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    def first_failure(self) -> dict | None:
        failures = [n.first_failure for n in self.nodes if n.first_failure]
        return min(failures, key=lambda f: f.get("time", 0)) if failures else None


def read(run_dir: Path) -> Outcome:
    out = Outcome()
    for path in sorted(Path(run_dir).glob("logs/agent-*.json")):
        try:
            rec = json.loads(path.read_text())
            out.nodes.append(NodeReport(host=str(rec["host"]), node_rank=int(rec["node_rank"]),
                                        exit_code=int(rec["exit_code"]),
                                        ranks={int(k): int(v) for k, v in rec.get("ranks", {}).items()},
                                        first_failure=rec.get("first_failure"), signal=rec.get("signal"),
                                        end=float(rec.get("end") or 0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue   # a node killed mid-write leaves nothing readable: reported as missing
    return out


def rank_error(run_dir: Path, rank: int) -> str | None:
    """The last ERROR/CRITICAL message of a rank's log (its first line), if any."""
    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        match = _LOG_LINE.match(line)
        if match and match.group("level") in ("ERROR", "CRITICAL"):
            return match.group("msg").strip()
    return None


def launcher_said(run_dir: Path) -> str | None:
    """The last line the launch command printed (logs/launcher.log), e.g. a container engine's error."""
    try:
        lines = (Path(run_dir) / "logs" / "launcher.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.strip() and not line.startswith("$ "):
            return line.strip()[:300]
    return None


def failure_summary(run_dir: Path, expected_nodes: int | None = None) -> str | None:
    """One line: which rank on which host failed first, and why; None when nothing is known."""
    outcome = read(run_dir)
    first = outcome.first_failure()
    parts = []
    if first is not None:
        code = int(first.get("exit_code", 1))
        how = f"signal {-code}" if code < 0 else f"status {code}"
        cause = rank_error(run_dir, int(first["rank"]))
        parts.append(f"rank {first['rank']} on {first['host']} failed first ({how})"
                     + (f": {cause}" if cause else ""))
    if expected_nodes and len(outcome.nodes) < expected_nodes:
        seen = {n.node_rank for n in outcome.nodes}
        missing = [str(i) for i in range(expected_nodes) if i not in seen]
        said = launcher_said(run_dir)
        parts.append(f"node rank(s) {', '.join(missing)} left no report (the node or its launcher was killed"
                     + (f"; the launch printed: {said}" if said else "") + ")")
    if not parts:
        errors = []
        for rank in sorted({r for n in outcome.nodes for r in n.ranks} or {0}):
            cause = rank_error(run_dir, rank)
            if cause:
                errors.append(f"rank {rank}: {cause}")
        if errors:
            parts.append(errors[0])
    return "; ".join(parts) or None

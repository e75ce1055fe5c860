"""metrics.jsonl read back: each step's last train and val record, the other records, and the
lines that could not be read.

    log = read(run_dir / "metrics.jsonl")    # MetricsLog; OSError when the file cannot be read

The trainer appends to one run directory's metrics.jsonl (trainer/metrics.py, and the straggler
detector's "straggler" and "rank_times" records, trainer/health.py). A run that resumes into the
same directory (a requeued Slurm job) logs again from its checkpoint's step: a step logged twice
keeps its last record, and the step where the log restarted is kept in `restarts`. A line cut
short by a kill, or still being written, is counted, never fatal. No torch: the report and the
plot read it on any machine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from core import names


@dataclass
class MetricsLog:
    train: dict[int, dict] = field(default_factory=dict)    # step -> its last "train" record
    val: dict[int, dict] = field(default_factory=dict)      # step -> its last "val" record
    events: list[dict] = field(default_factory=list)        # every other kind with a step, in file order
    restarts: list[int] = field(default_factory=list)       # first step logged after each restart
    damaged: list[int] = field(default_factory=list)        # line numbers (1-based) that are no record
    unfinished: bool = False                                # the last line has no newline yet (being written)
    lines: int = 0

    def problems(self, name: str = names.METRICS) -> list[str]:
        """What could not be read, in words (empty when everything could)."""
        out = []
        damaged = [n for n in self.damaged if not (self.unfinished and n == self.lines)]
        if damaged:
            shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
            out.append(f"{name}: {len(damaged)} damaged line(s) skipped (line {shown})")
        if self.unfinished:
            out.append(f"{name}: the last line is unfinished (the run is still writing it, or was killed)")
        return out


def parse(lines, log: MetricsLog | None = None) -> MetricsLog:
    """Records from an iterable of text lines (each with its newline, as a file gives them)."""
    log = log if log is not None else MetricsLog()
    last = 0
    for number, line in enumerate(lines, 1):
        log.lines = number
        log.unfinished = not line.endswith("\n")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            log.damaged.append(number)
            continue
        kind = record.get("kind")
        if kind == "train":
            if step <= last:
                log.restarts.append(step)
            last = step
            log.train[step] = record
        elif kind == "val":
            log.val[step] = record
        else:
            log.events.append(record)
    return log


def read(path: str | Path) -> MetricsLog:
    """One metrics.jsonl; invalid UTF-8 is replaced (its line then fails to parse and is counted)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return parse(handle)

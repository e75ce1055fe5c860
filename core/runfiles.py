"""The run files more than one program reads or writes, read and written here alone.

    log = read_metrics(run_dir / names.METRICS)   # MetricsLog; OSError when the file cannot be read
    writer = MetricsWriter(run_dir); writer.write({"kind": "train", "step": 3, ...}); writer.close()
    summary = read_summary(run_dir)               # the trainer's summary.json (OSError, ValueError)
    wall_time_text(summary), experts_text(summary["experts"])   # how its figures read, wherever shown
    source_text(summary["sources"][name])         # a blend's source, in words

metrics.jsonl: the trainer appends to one run directory's file (trainer/metrics.py, and the
straggler detector's "straggler" and "rank_times" records, trainer/health.py), each through a
MetricsWriter, a whole line a write. A run that resumes writes a "resume" record first, at its
checkpoint's step; one that resumes into the same directory (a requeued Slurm job) then logs again
from there: a step logged twice keeps its last record. Each restart's step is kept in `restarts`:
the resume record's, the checkpoint the curve goes on from (a log written before that record
existed: the first step logged again, a log interval later). `resumed_at` is the step of a resume
record the log starts with (a run resumed into a new directory). A line cut short by a kill, or
still being written, is counted, never fatal. No torch: the report and the plot read it on any
machine.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import names
from core.files import write_json_atomic


@dataclass
class MetricsLog:
    train: dict[int, dict] = field(default_factory=dict)    # step -> its last "train" record
    val: dict[int, dict] = field(default_factory=dict)      # step -> its last "val" record
    events: list[dict] = field(default_factory=list)        # every other kind with a step, in file order
    restarts: list[int] = field(default_factory=list)       # the step each restart went on from
    resumed_at: int | None = None                           # the resume record's step, when the log starts with one
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
        if kind == "resume":
            if not log.train and not log.val and log.resumed_at is None:
                log.resumed_at = step
            log.restarts.append(step)
            last = step       # the steps logged after it, from step + 1, are no restart of their own
        elif kind == "train":
            if step <= last:
                log.restarts.append(step)
            last = step
            log.train[step] = record
        elif kind == "val":
            log.val[step] = record
        else:
            log.events.append(record)
    return log


def read_metrics(path: str | Path) -> MetricsLog:
    """One metrics.jsonl; invalid UTF-8 is replaced (its line then fails to parse and is counted)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return parse(handle)


def metrics_records(run_dir: str | Path) -> list[dict]:
    """Every record of a run's metrics.jsonl in file order (the damaged lines left out)."""
    out = []
    with open(Path(run_dir) / names.METRICS, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


class MetricsWriter:
    """Appends records to a run's metrics.jsonl, a whole line per write (threads may share one)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / names.METRICS
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_summary(run_dir: str | Path) -> dict:
    """The trainer's summary of a finished run; OSError when there is none, ValueError when damaged."""
    data = json.loads((Path(run_dir) / names.SUMMARY).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{Path(run_dir) / names.SUMMARY}: not a JSON object")
    return data


def write_summary(run_dir: str | Path, summary: dict) -> None:
    write_json_atomic(Path(run_dir) / names.SUMMARY, summary)


def wall_time_text(summary: dict) -> str:
    """"12.3 s", or "12.3 s (this segment; 3 segments, 40.1 s in all)" for a resumed run: the summary
    table's words and snapshot.show's."""
    wall, segments, total = summary.get("wall_s"), summary.get("segments"), summary.get("wall_s_total")
    if not isinstance(wall, (int, float)) or isinstance(wall, bool):
        return "n/a"
    text = f"{wall:.1f} s"
    if isinstance(segments, int) and segments > 1 and isinstance(total, (int, float)):
        text += f" (this segment; {segments} segments, {total:.1f} s in all)"
    return text


def experts_text(experts: dict) -> str:
    """"most: layer 3 expert 5 (21.0% of its layer's tokens); least: layer 1 expert 2 (4.1%); load CV 0.32"."""
    most, least = experts["most"], experts["least"]
    return (f"most: layer {most['layer']} expert {most['expert']} ({most['share']:.1%} of its layer's tokens); "
            f"least: layer {least['layer']} expert {least['expert']} ({least['share']:.1%}); "
            f"load CV {experts['load_cv']:.2f}")


def source_text(figures: dict) -> str:
    """One source of a blend in the summary (summary.json's "sources"), as the trainer's summary table and
    the report say it: "70.1% of the tokens (weight 70.0%), 0.42 epochs, val loss 2.1234"; the figures a
    run's metrics do not give (read back from metrics.jsonl: no epochs; no weight without the config)
    are left out."""
    share, weight, epochs, loss = (figures.get(k) for k in ("token_share", "weight", "epochs", "val_loss"))
    parts = []
    if share is not None:
        parts.append(f"{share:.1%} of the tokens" + (f" (weight {weight:.1%})" if weight is not None else ""))
    elif weight is not None:
        parts.append(f"weight {weight:.1%}")
    parts += [f"{epochs:.2f} epochs"] if epochs is not None else []
    parts += [f"val loss {loss:.4f}"] if loss is not None else []
    return ", ".join(parts)

"""Cutting a corpus into units of work: spans of files, grouped to about one target size.

A large file becomes many spans (byte ranges of JSONL, runs of Parquet row groups or Arrow
record batches), so one 2 GB file keeps every core busy; small files share a unit, so a
folder of thousands costs no more than one file of the same size. The target size comes
from the corpus alone (about 64 units, each 1 to 64 MiB), never from the worker count or
the nodes: the same corpus always gives the same units, which is what lets a stopped
prepare keep its finished parts, and several nodes share one plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import formats
from .formats import SourceFile, Span

MIN_TARGET, MAX_TARGET = 1 << 20, 64 << 20
UNITS_PER_CORPUS = 64


@dataclass(frozen=True)
class Unit:
    index: int
    spans: tuple[Span, ...]
    size: int           # bytes of input it covers

    def to_dict(self) -> dict:
        return {"index": self.index, "size": self.size, "spans": [
            {"path": str(s.source.path), "key": s.source.key, "file_size": s.source.size,
             "mtime_ns": s.source.mtime_ns, "format": s.format, "start": s.start, "end": s.end,
             "size": s.size, "compression": s.compression, "broken": s.broken and list(s.broken)}
            for s in self.spans]}

    @classmethod
    def from_dict(cls, data: dict) -> "Unit":
        from pathlib import Path
        spans = tuple(Span(SourceFile(Path(s["path"]), s["key"], s["file_size"], s["mtime_ns"]), s["format"],
                           s["start"], s["end"], s["size"], s["compression"],
                           tuple(s["broken"]) if s["broken"] else None) for s in data["spans"])
        return cls(data["index"], spans, data["size"])


def target_size(total_bytes: int) -> int:
    return min(MAX_TARGET, max(MIN_TARGET, total_bytes // UNITS_PER_CORPUS))


def plan(files: list[SourceFile], text_field: str, target: int | None = None) -> list[Unit]:
    """The units of a corpus, in corpus order."""
    target = target or target_size(sum(f.size for f in files))
    units: list[Unit] = []
    spans: list[Span] = []
    size = 0
    for source in files:
        for span in formats.spans(source, text_field, target):
            if spans and size + span.size > target:
                units.append(Unit(len(units), tuple(spans), size))
                spans, size = [], 0
            spans.append(span)
            size += span.size
    if spans:
        units.append(Unit(len(units), tuple(spans), size))
    return units


def share(units: list[Unit], nodes: int, node: int) -> list[Unit]:
    """The units node `node` of `nodes` makes: the largest first to whichever node has the least
    so far (deterministic, so every node computes the same split without talking)."""
    loads = [0] * nodes
    mine = []
    for unit in sorted(units, key=lambda u: (-u.size, u.index)):
        owner = min(range(nodes), key=lambda n: (loads[n], n))
        loads[owner] += unit.size
        if owner == node:
            mine.append(unit)
    return sorted(mine, key=lambda u: u.index)

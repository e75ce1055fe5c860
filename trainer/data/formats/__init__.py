"""Corpus formats, one module each, recognised by content: a new format is one module here,
added to FORMATS (see base.py for the three functions a format has).

    probe(source) -> Probe             the file's first bytes (decompressed too)
    detect(probe) -> format module     the first in FORMATS whose sniff() claims it
    spans(source, text_field, target)  how the file is cut into work for the workers
    read(span, text_field, reading, limits)   the span's documents, within the limits
"""
from __future__ import annotations

from . import arrow, compression, jsonl, parquet, text
from .base import PROBE_BYTES, Limits, Piece, Probe, Reading, SourceFile, Span, Tally, note_text

# Binary containers first (their magic bytes are certain), then JSONL, then text (takes the rest).
FORMATS = (parquet, arrow, jsonl, text)
BY_NAME = {f.NAME: f for f in FORMATS}

__all__ = ["BY_NAME", "FORMATS", "Limits", "Piece", "Probe", "Reading", "SourceFile", "Span", "Tally", "detect",
           "note_text", "probe", "read", "spans"]


def probe(source: SourceFile) -> Probe:
    """Read the start of a file (and of its content, when it is compressed)."""
    try:
        with open(source.path, "rb") as f:
            head = f.read(PROBE_BYTES)
    except OSError as exc:
        return Probe(source, b"", None, b"", error=f"{exc.strerror or exc}")
    kind = compression.kind(head)
    inner = compression.peek(source.path, kind, PROBE_BYTES) if kind else head
    return Probe(source, head, kind, inner)


def detect(probe: Probe):
    """The format module that reads this file."""
    return next(f for f in FORMATS if f.sniff(probe))


def spans(source: SourceFile, text_field: str, target: int) -> list[Span]:
    """The file cut into spans of about `target` bytes, in its format (found by content)."""
    found = probe(source)
    if found.error:
        return [Span(source, text.NAME, 0, 1, source.size, broken=("unreadable", found.error))]
    return detect(found).spans(source, found, target, text_field)


def read(span: Span, text_field: str, reading: Reading, limits: Limits = Limits()):
    """The documents of a span, as Pieces; skips and changes counted in `reading`."""
    if span.broken:
        reading.skip(*span.broken)
        return iter(())
    return BY_NAME[span.format].read(span, text_field, reading, limits)

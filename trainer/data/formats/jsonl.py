"""JSON lines: one document per line, its text in a field (`--text-field`, default text).

Recognised by the suffix (.jsonl, .ndjson) or by content: a first line that is a JSON
object (Dolma's `.json.gz` files, a JSONL file under any name). An uncompressed file is cut
into byte ranges on line boundaries, so one large file is read by every worker: a span
holds the lines that START inside [start, end), the way Hadoop cuts text, so every line
belongs to exactly one span. A gzip or zstd file is read from its start by one worker.
Skipped and counted, with the line number: malformed JSON, a line without a string text
field, an empty text, invalid UTF-8, a line longer than --max-doc-bytes (read past to its end
a block at a time, never held whole); a damaged compressed stream ends the file there. A text
holding lone surrogates (an escaped "\\ud83d" alone) is kept with U+FFFD in their place, counted.
"""
from __future__ import annotations

import json
import re

from . import compression
from .base import PROBE_BYTES, Limits, Piece, Probe, Reading, SourceFile, Span, encodable

NAME = "jsonl"
SUFFIXES = (".jsonl", ".ndjson")
SKIP_BLOCK = 1 << 20   # what is held at a time of a line too long to keep
_END = object()


_OBJECT_START = re.compile(rb'\s*\{\s*"(?:[^"\\]|\\.)*"\s*:')


def sniff(probe: Probe) -> bool:
    if probe.stem_suffixes and probe.stem_suffixes[0] in SUFFIXES:
        return True
    lines = probe.text_head.split(b"\n")
    for number, line in enumerate(lines[:8]):
        if line.strip():
            if number == len(lines) - 1 and len(probe.text_head) >= PROBE_BYTES:
                # a first line longer than the probe (a long document): judged by how it starts
                return bool(_OBJECT_START.match(line))
            try:
                return isinstance(json.loads(line), dict)
            except ValueError:
                return False
    return False


def spans(source: SourceFile, probe: Probe, target: int, text_field: str = "text") -> list[Span]:
    if probe.compression or source.size <= target:
        return [Span(source, NAME, 0, source.size, source.size, probe.compression)]
    count = -(-source.size // target)
    bounds = [source.size * i // count for i in range(count + 1)]
    return [Span(source, NAME, a, b, b - a) for a, b in zip(bounds, bounds[1:])]


def read_line(stream, limit: int) -> tuple[bytes | None, int]:
    """(the next line, or None when it is longer than `limit` bytes; the bytes it took), (b"", 0) at
    the end. A longer line is read past to its end SKIP_BLOCK at a time: at most the limit is held."""
    line = stream.readline(limit + 1)
    if len(line) <= limit or line.endswith(b"\n"):
        return line, len(line)
    size, line = len(line), None
    while True:
        block = stream.readline(SKIP_BLOCK)
        size += len(block)
        if len(block) < SKIP_BLOCK or block.endswith(b"\n"):   # its newline, or the end of the file
            return None, size


def _lines(span: Span, stream, limit: int):
    """The span's lines (None for one longer than `limit`); a stream holds the whole file."""
    position = span.start
    if span.start > 0 and span.compression is None:   # the line running over the start belongs to the span before
        stream.seek(span.start - 1)
        if stream.read(1) != b"\n":
            position += read_line(stream, 0)[1]
    while span.compression is not None or position < span.end:
        line, size = read_line(stream, limit)
        if not size:
            return
        position += size
        yield line


def read(span: Span, text_field: str, reading: Reading, limits: Limits):
    stream = compression.open_span(span, reading, limits)
    if stream is None:
        return
    with stream:
        number = 0
        content = False
        lines = _lines(span, stream, limits.max_doc_bytes)
        while True:
            try:
                line = next(lines, _END)
            except compression.READ_ERRORS as exc:
                compression.skip_damaged(span, reading, exc, f"after line {number}; the lines before were read")
                break
            if line is _END:
                break
            number += 1
            if line is None:
                content = True
                limits.too_long(reading, number)
                continue
            if not line.strip():
                continue
            content = True
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                reading.skip("invalid_utf8", "invalid UTF-8", number)
                continue
            except ValueError as exc:
                reading.skip("bad_json_line", f"invalid JSON ({getattr(exc, 'msg', exc)})", number)
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                reading.skip("missing_text_field", f"no string field {text_field!r}", number)
                continue
            if not text.strip():
                reading.skip("empty", "empty text", number)
                continue
            yield Piece(number, encodable(text, reading, number))
        reading.records = number
        whole_file = span.start == 0 and (span.compression is not None or span.end >= span.source.size)
        if whole_file and not content and not reading.skipped:
            reading.skip("empty", "empty")

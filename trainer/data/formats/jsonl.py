"""JSON lines: one document per line, its text in a field (`--text-field`, default text).

Recognised by the suffix (.jsonl, .ndjson) or by content: a first line that is a JSON
object (Dolma's `.json.gz` files, a JSONL file under any name). An uncompressed file is cut
into byte ranges on line boundaries, so one large file is read by every worker: a span
holds the lines that START inside [start, end), the way Hadoop cuts text, so every line
belongs to exactly one span. A gzip or zstd file is read from its start by one worker.
Skipped and counted, with the line number: malformed JSON, a line without a string text
field, an empty text, invalid UTF-8; a damaged compressed stream ends the file there. A text
holding lone surrogates (an escaped "\\ud83d" alone) is kept with U+FFFD in their place, counted.
"""
from __future__ import annotations

import json
import re

from . import compression
from .base import PROBE_BYTES, Piece, Probe, Reading, SourceFile, Span, encodable

NAME = "jsonl"
SUFFIXES = (".jsonl", ".ndjson")


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


def _lines(span: Span, stream):
    """(line, is it inside the span) for the span's lines; a stream holds the whole file."""
    if span.compression is not None:
        yield from stream
        return
    position = span.start
    if span.start > 0:    # the line running over the start belongs to the span before
        stream.seek(span.start - 1)
        if stream.read(1) != b"\n":
            position += len(stream.readline())
    while position < span.end:
        line = stream.readline()
        if not line:
            return
        position += len(line)
        yield line


def read(span: Span, text_field: str, reading: Reading):
    stream = compression.open_span(span, reading)
    if stream is None:
        return
    with stream:
        number = 0
        content = False
        lines = _lines(span, stream)
        while True:
            try:
                line = next(lines, None)
            except compression.READ_ERRORS as exc:
                compression.skip_damaged(span, reading, exc, f"after line {number}; the lines before were read")
                break
            if line is None:
                break
            number += 1
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

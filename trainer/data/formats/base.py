"""What every corpus format shares: the span of a file a worker reads, and what reading it gave.

A format module (text, jsonl, parquet, arrow) has three functions:

    sniff(probe) -> bool                  is this file mine? (by content, the suffix only breaks ties)
    spans(source, probe, target) -> list  how to cut the file into pieces of about `target` bytes
    read(span, text_field, reading, limits)  yield Piece(record, text, last) for the span's documents

Records are what a format counts in a file (lines of JSONL, rows of Parquet and Arrow; a text
file is one record). `read` numbers them from 1 inside its span and counts them in
`reading.records`; the pieces of one file are contiguous, so the document's number in the
whole file is the records of the spans before it plus its own (parts.py adds them up). That
number names the document (`path#record`) for the validation split, so the split does not
depend on how a file was cut, or by how many workers it was read.

Problems with a file are counted skips (`reading.skip`), never exceptions: one bad file
in a corpus of thousands must not stop the others. A document kept but altered (text no
UTF-8 can hold, replaced; a text file cut at the limit) is counted as a change (`reading.change`).

Limits bound what a hostile file costs: a document longer than `max_doc_bytes` is skipped
(a JSONL line, a Parquet or Arrow value) or cut there (a text file), never held whole; a
compressed file whose content outgrows its compressed bytes `max_ratio` times is stopped
(compression.py) and left out whole (`reading.void`: its documents given so far are taken back).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

MAX_NOTES = 5           # notes kept per span: enough to find the problem, bounded for a broken file
PROBE_BYTES = 1 << 16   # what sniffing reads of a file (and of its decompressed start)
TOO_LONG = "too_long"   # skip reason: a record longer than max_doc_bytes
CUT = "cut_too_long"    # change reason: a text file cut at max_doc_bytes


@dataclass(frozen=True)
class Limits:
    """How much of a file is read: data.prepare's and data.tokenizer's --max-doc-bytes, --max-ratio."""

    # A document longer is skipped or cut: 64 MiB is far beyond any document worth training on
    # (a long book is 2 MB) and what a worker may hold of one, its tokens beside it.
    max_doc_bytes: int = 64 << 20
    # A compressed file whose content grows more than this many times the compressed bytes it came
    # from, over any 16 MiB of content, is stopped; 0: never. Text compresses 3-10x (zstd -19 on web
    # text ~10x); 100x is ten times that, and below gzip's ceiling (1032x) and zstd's (32768x), so every
    # gzip or zstd bomb trips it within 16 MiB; a file yields at most 100x its size (+16 MiB) of content.
    max_ratio: int = 100

    @classmethod
    def of(cls, settings: dict) -> "Limits":
        """The limits a prepare's settings hold."""
        return cls(settings["max_doc_bytes"], settings["max_ratio"])

    def too_long(self, reading: "Reading", record: int | None) -> None:
        reading.skip(TOO_LONG, f"longer than --max-doc-bytes ({self.max_doc_bytes:,} bytes): skipped", record)


@dataclass(frozen=True)
class SourceFile:
    """One input file: where it is, and the stable name its documents are keyed by."""

    path: Path
    key: str        # relative to the input it came from: the split does not depend on where it lies
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Probe:
    """The start of a file, as sniffing sees it: raw bytes, and decompressed when compressed."""

    source: SourceFile
    head: bytes                     # the first PROBE_BYTES of the file
    compression: str | None         # "gzip" | "zstd" | None
    text_head: bytes                # the first PROBE_BYTES after decompression (== head if none)
    error: str | None = None        # why the file could not be probed (reason: message)

    @property
    def stem_suffixes(self) -> list[str]:
        """The file's suffixes with a compression suffix dropped: corpus.jsonl.zst -> ['.jsonl']."""
        suffixes = [s.lower() for s in self.source.path.suffixes]
        if suffixes and suffixes[-1] in (".gz", ".gzip", ".zst", ".zstd"):
            suffixes = suffixes[:-1]
        return suffixes[-1:]


@dataclass(frozen=True)
class Span:
    """A piece of one file for one worker. start/end are in the format's own unit (bytes of
    JSONL, row groups of Parquet, record batches of Arrow); `size` is its share of the file's
    bytes, for balancing work and showing progress. `broken` carries (reason, message) when
    planning already found the file unusable: reading it only records that skip."""

    source: SourceFile
    format: str
    start: int = 0
    end: int = 0
    size: int = 0
    compression: str | None = None
    broken: tuple[str, str] | None = None


class Piece(NamedTuple):
    """A document, or a piece of a long one: `last` ends it. `text` None drops the document
    begun so far (a problem found after its first pieces were given out)."""

    record: int
    text: str | None
    last: bool = True


@dataclass
class Reading:
    """What reading one span gave besides its documents."""

    records: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)   # documents kept, altered: by reason
    notes: list[tuple[int | None, str]] = field(default_factory=list)   # (record in span, message)
    void: bool = False      # none of the span's documents count, those given out before this was set too

    def skip(self, reason: str, message: str, record: int | None = None) -> None:
        self._count(self.skipped, reason, message, record)

    def change(self, reason: str, message: str, record: int | None = None) -> None:
        self._count(self.changed, reason, message, record)

    def _count(self, counts: dict, reason: str, message: str, record: int | None) -> None:
        counts[reason] = counts.get(reason, 0) + 1
        if len(self.notes) < MAX_NOTES:
            self.notes.append((record, message))

    def to_dict(self) -> dict:
        return {"records": self.records, "skipped": self.skipped, "changed": self.changed,
                "notes": [list(n) for n in self.notes]}


@dataclass
class Tally:
    """What reading many spans gave, added up: skips and changes by reason, and the first notes as
    users read them (`path:LINE: message`)."""

    skipped: dict[str, int] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    max_notes: int = 50

    def add(self, path: Path, reading: dict, base: int = 0) -> None:
        """A span's reading (Reading.to_dict()) of the file at `path`, its records numbered on from `base`."""
        for total, counts in ((self.skipped, reading["skipped"]), (self.changed, reading.get("changed") or {})):
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        for record, message in reading["notes"]:
            if len(self.notes) < self.max_notes:
                self.notes.append(note_text(path, None if record is None else base + record, message))


# A lone surrogate (U+D800..U+DFFF not in a pair) is a str no UTF-8 can hold: JSON's "\ud83d" alone, common
# in web crawls where an emoji was cut in half, made every tokenizer fail on the whole batch.
_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACED = "replaced_unencodable"


def encodable(text: str, reading: Reading, record: int | None = None) -> str:
    """`text` with its lone surrogates replaced by U+FFFD (counted as a change): what UTF-8 can hold."""
    if text.isascii():   # (constant time: CPython knows)
        return text
    try:
        text.encode("utf-8")   # ~800 MB/s, where a search for surrogates runs at ~60
        return text
    except UnicodeEncodeError:
        pass
    fixed, count = _SURROGATE.subn("\ufffd", text)
    if count:
        reading.change(REPLACED, f"{count} lone surrogate{'' if count == 1 else 's'} (half an emoji or other "
                                 f"UTF-16 pair) replaced by U+FFFD", record)
    return fixed


def column_pieces(values: list, first: int, text_field: str, reading: Reading, limits: Limits):
    """The documents of one batch of a text column (a Parquet row group's, an Arrow record batch's),
    numbered on from `first`: a null, blank or too long value is a counted skip."""
    limit = limits.max_doc_bytes
    for number, text in enumerate(values, first + 1):
        if text is None:
            reading.skip("missing_text_field", f"null {text_field!r}", number)
        elif not text.strip():
            reading.skip("empty", "empty text", number)
        elif len(text) > limit or (len(text) * 4 > limit and len(text.encode()) > limit):   # (encoded only when it may be)
            limits.too_long(reading, number)
        else:
            yield Piece(number, text)


def group_spans(source: SourceFile, format: str, sizes: list[int], target: int) -> list[Span]:
    """Spans over runs of a file's pieces (row groups, record batches) of about `target` bytes
    each; `sizes` are the pieces' own sizes, scaled so that the spans add up to the file's."""
    scale = source.size / max(1, sum(sizes))
    out, first, size = [], 0, 0
    for i, s in enumerate(sizes):
        size += s
        if size >= target or i == len(sizes) - 1:
            out.append(Span(source, format, first, i + 1, round(size * scale)))
            first, size = i + 1, 0
    return out


def note_text(path: Path, record: int | None, message: str) -> str:
    """A skip note as users read it: `path:LINE: message`, or `path: message` for a whole file."""
    return f"{path}:{record}: {message}" if record is not None else f"{path}: {message}"

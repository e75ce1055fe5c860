"""Plain text (gzip or zstd too): the whole file is one document.

Read as a stream in pieces of about PIECE_BYTES, each cut right after a newline with a
non-space character on both sides. Common tokenizers (byte-level BPE, Llama 3's) never join
characters across such a place, so the pieces tokenize to the document's own tokens, and
memory is a piece, not the file (workers check this of their tokenizer before they cut).
A file is skipped, by reason, when it is empty or blank, holds a NUL byte (binary), is not
UTF-8, or its compressed stream is damaged; a problem found after the first piece drops
the pieces given so far. A file longer than --max-doc-bytes is cut there: its start is the
document (counted as changed) and the rest is not read, so a file without a newline to cut
at never takes more memory than the limit.
"""
from __future__ import annotations

import codecs

from . import compression
from .base import CUT, Limits, Piece, Probe, Reading, SourceFile, Span

NAME = "text"
PIECE_BYTES = 4 << 20
_SPACE = b" \t\r\n\x0b\x0c"


def sniff(probe: Probe) -> bool:
    return True   # the format of last resort: what no other format claims is text


def spans(source: SourceFile, probe: Probe, target: int, text_field: str = "text") -> list[Span]:
    return [Span(source, NAME, 0, 1, source.size, probe.compression)]


def cut_point(data: bytes) -> int:
    """Where to end a piece of `data` (0: nowhere): after the last lone newline, one with a
    non-space on both sides (a run of whitespace is one pre-token, which a cut would split)."""
    end = len(data) - 1
    while True:
        i = data.rfind(b"\n", 1, end)
        if i < 0:
            return 0
        if data[i + 1] not in _SPACE and data[i - 1] not in _SPACE:
            return i + 1
        end = i


def read(span: Span, text_field: str, reading: Reading, limits: Limits):
    reading.records = 1
    decoder = codecs.getincrementaldecoder("utf-8")()
    given = offset = 0      # pieces given out; bytes of the content consumed
    blank = True
    carry = b""
    stream = compression.open_span(span, reading, limits)
    if stream is None:
        return
    with stream:
        while True:
            try:
                block = stream.read(PIECE_BYTES)
            except compression.READ_ERRORS as exc:
                compression.skip_damaged(span, reading, exc, f"at byte {offset + len(carry)} of its content")
                if given:
                    yield Piece(1, None)
                return
            data = carry + block
            final = not block
            over = offset + len(data) - limits.max_doc_bytes
            cut_short = over > 0     # past the limit: what comes before it ends the document
            if cut_short:
                data, final = data[:len(data) - over], True
            cut = len(data) if final else cut_point(data)
            if not cut and not final:   # no place to cut yet: read on (a file without newlines is one piece)
                carry = data
                continue
            piece, carry = data[:cut], data[cut:]
            nul = piece.find(b"\x00")
            if nul >= 0:
                reading.skip("binary", f"binary (NUL byte at offset {offset + nul})")
                if given:
                    yield Piece(1, None)
                return
            try:   # (cut short: the bytes of a character the limit cuts in two are left in the decoder)
                text = decoder.decode(piece, final=final and not cut_short)
            except UnicodeDecodeError as exc:
                reading.skip("invalid_utf8", f"invalid UTF-8 at byte {offset + exc.start}")
                if given:
                    yield Piece(1, None)
                return
            offset += len(piece)
            blank = blank and not text.strip()
            if final:
                if blank:
                    reading.skip("empty", "empty")
                    if given:
                        yield Piece(1, None)
                    return
                if cut_short:
                    reading.change(CUT, f"longer than --max-doc-bytes ({limits.max_doc_bytes:,} bytes): its "
                                        f"first {offset:,} bytes are the document, the rest is not read")
                yield Piece(1, text, True)
                return
            if text:
                given += 1
                yield Piece(1, text, False)

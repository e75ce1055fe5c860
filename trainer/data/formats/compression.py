"""gzip and zstd, recognised by their magic bytes (not the suffix) and read as streams.

A compressed stream cannot be entered in the middle, so a compressed file is one span, read
from its start by one worker; a corpus of many compressed files (The Pile, Dolma) still uses
every core. A stream cut short or damaged raises one of READ_ERRORS where the damage is, after
the documents before it were read: the format counts the file as skipped from there on.

Bombs: the decompressor is handed FEED bytes at a time, so one call gives out at most FEED times
the format's largest ratio (32 MiB for zstd's 32768:1; zlib's own max_length bounds gzip), and the
content is checked against the compressed bytes it came from over every RATIO_WINDOW of it: more
than `max_ratio` times raises TooCompressed (one of READ_ERRORS), and the file is left out whole.
"""
from __future__ import annotations

import gzip
import io
import zlib

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
REASONS = {"gzip": "bad_gzip", "zstd": "bad_zstd"}   # skip reasons of a damaged stream
BOMB = "decompression_bomb"                          # skip reason of a stream past --max-ratio
FEED = 1 << 10              # compressed bytes a decompressor is given at a time
RATIO_WINDOW = 16 << 20     # content over which the ratio is checked (small files cannot hurt)


class TooCompressed(Exception):
    """The content grew past --max-ratio times the compressed bytes it came from."""


def _zstd_error() -> type[Exception]:
    import zstandard
    return zstandard.ZstdError


try:
    READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, TooCompressed, _zstd_error())
except ImportError:  # zstandard is a dependency; without it only gzip streams are read
    READ_ERRORS = (OSError, EOFError, zlib.error, TooCompressed)


def kind(head: bytes) -> str | None:
    """'gzip', 'zstd' or None, from the first bytes of a file."""
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:4] == ZSTD_MAGIC:
        return "zstd"
    return None


def open_stream(path, compression: str | None, buffer: int = 1 << 20, max_ratio: int = 0):
    """A binary, buffered reader of the file's content: decompressed as it is read, and with
    `max_ratio`, stopped (TooCompressed) where the content outgrows the compressed bytes that much."""
    raw = open(path, "rb", buffering=buffer)
    if compression is None:
        return raw
    try:
        fed = _Fed(raw)
        inner = gzip.GzipFile(fileobj=fed, mode="rb") if compression == "gzip" else _ZstdReader(fed)
        return io.BufferedReader(_Guard(inner, fed, max_ratio), buffer_size=buffer)
    except BaseException:
        raw.close()
        raise


class _Fed(io.RawIOBase):
    """The compressed file as a decompressor reads it: FEED bytes at most a read, counted."""

    def __init__(self, raw):
        self._raw, self.given = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(memoryview(buffer)[:FEED])
        self.given += n or 0
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Guard(io.RawIOBase):
    """The decompressed content, checked every RATIO_WINDOW of it against the compressed bytes fed
    meanwhile (0: not checked); closes the decompressor and the file (GzipFile leaves its file open)."""

    def __init__(self, inner, fed: _Fed, max_ratio: int):
        self._inner, self._fed, self._max_ratio = inner, fed, max_ratio
        self._out = self._window_out = self._window_in = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._inner.readinto(buffer)
        if n and self._max_ratio:
            self._out += n
            grown = self._out - self._window_out
            if grown >= RATIO_WINDOW:
                fed = self._fed.given - self._window_in
                if grown > self._max_ratio * fed:
                    raise TooCompressed(
                        f"{grown / (1 << 20):.0f} MiB of its content (from byte {self._window_out:,}) came from "
                        f"{fed:,} compressed bytes, {grown / max(fed, 1):,.0f}:1, past --max-ratio {self._max_ratio} "
                        f"(a decompression bomb, or text repeated over and over): left out; a larger --max-ratio, "
                        f"or 0, reads it")
                self._window_out, self._window_in = self._out, self._fed.given
        return n

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._fed.close()
            super().close()


class _ZstdReader(io.RawIOBase):
    """A zstd stream's content, frame after frame (parallel compressors write many), that
    raises ZstdError where the stream is cut short: zstandard's own stream_reader ends quietly
    there, which would pass a truncated file off as a whole one."""

    def __init__(self, raw, chunk: int = FEED):
        import zstandard
        self._raw, self._chunk, self._error = raw, chunk, zstandard.ZstdError
        self._context = zstandard.ZstdDecompressor()
        self._frame = self._context.decompressobj()
        self._begun = False          # bytes of the current frame were fed
        self._out = bytearray()
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out and not self._done:
            data = self._raw.read(self._chunk)
            if not data:
                if self._begun and not self._frame.eof:
                    raise self._error("the stream ends in the middle of a frame (file cut short)")
                self._done = True
                break
            while data:
                self._begun = True
                self._out += self._frame.decompress(data)
                if not self._frame.eof:
                    break
                data = self._frame.unused_data       # the next frame starts here
                self._frame = self._context.decompressobj()
                self._begun = False
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        del self._out[:n]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_span(span, reading, limits):
    """The content of a span's file as a stream, or None when it cannot be opened (counted)."""
    try:
        return open_stream(span.source.path, span.compression, max_ratio=limits.max_ratio)
    except OSError as exc:
        reading.skip("unreadable", f"{exc.strerror or exc}")
        return None


def skip_damaged(span, reading, exc: BaseException, where: str) -> None:
    """Count a stream that broke off `where` (corrupt gzip/zstd, or a read error); a bomb (TooCompressed)
    voids the whole span: none of its documents count, those before the guard tripped neither."""
    if isinstance(exc, TooCompressed):
        reading.skip(BOMB, str(exc))
        reading.void = True
        return
    what = f"corrupt {span.compression}" if span.compression else "unreadable"
    reading.skip(REASONS.get(span.compression, "unreadable"), f"{what} {where} ({exc})")


def peek(path, compression: str | None, size: int) -> bytes:
    """Up to `size` bytes of the content's start (decompressed); what it can read of a damaged one."""
    out = bytearray()
    try:
        with open_stream(path, compression, buffer=1 << 16) as stream:
            while len(out) < size:
                block = stream.read(size - len(out))
                if not block:
                    break
                out += block
    except READ_ERRORS:
        pass
    return bytes(out)

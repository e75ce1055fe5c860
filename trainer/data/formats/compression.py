"""gzip and zstd, recognised by their magic bytes (not the suffix) and read as streams.

A compressed stream cannot be entered in the middle, so a compressed file is one span, read
from its start by one worker; a corpus of many compressed files (The Pile, Dolma) still uses
every core. A stream cut short or damaged raises one of READ_ERRORS where the damage is, after
the documents before it were read: the format counts the file as skipped from there on.
"""
from __future__ import annotations

import gzip
import io
import zlib

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
REASONS = {"gzip": "bad_gzip", "zstd": "bad_zstd"}   # skip reasons of a damaged stream


def _zstd_error() -> type[Exception]:
    import zstandard
    return zstandard.ZstdError


try:
    READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, _zstd_error())
except ImportError:  # zstandard is a dependency; without it only gzip streams are read
    READ_ERRORS = (OSError, EOFError, zlib.error)


def kind(head: bytes) -> str | None:
    """'gzip', 'zstd' or None, from the first bytes of a file."""
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:4] == ZSTD_MAGIC:
        return "zstd"
    return None


def open_stream(path, compression: str | None, buffer: int = 1 << 20):
    """A binary, buffered reader of the file's content: decompressed as it is read."""
    raw = open(path, "rb", buffering=buffer)
    if compression is None:
        return raw
    try:
        if compression == "gzip":
            return io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), buffer_size=buffer)
        return io.BufferedReader(_ZstdReader(raw), buffer_size=buffer)
    except BaseException:
        raw.close()
        raise


class _ZstdReader(io.RawIOBase):
    """A zstd stream's content, frame after frame (parallel compressors write many), that
    raises ZstdError where the stream is cut short: zstandard's own stream_reader ends quietly
    there, which would pass a truncated file off as a whole one."""

    def __init__(self, raw, chunk: int = 1 << 17):
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


def open_span(span, reading):
    """The content of a span's file as a stream, or None when it cannot be opened (counted)."""
    try:
        return open_stream(span.source.path, span.compression)
    except OSError as exc:
        reading.skip("unreadable", f"{exc.strerror or exc}")
        return None


def skip_damaged(span, reading, exc: BaseException, where: str) -> None:
    """Count a stream that broke off `where` (corrupt gzip/zstd, or a read error)."""
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

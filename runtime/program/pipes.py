"""Standard output whose reader may leave: `inv preflight.all | head -3`.

When the reader closes the pipe, writing raises BrokenPipeError wherever the
task happens to print, and the run would be recorded as failed for it. With
`guard_stdout()` the task goes on with its output sent to /dev/null from that
moment: it ends, and is recorded, as it would have without the pipe.
"""
from __future__ import annotations

import os
import sys


class ReaderSafeStdout:
    """A proxy of sys.stdout that turns a closed pipe into /dev/null (`reader_left` says it happened)."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_left = False

    def write(self, text: str) -> int:
        if not self.reader_left:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._to_devnull()
        return len(text)

    def flush(self) -> None:
        if not self.reader_left:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._to_devnull()

    def _to_devnull(self) -> None:
        self.reader_left = True
        to_devnull(self._stream)        # what is still buffered, and any child's output, goes there
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def to_devnull(stream) -> None:
    """Point the stream's file descriptor at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def guard_stdout() -> None:
    if not isinstance(sys.stdout, ReaderSafeStdout) and sys.stdout is not None:
        sys.stdout = ReaderSafeStdout(sys.stdout)

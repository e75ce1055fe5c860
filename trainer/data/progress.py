"""Progress of a prepare: a live line on a terminal, a plain line every few seconds in a log."""
from __future__ import annotations

import os
import sys
import time

from core import names

PROGRESS_ENV = names.PROGRESS_INTERVAL  # seconds between plain progress lines (default 5)


class Progress:
    """A live line on a terminal; a plain line every `interval` seconds otherwise."""

    def __init__(self, total_bytes: int, enabled: bool = True, stream=None, interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.total = max(total_bytes, 1)
        self.interval = 0.1 if self.tty else float(os.environ.get(PROGRESS_ENV, interval))
        self.start = self.last = time.monotonic()

    def update(self, parts: int, total_parts: int, docs: int, tokens: int, done_bytes: int,
               final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < self.interval):
            return
        self.last = now
        elapsed = now - self.start
        frac = min(done_bytes / self.total, 1.0)
        rate = done_bytes / elapsed / 1e6 if elapsed > 0 else 0.0
        eta = f"eta {elapsed / frac - elapsed:4.0f}s" if 0 < frac < 1 else f"{elapsed:.1f}s"
        text = (f"prepare {frac:6.1%} | {parts:,}/{total_parts:,} parts | {docs:,} docs | {tokens:,} tokens "
                f"| {rate:.1f} MB/s | {eta}")
        if self.tty:
            bar = "#" * int(frac * 20)
            self.stream.write(f"\r[{bar:<20}] {text}\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()



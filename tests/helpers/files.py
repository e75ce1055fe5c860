"""Files and disks: what a folder holds, and a real full disk (a tmpfs; root only, skipped elsewhere)."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest


def tree(path: Path, leave_out: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under `path` (but those named in `leave_out`), by its path inside it: its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*"))
            if p.is_file() and p.name not in leave_out}


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` (mount's size=, e.g. 64m) mounted at the new folder `path` while in the block;
    the test is skipped where it cannot be mounted (not root)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(disk: Path, leave: int = 0) -> None:
    """Take all the free space of `disk` but `leave` bytes."""
    with open(disk / "filler", "wb") as handle:
        chunk = bytes(1 << 16)
        try:
            while free_bytes(disk) > leave + len(chunk):
                handle.write(chunk)
                handle.flush()
            handle.write(bytes(max(0, free_bytes(disk) - leave)))
            handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC

"""Write a file so that readers see the old content or the new, never half of it.

The one atomic writer of the project (run directories, checkpoints' metadata,
datasets' manifests, benchmark results): write a temporary file beside the
target, fsync it, rename it over the target. What it writes gets the mode a plain open()
would give (umask, default_mode, share): runs and datasets are read by the whole team.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process's umask, read without changing it. os.umask() reads only by setting: a
    thread creating a file between the set and the restore would get the placeholder's mode."""
    try:
        with open("/proc/self/status") as status:  # Linux >= 4.7
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # No /proc (macOS): the kernel gives a new file 0o777 less the umask; see what it gives.
    probe = Path(tempfile.gettempdir()) / f".anvil-umask-{os.getpid()}-{os.urandom(6).hex()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777)
    except OSError:
        return 0o077  # cannot tell: private is the safe guess
    try:
        return 0o777 & ~os.fstat(fd).st_mode
    finally:
        os.close(fd)
        os.unlink(probe)


def default_mode(directory: bool = False) -> int:
    """The mode mkdir() or open() gives a new folder or file: 0o777 or 0o666 less the umask."""
    return (0o777 if directory else 0o666) & ~umask()


def share(path: str | Path) -> None:
    """Give `path` the mode mkdir()/open() would have: for what a library or tempfile made
    private (mkdtemp's 0700, safetensors' 0600) that teammates on a shared cluster must read."""
    os.chmod(path, default_mode(directory=Path(path).is_dir()))


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """tempfile.mkdtemp(prefix=, dir=parent), shared: a folder built under a temporary name and
    renamed into place (a dataset, an export) must be as readable as one made by mkdir."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        share(path)
    except BaseException:
        os.rmdir(path)
        raise
    return path


def write_atomic(path: str | Path, data: str | bytes, mode: int | None = None) -> Path:
    """Replace `path` with `data` in one step; the folder is created if missing. The file gets
    `mode`, or what a plain open() would give it (teammates on a shared cluster can read runs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode if mode is not None else default_mode())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def file_in_the_way(path: str | Path) -> Path | None:
    """The nearest existing folder above `path` when it is a file (so `path` cannot be made)."""
    for parent in Path(path).absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


OURS_HEAD = 1 << 16     # how much of an existing file is read for its writer's mark


def not_ours(path: str | Path, marks: tuple[str, ...]) -> bool:
    """Whether `path` is a file with content that none of `marks` (each a text a task's output
    carries near its start: a header line, a generator tag) shows to be the task's own. A missing or
    empty file is free: writing there loses nothing."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(OURS_HEAD)
    except (FileNotFoundError, IsADirectoryError):
        return False
    except OSError:
        return True         # unreadable, yet a rename in its folder would replace it
    return bool(head) and not any(mark.encode() in head for mark in marks)


def refuse_foreign(path: str | Path, error: type[Exception], marks: tuple[str, ...], what: str, *,
                   force: bool = False, option: str = "--out", given: str | Path | None = None) -> None:
    """`error` with one line unless a task may write its output to `path`: a new or empty file, or one
    it wrote before (not_ours); with `force`, any regular file. Never a device, pipe or socket: the
    atomic writer would put a file in its place (/dev/null, as root). Call before the work."""
    path, given = Path(path), given if given is not None else path
    try:
        regular = not path.exists() or path.is_dir() or path.is_file()
    except OSError:
        regular = True      # (unreadable: the writer says why)
    if not regular:
        raise error(f"{option} {given} is not a regular file (a device, a pipe or a socket); expected a file path")
    if not force and not_ours(path, marks):
        raise error(f"{option} {given} exists and is not {what}; choose another path, or add --force to "
                    "write over it")


def make_parent(path: str | Path, error: type[Exception], given: str | Path | None = None) -> None:
    """Create `path`'s folder, or raise `error` with one line: "--out GIVEN: cannot create X (reason)"."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise error(f"--out {given if given is not None else path}: cannot create "
                    f"{exc.filename or path.parent} ({exc.strerror or exc})") from None


def leaves_folder(name: Any) -> str:
    """Why a file name that a manifest lists (a dataset's shards, a checkpoint's files) would point
    outside the folder holding the manifest ("" when it stays inside): not a string, empty, absolute,
    a '..' part, a NUL byte. Read from the name alone: a checkpoint or dataset from elsewhere names
    only its own files."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "\x00" in name:
        return "holds a NUL byte"
    path = Path(name)
    if path.is_absolute() or name.startswith("~"):
        return "is an absolute path, outside the folder"
    if ".." in path.parts or "\\" in name:
        return "leads outside the folder"
    return ""


def text_of(data: bytes) -> tuple[str | None, str]:
    """(the text, "") for UTF-8 bytes; (None, where it stops being text) for binary data."""
    nul = data.find(b"\x00")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"NUL byte at byte {nul}" if 0 <= nul < exc.start else f"invalid UTF-8 at byte {exc.start}"
    if nul >= 0:
        return None, f"NUL byte at byte {nul}"
    return text, ""


def sha256_file(path: str | Path, block: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read a block at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            digest.update(chunk)
    return digest.hexdigest()


SEAL = "record_sha256"   # the key of a record's own checksum (see seal)
KEYED_SEAL = "record_hmac"   # the key of its HMAC with its writer's key (see seal): who wrote it


def _digest(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != SEAL}
    return hashlib.sha256(_canonical(body)).hexdigest()


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def _hmac(record: dict, key: bytes) -> str:
    body = unsealed(record)
    return hmac.new(key, b"anvil-record\n" + _canonical(body), hashlib.sha256).hexdigest()


def seal(record: dict, key: bytes | None = None) -> dict:
    """The record with a checksum of its own content under SEAL, for a file a later command trusts
    (a dataset's manifest, a run's record): a byte flipped or a value edited is then noticed on
    reading (seal_problem) instead of being believed. Anyone can recompute that checksum; with a
    `key`, an HMAC of the content under KEYED_SEAL also says who wrote it (keyed_by). SEAL covers
    KEYED_SEAL too, so a reader that knows only the checksum reads a keyed record as before."""
    body = json.loads(json.dumps(unsealed(record), default=str))
    if key:
        body[KEYED_SEAL] = _hmac(body, key)
    return {**body, SEAL: _digest(body)}


def seal_problem(record: Any) -> str:
    """Why a sealed record cannot be trusted ("" when its checksum matches, or it has none: a file
    written before records were sealed)."""
    if not isinstance(record, dict) or SEAL not in record:
        return ""
    if record[SEAL] != _digest(record):
        return "does not match its own checksum (edited or damaged since it was written)"
    return ""


def keyed_by(record: Any, key: bytes | None) -> bool | None:
    """Whether the record's KEYED_SEAL was made with `key`; None when it has none (sealed without a
    key, or not at all)."""
    if not isinstance(record, dict) or not isinstance(record.get(KEYED_SEAL), str):
        return None
    return bool(key) and hmac.compare_digest(record[KEYED_SEAL], _hmac(record, key))


def unsealed(record: dict) -> dict:
    """The record without its seals: what its writer wrote."""
    return {k: v for k, v in record.items() if k not in (SEAL, KEYED_SEAL)}


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_atomic(path, to_json(obj))

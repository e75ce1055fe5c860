"""Per-file checksums of a checkpoint: computed while the writer has the bytes in hand (no
second read), recorded in checksums.json before COMPLETE, checked before anything reads them.

The hash is xxh3_64 (the xxhash package): one core hashes about 10 GB/s, where zlib.crc32
does 2.2, sha256 1.2 and blake2b 1.0 (measured on a Xeon of the CI machine). A 70B run keeps
about 1.1 TB of weights and AdamW state, 17 GB per rank on 64 ranks: about 1.7 s of one core
per rank and save, hidden behind the write. It guards against corruption, not an attacker,
so 64 bits do. Without xxhash, crc32 is used and named in the manifest.

checksums.json: {"format": 1, "algorithm": "xxh3_64",
                 "files": {"__0_0.distcp": {"size": 123, "digest": "9f..."}, ...}}
It lists every file of the checkpoint but COMPLETE and itself.
"""
from __future__ import annotations

import errno
import json
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from trainer.checkpoint.layout import CHECKSUMS_FILE, DCP_METADATA, CheckpointError
from core.files import leaves_folder, write_atomic

MANIFEST_FORMAT = 1
_CHUNK = 16 << 20          # read size when verifying: large reads keep a disk streaming
_VERIFY_THREADS = 4        # files hashed at once per rank (a parallel file system serves several)

Record = tuple[int, str]   # (size in bytes, hex digest)


class _Crc32:
    def __init__(self):
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _hashers() -> dict:
    found = {"crc32": _Crc32}
    try:
        import xxhash
        found["xxh3_64"] = xxhash.xxh3_64
    except ImportError:
        pass
    return found


HASHERS = _hashers()
ALGORITHM = "xxh3_64" if "xxh3_64" in HASHERS else "crc32"


def new_hasher(algorithm: str = ALGORITHM):
    return HASHERS[algorithm]()


@dataclass
class Problem:
    """What is wrong with one file of a checkpoint. `content`: the file itself is missing or
    wrong (set the checkpoint aside), not merely unreadable just now (an I/O error)."""
    file: str
    message: str
    content: bool = True

    def __str__(self) -> str:
        return self.message


def named(exc: OSError, path: Path | str) -> OSError:
    """The same error naming `path` when it named no file (a write or fsync that failed)."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), str(path))


# ----------------------------------------------------------------------------- writing

class HashingStream:
    """A binary file being written, hashed as the bytes pass; a failed write names the file."""

    def __init__(self, raw, path: Path):
        self.raw = raw
        self.path = path
        self.size = 0
        self.hasher = new_hasher()
        self.error: OSError | None = None   # torch.save's C++ writer reports a failed write as its own
        #                                     RuntimeError ("unexpected pos"); this keeps the real one

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        try:
            self.raw.write(view)
        except OSError as exc:
            self.error = named(exc, self.path)
            raise self.error from None
        self.size += view.nbytes
        return view.nbytes

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as exc:
            self.error = named(exc, self.path)
            raise self.error from None

    def close(self) -> None:
        pass   # the opener closes the file

    @property
    def closed(self) -> bool:
        return self.raw.closed


def _dcp_file_system():
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's FileSystem, hashing every file it writes (shards and .metadata) on the way."""

        def __init__(self):
            super().__init__()
            self.records: dict[str, Record] = {}
            self.error: OSError | None = None      # the first write that failed, whatever DCP made of it
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path, mode: str) -> Iterator:
            if "w" not in mode and "a" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            path = Path(path)
            stream = None
            try:
                with open(path, mode) as raw:
                    stream = HashingStream(raw, path)
                    yield stream
            except BaseException as exc:   # also what DCP's fsync or the closing flush raised
                error = exc if isinstance(exc, OSError) else stream.error if stream is not None else None
                if error is not None:
                    with self._lock:
                        self.error = self.error or named(error, path)
                if isinstance(exc, OSError):
                    raise named(exc, path) from None
                raise
            with self._lock:
                self.records[str(path)] = (stream.size, stream.hasher.hexdigest())

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            with self._lock:
                if str(path) in self.records:
                    self.records[str(new_path)] = self.records.pop(str(path))

        def rm_file(self, path) -> None:
            super().rm_file(path)
            with self._lock:
                self.records.pop(str(path), None)

    return HashingFileSystem()


def dcp_writer(path: Path, **options):
    """A DCP FileSystemWriter for `path` whose `.fs.records` end up holding {file: Record}."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), **options)
    writer.fs = _dcp_file_system()
    return writer


def relative_records(records: dict[str, Record], root: Path) -> dict[str, Record]:
    return {Path(name).relative_to(root).as_posix(): record for name, record in records.items()}


def record_of(data: bytes) -> Record:
    hasher = new_hasher()
    hasher.update(data)
    return len(data), hasher.hexdigest()


def write_file(path: Path, data: bytes) -> Record:
    """Write `data` to `path` (fsynced); returns its Record. A failure names the file."""
    try:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise named(exc, path) from None
    return record_of(data)


def write_manifest(checkpoint: Path, records: dict[str, Record]) -> None:
    files = {name: {"size": size, "digest": digest} for name, (size, digest) in sorted(records.items())}
    body = {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "files": files}
    path = checkpoint / CHECKSUMS_FILE
    try:
        write_atomic(path, json.dumps(body, indent=1) + "\n")
    except OSError as exc:
        raise named(exc, path) from None


# ----------------------------------------------------------------------------- checking

def read_manifest(checkpoint: Path) -> tuple[dict | None, Problem | None]:
    """(manifest, None); (None, None) for a checkpoint saved before checksums; (None, problem)
    when checksums.json cannot be read or is not one."""
    path = Path(checkpoint) / CHECKSUMS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as exc:
        return None, Problem(CHECKSUMS_FILE, f"{CHECKSUMS_FILE} cannot be read ({exc})", content=False)
    try:
        manifest = json.loads(text)
    except ValueError:
        manifest = None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    algorithm = manifest.get("algorithm") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and isinstance(algorithm, str) and all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("digest"), str)
            for r in files.values())):
        return None, Problem(CHECKSUMS_FILE, f"{CHECKSUMS_FILE} is not a valid checksum list")
    if algorithm not in HASHERS:
        return None, Problem(CHECKSUMS_FILE, f"{CHECKSUMS_FILE} uses {algorithm!r}, which this Python cannot "
                             "compute (pip install xxhash)", content=False)
    for name in files:
        problem = leaves_folder(name)
        if problem:     # never opened, not even to hash it
            return None, Problem(CHECKSUMS_FILE, f"{CHECKSUMS_FILE} names {name!r}, which {problem}: refused")
    return manifest, None


def quick_check(checkpoint: Path) -> tuple[dict | None, Problem | None]:
    """What can be told without reading the data: checksums.json readable, naming files inside the
    checkpoint only, every file it lists there with its size (a checkpoint without checksums: its
    DCP .metadata is there); then .metadata read as data (safe_dcp: nothing but DCP's own types,
    shards inside the folder), which is what DCP reads first.
    Returns (manifest or None for an unchecksummed checkpoint, the first problem or None)."""
    checkpoint = Path(checkpoint)
    manifest, problem = read_manifest(checkpoint)
    if problem is not None:
        return None, problem
    if manifest is None:
        if not (checkpoint / DCP_METADATA).is_file():
            return None, Problem(DCP_METADATA, f"{DCP_METADATA} is missing")
        return None, _metadata_problem(checkpoint)
    for name, record in sorted(manifest["files"].items()):
        problem = _size_problem(checkpoint, name, record["size"])
        if problem is not None:
            return manifest, problem
    return manifest, _metadata_problem(checkpoint)


def _metadata_problem(checkpoint: Path) -> Problem | None:
    from trainer.checkpoint import safe_dcp   # (torch.distributed.checkpoint: only when a checkpoint is read)
    try:
        safe_dcp.read_metadata(checkpoint)
    except CheckpointError as exc:
        return Problem(DCP_METADATA, str(exc))
    return None


def _size_problem(checkpoint: Path, name: str, size: int) -> Problem | None:
    path = checkpoint / name
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return Problem(name, f"{name} is missing")
    except OSError as exc:
        return Problem(name, f"{name} cannot be read ({exc.strerror or exc})", content=False)
    if actual != size:
        return Problem(name, f"{name} has {actual:,} bytes, {size:,} when it was saved")
    return None


def hash_file(path: Path, algorithm: str = ALGORITHM) -> Record:
    hasher = new_hasher(algorithm)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def check_files(checkpoint: Path, manifest: dict, names: list[str]) -> list[Problem]:
    """Read and hash `names` (files of the manifest), a few at a time; their problems."""
    checkpoint = Path(checkpoint)
    algorithm = manifest["algorithm"]

    def check(name: str) -> Problem | None:
        expected = manifest["files"][name]
        path = checkpoint / name
        try:
            size, digest = hash_file(path, algorithm)
        except FileNotFoundError:
            return Problem(name, f"{name} is missing")
        except OSError as exc:
            return Problem(name, f"{name} cannot be read ({exc.strerror or exc})", content=False)
        if size != expected["size"]:
            return Problem(name, f"{name} has {size:,} bytes, {expected['size']:,} when it was saved")
        if digest != expected["digest"]:
            return Problem(name, f"{name}: its bytes differ from those saved ({algorithm} {digest}, "
                                 f"saved as {expected['digest']})")
        return None

    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(_VERIFY_THREADS, len(names))) as pool:
        return [p for p in pool.map(check, names) if p is not None]


def share_of(manifest: dict, rank: int, world: int) -> list[str]:
    """The files `rank` verifies: the largest first, each to the rank with the fewest bytes so
    far, so every rank reads about the same amount (and each file is read by one rank)."""
    load = [0] * world
    mine = []
    for name, record in sorted(manifest["files"].items(), key=lambda kv: (-kv[1]["size"], kv[0])):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += record["size"]
        if owner == rank:
            mine.append(name)
    return mine


def total_bytes(manifest: dict, names: list[str] | None = None) -> int:
    files = manifest["files"]
    return sum(files[n]["size"] for n in (files if names is None else names))


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

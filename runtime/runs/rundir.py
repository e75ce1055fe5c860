"""Run directories: naming, creation, atomic writes, reading back.

    runs/<YYYY-mm-ddTHH-MM-SS>_<task>[_<name>]/
        metadata.json   task, name, argv, start, end, status, hosts, replay_of, ...
        command.txt     the exact command line (masked)
        env.json        resolved environment with sources (masked)
        environ.json    the whole process environment (masked)
        machine.json    GPU / system info (envs.detect)
        versions.json   python, torch, triton, driver, ROCm/CUDA, anvil commit
        git.json, git.diff, pip-freeze.txt
        configs/        configs as used
        hooks/          hook outputs
        logs/           runner.log, rank{R}.log
        result.json     what the task returned
        .space-reserve  1 MiB held while the run is open: a full disk cannot stop its end
                        from being recorded (Run.write_text gives it back and retries)

Everything goes through `write_text` (temp file + os.replace), so a reader
never sees half a file. The records a later command trusts (RECORDS: the run's
metadata, its environment, machine, versions and git state; a fan-out's
nodes/fail.json) are sealed with a checksum of their own content and an HMAC
with the writer's run key (core.files.seal, runtime.runs.trust.run_key):
`read_record` believes one only when its checksum matches, and reads one written
before records were sealed as it always did; `read_sealed` also says who sealed
it (trust.sealed_by: a run sealed with the user's key is the user's own).
"""
from __future__ import annotations

import errno
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from core import names
from core.errors import UserError
# The project's one atomic writer (temp file beside the target, fsync, rename), under the
# names run-directory code has always used.
from core.files import seal, seal_problem, unsealed
from core.files import to_json, write_atomic as write_text  # noqa: F401 (re-exported)

TIME_FORMAT = "%Y-%m-%dT%H-%M-%S"
METADATA = names.METADATA
#: The files of a run that a later command believes (snapshot.*, replay, --resume, jobend): sealed.
RECORDS = (METADATA, names.ENV_RECORD, names.MACHINE, names.VERSIONS, names.GIT)
SPACE_RESERVE = ".space-reserve"
RESERVE_BYTES = 1 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class RunDirError(UserError):
    """A path that is not a usable run directory."""


def reserve_space(run_dir: Path) -> None:
    """Hold RESERVE_BYTES of real blocks in the run directory (best effort)."""
    try:
        with open(Path(run_dir) / SPACE_RESERVE, "wb") as handle:
            handle.write(bytes(RESERVE_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        release_space(run_dir)


def release_space(run_dir: Path) -> bool:
    """Give the reserve back; True when there was one."""
    try:
        os.unlink(Path(run_dir) / SPACE_RESERVE)
    except OSError:
        return False
    return True


def disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def slug(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-.")[:80] or "run"


def dir_name(task: str, name: str | None = None, when: datetime | None = None) -> str:
    stamp = (when or datetime.now()).strftime(TIME_FORMAT)
    return f"{stamp}_{slug(task)}" + (f"_{slug(name)}" if name else "")


def create(runs_dir: Path, task: str, name: str | None = None, when: datetime | None = None) -> Path:
    """Make a fresh run directory; never reuses one (hosts share runs/ over NFS).

    A name taken in the same second gets one suffix scheme: `-2`, `-3`, ... (the host is in
    metadata.json; a second scheme such as `@host` made names hard to predict)."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    base = dir_name(task, name, when)
    candidates = [base] + [f"{base}-{i}" for i in range(2, 1000)]
    for candidate in candidates:
        path = runs_dir / candidate
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RunDirError(f"could not create a new run directory under {runs_dir}")


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise RunDirError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def seal_record(record: dict) -> dict:
    """The record sealed: its checksum, and an HMAC with this user's run key where there is one (no
    key, e.g. a home that cannot be written: the checksum alone, and the run reads as not the user's)."""
    from runtime.runs import trust
    return seal(record, trust.run_key()[0])


def write_record(path: Path, record: dict) -> Path:
    """A record a later command trusts, written atomically and sealed (seal_record)."""
    return write_text(path, to_json(seal_record(record)))


def read_record(path: Path, default: Any = None) -> Any:
    """A record as read_json reads it, without its seal; RunDirError when the seal does not match
    (the file was edited or damaged since it was written). A record without a seal (written before
    records were sealed) is read as it is."""
    return read_sealed(path, default)[0]


def read_sealed(path: Path, default: Any = None) -> tuple[Any, str]:
    """(read_record's record, who sealed it: trust.sealed_by), from one read of the file."""
    from runtime.runs import trust
    data = read_json(path, default)
    if not isinstance(data, dict):
        return data, trust.NOT_SEALED
    problem = seal_problem(data)
    if problem:
        raise RunDirError(f"{path} {problem}; the run directory is damaged")
    return unsealed(data), trust.sealed_by(data)


def resolve(path: str | Path, runs_dir: Path | None = None) -> Path:
    """A run directory given as a path, or as a name under runs_dir."""
    candidate = Path(path)
    if not candidate.is_dir() and runs_dir is not None and (Path(runs_dir) / path).is_dir():
        candidate = Path(runs_dir) / path
    if not candidate.is_dir():
        raise RunDirError(f"{path}: no such run directory")
    if not (candidate / METADATA).is_file():
        raise RunDirError(f"{path}: not a run directory (no {METADATA})")
    return candidate.resolve()


def metadata(run_dir: Path) -> dict:
    data = read_record(Path(run_dir) / METADATA, default=None)
    if not isinstance(data, dict):
        raise RunDirError(f"{run_dir}: missing or malformed {METADATA}")
    return data


def iter_runs(runs_dir: Path) -> Iterator[tuple[Path, dict]]:
    """(path, metadata) of every run under runs_dir, oldest first; broken ones skipped."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return
    for path in sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            yield path, metadata(path)
        except (RunDirError, OSError):
            continue

"""What a checkpoint folder holds and how folders come and go: names, errors, the atomic
rename into place, pruning, and setting a damaged checkpoint aside."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from core import names
from core.errors import UserError

FORMAT_VERSION = 2          # 2: checksums.json
COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
TRAINER_FILE = "trainer.pt"
RANKS_DIR = "ranks"
CHECKSUMS_FILE = "checksums.json"
DCP_METADATA = ".metadata"
TMP_PREFIX = ".tmp_step_"
DAMAGED_PREFIX = "damaged_"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not fit the model: the message says which."""


class DamagedCheckpoint(CheckpointError):
    """A file of a checkpoint is missing, has another size, or its bytes differ from the checksum
    written at save time. `path` is the checkpoint, `problem` names the file; `content`: the
    files themselves are wrong, not merely unreadable just now (an I/O error)."""

    def __init__(self, path: Path, problem: str, content: bool = True):
        super().__init__(f"checkpoint {path} is damaged: {problem}")
        self.path = Path(path)
        self.problem = problem
        self.content = content


class CheckpointWriteError(CheckpointError):
    """A save that could not be written (a full disk, a quota): the run stops; exit status 1, since
    the input was fine. The message names the file and the newest intact checkpoint."""

    exit_code = 1


def step_of(path: Path) -> int | None:
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    path = Path(path)
    return step_of(path) is not None and (path / COMPLETE_MARKER).is_file()


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints under checkpoint_dir, oldest first (damaged ones included: see
    resume.find_latest for the newest one that looks intact)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def checkpoint_root(path: Path) -> Path:
    """A run dir holds checkpoints/; anything else is taken as the checkpoint dir itself."""
    return path / names.CHECKPOINTS_DIR if (path / names.CHECKPOINTS_DIR).is_dir() else path


def read_meta(path: Path) -> dict:
    path = Path(path)
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / META_FILE}: {exc}") from None


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_dir(staging: Path, final: Path) -> None:
    """Put the finished directory `staging` at `final`. An existing `final` is swapped out
    first and removed after, so a crash leaves one whole version, never half of each."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)


def remove_stale(checkpoint_dir: Path) -> None:
    """Leftovers of saves that died before their rename."""
    for stale in Path(checkpoint_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def prune(checkpoint_dir: Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints, never `keep` (the one just
    saved, which a run resumed from an older step may have below newer ones); returns what
    was removed."""
    if keep_last is None or keep_last <= 0:
        return []
    found = list_checkpoints(checkpoint_dir)
    old = [p for p in found[:-keep_last] if keep is None or p.name != Path(keep).name]
    for path in old:
        # rename first so a crash mid-delete never leaves a half-deleted step_N that looks complete
        doomed = path.with_name(f".del_{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old


def set_aside(path: Path) -> Path | None:
    """Rename a damaged step_N to damaged_step_N (kept for a look, never resumed from or pruned);
    returns the new path, or None when it could not be renamed."""
    path = Path(path)
    target = path.with_name(DAMAGED_PREFIX + path.name)
    for n in range(2, 100):
        if not target.exists():
            break
        target = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{n}")
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target

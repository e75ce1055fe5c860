"""Which checkpoint `--resume` means, and which ones may stand in for it.

`--resume auto` and `--resume RUN_OR_CHECKPOINTS_DIR` mean "the newest intact checkpoint
there": a damaged one is named in a warning, set aside (damaged_step_N) and the one before it
is tried. `--resume .../step_N` names one checkpoint: if it is damaged, that is an error
(CheckpointError, exit 2) naming the file. Here only what costs no read of the data is
checked (COMPLETE, checksums.json, every file there with its size); the reader hashes the
bytes before DCP reads them (trainer.checkpoint.reader).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.checksums import quick_check
from trainer.checkpoint.layout import (COMPLETE_MARKER, CheckpointError, DamagedCheckpoint, checkpoint_root,
                                       is_complete, list_checkpoints, step_of)


@dataclass
class Candidate:
    path: Path
    fallback: bool      # True: when damaged, warn and try the next; False: damaged is an error


def find_latest(path: Path) -> Path | None:
    """Newest complete checkpoint that looks intact (quick_check) in a run dir, a checkpoint
    dir, or `path` itself if it is one."""
    path = Path(path)
    if is_complete(path):
        return path if quick_check(path)[1] is None else None
    for found in reversed(list_checkpoints(checkpoint_root(path))):
        if quick_check(found)[1] is None:
            return found
    return None


def resolve(resume: str | os.PathLike | None, checkpoint_dir: Path, what: str = "--resume") -> Path | None:
    """What `--resume` means: None/"none" -> fresh start; "auto" -> newest intact-looking
    checkpoint under checkpoint_dir (fresh start when there is none); a path (run dir,
    checkpoint dir, or one step_N) -> its newest intact-looking checkpoint, CheckpointError
    when it has none. `what` names the asker in messages ("--resume", "the run")."""
    if _fresh(resume):
        return None
    if str(resume) == "auto":
        return find_latest(checkpoint_dir)
    path = _existing(resume, what)
    if step_of(path) is not None and path.is_dir():
        _check_one(path, what, resume)
        return path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(_none_intact(path, what, resume))
    return latest


def candidates(resume: str | os.PathLike | None, checkpoint_dir: Path, what: str = "--resume") -> list[Candidate]:
    """The checkpoints a run may resume from, in the order to try them. A requeued job restarts
    with the same --resume: the run's own checkpoints come first (newest first), then what
    --resume names. Checkpoints whose files are visibly missing are left in: the reader names
    them as it skips them."""
    if _fresh(resume):
        return []
    own = [Candidate(p, True) for p in reversed(list_checkpoints(Path(checkpoint_dir)))]
    if str(resume) == "auto":
        return own
    path = _existing(resume, what)
    if step_of(path) is not None and path.is_dir():
        if not is_complete(path):
            _check_one(path, what, resume)     # raises: incomplete
        named = [Candidate(path, False)]
    else:
        named = [Candidate(p, True) for p in reversed(list_checkpoints(checkpoint_root(path)))]
        if not named:
            raise CheckpointError(_none_intact(path, what, resume))
    seen = {c.path.resolve() for c in own}
    return own + [c for c in named if c.path.resolve() not in seen]


def before(path: Path) -> Path | None:
    """The newest checkpoint older than `path` beside it that looks intact (a hint)."""
    path = Path(path)
    older = [p for p in list_checkpoints(path.parent) if step_of(p) < step_of(path)]
    for found in reversed(older):
        if quick_check(found)[1] is None:
            return found
    return None


def _fresh(resume) -> bool:
    return resume is None or str(resume).lower() in ("", "none", "no", "false")


def _existing(resume, what: str) -> Path:
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"{what} {resume}: no such file or directory")
    return path


def _check_one(path: Path, what: str, resume) -> None:
    if not is_complete(path):
        raise CheckpointError(f"{what} {resume}: checkpoint is incomplete (no {COMPLETE_MARKER} "
                              "marker: its save was interrupted); pick an earlier step_N")
    problem = quick_check(path)[1]
    if problem is not None:
        raise DamagedCheckpoint(path, f"{problem}{_try_instead(path)}")


def _try_instead(path: Path) -> str:
    earlier = before(path)
    hint = f"--resume {earlier}" if earlier is not None else "--resume auto"
    return f"; resume from an earlier checkpoint ({hint})"


def _none_intact(path: Path, what: str, resume) -> str:
    complete = list_checkpoints(checkpoint_root(path))
    if not complete:
        return (f"{what} {resume}: no complete checkpoint (step_N/ with a {COMPLETE_MARKER} "
                f"marker) in {path}")
    damaged = "; ".join(f"{p.name}: {quick_check(p)[1]}" for p in reversed(complete))
    return f"{what} {resume}: no intact checkpoint in {path} ({damaged})"

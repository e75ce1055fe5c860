"""The dataset folder a prepare writes: checked before anything is touched, locked while it is
built, put in place in one step, and repaired after a kill.

The promise: an existing dataset is never damaged, and nothing Anvil did not write is lost.
The new one is assembled in OUT.tmp-XXXX beside OUT and swapped in by two renames (OUT ->
OUT.old-X, tmp -> OUT), which a lock (flock on .OUT.lock, removed before it is released)
keeps to one run at a time; then whatever in OUT.old-X is not Anvil's (`theirs`: anything
but the files the old manifest lists, in the dataset's layout) is moved back into OUT, and
only Anvil's files go with OUT.old-X. Whatever a killed run left (a tmp, an old, a swap cut
between its renames or before the move back) is finished or undone by the next run while it
holds the lock (`recover`). `check_out` refuses, before anything is written, an --out that
the swap would damage: the filesystem root, the working directory or one above it, a place
inside or around an input, and a folder holding other things, unless --force (then the
dataset is written beside them, none of them touched) and none of them has a name the
dataset uses (manifest.json, tokenizer.json, train/, val/).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from core.files import seal_problem
from core.signals import deferred

from .dataset import FORMAT, MANIFEST
from .errors import DataError
from .parts import stale_folders

EXPECTED_OUT = "expected a new or empty directory, or an existing Anvil dataset to rebuild"
SPLITS = ("train", "val")
NAMES = (MANIFEST, "tokenizer.json", *SPLITS)   # what a dataset puts at the top of its folder
# Every file a prepare writes in a dataset: no other name is ever taken for Anvil's, whatever a manifest says.
_LAYOUT = re.compile(rf"(?:{re.escape(MANIFEST)}|tokenizer\.json|(?:train|val)/(?:\d{{6}}\.bin|documents\.bin))")


def is_dataset_dir(path: Path) -> bool:
    """Whether `path` holds an Anvil dataset: its manifest.json carries the format marker
    (a manifest too damaged to parse still counts when the marker is in its text)."""
    manifest = Path(path) / MANIFEST
    try:
        with open(manifest, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    try:
        data = json.loads(head)
    except ValueError:
        return f'"{FORMAT}"'.encode() in head
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_out(out, inputs: list[str], force: bool = False) -> Path:
    """The absolute --out, or DataError before anything is touched: --out must be missing,
    an empty directory or an Anvil dataset (with `force`, a folder holding other things too,
    none of them named as the dataset's files are), and neither the filesystem root, the
    current directory or one of its parents, nor inside an input or holding one."""
    given = str(out)
    if not given.strip():
        raise DataError("--out is empty; expected a dataset directory such as data/mine")
    out = Path(given).expanduser().absolute()
    real = out.resolve()
    if real == Path(real.anchor):
        raise DataError(f"--out {given} is the filesystem root; expected a dataset directory "
                        f"such as data/mine")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        where = "the current directory" if real == cwd else "a parent of the current directory"
        raise DataError(f"--out {given} is {where} ({real}); expected a dataset directory of its "
                        f"own such as data/mine")
    for name in inputs:
        source = Path(name).resolve()
        if real == source or source in real.parents:
            raise DataError(f"--out {given} is {'' if real == source else 'inside '}the input "
                            f"{source}; expected a directory outside the corpus")
        if real in source.parents:
            raise DataError(f"--out {given} holds the input {source}; expected a directory "
                            f"outside the corpus")
    for parent in out.parents:  # the nearest thing that exists above --out must be a directory
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"--out {given}: a file is in the way where a directory is needed "
                                f"({parent})")
            break
    if out.is_symlink() and not out.exists():
        raise DataError(f"--out {given} is a broken symbolic link; {EXPECTED_OUT}")
    if out.exists():
        if not out.is_dir():
            raise DataError(f"--out {given} is a file, not a directory; {EXPECTED_OUT}")
        try:
            entries = sorted(os.listdir(out))
        except OSError as exc:
            raise DataError(f"--out {given}: cannot read it ({exc.strerror or exc}); "
                            f"{EXPECTED_OUT}") from None
        if entries and not is_dataset_dir(out):
            taken = [name for name in NAMES if name in entries]
            if force and taken:
                raise DataError(f"--out {given} is not an Anvil dataset but holds {taken[0]}, a name the dataset's "
                                f"own files take ({', '.join(NAMES)}); expected a folder without them (nothing "
                                f"was written)")
            if not force:
                shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
                raise DataError(f"--out {given} is a directory holding other things ({len(entries)} "
                                f"{'entry' if len(entries) == 1 else 'entries'}: {shown}) and not an Anvil dataset "
                                f"(no {MANIFEST} with format {FORMAT!r}); {EXPECTED_OUT} (--force writes the "
                                f"dataset beside them, touching none of them)")
    return out


def anvils(folder: Path) -> set[str]:
    """The files Anvil wrote in the dataset at `folder`, relative to it: those its manifest lists (itself,
    the shards, the document indexes, tokenizer.json), or every file of the layout when the manifest
    cannot be trusted (damaged, or edited: its seal broken); nothing in a folder that is no dataset."""
    if not is_dataset_dir(folder):
        return set()
    layout = {f"{split}/{p.name}" for split in SPLITS for p in _entries(folder / split)} | {MANIFEST, "tokenizer.json"}
    layout = {name for name in layout if _LAYOUT.fullmatch(name)}
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
        if seal_problem(manifest):
            return layout
        listed = {MANIFEST, str(manifest["tokenizer"].get("path") or "")}
        for split in manifest["splits"].values():
            listed |= {shard["file"] for shard in split["shards"]} | {(split.get("doc_index") or {}).get("file")}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return layout
    return listed & layout


def _entries(folder: Path) -> list[Path]:
    """What a real folder holds (nothing for a missing folder, a file or a link to a folder)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(folder.iterdir())


def theirs(folder: Path) -> list[str]:
    """What in `folder` Anvil did not write, relative to it: its entries other than the files of
    anvils() and the split folders holding them (inside those, what is not Anvil's)."""
    ours = anvils(folder)
    out = []
    for entry in _entries(folder):
        inside = _entries(entry) if entry.name in SPLITS and not entry.is_symlink() else None
        if inside is None:
            if entry.name not in ours:
                out.append(entry.name)
            continue
        out += [f"{entry.name}/{p.name}" for p in inside if f"{entry.name}/{p.name}" not in ours]
    return out


def put_back(old: Path, out: Path) -> list[str]:
    """Move what in `old` is not Anvil's to the same place in `out` (where that place is free);
    returns what could not be (its place in `out` is taken), which stays in `old`."""
    left = []
    for name in theirs(old):
        target = out / name
        if target.exists() or target.is_symlink():
            left.append(name)
            continue
        target.parent.mkdir(exist_ok=True)
        os.rename(old / name, target)
    return left


def remove_old(old: Path) -> bool:
    """Remove a replaced dataset (OUT.old-X) if nothing in it is the user's; whether it was."""
    if theirs(old):
        return False
    shutil.rmtree(old, ignore_errors=True)
    return True


@contextmanager
def locked(out: Path):
    """Hold the lock of `out` (flock on .OUT.lock beside it) while building it.

    The lock file is removed while still locked, so none is left beside the dataset (one
    killed with SIGKILL stays, empty, and the next run takes it over and removes it). That is
    race-free because the lock counts only on the file that is at the path: a run that
    opened the file just before its holder removed it gets a lock on a file nobody sees any
    more, notices (its inode is not the path's), and opens the path again."""
    lock_path = out.parent / f".{out.name}.lock"
    for _ in range(100):  # each retry needs another run to have finished meanwhile
        try:
            fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise DataError(f"cannot write in {out.parent}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except BlockingIOError:  # held: another run is writing `out`
            os.close(fd)
            held = False
            break
        except FileNotFoundError:  # removed by the run that held it: take the path's new file
            held = False
        except BaseException:
            os.close(fd)
            raise
        if held:
            break
        os.close(fd)
    else:
        held = False
    if not held:
        raise DataError(f"another data.prepare is writing {out} right now "
                        f"(lock {lock_path}); wait for it to finish")
    try:
        yield
    finally:
        try:
            os.unlink(lock_path)  # before the lock goes: see above
        except OSError:
            pass
        os.close(fd)


def recover(out: Path, fingerprint: str | None = None) -> list[str]:
    """Under the lock: finish or undo what a killed run left next to `out`; work folders of
    other inputs or settings go too (this build's own is kept: it holds finished parts)."""
    actions = []
    olds = sorted(out.parent.glob(f"{out.name}.old-*"))
    if not out.exists():
        for old in olds:
            if _entries(old):  # killed between the two renames of a swap: a dataset, or the user's folder
                old.rename(out)
                actions.append(f"restored {out} from {old.name}")
                break
    for leftover in out.parent.glob(f"{out.name}.tmp-*"):   # (only ever Anvil's)
        shutil.rmtree(leftover, ignore_errors=True)
        actions.append(f"removed stale {leftover.name}")
    for old in out.parent.glob(f"{out.name}.old-*"):   # killed before the user's files were put back
        moved = theirs(old)
        left = put_back(old, out) if out.is_dir() else moved
        if len(left) < len(moved):
            actions.append(f"put {len(moved) - len(left)} of your files back in {out} from {old.name}")
        if remove_old(old):
            actions.append(f"removed stale {old.name}")
        else:
            actions.append(f"kept {old.name}: it holds {len(left)} files that are not Anvil's and whose places in "
                           f"{out} are taken (first: {left[0]})")
    for folder in stale_folders(out, fingerprint):
        shutil.rmtree(folder, ignore_errors=True)
        actions.append(f"removed the finished parts of an earlier prepare with other inputs or settings "
                       f"({folder.name})")
    return actions


# Hold a Ctrl-C (and inv's other stop signals: SIGTERM, SIGHUP, SIGUSR2) back until the block is
# over, then raise it (a KeyboardInterrupt). Only the main thread can set handlers; elsewhere the
# block runs as it is.
ctrl_c_deferred = deferred


def remove(path: Path) -> None:
    """rmtree that a second Ctrl-C cannot cut short (it is raised once the folder is gone)."""
    with ctrl_c_deferred():
        shutil.rmtree(path, ignore_errors=True)


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def swap_into_place(tmp: Path, out: Path, force: bool = False) -> None:
    """tmp -> out. With an existing out: out -> out.old-X, tmp -> out, what in old is not Anvil's
    moved back into out, drop old; a kill on the way is repaired by `recover` on the next run."""
    if not out.exists():
        tmp.rename(out)
        return
    if not force and os.listdir(out) and not is_dataset_dir(out):  # filled since check_out looked: keep it
        raise DataError(f"--out {out} was filled with other things while the dataset was being "
                        f"built; it was left as it is; {EXPECTED_OUT}")
    clash = [name for name in theirs(out) if (tmp / name).exists() or (tmp / name).is_symlink()]
    if clash:
        raise DataError(f"--out {out} holds {clash[0]}, which the dataset there does not list as its own, and the "
                        f"new dataset writes a file of that name; both were left as they are: move it elsewhere "
                        f"and run the same command again")
    old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    tmp.rename(out)
    put_back(old, out)
    remove_old(old)



"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint (CHECKPOINT_DIR/step_{N}/):

    .metadata, __*_*.distcp   DCP files: {"model": ..., "optim": ...}, sharded per rank
    ranks/rank{R}.pt          per rank: RNG states (python, numpy, torch CPU, CUDA) and the
                              data loader's state_dict()
    trainer.pt                step, scheduler state_dict, extra (tokens_seen, wall_s, ...)
    meta.json                 human-readable: step, world_size, time, versions, config
    COMPLETE                  written last; a directory without it is never resumed from

Atomicity: every rank writes into CHECKPOINT_DIR/.tmp_step_{N}; after a barrier rank 0 writes
meta.json and COMPLETE, then renames the directory to step_{N} (one atomic rename) and prunes
to the last k. A crash at any point leaves the previous step_* untouched, and a leftover
.tmp_step_* is ignored by `find_latest` and removed by the next save.

Model and optimizer go through torch.distributed.checkpoint.state_dict.get_state_dict /
set_state_dict, whose keys are the plain parameter names whatever the wrapping (FSDP2 DTensor
shards, DDP, or none), so a checkpoint from N ranks loads on M ranks, a single process included.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.errors import UserError
from trainer.files import write_atomic

FORMAT_VERSION = 1
COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
TRAINER_FILE = "trainer.pt"
RANKS_DIR = "ranks"
TMP_PREFIX = ".tmp_step_"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not fit the model: the message says which."""


# ----------------------------------------------------------------------------- discovery

def _step_of(path: Path) -> int | None:
    match = _STEP_RE.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    path = Path(path)
    return _step_of(path) is not None and (path / COMPLETE_MARKER).is_file()


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints under checkpoint_dir, oldest first."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=_step_of)


def _checkpoint_root(path: Path) -> Path:
    """A run dir holds checkpoints/; anything else is taken as the checkpoint dir itself."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def find_latest(path: Path) -> Path | None:
    """Newest complete checkpoint in a run dir, a checkpoint dir, or `path` itself if it is one."""
    path = Path(path)
    if is_complete(path):
        return path
    found = list_checkpoints(_checkpoint_root(path))
    return found[-1] if found else None


def resolve(resume: str | os.PathLike | None, checkpoint_dir: Path, what: str = "--resume") -> Path | None:
    """What `--resume` means: None/"none" -> fresh start; "auto" -> newest complete checkpoint
    under checkpoint_dir (fresh start when there is none); a path (run dir, checkpoint dir, or
    one step_N) -> its newest complete checkpoint, CheckpointError when it has none.
    `what` names the asker in messages ("--resume", "the run")."""
    if resume is None or str(resume).lower() in ("", "none", "no", "false"):
        return None
    if str(resume) == "auto":
        return find_latest(checkpoint_dir)
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"{what} {resume}: no such file or directory")
    if _step_of(path) is not None and path.is_dir() and not is_complete(path):
        raise CheckpointError(f"{what} {resume}: checkpoint is incomplete (no {COMPLETE_MARKER} "
                              "marker: its save was interrupted); pick an earlier step_N")
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{what} {resume}: no complete checkpoint (step_N/ with a "
                              f"{COMPLETE_MARKER} marker) in {path}")
    return latest


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


def read_meta(path: Path) -> dict:
    path = Path(path)
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / META_FILE}: {exc}") from None


# ----------------------------------------------------------------------------- helpers

def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns "assuming the intent is to save in a single process" without a process
    group; that is exactly our intent there."""
    with warnings.catch_warnings():
        if not _dist_on():
            warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
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


def _torch_save_atomic(obj: Any, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _torch_load(path: Path) -> Any:
    try:
        # weights_only: a checkpoint is data, never code (RNG and loader states are plain types)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def rng_state() -> dict:
    """This process's RNG states as plain types (torch.load(weights_only=True) reads them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }
    return state


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _versions() -> dict:
    return {"torch": torch.__version__, "format": FORMAT_VERSION}


# ----------------------------------------------------------------------------- save

def _model_optim_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(path), no_dist=not _dist_on())


def save(checkpoint_dir: Path, step: int, *, model, optimizer, scheduler=None, loader=None,
         extra: dict | None = None, keep_last: int = 3, config: dict | None = None) -> Path:
    """Write checkpoint_dir/step_{step}/ atomically. Collective: every rank calls it.

    model: the plain (possibly fully_shard-ed) module, never the DDP wrapper;
    loader: anything with state_dict() (per rank); config: the training config as a dict
    (stored in meta.json so the checkpoint is self-describing for export);
    keep_last: complete checkpoints kept after this one is in place (<= 0 keeps all).
    """
    checkpoint_dir = Path(checkpoint_dir)
    rank, world = _rank(), _world()
    final = checkpoint_dir / f"step_{step}"
    tmp = checkpoint_dir / f"{TMP_PREFIX}{step}"
    started = time.time()

    if rank == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for stale in checkpoint_dir.glob(f"{TMP_PREFIX}*"):  # leftovers of crashed saves
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / RANKS_DIR).mkdir(parents=True)
    _barrier()

    _dcp_save(_model_optim_state(model, optimizer), tmp)
    _torch_save_atomic({"rng": rng_state(),
                        "loader": loader.state_dict() if loader is not None else None,
                        "rank": rank, "world_size": world},
                       tmp / RANKS_DIR / f"rank{rank}.pt")
    _barrier()  # every rank's shards and state files are on disk

    if rank == 0:
        _torch_save_atomic({"step": int(step),
                            "scheduler": scheduler.state_dict() if scheduler is not None else None,
                            "extra": dict(extra or {})},
                           tmp / TRAINER_FILE)
        meta = {"step": int(step), "world_size": world, "time": time.time(),
                "host": socket.gethostname(), "save_s": None, "versions": _versions(),
                "extra": _jsonable(extra or {}), "config": _jsonable(config),
                "cwd": os.getcwd()}
        meta["save_s"] = round(time.time() - started, 3)
        write_atomic(tmp / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
        write_atomic(tmp / COMPLETE_MARKER, f"{step}\n".encode())
        _fsync_dir(tmp)
        replace_dir(tmp, final)  # the same step may be saved again (final save right after a resume)
        _fsync_dir(checkpoint_dir)
        prune(checkpoint_dir, keep_last)
    _barrier()  # nobody continues (or exits) before the checkpoint is final
    return final


def prune(checkpoint_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints; returns what was removed."""
    if keep_last is None or keep_last <= 0:
        return []
    old = list_checkpoints(checkpoint_dir)[:-keep_last]
    for path in old:
        # rename first so a crash mid-delete never leaves a half-deleted step_N that looks complete
        doomed = path.with_name(f".del_{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str)) if obj is not None else None


# ----------------------------------------------------------------------------- load

def _check_model_config(path: Path, config: dict | None) -> None:
    """Name the differing model fields instead of letting DCP fail on a shape mismatch."""
    if not config or "model" not in config:
        return
    saved = (read_meta(path).get("config") or {}).get("model")
    if not saved:
        return
    current = _jsonable(config["model"])
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}" for k in diff)
        raise CheckpointError(f"checkpoint {path} was trained with a different model ({detail})")


def load(path: Path, *, model, optimizer=None, scheduler=None, loader=None,
         config: dict | None = None) -> dict:
    """Restore model, optimizer, scheduler, loader position and RNG states in place.
    Collective. Works on any world size: DCP re-slices model and optimizer shards; RNG and
    loader states come from the same rank when the world size matches (exact resume), else the
    loader gets rank 0's state and must re-slice its global position for this rank (see
    TokenLoader.load_state_dict) and ranks keep their freshly seeded RNGs.
    Returns {"step": int, "extra": dict, "world_size": saved world size, "path": Path}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                           set_model_state_dict, set_state_dict)

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (expected step_N/ with "
                              f"a {COMPLETE_MARKER} marker)")
    meta = read_meta(path)
    _check_model_config(path, config)
    rank, world = _rank(), _world()
    saved_world = int(meta.get("world_size", 1))

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), no_dist=not _dist_on())
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(f"cannot load {path} into this model/optimizer: {_dcp_reason(exc)}") from None
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])

    trainer_state = _torch_load(path / TRAINER_FILE)
    if scheduler is not None and trainer_state.get("scheduler") is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])

    same_world = saved_world == world
    rank_state = _torch_load(path / RANKS_DIR / f"rank{rank if same_world else 0}.pt")
    if loader is not None and rank_state.get("loader") is not None:
        loader.load_state_dict(rank_state["loader"])
    if same_world:
        set_rng_state(rank_state["rng"])  # last, so nothing above consumes the restored streams
    _barrier()
    return {"step": int(trainer_state["step"]), "extra": dict(trainer_state.get("extra") or {}),
            "world_size": saved_world, "path": path}


def _dcp_reason(exc: BaseException) -> str:
    """DCP's CheckpointException carries each rank's exception with a full traceback; the
    first rank's message is the useful part."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, failure = sorted(failures.items())[0]
        error = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {error}"
    return str(exc)


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as one full CPU state dict, in this single process
    (no process group, no model class needed): read the DCP metadata, allocate the "model.*"
    tensors, and let DCP assemble them from however many shards were written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint")
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"{path} holds no model weights")
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len("model."):]: value for key, value in state.items()}

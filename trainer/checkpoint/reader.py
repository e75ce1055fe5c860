"""Loading: verify a checkpoint's bytes against its checksums, then restore model, optimizer,
scheduler, loader position and RNG states; or, for --resume, the first intact one of a list.

Verifying reads every file once. The ranks share the work (each file is read by one rank, the
bytes spread evenly) and then agree, so a 70B checkpoint costs one read of its size spread over
all ranks; DCP's own read that follows finds the files in the page cache where memory allows.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from trainer.checkpoint import checksums
from trainer.checkpoint.layout import (COMPLETE_MARKER, RANKS_DIR, TRAINER_FILE, CheckpointError,
                                       DamagedCheckpoint, is_complete, read_meta, set_aside)
from trainer.checkpoint.resume import Candidate, before
from trainer.checkpoint.state import (all_gather, barrier, broadcast_from_first, dist_on, jsonable, rank,
                                      set_rng_state, world)

log = logging.getLogger("anvil.trainer")
_said_unverified = False


def verify(path: Path, collective: bool = True) -> bool:
    """Check every file of the checkpoint against checksums.json. Collective by default (every
    rank calls it, each hashes its share, all agree); `collective=False` checks it all here.
    Raises DamagedCheckpoint naming the first bad file. Returns False for a checkpoint saved
    before checksums (loaded unverified, said once)."""
    global _said_unverified
    path = Path(path)
    started = time.perf_counter()
    manifest, problem = checksums.quick_check(path)
    mine: list[str] = []
    if problem is None and manifest is not None:
        mine = checksums.share_of(manifest, *((rank(), world()) if collective else (0, 1)))
        problems = checksums.check_files(path, manifest, mine)
        problem = problems[0] if problems else None
    found = [p for p in (all_gather(problem) if collective else [problem]) if p is not None]
    if found:
        first = min(found, key=lambda p: p.file)
        raise DamagedCheckpoint(path, first.message, first.content)
    if manifest is None:
        if not _said_unverified:
            log.warning(f"{path} has no checksums (saved before Anvil wrote them): loading it unverified")
            _said_unverified = True
        return False
    seconds = time.perf_counter() - started
    nbytes = checksums.total_bytes(manifest, mine)
    log.info(f"verified {path.name}: {len(mine)} of {len(manifest['files'])} files, {nbytes / 1e9:.2f} GB "
             f"on this rank in {seconds:.1f} s ({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
    return True


def load_first_intact(found: list[Candidate], **kwargs) -> dict | None:
    """Load the first intact checkpoint of `found` (resume.candidates); None when there is none
    to try. A damaged fallback candidate is named, set aside and skipped; a damaged named one
    (--resume .../step_N) raises. Every candidate damaged: CheckpointError listing them."""
    damaged = []
    found = broadcast_from_first(found)   # one list for all ranks, whatever each one's file system showed
    for candidate in found:
        try:
            return load(candidate.path, **kwargs)
        except DamagedCheckpoint as exc:
            if not candidate.fallback:
                earlier = before(candidate.path)
                hint = f"--resume {earlier}" if earlier is not None else "--resume auto"
                raise DamagedCheckpoint(candidate.path, f"{exc.problem}; resume from an earlier checkpoint "
                                                        f"({hint})", exc.content) from None
            moved = None
            if rank() == 0 and exc.content:
                moved = set_aside(candidate.path)
            barrier()
            log.warning(f"{exc}; " + (f"set aside as {moved.name}; " if moved else "")
                        + "trying the checkpoint before it")
            damaged.append(f"{candidate.path.name} ({exc.problem})")
    if damaged:
        raise CheckpointError("no intact checkpoint to resume from: " + "; ".join(damaged))
    return None


@contextmanager
def _dcp_tracebacks_quiet():
    """DCP logs each failed read with its traceback through the root logger before it raises;
    the CheckpointError we raise says it in one line."""
    def drop(record: logging.LogRecord) -> bool:
        return "torch/distributed/checkpoint" not in record.pathname.replace("\\", "/")
    root = logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def _check_model_config(path: Path, config: dict | None) -> None:
    """Name the differing model fields instead of letting DCP fail on a shape mismatch."""
    if not config or "model" not in config:
        return
    saved = (read_meta(path).get("config") or {}).get("model")
    if not saved:
        return
    current = jsonable(config["model"])
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}" for k in diff)
        raise CheckpointError(f"checkpoint {path} was trained with a different model ({detail})")


def _torch_load(path: Path):
    try:
        # weights_only: a checkpoint is data, never code (RNG and loader states are plain types)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def load(path: Path, *, model, optimizer=None, scheduler=None, loader=None, config: dict | None = None) -> dict:
    """Verify, then restore model, optimizer, scheduler, loader position and RNG states in place.
    Collective. Works on any world size: DCP re-slices model and optimizer shards; RNG and
    loader states come from the same rank when the world size matches (exact resume), else the
    loader gets rank 0's state and must re-slice its global position for this rank (see
    TokenLoader.load_state_dict) and ranks keep their freshly seeded RNGs.
    Returns {"step": int, "extra": dict, "world_size": saved world size, "path": Path}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                           set_model_state_dict, set_state_dict)

    from trainer.checkpoint import safe_dcp

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (expected step_N/ with "
                              f"a {COMPLETE_MARKER} marker)")
    verify(path)
    meta = read_meta(path)
    _check_model_config(path, config)
    saved_world = int(meta.get("world_size", 1))

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    try:
        with _dcp_tracebacks_quiet():
            dcp.load(state, storage_reader=safe_dcp.reader(path), planner=safe_dcp.planner(), no_dist=not dist_on())
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        if isinstance(dcp_first_error(exc), CheckpointError):    # a value of another kind: said as it is
            raise dcp_first_error(exc) from None
        raise CheckpointError(f"cannot load {path} into this model/optimizer: {dcp_reason(exc)}") from None
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])

    trainer_state = _torch_load(path / TRAINER_FILE)
    if scheduler is not None and trainer_state.get("scheduler") is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])

    same_world = saved_world == world()
    rank_state = _torch_load(path / RANKS_DIR / f"rank{rank() if same_world else 0}.pt")
    if loader is not None and rank_state.get("loader") is not None:
        loader.load_state_dict(rank_state["loader"])
    if same_world:
        set_rng_state(rank_state["rng"])  # last, so nothing above consumes the restored streams
    barrier()
    return {"step": int(trainer_state["step"]), "extra": dict(trainer_state.get("extra") or {}),
            "world_size": saved_world, "path": path}


def dcp_reason(exc: BaseException) -> str:
    """DCP's CheckpointException carries each rank's exception with a full traceback; the
    first rank's exception is the useful part."""
    error = dcp_first_error(exc)
    if error is not exc:
        return f"rank {dcp_first_rank(exc)}: {error}"
    return str(exc)


def dcp_first_error(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    _, failure = sorted(failures.items())[0]
    return failure[0] if isinstance(failure, tuple) else failure


def dcp_first_rank(exc: BaseException) -> int | None:
    failures = getattr(exc, "failures", None)
    return sorted(failures)[0] if failures else None


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as one full CPU state dict, in this single process
    (no process group, no model class needed): verify every file, read the DCP metadata,
    allocate the "model.*" tensors, and let DCP assemble them from however many shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.checkpoint import safe_dcp

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint")
    verify(path, collective=False)
    reader = safe_dcp.reader(path)
    metadata = reader.read_metadata()
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"{path} holds no model weights")
    with _dcp_tracebacks_quiet():
        dcp.load(state, storage_reader=reader, planner=safe_dcp.planner(), no_dist=True)
    return {key[len("model."):]: value for key, value in state.items()}

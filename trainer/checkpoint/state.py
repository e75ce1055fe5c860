"""What a checkpoint captures besides DCP's shards, and the process-group helpers the writer
and the reader share: RNG states, the model and optimizer state dicts, versions."""
from __future__ import annotations

import io
import json
import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoint.layout import FORMAT_VERSION

# DCP warns "assuming the intent is to save in a single process" without a process group;
# that is exactly our intent there. A filter, not catch_warnings: saves run on a thread too.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def world() -> int:
    return dist.get_world_size() if dist_on() else 1


def barrier(group=None) -> None:
    if dist_on():
        dist.barrier(group=group)


def all_gather(obj: Any, group=None) -> list:
    if not dist_on():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_to_first(obj: Any, group=None) -> list | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    if not dist_on():
        return [obj]
    out = [None] * dist.get_world_size(group) if rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def broadcast_from_first(obj: Any, group=None) -> Any:
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def rng_state() -> dict:
    """This process's RNG states as plain types (torch.load(weights_only=True) reads them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def versions() -> dict:
    return {"torch": torch.__version__, "format": FORMAT_VERSION}


def jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str)) if obj is not None else None


def to_bytes(obj: Any) -> bytes:
    """torch.save into memory: the bytes are a snapshot, written (and hashed) later."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def model_optim_state(model, optimizer) -> dict:
    """{"model": ..., "optim": ...} keyed by plain parameter names whatever the wrapping (FSDP2
    DTensor shards, DDP, none): what DCP saves and loads, on any world size."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def dtensor_type() -> type:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # torch 2.4
        from torch.distributed._tensor import DTensor
    return DTensor


def tensors_of(state: Any, key: tuple = ()):
    """(path, tensor) of every tensor this rank holds in a state dict (a DTensor: its local
    shard); the path is the keys and indices that lead to it."""
    if isinstance(state, dtensor_type()):
        yield key, state._local_tensor
    elif isinstance(state, torch.Tensor):
        yield key, state
    elif isinstance(state, dict):
        for k, value in state.items():
            yield from tensors_of(value, key + (k,))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from tensors_of(value, key + (i,))


def local_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors_of(state))

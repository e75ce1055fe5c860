"""Copy a state dict into host memory that the background write can read while training goes
on: the only part of an asynchronous save that the training loop waits for.

The buffers are allocated at the first save and reused by every later one (at most one save
is in flight, so the previous write is done with them). On a GPU they are page-locked, so the
device-to-host copies run at full speed (55 GB/s on an H200) and asynchronously: the copies
are queued on the training stream, ahead of the next optimizer step that would change the
weights, and the writer thread waits for a CUDA event before it reads them.

Page-locked memory comes from anonymous mmaps registered with cudaHostRegister, one per
tensor, exactly its size: torch's pinned allocator rounds every block up to a power of two,
which for a state made of large tensors costs up to twice the memory. Where registering
fails (no CUDA runtime call of that name), the buffers stay pageable and the copies wait.
"""
from __future__ import annotations

import copy
import logging
import mmap
from typing import Any

import torch

from trainer.checkpoint.state import dtensor_type

log = logging.getLogger("anvil.trainer")


class Stager:
    def __init__(self):
        self._staged: dict[tuple, Any] = {}     # path in the state dict -> staged tensor / DTensor
        self._registered: list[int] = []        # data pointers given to cudaHostRegister
        self._can_pin = True

    def stage(self, state: Any) -> tuple[Any, "torch.cuda.Event | None"]:
        """(a copy of `state` in host buffers, an event the copies complete at or None)."""
        self._on_device = False
        staged = self._stage(state, ())
        if not self._on_device:
            return staged, None
        event = torch.cuda.Event()
        event.record()
        return staged, event

    def _stage(self, obj: Any, key: tuple) -> Any:
        DTensor = dtensor_type()
        if isinstance(obj, DTensor):
            local = obj._local_tensor
            shell = self._staged.get(key)
            if shell is None or not _fits(shell._local_tensor, local):
                # DTensor's own metadata (mesh, placements, global shape) around a host buffer,
                # as torch.distributed.checkpoint's own staging builds it
                shell = obj.to("cpu") if obj.device.type != "cpu" else copy.deepcopy(obj)
                shell._local_tensor = self._empty(local)
                self._staged[key] = shell
            self._copy(shell._local_tensor, local)
            return shell
        if isinstance(obj, torch.Tensor):
            buffer = self._staged.get(key)
            if buffer is None or not _fits(buffer, obj):
                buffer = self._staged[key] = self._empty(obj)
            self._copy(buffer, obj)
            return buffer
        if isinstance(obj, dict):
            return {k: self._stage(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._stage(v, key + (i,)) for i, v in enumerate(obj))
        return obj   # numbers, strings, None: immutable

    def _copy(self, buffer: torch.Tensor, source: torch.Tensor) -> None:
        on_device = source.device.type == "cuda"
        self._on_device |= on_device
        with torch.no_grad():
            buffer.copy_(source.detach(), non_blocking=on_device)

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if like.device.type != "cuda" or nbytes == 0 or not self._can_pin:
            return torch.empty(like.shape, dtype=like.dtype)
        region = mmap.mmap(-1, nbytes)
        tensor = torch.frombuffer(region, dtype=like.dtype, count=like.numel()).view(like.shape)
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0))
        if code != 0:
            self._can_pin = False
            log.warning(f"checkpoint staging: cannot page-lock host memory (cudaHostRegister error "
                        f"{code}); staging into pageable memory, which makes each save's pause longer")
            return tensor
        self._registered.append(tensor.data_ptr())
        return tensor

    def close(self) -> None:
        """Unregister the page-locked buffers and let them go."""
        for pointer in self._registered:
            torch.cuda.cudart().cudaHostUnregister(pointer)
        self._registered.clear()
        self._staged.clear()


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.shape == source.shape and buffer.dtype == source.dtype

"""Copy a state dict into host memory that the background write can read while training goes
on: the only part of an asynchronous save that the training loop waits for.

The buffers are made once and reused by every later save (at most one save is in flight, so
the previous write is done with them). On a GPU they are page-locked, so the device-to-host
copies run at the link's speed (51-54 GB/s measured on an H100) and asynchronously: they are
queued on the training stream, ahead of the next optimizer step that would change the
weights, and the writer thread waits for a CUDA event before it reads them.

Page-locked memory comes from anonymous mmaps registered with cudaHostRegister, one per
tensor, exactly its size: torch's pinned allocator rounds every block up to a power of two,
which for a state made of large tensors costs up to twice the memory. Page-locking fresh
memory costs 0.5 s per GB, nearly all of it page faults; memory already faulted in registers
at 0.06 s per GB (H100 host). So `reserve` faults the buffers in on a thread, with
MAP_POPULATE, ahead of the first save, and then registers them on that thread too, one
buffer per call (at most about 1 GB, 0.07 s, for llama3_8b's largest shard): registering
everything in one call on a thread held up the training thread's CUDA calls for the whole
of it. Registering at the first save paused a two-GPU llama3_8b run 3.3-3.7 s (48 GB a
rank); on the thread, that save paused 0.1 s, and the run paid about the same 4 s once, in
the few steps the registration overlapped (it is logged). The save's own pause is what a
preemption notice waits on. The buffers are registered portable (pinned for every CUDA
context of the process), from the thread with the state's device current. What the thread
has not registered by the first save, that save registers. Where registering fails, the
buffers stay pageable and the copies wait (about 1 GB/s).
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from typing import Any

import torch

from trainer.checkpoint.state import dtensor_type, tensors_of

log = logging.getLogger("anvil.trainer")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)   # Linux
_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every CUDA context, not only the caller's


class Stager:
    def __init__(self):
        self._staged: dict[tuple, Any] = {}     # path in the state dict -> staged tensor / DTensor
        self._registered: list[int] = []        # data pointers given to cudaHostRegister
        self._regions: dict[tuple, mmap.mmap] = {}   # faulted in ahead of the first save
        self._pinned: dict[tuple, int] = {}     # which of those the reserve thread registered: their pointers
        self._reserving: threading.Thread | None = None
        self._can_pin = True
        self._on_device = False

    def reserve(self, state: Any, wait: bool = False) -> None:
        """Fault in, on a thread, the host memory that staging `state` will take (GPU tensors);
        wait: until it is done."""
        tensors = [(key, t) for key, t in tensors_of(state) if t.device.type == "cuda" and _nbytes(t)]
        if not tensors or self._reserving is not None:
            return
        device = tensors[0][1].device

        def populate() -> None:
            for key, tensor in tensors:
                try:
                    self._regions[key] = mmap.mmap(-1, _nbytes(tensor), flags=mmap.MAP_SHARED | _POPULATE)
                except OSError:
                    return   # no room: stage() allocates what is missing
            torch.cuda.set_device(device)   # a new thread's current device is 0, whatever the rank's
            started = time.perf_counter()
            for key, region in self._regions.items():
                pointer = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
                if int(torch.cuda.cudart().cudaHostRegister(pointer, len(region), _PORTABLE)) != 0:
                    return   # stage() registers the rest, and says so if it cannot
                self._pinned[key] = pointer
                time.sleep(0.001)   # let the training thread's CUDA calls in between
            # Said, since the steps it overlaps run slower (a two-GPU llama3_8b run: 4 s over 4 steps)
            log.info(f"checkpoint staging: {sum(len(r) for r in self._regions.values()) / 1e9:.1f} GB of host "
                     f"memory page-locked ahead of the first save, in {time.perf_counter() - started:.1f} s")
        self._reserving = threading.Thread(target=populate, name="checkpoint-reserve", daemon=True)
        self._reserving.start()
        if wait:
            self._reserving.join()

    def stage(self, state: Any) -> tuple[Any, "torch.cuda.Event | None"]:
        """(a copy of `state` in host buffers, an event the copies complete at or None)."""
        if self._reserving is not None:
            self._reserving.join()
        self._on_device = False
        staged = self._stage(state, ())
        self._drop_reserved()      # what was reserved and not used (the state changed)
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
                # The DTensor's own spec (mesh, placements, global shape) around a host buffer.
                # Not obj.to("cpu"), as DCP's own staging makes its shell: that copies the whole
                # shard into fresh pageable memory first, on the training thread (38 s of a
                # llama3_8b save on two H200s, 48 GB a rank, for a copy thrown away).
                shell = DTensor(self._empty(local, key), obj._spec, requires_grad=False)
                self._staged[key] = shell
            self._copy(shell._local_tensor, local)
            return shell
        if isinstance(obj, torch.Tensor):
            buffer = self._staged.get(key)
            if buffer is None or not _fits(buffer, obj):
                buffer = self._staged[key] = self._empty(obj, key)
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

    def _empty(self, like: torch.Tensor, key: tuple) -> torch.Tensor:
        nbytes = _nbytes(like)
        if like.device.type != "cuda" or nbytes == 0 or not self._can_pin:
            return torch.empty(like.shape, dtype=like.dtype)
        region, pointer = self._regions.pop(key, None), self._pinned.pop(key, None)
        if region is None or len(region) != nbytes:   # not reserved, or for another shape
            if pointer is not None:
                torch.cuda.cudart().cudaHostUnregister(pointer)
            region, pointer = mmap.mmap(-1, nbytes), None
        tensor = torch.frombuffer(region, dtype=like.dtype, count=like.numel()).view(like.shape)
        if pointer is not None:      # registered ahead by the reserve thread
            self._registered.append(pointer)
            return tensor
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _PORTABLE))
        if code != 0:
            self._can_pin = False
            log.warning(f"checkpoint staging: cannot page-lock host memory (cudaHostRegister error "
                        f"{code}); staging into pageable memory, which makes each save's pause longer")
            return tensor
        self._registered.append(tensor.data_ptr())
        return tensor

    def close(self) -> None:
        """Unregister the page-locked buffers and let them go."""
        if self._reserving is not None:
            self._reserving.join()
        for pointer in self._registered:
            torch.cuda.cudart().cudaHostUnregister(pointer)
        self._registered.clear()
        self._staged.clear()
        self._drop_reserved()

    def _drop_reserved(self) -> None:
        """Let go of reserved buffers no save took (unregistered first: their memory goes)."""
        for key in list(self._regions):
            pointer = self._pinned.pop(key, None)
            if pointer is not None:
                torch.cuda.cudart().cudaHostUnregister(pointer)
        self._regions.clear()
        self._pinned.clear()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.shape == source.shape and buffer.dtype == source.dtype

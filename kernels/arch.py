"""Launch parameters per GPU architecture.

Every kernel asks this module for its block sizes, warps and grid sizes, so no
kernel carries an NVIDIA-only constant. The table is keyed by architecture
name (sm_90, gfx942, ...); an unknown architecture falls back to its vendor's
row. HIP wavefronts are 64 lanes wide, so a program of more than 16 warps
would exceed the 1024-thread limit (Liger-Kernel issue #231): the cap lives
here and every num_warps goes through `clamp_warps`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from core.vendor import Vendor


@dataclass(frozen=True)
class ArchParams:
    """Tuning knobs for one architecture family."""

    warp_size: int  # lanes per warp / wavefront
    max_warps: int  # most warps one program may use
    elems_per_thread: int  # target elements per thread for row kernels
    programs_per_sm: int  # resident programs per SM/CU for persistent kernels
    elementwise_block: int  # elements per program for flat elementwise kernels
    elementwise_warps: int


# sm_90 measured on an H200 (benchmarks/cases_elementwise.py --sweep, 2026-11-22): RMSNorm
# 65536x4096 fwd+bwd 0.688 ms at 32 elements/thread (4 warps per 4096-row) against 0.732 at
# 16 and 0.756 at 8; elementwise blocks 1024-8192 all ran at the copy ceiling. sm_80 and the
# AMD rows are not measured: they follow the same bytes-in-flight reasoning, scaled by wave width.
_TABLE: dict[str, ArchParams] = {
    Vendor.NVIDIA: ArchParams(32, 32, 16, 4, 4096, 8),   # an NVIDIA architecture not listed
    "sm_80": ArchParams(32, 32, 16, 4, 4096, 8),
    "sm_90": ArchParams(32, 32, 32, 4, 4096, 8),
    Vendor.AMD: ArchParams(64, 16, 16, 2, 4096, 8),      # an AMD architecture not listed
    "gfx90a": ArchParams(64, 16, 16, 2, 4096, 8),
    "gfx942": ArchParams(64, 16, 16, 2, 4096, 8),
    "gfx950": ArchParams(64, 16, 16, 2, 4096, 8),
    # TRITON_INTERPRET=1 on the CPU: warps are ignored, small blocks keep numpy fast.
    Vendor.CPU: ArchParams(32, 32, 16, 1, 1024, 4),
}


@dataclass(frozen=True)
class Arch:
    vendor: Vendor
    name: str  # "sm_90", "gfx942", "cpu"
    sm_count: int
    params: ArchParams


def _params_for(vendor: Vendor, name: str) -> ArchParams:
    return _TABLE.get(name) or _TABLE[vendor]


@functools.lru_cache(maxsize=None)
def _detect(device_type: str, index: int) -> Arch:
    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return Arch(Vendor.CPU, "cpu", 1, _TABLE[Vendor.CPU])
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        # gcnArchName looks like "gfx942:sramecc+:xnack-"
        name = getattr(props, "gcnArchName", "gfx").split(":")[0]
        vendor = Vendor.AMD
    else:
        name = f"sm_{props.major}{props.minor}"
        vendor = Vendor.NVIDIA
    return Arch(vendor, name, props.multi_processor_count, _params_for(vendor, name))


def detect(device: torch.device | None = None) -> Arch:
    """Architecture of `device` (default: the current CUDA/HIP device, else CPU)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _detect(device.type, index)


def clamp_warps(arch: Arch, num_warps: int) -> int:
    """Power of two in [1, arch max]; never more than 16 on HIP."""
    return max(1, min(num_warps, arch.params.max_warps))


def next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def row_config(arch: Arch, n_cols: int, max_block: int = 65536, tile_elems: int = 4096) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for a kernel that holds ROWS rows of n_cols in registers.

    Short rows are packed ROWS to a program so each program still moves about
    tile_elems elements; warps follow the tile size at elems_per_thread each.
    """
    block = next_pow2(n_cols)
    if block > max_block:
        raise ValueError(f"row of {n_cols} elements exceeds the largest supported block ({max_block})")
    rows = max(1, tile_elems // block)
    p = arch.params
    threads = rows * block // p.elems_per_thread
    return block, rows, clamp_warps(arch, next_pow2(max(1, threads // p.warp_size)))


def persistent_grid(arch: Arch, n_work: int, per_sm: int | None = None) -> int:
    """Programs for a persistent kernel that loops over n_work items: per_sm (default the arch's) an SM."""
    return max(1, min(n_work, arch.sm_count * (per_sm or arch.params.programs_per_sm)))


def elementwise_config(arch: Arch) -> tuple[int, int]:
    """(BLOCK, num_warps) for flat elementwise kernels."""
    return arch.params.elementwise_block, clamp_warps(arch, arch.params.elementwise_warps)

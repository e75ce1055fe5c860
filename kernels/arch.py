"""Launch parameters per GPU architecture.

Every kernel asks this module for its block sizes, warps and grid sizes, so no
kernel carries an NVIDIA-only constant. The table is keyed by architecture
name (sm_90, gfx942, ...); an unknown architecture falls back to its vendor's
row. HIP wavefronts are 64 lanes wide, so a program of more than 16 warps
would exceed the 1024-thread limit (Liger-Kernel issue #231): the cap lives
here and every num_warps goes through `clamp_warps`.
"""

from __future__ import annotations

import dataclasses
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


# --- tiled GEMMs (kernels/grouped_gemm.py) ----------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    """One launch of a tiled GEMM kernel: an output tile of block_m x block_n, block_k of the reduction a
    step, programs_per_sm persistent programs an SM (2: one's epilogue hides under the other's main loop)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1
    tma: bool = False  # operands through tensor descriptors (TMA) where the tensors allow it (sm_90+)
    flatten: bool = False  # tl.range(flatten=True): tile and reduction loops pipelined as one (when the
    #                        reduction's length is the same for every tile: not the weight gradient's)
    options: tuple[tuple[str, int], ...] = ()  # vendor launch options (AMD: matrix_instr_nonkdim, waves_per_eu)

    def for_itemsize(self, itemsize: int) -> "GemmConfig":
        """The same shared-memory bytes a stage for wider elements: fp32 halves block_k."""
        return dataclasses.replace(self, block_k=max(16, self.block_k * 2 // max(2, itemsize)))

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.options)}


# Candidates per architecture, timed on the real operands once per signature (kernels/grouped_gemm.py);
# the first is the one used untimed. sm_90 (H100/H200: 228 KiB shared memory and 64K registers an SM,
# wgmma over warp groups of 4 warps), not yet timed (benchmarks/cases_moe.py --sweep times each):
# one 8-warp program an SM (a 128x128 fp32 accumulator is 64 registers a thread at 8 warps, 128 at 4),
# with and without flatten (the tile loop and the reduction loop pipelined as one, hiding each tile's
# prologue and epilogue; the forward's reduction length is the same for every tile so the compiler
# can fuse them); or two 4-warp programs an SM, one's epilogue under the other's main loop (2 x 96 KiB
# shared, 2 x 128 threads x at most 255 registers); 64-row tiles for experts with few rows each; and
# pointer loads in case the TMA path loses. sm_80 (no TMA, 164 KiB): the Triton matmul tutorial's A100
# tiles, not run. AMD (not run; AMD's "Optimizing Triton kernels" guide for MI300X: 304 CUs, 64-wide
# wavefronts, 64 KiB LDS a CU, num_stages=2 for the stream pipeliner, matrix_instr_nonkdim=16 for the
# 16x16 MFMA, waves_per_eu to trade registers for occupancy): tiles whose single LDS stage,
# (block_m + block_n) x block_k x 2 bytes, fits the 64 KiB.
_AMD_GEMM = (
    GemmConfig(256, 256, 32, 8, 2, 1, options=(("matrix_instr_nonkdim", 16), ("waves_per_eu", 0))),
    GemmConfig(128, 256, 64, 8, 2, 1, options=(("matrix_instr_nonkdim", 16), ("waves_per_eu", 0))),
    GemmConfig(128, 128, 64, 8, 2, 2, options=(("matrix_instr_nonkdim", 16), ("waves_per_eu", 2))),
)
_GEMM_TABLE: dict[str, tuple[GemmConfig, ...]] = {
    "sm_90": (
        GemmConfig(128, 128, 64, 8, 4, 1, tma=True),
        GemmConfig(128, 128, 64, 8, 4, 1, tma=True, flatten=True),
        GemmConfig(128, 256, 64, 8, 3, 1, tma=True, flatten=True),
        GemmConfig(128, 128, 64, 4, 3, 2, tma=True),
        GemmConfig(64, 128, 64, 4, 4, 2, tma=True),
        GemmConfig(128, 128, 64, 8, 3, 1),
    ),
    Vendor.NVIDIA: (GemmConfig(128, 128, 32, 4, 4, 1), GemmConfig(128, 128, 64, 8, 3, 1),
                    GemmConfig(64, 128, 32, 4, 4, 2)),
    Vendor.AMD: _AMD_GEMM,
    "gfx942": _AMD_GEMM,
    # The interpreter: tl.dot's smallest tile, three programs so the persistent stride is exercised, TMA
    # (the interpreter emulates tensor descriptors) so the sm_90 path runs in the CPU tests too.
    Vendor.CPU: (GemmConfig(16, 16, 16, 1, 1, 3, tma=True),),
}


def gemm_configs(arch: Arch, itemsize: int = 2) -> tuple[GemmConfig, ...]:
    """The tiled-GEMM candidates for `arch` and an element size (bytes); the first is the untimed default."""
    rows = _GEMM_TABLE.get(arch.name) or _GEMM_TABLE[arch.vendor]
    return tuple(c.for_itemsize(itemsize) for c in rows)

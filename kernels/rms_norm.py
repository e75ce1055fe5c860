"""RMSNorm, forward and backward, as transformers' LlamaRMSNorm computes it.

LlamaRMSNorm: statistics in fp32, the normalized x cast back to the input
dtype, then multiplied by the weight (so the output dtype is the promotion of
x's and weight's dtypes). Forward stores one fp32 rstd per row. Backward is a
persistent kernel: each program loops over rows, writes dx, and keeps its own
fp32 dW partial in registers. On NVIDIA the partials meet in the same launch
(fp32 atomics into a zeroed [H] buffer; the program that takes the last ticket
casts it into dW); elsewhere, and under torch.use_deterministic_algorithms,
the [programs, H] partials are summed by a second small kernel. Never a
[rows, H] buffer.

Eager calls go through a torch.autograd.Function (a few microseconds of
Python); under torch.compile the same launchers run inside the custom ops
anvil::rms_norm_fwd / anvil::rms_norm_bwd, which trace without graph breaks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from core.vendor import Vendor
from kernels import arch, float8


@triton.jit
def _load(ptrs, mask, EVICT: tl.constexpr):
    # Single-use streams: evict_first keeps them from pushing reusable lines (W, partials) out of L2.
    if EVICT:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store(ptrs, value, mask, EVICT: tl.constexpr):
    if EVICT:
        tl.store(ptrs, value, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, EVICT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = _load(X + rows[:, None] * stride_x + cols[None, :], mask, EVICT).to(tl.float32)
    rstd = _rstd(x, n_cols, eps)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    _store(Y + rows[:, None] * stride_y + cols[None, :], _normed(x, rstd, w, X.dtype.element_ty, Y.dtype.element_ty),
           mask, EVICT)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rstd(x, n_cols, eps):
    return tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)


@triton.jit
def _normed(x, rstd, w, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr):
    """y of a [ROWS, BLOCK] tile of fp32 x, in Y_DTYPE. LlamaRMSNorm rounds the normalized x to the
    input dtype before the weight."""
    x_hat = (x * rstd[:, None]).to(X_DTYPE).to(tl.float32)
    return (x_hat * w[None, :]).to(Y_DTYPE)


# --- float8 output (kernels/float8.py): an amax pass, then a cast pass ------------------------------

@triton.jit
def _rms_norm_amax_kernel(
    X, W, RSTD, AMAX, n_rows, n_cols, stride_x, eps,
    Y_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """Persistent: rstd of every row, and max |y| over all rows folded into AMAX (one atomic per program)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.cdiv(n_rows, ROWS) - pid, n_programs)):
        rows = (pid + i * n_programs).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        rstd = _rstd(x, n_cols, eps)
        y = _normed(x, rstd, w, X.dtype.element_ty, Y_DTYPE).to(V_DTYPE).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))   # masked columns and rows are 0
        tl.store(RSTD + rows, rstd, mask=row_mask)
    tl.atomic_max(AMAX, tl.max(amax, axis=0), sem="relaxed")


@triton.jit
def _rms_norm_float8_kernel(
    X, W, RSTD, AMAX, Q, SCALE, n_rows, n_cols, stride_x,
    Y_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MANTISSA: tl.constexpr, ROUND_IN_KERNEL: tl.constexpr,
):
    """y again from x and the stored rstd, written as float8 with the tensor's scale."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = _normed(x, rstd, w, X.dtype.element_ty, Y_DTYPE).to(V_DTYPE)
    scale = float8.scale_of(AMAX, FP8_MAX)
    tl.store(Q + rows[:, None] * n_cols + cols[None, :],
             float8.to_float8_grid(y, scale, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)
             .to(Q.dtype.element_ty), mask=mask)
    if pid == 0:
        tl.store(SCALE, scale)


@triton.jit
def _bwd_tile(x, dy, rstd, w, n_cols, dw_acc, COMPUTE_DW: tl.constexpr):
    """dx of one [ROWS, BLOCK] tile (fp32) and dw_acc plus this tile's dW contribution."""
    x_hat = x.to(tl.float32) * rstd[:, None]
    g = dy.to(tl.float32) * w[None, :]
    if COMPUTE_DW:
        # dW sees exactly the rounded x_hat the forward multiplied by W.
        dw_acc += tl.sum(dy.to(tl.float32) * x_hat.to(x.dtype).to(tl.float32), axis=0)
    c = tl.sum(g * x_hat, axis=1) / n_cols
    return (g - x_hat * c[:, None]) * rstd[:, None], dw_acc


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, DW_TOTAL, COUNTER, DW, n_rows, n_cols, stride_dy, stride_x, stride_dx,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COMPUTE_DW: tl.constexpr, PREFETCH: tl.constexpr,
    EVICT: tl.constexpr, FOLD_DW: tl.constexpr, EVICT_DX: tl.constexpr = False, STAGES: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, ROWS)
    # Tiles pid, pid + n_programs, ...; index arithmetic in int64.
    if PREFETCH:
        # The next tile's loads are issued before this tile's math: two tiles of bytes in flight.
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load(X + rows[:, None] * stride_x + cols[None, :], mask, EVICT)
        dy = _load(DY + rows[:, None] * stride_dy + cols[None, :], mask, EVICT)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        for i in range(0, tl.cdiv(n_tiles - pid, n_programs)):
            next_rows = rows + n_programs * ROWS
            next_row_mask = next_rows < n_rows
            next_mask = next_row_mask[:, None] & col_mask[None, :]
            x_next = _load(X + next_rows[:, None] * stride_x + cols[None, :], next_mask, EVICT)
            dy_next = _load(DY + next_rows[:, None] * stride_dy + cols[None, :], next_mask, EVICT)
            rstd_next = tl.load(RSTD + next_rows, mask=next_row_mask, other=0.0)
            dx, dw_acc = _bwd_tile(x, dy, rstd, w, n_cols, dw_acc, COMPUTE_DW)
            _store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask, EVICT or EVICT_DX)
            rows, mask, x, dy, rstd = next_rows, next_mask, x_next, dy_next, rstd_next
    else:
        for i in tl.range(0, tl.cdiv(n_tiles - pid, n_programs), num_stages=STAGES):
            rows = (pid + i * n_programs).to(tl.int64) * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load(X + rows[:, None] * stride_x + cols[None, :], mask, EVICT)
            dy = _load(DY + rows[:, None] * stride_dy + cols[None, :], mask, EVICT)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            dx, dw_acc = _bwd_tile(x, dy, rstd, w, n_cols, dw_acc, COMPUTE_DW)
            _store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask, EVICT or EVICT_DX)
    if COMPUTE_DW:
        if FOLD_DW:
            # One launch: fp32 atomics into DW_TOTAL (zeroed, like COUNTER); the program that
            # takes the last ticket casts the sum into DW. Summation order varies run to run.
            tl.atomic_add(DW_TOTAL + cols, dw_acc, mask=col_mask, sem="relaxed")
            tl.debug_barrier()
            ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel")
            if ticket == n_programs - 1:
                # an atomic read: the other programs' sums live in L2, not in this SM's L1
                total = tl.atomic_add(DW_TOTAL + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=col_mask,
                                      sem="acquire")
                tl.store(DW + cols, total.to(DW.dtype.element_ty), mask=col_mask)
        else:
            tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


@triton.jit
def _sum_rows_kernel(P, OUT, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT[c] = sum_r P[r, c] in fp32, cast to OUT's dtype (the dW reduction)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(P + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[..., H] -> [rows, H] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x on {x.device} but weight on {weight.device}")


@dataclass(frozen=True)
class Tuning:
    """Launch choices beyond kernels/arch.py's row_config, per vendor (benchmarks/cases_elementwise.py
    --sweep times the alternatives)."""

    fwd_evict: bool = False  # evict_first on the forward's x loads and y stores
    fwd_rows: int = 1  # row_config's rows times this per forward program
    fwd_warps: int = 1  # row_config's warps times this for the forward
    bwd_rows: int = 1  # row_config's rows times this per backward loop iteration
    bwd_warps: int = 1  # row_config's warps times this for the backward
    programs_per_sm: int | None = None  # backward's persistent programs per SM (None: the arch table's)
    prefetch: bool = True  # backward loads the next tile before this tile's math
    evict: bool = False  # evict_first on the backward's x/dy loads and dx stores
    evict_dx: bool = False  # evict_first on the dx stores alone
    stages: int = 1  # without prefetch: Triton's loop pipelining depth (tl.range num_stages)
    fold_dw: bool = False  # dW summed by fp32 atomics in the same launch (not under deterministic mode)


# sm_90 (H200, 2026-11-22, `python -m benchmarks.cases_elementwise --sweep`, 65536x4096 bf16 fwd+bwd,
# one run): folded dW, no manual prefetch, Triton's 3-stage loop pipelining (cp.async into shared
# memory), 2 programs per SM: 0.660 ms (backward 0.397); folded dW with the register prefetch 0.680;
# the old two-launch default 0.694. Slower: 3/5 programs per SM, 2 stages, evict_first hints (+0.04 ms
# with them on every stream), two rows per iteration, 8 warps. HIP keeps the two-launch reduction and
# the register prefetch until they are measured on AMD.
_TUNING: dict[Vendor, Tuning] = {
    Vendor.NVIDIA: Tuning(fold_dw=True, prefetch=False, stages=3, programs_per_sm=2),
    Vendor.AMD: Tuning(),
    Vendor.CPU: Tuning(),
}
TUNING_OVERRIDE: Tuning | None = None  # for sweeps; call _config.cache_clear() after setting it


@dataclass(frozen=True)
class _Plan:
    block: int
    fwd_rows: int
    fwd_warps: int
    bwd_rows: int
    bwd_warps: int
    max_programs: int
    tuning: Tuning


@functools.lru_cache(maxsize=None)
def _config(device: torch.device, n_cols: int) -> _Plan:
    """Block, rows, warps and persistent grid for rows of n_cols on this device."""
    a = arch.detect(device)
    t = TUNING_OVERRIDE or _TUNING.get(a.vendor, Tuning())
    block, rows, warps = arch.row_config(a, n_cols)
    pps = t.programs_per_sm or a.params.programs_per_sm
    return _Plan(block, rows * t.fwd_rows, arch.clamp_warps(a, warps * t.fwd_warps), rows * t.bwd_rows, arch.clamp_warps(a, warps * t.bwd_warps),
                 max(1, a.sm_count * pps), t)


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x2 = _as_rows(x, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    p = _config(x.device, n_cols)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, p.fwd_rows),)](
        x2, weight.contiguous(), y, rstd, n_rows, n_cols, x2.stride(0), n_cols, eps,
        BLOCK=p.block, ROWS=p.fwd_rows, EVICT=p.tuning.fwd_evict, num_warps=p.fwd_warps,
    )
    return y, rstd


def _forward_float8(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype,
                    value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y as float8 [..., H], its float32 scale [], rstd [rows]); y rounded to value_dtype before scaling."""
    n_cols = x.shape[-1]
    x2 = _as_rows(x, n_cols)
    n_rows = x2.shape[0]
    y_dtype = torch.promote_types(x.dtype, weight.dtype)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    amax, scale = float8.amax_and_scale(x.device)
    if n_rows == 0:
        scale.fill_(torch.finfo(fp8_dtype).max / float8.EPS)
        return q, scale, rstd
    p = _config(x.device, n_cols)
    a = arch.detect(x.device)
    w = weight.contiguous()
    types = dict(Y_DTYPE=float8.to_triton(y_dtype), V_DTYPE=float8.to_triton(value_dtype))
    _rms_norm_amax_kernel[(arch.persistent_grid(a, triton.cdiv(n_rows, p.fwd_rows)),)](
        x2, w, rstd, amax, n_rows, n_cols, x2.stride(0), eps,
        BLOCK=p.block, ROWS=p.fwd_rows, num_warps=p.fwd_warps, **types)
    _rms_norm_float8_kernel[(triton.cdiv(n_rows, p.fwd_rows),)](
        x2, w, rstd, amax, q, scale, n_rows, n_cols, x2.stride(0),
        BLOCK=p.block, ROWS=p.fwd_rows, num_warps=p.fwd_warps, **types, **float8.constants(fp8_dtype))
    return q, scale, rstd


# Shared memory left for the pipelined loop's tiles after the kernel's own reductions.
_SMEM_MARGIN = 4096


@functools.lru_cache(maxsize=None)
def _max_shared_memory(device: torch.device) -> int:
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # no driver query (interpreter, CPU): pipelining is not used there anyway
        return 0


def pipeline_stages(stages: int, block: int, rows: int, item_bytes: int, smem_bytes: int) -> int:
    """Deepest loop pipelining that fits: Triton keeps stages-1 tiles of x and dy in shared
    memory (fp32 rows of 16384 at 3 stages need 256 KiB, more than Hopper's 227 KiB)."""
    budget = smem_bytes - _SMEM_MARGIN
    while stages > 1 and (stages - 1) * block * rows * item_bytes > budget:
        stages -= 1
    return stages


def _backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_cols = x.shape[-1]
    x2 = _as_rows(x, n_cols)
    dy2 = _as_rows(dy, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, (torch.zeros_like(weight) if compute_dw else None)
    p = _config(x.device, n_cols)
    grid = min(p.max_programs, triton.cdiv(n_rows, p.bwd_rows))
    weight_c = weight.contiguous()
    fold = compute_dw and p.tuning.fold_dw and not torch.are_deterministic_algorithms_enabled()
    dw = torch.empty_like(weight_c) if compute_dw else None
    partial = total = counter = rstd  # placeholders for pointers a variant does not use
    if fold:
        total = torch.zeros(n_cols + 1, dtype=torch.float32, device=x.device)  # one memset: sums + ticket
        counter = total[n_cols:].view(torch.int32)
    elif compute_dw:
        partial = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device)
    stages = p.tuning.stages
    if stages > 1:
        stages = pipeline_stages(stages, p.block, p.bwd_rows, x.element_size() + dy.element_size(),
                                 _max_shared_memory(x.device))
    _rms_norm_bwd_kernel[(grid,)](
        dy2, x2, weight_c, rstd, dx, partial, total, counter, dw if compute_dw else rstd,
        n_rows, n_cols, dy2.stride(0), x2.stride(0), n_cols,
        BLOCK=p.block, ROWS=p.bwd_rows, COMPUTE_DW=compute_dw, PREFETCH=p.tuning.prefetch,
        EVICT=p.tuning.evict, FOLD_DW=fold, EVICT_DX=p.tuning.evict_dx, STAGES=stages,
        num_warps=p.bwd_warps,
    )
    if compute_dw and not fold:
        block_c = 64
        _sum_rows_kernel[(triton.cdiv(n_cols, block_c),)](partial, dw, grid, n_cols, BLOCK_R=32, BLOCK_C=block_c,
                                                          num_warps=4)
    return dx, dw


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd, compute_dw=ctx.needs_input_grad[1])
        return dx, dw, None


# --- custom ops: what torch.compile sees ---------------------------------------------------------

@torch.library.custom_op("anvil::rms_norm_fwd", mutates_args=())
def rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, weight, eps)


@rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    _check(x, weight)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device),
        x.new_empty((n_rows,), dtype=torch.float32),
    )


@torch.library.custom_op("anvil::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _backward(dy, x, weight, rstd)
    return dx, dw


@rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.anvil.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


@torch.library.custom_op("anvil::rms_norm_float8_fwd", mutates_args=())
def rms_norm_float8_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype,
                           value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_float8(x, weight, eps, fp8_dtype, value_dtype)


@rms_norm_float8_fwd_op.register_fake
def _(x, weight, eps, fp8_dtype, value_dtype):
    _check(x, weight)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((), dtype=torch.float32),
            x.new_empty((n_rows,), dtype=torch.float32))


@torch._dynamo.allow_in_graph   # like torchao's float8 matmul: AOTAutograd traces the subclass it returns
class _RMSNormFloat8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, target):
        y_dtype = torch.promote_types(x.dtype, weight.dtype)
        q, scale, rstd = torch.ops.anvil.rms_norm_float8_fwd(x, weight, eps, target.dtype, float8.value_dtype(y_dtype))
        ctx.save_for_backward(x, weight, rstd)
        return float8.as_gemm_input(q, scale, y_dtype, target)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.anvil.rms_norm_bwd(dy, x, weight, rstd)
        return dx, dw, None, None


def rms_norm_float8(x: torch.Tensor, weight: torch.Tensor, eps: float, target: float8.Float8Target) -> torch.Tensor:
    """rms_norm(x, weight, eps) as the float8 input of a tensorwise Float8Linear (kernels/float8.py)."""
    _check(x, weight)
    return _RMSNormFloat8Function.apply(x, weight, eps, target)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32; x [..., H]."""
    if torch.compiler.is_compiling():
        return torch.ops.anvil.rms_norm_fwd(x, weight, eps)[0]
    _check(x, weight)
    return _RMSNormFunction.apply(x, weight, eps)

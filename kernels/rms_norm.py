"""RMSNorm, forward and backward, as transformers' LlamaRMSNorm computes it.

LlamaRMSNorm: statistics in fp32, the normalized x cast back to the input
dtype, then multiplied by the weight (so the output dtype is the promotion of
x's and weight's dtypes). Forward stores one fp32 rstd per row. Backward is a
persistent kernel: each program loops over rows, writes dx, and keeps its own
fp32 dW partial in registers; the [programs, H] partials are then summed by a
second small kernel (never a [rows, H] buffer).

Eager calls go through a torch.autograd.Function (a few microseconds of
Python); under torch.compile the same launchers run inside the custom ops
anvil::rms_norm_fwd / anvil::rms_norm_bwd, which trace without graph breaks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import arch


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    # LlamaRMSNorm rounds the normalized x to the input dtype before the weight.
    x_hat = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (x_hat * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, stride_dy, stride_x, stride_dx,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COMPUTE_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, ROWS)
    # Tiles pid, pid + n_programs, ...; index arithmetic in int64. The next tile's loads are
    # issued before this tile's math so each program keeps two tiles of bytes in flight.
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    for i in range(0, tl.cdiv(n_tiles - pid, n_programs)):
        next_rows = rows + n_programs * ROWS
        next_row_mask = next_rows < n_rows
        next_mask = next_row_mask[:, None] & col_mask[None, :]
        x_next = tl.load(X + next_rows[:, None] * stride_x + cols[None, :], mask=next_mask, other=0.0)
        dy_next = tl.load(DY + next_rows[:, None] * stride_dy + cols[None, :], mask=next_mask, other=0.0)
        rstd_next = tl.load(RSTD + next_rows, mask=next_row_mask, other=0.0)

        x_hat = x.to(tl.float32) * rstd[:, None]
        g = dy.to(tl.float32) * w[None, :]
        if COMPUTE_DW:
            # dW sees exactly the rounded x_hat the forward multiplied by W.
            dw_acc += tl.sum(dy.to(tl.float32) * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

        rows, mask, x, dy, rstd = next_rows, next_mask, x_next, dy_next, rstd_next
    if COMPUTE_DW:
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


@functools.lru_cache(maxsize=None)
def _config(device: torch.device, n_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK, ROWS, num_warps, max persistent programs) for rows of n_cols on this device."""
    a = arch.detect(device)
    block, rows, warps = arch.row_config(a, n_cols)
    return block, rows, warps, arch.persistent_grid(a, 1 << 62)


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x2 = _as_rows(x, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    block, rows, warps, _ = _config(x.device, n_cols)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x2, weight.contiguous(), y, rstd, n_rows, n_cols, x2.stride(0), n_cols, eps,
        BLOCK=block, ROWS=rows, num_warps=warps,
    )
    return y, rstd


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
    block, rows, warps, max_programs = _config(x.device, n_cols)
    grid = min(max_programs, triton.cdiv(n_rows, rows))
    weight_c = weight.contiguous()
    partial = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device) if compute_dw else rstd
    _rms_norm_bwd_kernel[(grid,)](
        dy2, x2, weight_c, rstd, dx, partial, n_rows, n_cols, dy2.stride(0), x2.stride(0), n_cols,
        BLOCK=block, ROWS=rows, COMPUTE_DW=compute_dw, num_warps=warps,
    )
    if not compute_dw:
        return dx, None
    dw = torch.empty_like(weight_c)
    block_c = 64
    _sum_rows_kernel[(triton.cdiv(n_cols, block_c),)](partial, dw, grid, n_cols, BLOCK_R=32, BLOCK_C=block_c, num_warps=4)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32; x [..., H]."""
    if torch.compiler.is_compiling():
        return torch.ops.anvil.rms_norm_fwd(x, weight, eps)[0]
    _check(x, weight)
    return _RMSNormFunction.apply(x, weight, eps)

"""SwiGLU activation: silu(gate) * up, forward and backward.

The GEMMs around it stay in BLAS; this fuses the elementwise part. Forward
keeps only gate and up (which the MLP holds anyway) and backward recomputes
sigmoid(gate) from them, so no activation is stored. Math in fp32, one
rounding to the input dtype per output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arch


@triton.jit
def _swiglu_fwd_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DOUT, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + offs, (dout * silu).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dout * u * (sig + silu * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape, dtype and device")


def _grid(n: int, block: int) -> tuple[int]:
    return (triton.cdiv(n, block),)


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        block, warps = arch.elementwise_config(arch.detect(gate.device))
        _swiglu_fwd_kernel[_grid(n, block)](gate, up, out, n, BLOCK=block, num_warps=warps)
    return out


def _backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    if n:
        block, warps = arch.elementwise_config(arch.detect(gate.device))
        _swiglu_bwd_kernel[_grid(n, block)](dout, gate, up, d_gate, d_up, n, BLOCK=block, num_warps=warps)
    return d_gate, d_up


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return _backward(dout, gate, up)


# --- custom ops: what torch.compile sees ---------------------------------------------------------

@torch.library.custom_op("anvil::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up)


@swiglu_fwd_op.register_fake
def _(gate, up):
    _check(gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("anvil::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dout, gate, up)


@swiglu_bwd_op.register_fake
def _(dout, gate, up):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    return torch.ops.anvil.swiglu_bwd(dout, gate, up)


swiglu_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and rounded once to the input dtype."""
    if torch.compiler.is_compiling():
        return torch.ops.anvil.swiglu_fwd(gate, up)
    _check(gate, up)
    return _SwiGLUFunction.apply(gate, up)

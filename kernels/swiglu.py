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

from kernels import arch, float8


@triton.jit
def _swiglu_fwd_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, _silu_mul(g, u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(g, u):
    return g * tl.sigmoid(g) * u


# --- float8 output (kernels/float8.py): an amax pass, then a cast pass ------------------------------

@triton.jit
def _cast_input(g, u, H_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr):
    """silu(g) * u as the float8 cast sees it: rounded to the output's dtype (H_DTYPE), then to the
    dtype torchao's cast would take (V_DTYPE). The amax and the cast must agree on it bit for bit."""
    return _silu_mul(g, u).to(H_DTYPE).to(V_DTYPE)


@triton.jit
def _swiglu_amax_kernel(G, U, AMAX, n, V_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Persistent: max |silu(g) * u| (rounded as the plain kernel's output) folded into AMAX."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.cdiv(n, BLOCK) - pid, n_programs)):
        offs = (pid + i * n_programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        h = _cast_input(g, u, G.dtype.element_ty, V_DTYPE).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(h))   # masked lanes are silu(0) * 0 = 0
    tl.atomic_max(AMAX, tl.max(amax, axis=0), sem="relaxed")


@triton.jit
def _swiglu_float8_kernel(
    G, U, STASH_SCALES, AMAX, Q, SCALE, n, H_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MANTISSA: tl.constexpr, ROUND_IN_KERNEL: tl.constexpr,
    STASH: tl.constexpr,
):
    """The cast pass. With STASH, G and U are the stash (below): float8, one fp32 scale per block."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g, u = _gate_up(G, U, STASH_SCALES, offs, pid, n, mask, BLOCK, STASH)
    h = _cast_input(g, u, H_DTYPE, V_DTYPE)
    scale = float8.scale_of(AMAX, FP8_MAX)
    tl.store(Q + offs, float8.to_float8_grid(h, scale, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)
             .to(Q.dtype.element_ty), mask=mask)
    if pid == 0:
        tl.store(SCALE, scale)


# --- the stash: gate and up kept for the backward in float8, one scale per block of BLOCK ----------

@triton.jit
def _swiglu_stash_kernel(G, U, QG, QU, STASH_SCALES, AMAX, n, V_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                         FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MANTISSA: tl.constexpr,
                         ROUND_IN_KERNEL: tl.constexpr):
    """gate and up stashed, and the |max| of the output their stashed values give folded into AMAX (the
    cast pass's, from the stash, which then needs no amax pass of its own)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    n_blocks = tl.cdiv(n, BLOCK)
    g = _stash(tl.load(G + offs, mask=mask, other=0.0).to(tl.float32), QG + offs, STASH_SCALES + pid, mask,
               FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)
    u = _stash(tl.load(U + offs, mask=mask, other=0.0).to(tl.float32), QU + offs, STASH_SCALES + n_blocks + pid,
               mask, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)
    h = _cast_input(g, u, G.dtype.element_ty, V_DTYPE).to(tl.float32)
    tl.atomic_max(AMAX, tl.max(tl.abs(h), axis=0), sem="relaxed")   # masked lanes: 0


@triton.jit
def _stash(v, Q_PTRS, SCALE_PTR, mask, FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
           FP8_MANTISSA: tl.constexpr, ROUND_IN_KERNEL: tl.constexpr):
    """v (fp32, a block in registers) as float8 scaled by its own block's |max|, to Q_PTRS, the scale to
    SCALE_PTR; returns what _unstash will read back."""
    # The stash's own scale, read back only by _unstash: fp32 arithmetic will do. Scales a torch._scaled_mm
    # or torchao's casts must agree with go through float8.scale_from_amax (float64, then rounded).
    scale = FP8_MAX / tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12)
    q = float8.to_float8_grid(v, scale, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL
                              ).to(Q_PTRS.dtype.element_ty)
    tl.store(Q_PTRS, q, mask=mask)
    tl.store(SCALE_PTR, scale)
    return _dequantize(q, scale)   # masked lanes: 0


@triton.jit
def _unstash(Q_PTRS, SCALE_PTR, mask):
    """A stashed block back in fp32."""
    return _dequantize(tl.load(Q_PTRS, mask=mask, other=0.0), tl.load(SCALE_PTR))


@triton.jit
def _dequantize(q, scale):
    """Stashed values in fp32: times the block's 1 / scale, rounded to nearest (a GPU's `/` may be
    approximate), so that every kernel and torch's `data.float() * (1 / scale)` read the same values."""
    return q.to(tl.float32) * tl.math.div_rn(1.0, scale)


@triton.jit
def _gate_up(G, U, STASH_SCALES, offs, block, n, mask, BLOCK: tl.constexpr, STASH: tl.constexpr):
    """gate and up of block `block` in fp32: loaded, or restored from the stash (G, U its float8 data)."""
    if STASH:
        n_blocks = tl.cdiv(n, BLOCK)
        return (_unstash(G + offs, STASH_SCALES + block, mask),
                _unstash(U + offs, STASH_SCALES + n_blocks + block, mask))
    return (tl.load(G + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(U + offs, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _swiglu_bwd_kernel(DOUT, G, U, STASH_SCALES, DG, DU, n, BLOCK: tl.constexpr, STASH: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g, u = _gate_up(G, U, STASH_SCALES, offs, pid, n, mask, BLOCK, STASH)
    dg, du = _silu_mul_grads(dout, g, u)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_grads(dout, g, u):
    """(d gate, d up) in fp32."""
    sig = tl.sigmoid(g)
    silu = g * sig
    return dout * u * (sig + silu * (1.0 - sig)), dout * silu


@triton.jit
def _swiglu_bwd_amax_kernel(DOUT, G, U, STASH_SCALES, AMAX_G, AMAX_U, n, V_DTYPE: tl.constexpr,
                            BLOCK: tl.constexpr, STASH: tl.constexpr):
    """Persistent: max |d gate| and max |d up| (rounded as the plain backward's outputs, V_DTYPE) into
    AMAX_G, AMAX_U."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    amax_g = tl.zeros([BLOCK], dtype=tl.float32)
    amax_u = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.cdiv(n, BLOCK) - pid, n_programs)):
        block = pid + i * n_programs
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
        g, u = _gate_up(G, U, STASH_SCALES, offs, block, n, mask, BLOCK, STASH)
        dg, du = _silu_mul_grads(dout, g, u)
        amax_g = tl.maximum(amax_g, tl.abs(dg.to(V_DTYPE).to(tl.float32)))
        amax_u = tl.maximum(amax_u, tl.abs(du.to(V_DTYPE).to(tl.float32)))
    tl.atomic_max(AMAX_G, tl.max(amax_g, axis=0), sem="relaxed")
    tl.atomic_max(AMAX_U, tl.max(amax_u, axis=0), sem="relaxed")


@triton.jit
def _swiglu_bwd_float8_kernel(
    DOUT, G, U, STASH_SCALES, AMAX_G, AMAX_U, QG, QU, SCALE_G, SCALE_U, n, V_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MANTISSA: tl.constexpr,
    ROUND_IN_KERNEL: tl.constexpr, STASH: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g, u = _gate_up(G, U, STASH_SCALES, offs, pid, n, mask, BLOCK, STASH)
    dg, du = _silu_mul_grads(dout, g, u)
    scale_g = float8.scale_of(AMAX_G, FP8_MAX)
    scale_u = float8.scale_of(AMAX_U, FP8_MAX)
    tl.store(QG + offs, float8.to_float8_grid(dg.to(V_DTYPE), scale_g, FP8_MAX, FP8_MIN_NORMAL,
                                              FP8_MANTISSA, ROUND_IN_KERNEL).to(QG.dtype.element_ty), mask=mask)
    tl.store(QU + offs, float8.to_float8_grid(du.to(V_DTYPE), scale_u, FP8_MAX, FP8_MIN_NORMAL,
                                              FP8_MANTISSA, ROUND_IN_KERNEL).to(QU.dtype.element_ty), mask=mask)
    if pid == 0:
        tl.store(SCALE_G, scale_g)
        tl.store(SCALE_U, scale_u)


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


def _stash_block(n: int, block: int, stash_scales: torch.Tensor | None) -> None:
    """A stash is read with the block size it was written with (one device, one kernel config)."""
    if stash_scales is not None and stash_scales.numel() != 2 * triton.cdiv(n, block):
        raise RuntimeError(f"swiglu: a stash of {stash_scales.numel()} scales does not match {n} elements in "
                           f"blocks of {block}")


def _or(t: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if t is None else t   # a pointer the kernel leaves unread (STASH off)


def _backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              stash_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in gate's dtype. With `stash_scales`, gate and up are the forward's float8 stash, and
    the gradients take dout's dtype (the forward's output dtype, gate's)."""
    dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    dtype = gate.dtype if stash_scales is None else dout.dtype
    d_gate = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=dtype, device=up.device)
    n = gate.numel()
    if n:
        block, warps = arch.elementwise_config(arch.detect(gate.device))
        _stash_block(n, block, stash_scales)
        _swiglu_bwd_kernel[_grid(n, block)](dout, gate, up, _or(stash_scales, dout), d_gate, d_up, n, BLOCK=block,
                                            STASH=stash_scales is not None, num_warps=warps)
    return d_gate, d_up


def _stash_gate_up(gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype, value_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, ...]:
    """The stash: gate and up in fp8_dtype, each block of the kernel's BLOCK elements scaled by its own
    |max|, and the amax of the output its values give (as _forward_float8 rounds it): (gate8, up8, fp32
    scales [2, blocks] gate's then up's, fp32 amax []). One pass, 4 bytes read and 2 written per
    element in bf16."""
    gate, up = gate.contiguous(), up.contiguous()
    n = gate.numel()
    block, warps = arch.elementwise_config(arch.detect(gate.device))
    qg = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    qu = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    scales = torch.empty(2, triton.cdiv(n, block), dtype=torch.float32, device=gate.device)
    amax = torch.zeros((), dtype=torch.float32, device=gate.device)
    if n:
        _swiglu_stash_kernel[_grid(n, block)](gate, up, qg, qu, scales, amax, n, BLOCK=block, num_warps=warps,
                                              V_DTYPE=float8.to_triton(value_dtype), **float8.constants(fp8_dtype))
    return qg, qu, scales, amax


def _forward_float8(gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype, value_dtype: torch.dtype,
                    stash: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up as float8, its float32 scale []); rounded to the input dtype, then value_dtype.
    With `stash` (its block scales and amax), gate and up are a stash (_stash_gate_up) of tensors of
    `dtype`, the values are those of what it holds, and only the cast pass runs."""
    if stash is not None and dtype is None:
        raise ValueError("swiglu: a stash needs the dtype gate and up had")
    gate, up = gate.contiguous(), up.contiguous()
    q = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    amax, scale = float8.amax_and_scale(gate.device)
    n = gate.numel()
    if n == 0:
        scale.fill_(torch.finfo(fp8_dtype).max / float8.EPS)
        return q, scale
    a = arch.detect(gate.device)
    block, warps = arch.elementwise_config(a)
    v = float8.to_triton(value_dtype)
    if stash is None:
        _swiglu_amax_kernel[(arch.persistent_grid(a, triton.cdiv(n, block)),)](
            gate, up, amax, n, V_DTYPE=v, BLOCK=block, num_warps=warps)
        stash_scales = scale    # an unread pointer
    else:
        stash_scales, amax = stash
        _stash_block(n, block, stash_scales)
    _swiglu_float8_kernel[_grid(n, block)](gate, up, stash_scales, amax, q, scale, n,
                                           H_DTYPE=float8.to_triton(dtype or gate.dtype), V_DTYPE=v, BLOCK=block,
                                           STASH=stash is not None, num_warps=warps, **float8.constants(fp8_dtype))
    return q, scale


def _backward_float8(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype,
                     stash_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate, d up as float8, their float32 scales [2]); each rounded to dout's dtype before scaling.
    With `stash_scales`, gate and up are the forward's float8 stash."""
    dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    qg = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    qu = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    buf = torch.zeros(8, dtype=torch.float32, device=gate.device)   # amaxes, then the scales 16 bytes in
    amax_g, amax_u, scales = buf[0], buf[1], buf[4:6]
    scale_g, scale_u = scales[0], scales[1]
    n = gate.numel()
    if n == 0:
        scales.fill_(torch.finfo(fp8_dtype).max / float8.EPS)
        return qg, qu, scales
    a = arch.detect(gate.device)
    block, warps = arch.elementwise_config(a)
    _stash_block(n, block, stash_scales)
    stash, v = stash_scales is not None, float8.to_triton(dout.dtype)
    stash_scales = _or(stash_scales, dout)
    _swiglu_bwd_amax_kernel[(arch.persistent_grid(a, triton.cdiv(n, block)),)](
        dout, gate, up, stash_scales, amax_g, amax_u, n, V_DTYPE=v, BLOCK=block, STASH=stash, num_warps=warps)
    _swiglu_bwd_float8_kernel[_grid(n, block)](
        dout, gate, up, stash_scales, amax_g, amax_u, qg, qu, scale_g, scale_u, n, V_DTYPE=v, BLOCK=block,
        STASH=stash, num_warps=warps, **float8.constants(fp8_dtype))
    return qg, qu, scales


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


@torch.library.custom_op("anvil::swiglu_float8_fwd", mutates_args=())
def swiglu_float8_fwd_op(gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype,
                         value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_float8(gate, up, fp8_dtype, value_dtype)


@swiglu_float8_fwd_op.register_fake
def _(gate, up, fp8_dtype, value_dtype):
    _check(gate, up)
    return gate.new_empty(gate.shape, dtype=fp8_dtype), gate.new_empty((), dtype=torch.float32)


@torch.library.custom_op("anvil::swiglu_float8_bwd", mutates_args=())
def swiglu_float8_bwd_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_float8(dout, gate, up, fp8_dtype)


def _float8_grads_like(gate: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """What the float8 backward returns, for the fake registrations: d gate, d up, their scales [2]."""
    return (gate.new_empty(gate.shape, dtype=fp8_dtype), gate.new_empty(gate.shape, dtype=fp8_dtype),
            gate.new_empty((2,), dtype=torch.float32))


@swiglu_float8_bwd_op.register_fake
def _(dout, gate, up, fp8_dtype):
    return _float8_grads_like(gate, fp8_dtype)


# The stash: the forward keeps gate and up for the backward as float8, block-scaled, instead of the
# 16-bit tensors (train.float8_activations, the MLP's share of it), and computes its output from what the
# stash holds, so that the output can be rebuilt from it in backward rather than kept. An op whose name
# ends in "_stash_fwd" returns saved activations in compact form: checkpointing (trainer.models.blocks'
# selective, and the MLP's own region under none) keeps its outputs and recomputes the rest: the
# projections it was made from (under torch.compile: dropped, nothing in backward reads them) and the
# float8 output down_proj's backward reads (swiglu_float8_from_stash again: one pass, 2 bytes read and
# 1 written per element, for the byte not kept). The stash op also returns that output's amax, so
# from_stash needs no amax pass.

@torch.library.custom_op("anvil::swiglu_float8_stash_fwd", mutates_args=())
def swiglu_float8_stash_fwd_op(gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype, value_dtype: torch.dtype
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _stash_gate_up(gate, up, fp8_dtype, value_dtype)


@swiglu_float8_stash_fwd_op.register_fake
def _(gate, up, fp8_dtype, value_dtype):
    _check(gate, up)
    block, _ = arch.elementwise_config(arch.detect(gate.device))
    return (gate.new_empty(gate.shape, dtype=fp8_dtype), gate.new_empty(gate.shape, dtype=fp8_dtype),
            gate.new_empty((2, triton.cdiv(gate.numel(), block)), dtype=torch.float32),
            gate.new_empty((), dtype=torch.float32))


@torch.library.custom_op("anvil::swiglu_float8_from_stash", mutates_args=())
def swiglu_float8_from_stash_op(gate8: torch.Tensor, up8: torch.Tensor, stash_scales: torch.Tensor,
                                amax: torch.Tensor, fp8_dtype: torch.dtype, value_dtype: torch.dtype,
                                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_float8(gate8, up8, fp8_dtype, value_dtype, (stash_scales, amax), dtype)


@swiglu_float8_from_stash_op.register_fake
def _(gate8, up8, stash_scales, amax, fp8_dtype, value_dtype, dtype):
    return gate8.new_empty(gate8.shape, dtype=fp8_dtype), gate8.new_empty((), dtype=torch.float32)


@torch.library.custom_op("anvil::swiglu_float8_stash_bwd", mutates_args=())
def swiglu_float8_stash_bwd_op(dout: torch.Tensor, gate8: torch.Tensor, up8: torch.Tensor,
                               stash_scales: torch.Tensor, fp8_dtype: torch.dtype
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_float8(dout, gate8, up8, fp8_dtype, stash_scales)


@swiglu_float8_stash_bwd_op.register_fake
def _(dout, gate8, up8, stash_scales, fp8_dtype):
    return _float8_grads_like(gate8, fp8_dtype)


@torch.library.custom_op("anvil::swiglu_stash_bwd", mutates_args=())
def swiglu_stash_bwd_op(dout: torch.Tensor, gate8: torch.Tensor, up8: torch.Tensor, stash_scales: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dout, gate8, up8, stash_scales)


@swiglu_stash_bwd_op.register_fake
def _(dout, gate8, up8, stash_scales):
    return dout.new_empty(gate8.shape), dout.new_empty(gate8.shape)


@torch._dynamo.allow_in_graph   # like torchao's float8 matmul: AOTAutograd traces the subclass it returns
class _SwiGLUFloat8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, target, grad_target, stash):
        value_dtype = float8.value_dtype(gate.dtype)
        if stash:
            *stashed, amax = torch.ops.anvil.swiglu_float8_stash_fwd(gate, up, target.dtype, value_dtype)
            q, scale = torch.ops.anvil.swiglu_float8_from_stash(*stashed, amax, target.dtype, value_dtype, gate.dtype)
            ctx.save_for_backward(*stashed)
        else:
            q, scale = torch.ops.anvil.swiglu_float8_fwd(gate, up, target.dtype, value_dtype)
            ctx.save_for_backward(gate, up)
        ctx.grad_target, ctx.stash, ctx.dtype = grad_target, stash, gate.dtype
        return float8.as_gemm_input(q, scale, gate.dtype, target)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        t = ctx.grad_target
        if t is None:
            d_gate, d_up = (torch.ops.anvil.swiglu_stash_bwd(dout, *saved) if ctx.stash
                            else torch.ops.anvil.swiglu_bwd(dout, *saved))
            return d_gate, d_up, None, None, None
        qg, qu, scales = (torch.ops.anvil.swiglu_float8_stash_bwd(dout, *saved, t.grad_dtype) if ctx.stash
                          else torch.ops.anvil.swiglu_float8_bwd(dout, *saved, t.grad_dtype))
        return (float8.as_gemm_input(qg, scales[0], ctx.dtype, t, gradient=True),
                float8.as_gemm_input(qu, scales[1], ctx.dtype, t, gradient=True), None, None, None)


def swiglu_float8(gate: torch.Tensor, up: torch.Tensor, target: float8.Float8Target,
                  grad_target: float8.Float8Target | None = None, stash: bool = False) -> torch.Tensor:
    """swiglu(gate, up) as the float8 input of a tensorwise Float8Linear (kernels/float8.py).

    `grad_target`: the Float8Target of the layers that made gate and up (it needs a grad_dtype); the
    backward then hands them their output gradients as float8 too, instead of bf16.
    `stash`: keep gate and up for the backward as float8 with one scale per block (the stash, above)
    and compute the output from them: half their memory, and the output need not be kept, at e4m3's
    precision for gate and up.
    Where no backward will run (no grad mode, inputs without grad) nothing is stashed."""
    _check(gate, up)
    if grad_target is not None and grad_target.grad_dtype is None:
        raise ValueError("swiglu_float8: grad_target has no tensorwise gradient cast (grad_dtype is None)")
    stash = stash and torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    return _SwiGLUFloat8Function.apply(gate, up, target, grad_target, stash)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and rounded once to the input dtype."""
    if torch.compiler.is_compiling():
        return torch.ops.anvil.swiglu_fwd(gate, up)
    _check(gate, up)
    return _SwiGLUFunction.apply(gate, up)

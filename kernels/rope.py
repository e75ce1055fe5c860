"""Rotary position embedding (Llama rotate-half), forward and backward.

q [B, S, Hq, D] and k [B, S, Hkv, D] (grouped-query attention: Hkv may be
smaller) are rotated by cos/sin of shape [S, D], [1, S, D] or [B, S, D], the
tensors transformers' LlamaRotaryEmbedding returns (its Llama 3.1 frequency
scaling and theta are already inside them):

    out[..., :D/2] = x1 * cos[:D/2] - x2 * sin[:D/2]
    out[..., D/2:] = x2 * cos[D/2:] + x1 * sin[D/2:]

cos/sin are indexed as full [.., D] rows at position s (the MI300X seed repo
read them as [S, D/2] and so took the angle of position ~s/2). Both halves of
cos/sin are read, so no assumption that they repeat. One program handles one
(batch, position) and all q and k heads. q/k may have any strides except in
the last dimension; outputs are new contiguous [B, S, H, D] tensors. cos/sin
are constants: no gradient flows to them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import arch


@triton.jit
def _rotate(
    X, OUT, b, s, seq_len, sx_b, sx_s, sx_h, c1, c2, s1, s2, d, d_mask,
    N_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    mask = (h < N_HEADS)[:, None] & d_mask[None, :]
    x_ptr = X + b * sx_b + s * sx_s + h[:, None].to(tl.int64) * sx_h + d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    # outputs are contiguous [B, S, H, D]
    o_ptr = OUT + (b * seq_len + s) * (N_HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(o_ptr, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO, seq_len, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s,
    N_QH: tl.constexpr, N_KH: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cs = b * sc_b + s * sc_s + d
    c1 = tl.load(COS + cs, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + HALF, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + HALF, mask=d_mask, other=0.0).to(tl.float32)
    _rotate(Q, QO, b, s, seq_len, sq_b, sq_s, sq_h, c1, c2, s1, s2, d, d_mask, N_QH, HALF, BLOCK_QH, BACKWARD)
    _rotate(K, KO, b, s, seq_len, sk_b, sk_s, sk_h, c1, c2, s1, s2, d, d_mask, N_KH, HALF, BLOCK_KH, BACKWARD)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cos_sin_view(t: torch.Tensor, batch: int, seq_len: int, head_dim: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, batch stride, position stride) for cos/sin of shape [S, D], [1, S, D] or [B, S, D]."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[1:] != (seq_len, head_dim) or t.shape[0] not in (1, batch):
        raise ValueError(f"apply_rope: cos/sin shape {tuple(t.shape)}; expected [S, D], [1, S, D] or [B, S, D] "
                         f"with B={batch}, S={seq_len}, D={head_dim}")
    t = _unit_last(t)
    stride_b, stride_s, _ = t.stride()
    return t, (stride_b if t.shape[0] > 1 else 0), stride_s


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, S, H, D] with equal B, S, D")
    if q.shape[3] % 2:
        raise ValueError(f"apply_rope: head_dim {q.shape[3]} must be even")


@functools.lru_cache(maxsize=None)
def _config(device: torch.device, n_qh: int, n_kh: int, head_dim: int) -> dict:
    a = arch.detect(device)
    block_d, block_qh = arch.next_pow2(head_dim // 2), arch.next_pow2(n_qh)
    # one program holds the q tile (both halves); measured on H200: 4 warps for 32 x 128 beat 8 and 16
    warps = arch.clamp_warps(a, arch.next_pow2(max(1, 2 * block_qh * block_d // (32 * a.params.warp_size))))
    return dict(N_QH=n_qh, N_KH=n_kh, HALF=head_dim // 2, BLOCK_D=block_d, BLOCK_QH=block_qh,
                BLOCK_KH=arch.next_pow2(n_kh), num_warps=warps)


def _launch(q, k, cos, sin, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, n_qh, head_dim = q.shape
    q, k = _unit_last(q), _unit_last(k)
    cos, sc_b, sc_s = _cos_sin_view(cos, batch, seq_len, head_dim)
    sin, ss_b, ss_s = _cos_sin_view(sin, batch, seq_len, head_dim)
    if (ss_b, ss_s) != (sc_b, sc_s):  # e.g. one of them [S, D], the other [B, S, D]: give both one layout
        cos, sin = (t.contiguous() for t in torch.broadcast_tensors(cos, sin))
        cos, sc_b, sc_s = _cos_sin_view(cos, batch, seq_len, head_dim)
        sin, _, _ = _cos_sin_view(sin, batch, seq_len, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if batch * seq_len == 0:
        return q_out, k_out
    sq_b, sq_s, sq_h, _ = q.stride()
    sk_b, sk_s, sk_h, _ = k.stride()
    _rope_kernel[(batch * seq_len,)](
        q, k, cos, sin, q_out, k_out, seq_len, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s,
        BACKWARD=backward, **_config(q.device, n_qh, k.shape[2], head_dim),
    )
    return q_out, k_out


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _launch(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


# --- custom ops: what torch.compile sees ---------------------------------------------------------

@torch.library.custom_op("anvil::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, backward)


@rope_op.register_fake
def _(q, k, cos, sin, backward):
    _check(q, k)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


def _setup_context(ctx, inputs, output):
    _q, _k, cos, sin, _backward = inputs
    ctx.save_for_backward(cos, sin)


def _op_backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.anvil.rope(dq, dk, cos, sin, True)
    return dq, dk, None, None, None


rope_op.register_autograd(_op_backward, setup_context=_setup_context)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, S, Hq, D] and k [B, S, Hkv, D] by cos/sin [S, D] | [B, S, D]; returns (q_rot, k_rot)."""
    if torch.compiler.is_compiling():
        return torch.ops.anvil.rope(q, k, cos, sin, False)
    _check(q, k)
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("apply_rope: cos/sin are treated as constants; detach them (no gradient flows to them)")
    return _RopeFunction.apply(q, k, cos, sin)

"""LM head matmul + cross-entropy, chunked over tokens: the [tokens, vocab] logits never exist.

Per chunk of C tokens (all in forward, as Liger does):
    logits_c = x_c @ W^T              cuBLAS, into one reused [C, V] buffer
    launch_ce in place                loss rows, and the gradient over logits_c, scaled by 1/n
    gx_c     = grad_c @ W             cuBLAS, straight into grad_hidden[c]
    gW      += grad_c^T @ x_c         cuBLASLt, tuned (kernels/cublaslt.py); fp32 inside, bf16 across chunks
Backward only scales gx and gW by the incoming gradient (no traffic when it is 1.0).

`float8=` runs the first two GEMMs on FP8 tensor cores, operands cast per row (_Float8Head; the
cross-entropy kernel writes grad_c's float8 copy as it stores grad_c); gW stays in bf16, as
torchao's recipe that keeps the weight gradient in high precision does (torch._scaled_mm cannot
accumulate into gW, so a float8 gW would cost a read and a write of gW a chunk).

Memory above the inputs: grad_hidden + grad_weight (what any method returns) + the C x V chunk.
The chunk trades speed for memory: the gW update reads and writes all of gW once per chunk,
so small chunks make it memory-bound. `chunk_size=None` takes the size that keeps the chunk
buffer at about `4 x` the hidden states' bytes (_CHUNK_FACTOR) (see
benchmarks/cases_loss.py for the measured trade-off, `python -m benchmarks.ce_floor --hidden H` for the floor).
The updates' re-reads of gW are what a small chunk adds; cuBLASLt's ping-pong kernel hides most of them
where torch.mm's cooperative one does not (kernels/cublaslt.py picks it by timing). Tried and slower on an
H100 (benchmarks/flce_variants.py): the hidden-gradient GEMM on a second stream beside the update, torch's
cuBLASLt backend (its heuristic's first choice), and a Triton update that loads C early.
In a V x C chunk cuBLAS picks a faster logits kernel (`ce_floor --kernels`), but there a token's logits are
strided by C, and the cross-entropy kernel walks each row contiguously, the second time from L2.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from core import names
from kernels import arch, cublaslt
from kernels.cross_entropy import float8_grad_fusable, launch_ce, scale_grad
from kernels.float8 import cast_rowwise

# Chunk = this x next_pow2(N / ceil(V/H)) tokens (1 is Liger's choice: chunk buffer ~ the hidden states' size).
# Measured on an H200 at 8192 x 4096 -> 128256 bf16: x1 (256) 53.7 ms, 1.10 GiB; x2 (512) 46.9 ms, 1.16 GiB;
# x4 (1024) 41.1-42.1 ms, 1.29 GiB (x3, 768: 44.8 ms, 1.22 GiB); x8 (2048) 41.7 ms, 1.53 GiB. Each chunk re-reads
# and re-writes all of gW, so small chunks are bound by that traffic. The GEMMs alone (H100, this shape,
# `python -m benchmarks.ce_floor --hidden 4096`): unchunked 35.6 ms, C1024 39.1, C2048 and C4096 37.8.
# Again on 2026-11-23 with the persistent cross-entropy (same shape, two calls, +-1 ms between them): C1024
# 40.2 ms, C2048 39.0-39.4 (1.53 GiB), C4096 38.9-40.1 (2.02 GiB); torch.compile 39.9 at 3.0 GiB. x4 stays:
# larger chunks gain 2-3% for 0.25-0.75 GiB, and one chunk for the whole batch changed nothing in training.
# names.FLCE_CHUNK_FACTOR overrides it (1 = Liger's memory footprint).
_CHUNK_FACTOR = int(os.environ.get(names.FLCE_CHUNK_FACTOR) or 4)
# float8: torch._scaled_mm's operands need H and V divisible by 16, and each chunk's slice of the row
# scales 16-byte aligned (cuBLASLt), so chunks are whole multiples of 16 rows
_FLOAT8_ALIGN = 16
# float8: the cross-entropy kernel writes the float8 gradient as it stores the bf16 one (0: a cast pass)
_FUSED_GRAD_CAST = os.environ.get(names.FLCE_FUSED_CAST, "1") != "0"


def default_chunk(n_tokens: int, hidden: int, vocab: int) -> int:
    base = arch.next_pow2(max(1, -(-n_tokens // -(-vocab // hidden))))  # Liger's: N / ceil(V / H)
    return max(16, min(base * _CHUNK_FACTOR, arch.next_pow2(max(1, n_tokens))))


def _flce(hidden, weight, target, normalizer, ignore_index, z_loss, label_smoothing, scale_by_norm, chunk,
          need_gx, need_gw, float8=None):
    n, _ = hidden.shape
    vocab = weight.shape[0]
    row_loss = torch.empty(n, device=hidden.device, dtype=torch.float32)
    gx = torch.empty_like(hidden) if need_gx else hidden.new_empty(0)
    gw = torch.zeros_like(weight) if need_gw and n == 0 else (torch.empty_like(weight) if need_gw else
                                                              weight.new_empty(0))
    grads = need_gx or need_gw
    norm = normalizer if scale_by_norm else None
    buf = torch.empty(min(chunk, n), vocab, device=hidden.device, dtype=hidden.dtype) if n else None
    head = (_Float8Head(hidden, weight, need_gx, float8, min(chunk, n), z_loss, label_smoothing)
            if float8 is not None and n else None)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        x_c = hidden[c0:c1]
        logits = buf[: c1 - c0]
        if head:
            head.logits(c0, c1, logits)
        else:
            torch.mm(x_c, weight.t(), out=logits)
        launch_ce(logits, target[c0:c1], logits if grads else None, row_loss[c0:c1], norm, ignore_index, z_loss,
                  label_smoothing, float8_grad=head.fused_grad(c1 - c0) if head else None)
        if need_gx:
            if head:
                head.grad_hidden(logits, row_loss[c0:c1], norm, gx[c0:c1])
            else:
                torch.mm(logits, weight, out=gx[c0:c1])
        if need_gw:
            cublaslt.mm(logits.t(), x_c, gw, accumulate=c0 > 0)
    return row_loss, gx, gw


class _Float8Head:
    """The head's float8 operands for one call, cast once: hidden and weight per row (the logits GEMM
    reduces over H), the weight per column (the hidden-gradient GEMM reduces over V), and a buffer for
    each chunk's gradient over the logits, cast per row.

    The gradient's row |max| needs no pass of its own: a row is (softmax - onehot(target)) / n, whose
    largest entry in size is the target's, 1 - p_target = -expm1(-row loss), since the other
    probabilities sum to it (with z-loss or label smoothing it is measured instead). Where the
    cross-entropy kernel can (float8_grad_fusable), it writes the float8 gradient itself as it stores
    the bf16 one, scaled by that entry, and the gradient is never read back to be cast
    (names.FLCE_FUSED_CAST=0 casts in a pass of its own, for comparison)."""

    def __init__(self, hidden, weight, need_gx, dtype, chunk, z_loss, label_smoothing):
        self.dtype, self.out_dtype = dtype, hidden.dtype
        self.exact_amax = z_loss == 0.0 and label_smoothing == 0.0
        self.fused = (need_gx and _FUSED_GRAD_CAST
                      and float8_grad_fusable(hidden.device, weight.shape[0], z_loss, label_smoothing))
        self.x, self.x_scale = cast_rowwise(hidden, dtype)
        self.w, self.w_scale = cast_rowwise(weight, dtype)
        if need_gx:
            self.w_t, self.w_t_scale = cast_rowwise(weight.t(), dtype)
            self.grad = torch.empty(chunk, weight.shape[0], device=hidden.device, dtype=dtype)
            self.grad_scale = torch.empty(chunk, 1, device=hidden.device, dtype=torch.float32)

    def fused_grad(self, rows):
        """The (float8 values, inverse scales) for the cross-entropy kernel to fill, or None."""
        return (self.grad[:rows], self.grad_scale[:rows]) if self.fused else None

    def logits(self, c0, c1, out):
        # forward GEMM with fast accumulation, as torchao's float8 forward does
        torch._scaled_mm(self.x[c0:c1], self.w.t(), self.x_scale[c0:c1], self.w_scale.t(),
                         out_dtype=self.out_dtype, use_fast_accum=True, out=out)

    def grad_hidden(self, grad, row_loss, normalizer, out):
        rows = grad.shape[0]
        if self.fused:
            g, g_scale = self.grad[:rows], self.grad_scale[:rows]
        else:
            amax = None
            if self.exact_amax:
                amax = -torch.expm1(-row_loss)
                if normalizer is not None:
                    amax = amax / normalizer
            g, g_scale = cast_rowwise(grad, self.dtype, amax, out=self.grad[:rows])
        torch._scaled_mm(g, self.w_t.t(), g_scale, self.w_t_scale.t(), out_dtype=self.out_dtype, out=out)


@torch.library.custom_op("anvil::fused_linear_cross_entropy_fwd", mutates_args=())
def _flce_fwd(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, normalizer: torch.Tensor,
              ignore_index: int, z_loss: float, label_smoothing: float, scale_by_norm: bool, chunk: int,
              need_gx: bool, need_gw: bool, float8: Optional[torch.dtype]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _flce(hidden, weight, target, normalizer, ignore_index, z_loss, label_smoothing, scale_by_norm,
                 chunk, need_gx, need_gw, float8)


@_flce_fwd.register_fake
def _(hidden, weight, target, normalizer, ignore_index, z_loss, label_smoothing, scale_by_norm, chunk,
      need_gx, need_gw, float8):
    return (hidden.new_empty(hidden.shape[0], dtype=torch.float32),
            torch.empty_like(hidden) if need_gx else hidden.new_empty(0),
            torch.empty_like(weight) if need_gw else weight.new_empty(0))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, normalizer, ignore_index, z_loss, label_smoothing, reduction, chunk,
                need_gx, need_gw, float8):
        row_loss, gx, gw = torch.ops.anvil.fused_linear_cross_entropy_fwd(
            hidden, weight, target, normalizer, ignore_index, z_loss, label_smoothing, reduction == "mean", chunk,
            need_gx, need_gw, float8)
        ctx.save_for_backward(gx, gw)
        ctx.needs = (need_gx, need_gw)
        total = row_loss.sum()
        return total / normalizer if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss):
        gx, gw = ctx.saved_tensors
        need_gx, need_gw = ctx.needs
        gx = scale_grad(gx, grad_loss) if need_gx else None
        gw = scale_grad(gw, grad_loss) if need_gw else None
        return gx, gw, None, None, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean", z_loss: float = 0.0,
                               label_smoothing: float = 0.0, num_items: torch.Tensor | int | None = None,
                               chunk_size: int | None = None, loss_dtype: torch.dtype | None = None,
                               float8: torch.dtype | None = None) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target) without the full logits.

    float8 (an e4m3 dtype): the logits and hidden-gradient GEMMs take float8 operands with one scale
    per row (torch._scaled_mm); the weight gradient stays in hidden's dtype. H and V must be multiples
    of 16. On a GPU it needs rowwise-scaled FP8 GEMMs (sm_90+, MI300+).

    The loss is computed in fp32 and returned in loss_dtype (default: hidden's dtype, as
    F.cross_entropy on those logits would; pass torch.float32 for training logs).

    hidden [..., H], weight [V, H] (an LM head's weight), target [...] (already shifted).
    reduction "mean" (over non-ignored targets, or over num_items when given) or "sum".
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit (weight must be [V, H])")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"fused_linear_cross_entropy: target {tuple(target.shape)} must be hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"fused_linear_cross_entropy: hidden {hidden.dtype} and weight {weight.dtype} differ")
    if float8 is not None and (weight.shape[0] % _FLOAT8_ALIGN or weight.shape[1] % _FLOAT8_ALIGN):
        raise ValueError(f"fused_linear_cross_entropy: float8 needs weight dimensions that are multiples of "
                         f"{_FLOAT8_ALIGN}, got {tuple(weight.shape)}")
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    weight = weight.contiguous()
    target1d = target.reshape(-1).contiguous()
    if num_items is None:
        normalizer = (target1d != ignore_index).sum().to(torch.float32)
    else:
        normalizer = torch.as_tensor(num_items, device=hidden.device).to(torch.float32)
    chunk = chunk_size or default_chunk(hidden2d.shape[0], weight.shape[1], weight.shape[0])
    if float8 is not None:
        chunk = -(-chunk // _FLOAT8_ALIGN) * _FLOAT8_ALIGN
    grad_on = torch.is_grad_enabled()
    need_gx, need_gw = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    loss = _FusedLinearCrossEntropy.apply(hidden2d, weight, target1d, normalizer, ignore_index, float(z_loss),
                                          float(label_smoothing), reduction, int(chunk), need_gx, need_gw, float8)
    return loss.to(loss_dtype or hidden.dtype)

"""Float8 GEMM inputs written by our own kernels (tensorwise scaling, torchao's rule).

torchao's Float8Linear casts its input in kernels of its own: one pass over the
tensor for its amax, one to scale and cast it. Where the input is the output of
one of our kernels (RMSNorm before q/k/v and gate/up, SwiGLU before down), that
kernel does it instead, in two passes over its own inputs:

1. compute the values as the plain kernel does and fold their |max| into one
   fp32 amax (a persistent grid, one atomic max per program), writing only
   what the backward needs;
2. compute them again, scale, saturate and store float8.

(SwiGLU with its stash, train.float8_activations, folds the amax in the pass
that writes the stash, and the cast pass reads the stash: kernels/swiglu.py.)

The high-precision output is never written or read back: in bf16, a norm
moves 5 bytes per element instead of 9, SwiGLU 9 instead of 11 (its backward
14 instead of 20). The result is torchao's Float8TrainingTensor,
which Float8Linear takes as already cast: its forward GEMM uses it, and its
backward reuses the same bytes for the weight gradient (tensorwise scales
serve both orientations). One tensor feeds q, k and v, where torchao casts
the norm's output once per layer in eager mode.

The scale is torchao's `amax_to_scale`, bit for bit: fp8_max / max(amax,
1e-12) in float64, rounded to float32; values are (v in fp32) * scale,
clamped to +-fp8_max, rounded to nearest even. The values first take the
dtype torchao's cast would have seen: under autocast, Float8Linear casts its
input to the autocast dtype before scaling, so the kernels round to it too.
Tensorwise only: a rowwise weight gradient needs the input scaled along the
other axis, which is torchao's own cast again.

The same holds backwards: SwiGLU's backward produces the output gradients of
gate and up, which their Float8Linear casts to e5m2 (an amax pass, a cast
pass) before both of its backward GEMMs. With a gradient target, SwiGLU's
backward writes them as e5m2 itself, each with its own scale.

`cast_rowwise` serves the LM head in float8 (kernels/fused_linear_cross_entropy.py): one scale per
row, any source strides, the operands and scales torch._scaled_mm takes.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

EPS = 1e-12   # torchao.float8.float8_utils.EPS: the amax floor of its scale


@dataclass(frozen=True)
class Float8Target:
    """What a consuming Float8Linear expects: its input's float8 dtype, torchao's LinearMMConfig, and
    its output gradient's float8 dtype where that cast is tensorwise too (else None)."""

    dtype: torch.dtype
    linear_mm_config: object   # torchao.float8.float8_training_tensor.LinearMMConfig (a NamedTuple)
    grad_dtype: torch.dtype | None = None


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torchao's cast sees for an output of `dtype`: under (CUDA) autocast, Float8Linear casts
    its input to the autocast dtype first, whatever it was."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else dtype


@functools.lru_cache(maxsize=None)
def to_triton(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def as_gemm_input(data: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype, target: Float8Target,
                  gradient: bool = False):
    """torchao's Float8TrainingTensor for a Float8Linear's input, or (gradient) for its output's
    gradient; tensorwise, so no axiswise dim."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    role = GemmInputRole.GRAD_OUTPUT if gradient else GemmInputRole.INPUT
    return Float8TrainingTensor(data, scale, orig_dtype, target.linear_mm_config, role, None)


def _tensorwise_dynamic(cast, also) -> bool:
    from torchao.float8.config import ScalingGranularity, ScalingType

    return (cast.scaling_type is ScalingType.DYNAMIC and also == cast
            and cast.scaling_granularity is ScalingGranularity.TENSORWISE)


def target_of(linear) -> Float8Target | None:
    """The Float8Target of a torchao Float8Linear whose input cast is dynamic and tensorwise, else None."""
    config = getattr(linear, "config", None)
    mm = getattr(linear, "linear_mm_config", None)
    if config is None or mm is None:
        return None
    if not _tensorwise_dynamic(config.cast_config_input, config.cast_config_input_for_grad_weight):
        return None
    grad = config.cast_config_grad_output
    grad_dtype = (grad.target_dtype if _tensorwise_dynamic(grad, config.cast_config_grad_output_for_grad_weight)
                  else None)
    return Float8Target(config.cast_config_input.target_dtype, mm, grad_dtype)


def amax_and_scale(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed fp32 amax and the scale's slot, in one allocation and one memset; the scale 16 bytes
    in (Inductor asserts that a custom op's outputs are aligned)."""
    buf = torch.zeros(8, dtype=torch.float32, device=device)
    return buf[0], buf[4]


@triton.jit
def scale_from_amax(amax, FP8_MAX: tl.constexpr):
    """torchao's amax_to_scale: FP8_MAX / max(amax, EPS) in float64, rounded to float32 (any shape)."""
    return (FP8_MAX / tl.maximum(amax.to(tl.float64), 1e-12)).to(tl.float32)


@triton.jit
def inverse_of(scale):
    """1 / scale in float64, rounded to float32: the rowwise inverse scale torch._scaled_mm multiplies by."""
    return (1.0 / scale.to(tl.float64)).to(tl.float32)


@triton.jit
def scale_of(AMAX, FP8_MAX: tl.constexpr):
    """scale_from_amax of the fp32 amax at AMAX."""
    return scale_from_amax(tl.load(AMAX), FP8_MAX)


# Triton's interpreter rounds float8 casts half-up and drops the carry out of the mantissa (31.7
# becomes 16, not 32). Under it, the kernels round to the float8 grid themselves (round to
# nearest even, as the hardware's cvt does), so the cast that follows is exact; on a GPU the
# hardware conversion rounds.
ROUND_IN_KERNEL = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def constants(dtype: torch.dtype) -> dict:
    """The float8 format's constants, as the kernels' constexpr arguments."""
    info = torch.finfo(dtype)
    # mantissa bits from the name: torch.finfo(float8_e5m2fnuz).eps says 3 bits, where it has 2
    mantissa = int(re.search(r"e\dm(\d)", str(dtype)).group(1))
    return dict(FP8_MAX=float(info.max), FP8_MIN_NORMAL=float(info.smallest_normal),
                FP8_MANTISSA=mantissa, ROUND_IN_KERNEL=ROUND_IN_KERNEL)


@triton.jit
def to_float8_grid(v, scale, FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MANTISSA: tl.constexpr,
                   ROUND_IN_KERNEL: tl.constexpr):
    """v * scale in fp32, clamped to the float8 range (torchao's to_fp8_saturated before its cast)."""
    s = tl.minimum(tl.maximum(v.to(tl.float32) * scale, -FP8_MAX), FP8_MAX)
    if ROUND_IN_KERNEL:
        cut: tl.constexpr = 23 - FP8_MANTISSA
        bits = s.to(tl.int32, bitcast=True)
        normal = ((bits + ((1 << (cut - 1)) - 1) + ((bits >> cut) & 1)) >> cut << cut).to(tl.float32, bitcast=True)
        magic: tl.constexpr = FP8_MIN_NORMAL * (2.0 ** (23 - FP8_MANTISSA))   # its ulp is the subnormal step
        small = (tl.abs(s) + magic) - magic
        s = tl.where(tl.abs(s) < FP8_MIN_NORMAL, tl.where(s < 0, -small, small), normal)
    return s


# --------------------------------------------------------------------------- rowwise casts (the LM head)

_ROW_TILE, _COL_TILE = 32, 128


@triton.jit
def _cast_rows_kernel(X, stride_r, stride_c, AMAX, OUT, INV_SCALE, n_rows, n_cols, BR: tl.constexpr,
                      BC: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
                      FP8_MANTISSA: tl.constexpr, ROUND_IN_KERNEL: tl.constexpr):
    """One [BR, BC] tile: x * (FP8_MAX / row amax) to float8, stored row-major whatever X's strides
    (a transposed X is read down its columns and written across its rows)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    scale = scale_from_amax(tl.load(AMAX + rows, mask=row_ok, other=1.0), FP8_MAX)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c, mask=mask,
                other=0.0)
    s = to_float8_grid(x, scale[:, None], FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)
    tl.store(OUT + rows[:, None].to(tl.int64) * n_cols + cols[None, :], s.to(OUT.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(INV_SCALE + rows, inverse_of(scale), mask=row_ok)


def cast_rowwise(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (any strides) -> (float8 [R, C] row-major, fp32 [R, 1] inverse scales): each row scaled so
    its |max| lands on the format's max, torchao's rowwise rule (amax_to_scale, per row). These are the
    operand and the scale `torch._scaled_mm` takes, for x as its left operand, or x.t() as its right.

    amax [R]: the rows' |max| when the caller knows it (the cross-entropy gradient's follows from the
    loss); values over it saturate. Else one reduction pass measures it. out: a float8 buffer to fill.
    """
    n_rows, n_cols = x.shape
    if amax is None:
        amax = torch.linalg.vector_norm(x, float("inf"), dim=1)
    out = torch.empty(n_rows, n_cols, device=x.device, dtype=dtype) if out is None else out
    inv_scale = torch.empty(n_rows, 1, device=x.device, dtype=torch.float32)
    if x.numel():
        grid = (triton.cdiv(n_rows, _ROW_TILE), triton.cdiv(n_cols, _COL_TILE))
        _cast_rows_kernel[grid](x, x.stride(0), x.stride(1), amax, out, inv_scale, n_rows, n_cols,
                                BR=_ROW_TILE, BC=_COL_TILE, num_warps=4, **constants(dtype))
    return out, inv_scale

"""Shared helpers for the kernel tests. Import this BEFORE anything that imports `kernels`.

- Without a GPU, TRITON_INTERPRET=1 is set here so the Triton kernels run on CPU
  tensors through the interpreter (it must be set before `@triton.jit` runs).
  With a GPU (and TRITON_INTERPRET unset) the same tests run compiled, at the
  larger sizes `sizes(cpu=..., gpu=...)` picks.
- Tolerances per op and dtype: never looser than Liger-Kernel's own tests use
  for the same op and dtype, tighter where our references replicate the
  kernel's rounding points (they are computed in fp64).
- `poisoned_allocations()`: while active, every floating tensor made by
  torch.empty / torch.empty_like / Tensor.new_empty is filled with NaN (integers
  with their minimum), so an output element a kernel never writes fails the
  comparison. Kernels must allocate their outputs with those calls.
- `fresh_seed()`: a new random seed per test, returned for the failure message.
"""

from __future__ import annotations

import contextlib
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
ON_GPU = DEVICE == "cuda"

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# A CUDA GPU is visible (interpreted or not): the loss kernels' tests then run at real sizes, there.
CUDA = torch.cuda.is_available()
CUDA_OR_CPU = "cuda" if CUDA else "cpu"

# (atol, rtol) against an fp64 reference. Liger's table in brackets.
_TOLERANCES = {
    # RMSNorm [fp32 1e-4/1e-6, bf16 2e-1/2e-2]
    "rms_norm": {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 2e-2), torch.float16: (1e-2, 5e-3)},
    # RoPE [fp32 1e-5/1e-5, bf16 1e-1/1e-5]
    "rope": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 1e-2), torch.float16: (4e-3, 2e-3)},
    # SwiGLU [fp32 1e0/1e-5, bf16 1e4/1e-2]: ours are far tighter (one rounding per output)
    "swiglu": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (3e-3, 2e-3)},
    # CE [fp32 1e-8/1e-6, bf16 1e-8/5e-2]; FLCE mean [fp32 1e-5/5e-4, bf16 5e-3/5e-2]
    "cross_entropy": {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-8, 5e-2), torch.float16: (1e-8, 1e-2)},
    "fused_linear_cross_entropy": {torch.float32: (1e-5, 5e-4), torch.bfloat16: (5e-3, 5e-2),
                                   torch.float16: (5e-3, 1e-2)},
    # No Liger counterpart. fp32 accumulation, one rounding per output element: the output dtype's
    # half-ulp relative (bf16 2^-9, fp16 2^-12) with room; fp32 the summation order over K or rows. Long
    # reductions add the fp32 accumulation's own error (assert_close's `accumulation`, measured).
    "grouped_gemm": {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-3, 2e-3)},
    # No Liger counterpart. Sums of k weighted rows in fp32, rounded once (as swiglu's outputs); the
    # routing weights' gradient is a D-long fp32 dot product, in the weights' dtype.
    "moe_permute": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (3e-3, 2e-3)},
    "moe_permute_weights": {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 1e-2), torch.float16: (3e-3, 2e-3)},
    # No Liger counterpart. Scores and weights are fp32 from fp32 math (exp may differ by an ulp);
    # the logits' gradient is rounded once to the logits' dtype.
    "router": {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-4, 1e-2), torch.float16: (1e-5, 2e-3)},
}


def tolerance(op: str, dtype: torch.dtype) -> dict:
    atol, rtol = _TOLERANCES[op][dtype]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, op: str, dtype: torch.dtype, what: str,
                 seed: int | None = None, accumulation: float = 0.0) -> None:
    """Compare in fp64 with the op's tolerance for `dtype`; NaN (an unwritten element) never passes.
    `accumulation`: the absolute error an fp32 reduction of this length makes on these operands (a GEMM
    test measures it on torch's own product), which the atol then covers at least."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = tolerance(op, dtype)
    tol["atol"] = max(tol["atol"], accumulation)
    torch.testing.assert_close(
        actual.detach().double().cpu(), expected.detach().double().cpu(), **tol,
        msg=lambda m: f"{op} {what} ({dtype}, seed {seed}, atol {tol['atol']:.2g}): {m}",
    )


def sizes(cpu, gpu):
    """Parametrize by device: tiny shapes for the interpreter, real ones on the GPU."""
    return gpu if ON_GPU else cpu


def case_dtypes(cases: list) -> list:
    """(case, dtype) pairs: on the CPU every case in every dtype; on a GPU, where each dtype compiles its
    own kernels (seconds each), every case in bf16 and fp32 and fp16 at the first (the hardest) only."""
    return sizes(cpu=[(c, d) for c in cases for d in DTYPES],
                 gpu=[(c, torch.bfloat16) for c in cases] + [(cases[0], d) for d in (torch.float32, torch.float16)])


def fresh_seed() -> int:
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    return seed


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool and t.numel():
        t.fill_(torch.iinfo(t.dtype).min)
    return t


@contextlib.contextmanager
def poisoned_allocations():
    """Fill every tensor made by torch.empty / empty_like / new_empty with NaN while active."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def empty(*args, **kwargs):
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return _poison(real_empty_like(*args, **kwargs))

    def new_empty(self, *args, **kwargs):
        return _poison(real_new_empty(self, *args, **kwargs))

    torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = real_empty, real_empty_like, real_new_empty


@contextlib.contextmanager
def uninitialized_memory_filled():
    """Every torch.empty inside is filled with NaN (torch's deterministic mode), so an output
    element a kernel never writes shows up as NaN instead of passing by luck."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; a NaN means an element was never written."""
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN: an element was never written"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()

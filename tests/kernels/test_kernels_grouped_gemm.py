"""Grouped GEMM (kernels/grouped_gemm.py) against a per-expert loop in fp64: y, dx, dw.

Tolerances: the op's table (kernel_utils) for the output's rounding, and for the fp32 accumulation over
the reduction (K for y, N for dx, an expert's rows for dw) at least ACCUMULATION_MARGIN times what torch's
own fp32 product of the same operands misses the fp64 one by, under the same
torch.get_float32_matmul_precision(). A reduction of 8192 unit-scale products in fp32 is off by ~1e-3
at outputs of ~100 (the rounding of a running sum, whatever the kernel), which no fixed atol of 1e-4 can
hold; TF32 where "highest" asks for fp32 is ~100x further off and fails.

On a GPU the tuner is off (each call takes the table's first configuration, compiled once per kernel
variant): test_every_candidate_configuration (marker tile_sweep) compiles and checks the others, and
test_the_tuner_skips_what_cannot_run the tuner itself."""

from helpers.kernels import DEVICE, DTYPES, ON_GPU, assert_close, case_dtypes, fresh_seed, poisoned_allocations, sizes  # noqa: I001

import dataclasses

import pytest
import torch

from kernels import arch, grouped_gemm
from kernels.grouped_gemm import grouped_mm


def offsets(group_sizes: list[int]) -> torch.Tensor:
    return torch.tensor(group_sizes, device=DEVICE).cumsum(0).to(torch.int32)


# Our error may be this many times torch's fp32 product's: the two sum in other orders (the max over a
# million outputs of two such errors differs by tens of percent). TF32 where fp32 is asked is ~250x at
# 8192 rows (a 2^-11 relative error a product, random, against the sum's rounding).
ACCUMULATION_MARGIN = 3.0
# 16-bit operands on a GPU's tensor cores: each MMA step adds its products into the fp32 accumulator with
# truncation, not round-to-nearest, a bias that grows with the steps (8192 rows / 64 a step); torch's fp32
# reference is computed without tensor cores. Measured on an H100 (2026-12-07): fp16 dw at 8192 rows 4.3x
# torch's fp32 error, at 3 of 100M elements near zero (0.0017 where the outputs reach ~100).
HALF_ACCUMULATION_MARGIN = 6.0


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    """Every call takes the first candidate (no timing of the others), chosen afresh for each test."""
    monkeypatch.setattr(grouped_gemm, "_TUNE", False)
    monkeypatch.setattr(grouped_gemm, "_chosen", {})


def reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype = torch.float64
              ) -> torch.Tensor:
    """The per-expert loop in `dtype` (fp64: the reference; fp32: torch's own product); rows past the last
    offset (no expert's) are zeros."""
    x, w = x.to(dtype), w.to(dtype)
    out = torch.zeros(x.shape[0], w.shape[2], dtype=dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def products(x, w, offs, dy, dtype):
    """(y, dx, dw) of the per-expert loop in `dtype`."""
    x = x.detach().to(dtype).requires_grad_(True)
    w = w.detach().to(dtype).requires_grad_(True)
    y = reference(x, w, offs, dtype)
    y.backward(dy.to(dtype))
    return y.detach(), x.grad, w.grad


def run_and_compare(x, w, offs, dtype, seed, what=""):
    x.requires_grad_(True)
    w.requires_grad_(True)
    with poisoned_allocations():
        y = grouped_mm(x, w, offs)
        dy = torch.randn_like(y)
        y.backward(dy)
    assert y.dtype == dtype and w.grad.stride() == w.stride()
    exact, fp32 = products(x, w, offs, dy, torch.float64), products(x, w, offs, dy, torch.float32)
    margin = HALF_ACCUMULATION_MARGIN if ON_GPU and dtype != torch.float32 else ACCUMULATION_MARGIN
    for name, ours, ref, torchs in zip(("y", "dx", "dw"), (y, x.grad, w.grad), exact, fp32):
        accumulation = margin * (torchs.double() - ref).abs().max().item()
        assert_close(ours, ref, "grouped_gemm", dtype, f"{name} {what}", seed, accumulation=accumulation)


# (T, K, N, rows per expert). Empty experts first, between and last; one expert with every row (on the
# GPU a reduction of 8192 rows); rows past the last expert's end; odd K and N (no TMA: the pointer path
# with the same tiles).
CASES = sizes(
    cpu=[(53, 40, 24, [0, 7, 0, 19, 1, 26, 0]), (40, 32, 16, [0, 40, 0]), (37, 24, 40, [5, 0, 20]),
         (33, 37, 19, [3, 17, 13])],
    gpu=[(8192, 2048, 768, [0, 8192] + [0] * 62), (4099, 1408, 2048, None),
         (3001, 1000, 777, [1000, 0, 1, 999, 0, 1001])],
)
GEMM_CASE_DTYPES = case_dtypes(CASES)   # the first case is the hardest (TMA tiles, the 8192-row reduction)


def _group_sizes(t, sizes_or_none, n_experts=64):
    if sizes_or_none is not None:
        return sizes_or_none
    cuts = torch.randint(0, t + 1, (n_experts - 1,)).sort().values.tolist()   # random, some empty
    return [b - a for a, b in zip([0] + cuts, cuts + [t])]


@pytest.mark.parametrize("case, dtype", GEMM_CASE_DTYPES, ids=lambda v: str(v) if isinstance(v, torch.dtype) else
                         f"{v[0]}x{v[1]}x{v[2]}")
def test_matches_reference(case, dtype):
    seed = fresh_seed()
    t, k, n, group_sizes = case
    group_sizes = _group_sizes(t, group_sizes)
    x = torch.randn(t, k, device=DEVICE, dtype=dtype)
    w = (torch.randn(len(group_sizes), k, n, device=DEVICE) / k**0.5).to(dtype)
    run_and_compare(x, w, offsets(group_sizes), dtype, seed)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer loads", "tensor descriptors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_load_paths(tma, dtype):
    """The same tiles through pointer loads and through TMA descriptors (the interpreter emulates them)."""
    seed = fresh_seed()
    a = arch.detect(torch.device(DEVICE))
    config = arch.gemm_configs(a, torch.tensor([], dtype=dtype).element_size())[0]
    group_sizes = [0, 9, 31, 0, 2] if not ON_GPU else [0, 900, 3100, 0, 17]
    x = torch.randn(sum(group_sizes) + 3, 32, device=DEVICE, dtype=dtype)
    w = torch.randn(5, 32, 48, device=DEVICE, dtype=dtype)
    with grouped_gemm.forced_config(dataclasses.replace(config, tma=tma)):
        run_and_compare(x, w, offsets(group_sizes), dtype, seed, "tma" if tma else "pointer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transformers_weight_layout(dtype):
    """w as transformers stores experts (gate_up_proj [E, N, K]) seen as [E, K, N]: K innermost. Its
    gradient comes back in the same layout."""
    seed = fresh_seed()
    stored = torch.randn(3, 24, 32, device=DEVICE, dtype=dtype)
    w = stored.transpose(1, 2).detach()
    x = torch.randn(29, 32, device=DEVICE, dtype=dtype)
    run_and_compare(x, w, offsets([11, 0, 18]), dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_no_expert_are_zero_whatever_they_hold(dtype):
    """Rows past the last expert's end (padding, say) give zero outputs and gradients even if they hold NaN,
    and do not reach the weights' gradient (bf16 on sm_90: torch._grouped_mm's)."""
    fresh_seed()
    x = torch.randn(40, 32, device=DEVICE, dtype=dtype)
    x[33:] = float("nan")
    x.requires_grad_(True)
    w = torch.randn(3, 32, 16, device=DEVICE, dtype=dtype, requires_grad=True)
    y = grouped_mm(x, w, offsets([20, 0, 13]))
    dy = torch.randn_like(y)
    dy[33:] = float("nan")
    y.backward(dy)
    assert not y[33:].any() and not x.grad[33:].any()
    assert y[:33].isfinite().all() and x.grad[:33].isfinite().all() and w.grad.isfinite().all()


def test_a_wrong_offset_is_caught():
    """The comparison sees one row moved to the neighbouring expert."""
    fresh_seed()
    x = torch.randn(30, 16, device=DEVICE)
    w = torch.randn(3, 16, 16, device=DEVICE)
    offs = offsets([10, 8, 12])
    y = grouped_mm(x, w, offs)
    assert_close(y, reference(x, w, offs), "grouped_gemm", torch.float32, "y")
    with pytest.raises(AssertionError):
        assert_close(y, reference(x, w, offsets([10, 9, 11])), "grouped_gemm", torch.float32, "y, shifted")


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_float32_follows_torchs_matmul_precision(precision):
    """fp32 operands: exact fp32 products under "highest", TF32 allowed under "high", as torch's matmul; the
    allowance is torch's own error under the same setting, so TF32 under "highest" fails. A long reduction
    (every row one expert's) for dw."""
    seed = fresh_seed()
    t, k, n = sizes(cpu=(96, 32, 16), gpu=(8192, 512, 256))
    x = torch.randn(t, k, device=DEVICE)
    w = torch.randn(3, k, n, device=DEVICE) / k**0.5
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert grouped_gemm._dot_flags(torch.float32, arch.detect(torch.device(DEVICE)))["PRECISE_FP32"] == (
            precision == "highest")
        run_and_compare(x, w, offsets([0, t, 0]), torch.float32, seed, precision)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_torch_grouped_mm_weight_gradient_as_the_weight_is_laid_out():
    """The TORCH_GROUPED_MM candidate: dw in w's layout ([E, K, N], or [E, N, K] storage seen transposed) with
    no copy, empty experts zero, rows past the last expert left out."""
    fresh_seed()
    x = torch.randn(40, 32, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(40, 16, device=DEVICE, dtype=torch.bfloat16)
    x[37:] = float("nan")
    offs = offsets([11, 0, 26])
    expected = torch.stack([x[:11].double().T @ dy[:11].double(), torch.zeros(32, 16, device=DEVICE),
                            x[11:37].double().T @ dy[11:37].double()])
    a = arch.detect(torch.device(DEVICE))
    for w in (torch.empty(3, 32, 16, device=DEVICE), torch.empty(3, 16, 32, device=DEVICE).transpose(1, 2)):
        launch = grouped_gemm._weight_grad_launcher(x, dy, offs, list(w.shape), list(w.stride()), a)
        try:
            dw = launch(grouped_gemm.TORCH_GROUPED_MM)
        except (RuntimeError, NotImplementedError) as exc:   # a torch without _grouped_mm on this device
            pytest.skip(f"torch._grouped_mm: {exc}")
        assert dw.stride() == w.stride()
        assert_close(dw, expected, "grouped_gemm", torch.bfloat16, "dw")


def test_who_computes_the_weight_gradient():
    """bf16 on sm_90: torch._grouped_mm first (measured faster there); else, and for fp16, our kernel."""
    offs = offsets([5, 0, 16])
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(21, 32, device=DEVICE, dtype=dtype)
        grouped_gemm._weight_grad(x, torch.randn(21, 16, device=DEVICE, dtype=dtype), offs, [3, 32, 16], [512, 16, 1])
    picks = {key.split()[-1]: c for key, c in grouped_gemm.chosen().items() if key.startswith("weight_grad")}
    a = arch.detect(torch.device(DEVICE))
    sm90 = ON_GPU and a.name == "sm_90" and not torch.version.hip
    assert (picks["torch.bfloat16"] is grouped_gemm.TORCH_GROUPED_MM) == sm90
    assert isinstance(picks["torch.float16"], arch.GemmConfig)


def test_bad_inputs_give_clear_errors():
    x = torch.randn(8, 16, device=DEVICE)
    w = torch.randn(2, 16, 4, device=DEVICE)
    with pytest.raises(ValueError, match="K=16"):
        grouped_mm(x, torch.randn(2, 15, 4, device=DEVICE), offsets([4, 4]))
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(x, w, offsets([4, 4]).float())
    with pytest.raises(ValueError, match=r"\[E=2\]"):
        grouped_mm(x, w, offsets([4, 2, 2]))
    with pytest.raises(ValueError, match="share"):
        grouped_mm(x, w.bfloat16(), offsets([4, 4]))


def test_empty_inputs():
    w = torch.randn(2, 16, 4, device=DEVICE)
    assert grouped_mm(torch.randn(0, 16, device=DEVICE), w, offsets([0, 0])).shape == (0, 4)
    y = grouped_mm(torch.randn(5, 0, device=DEVICE), torch.randn(2, 0, 4, device=DEVICE), offsets([2, 3]))
    assert y.shape == (5, 4) and not y.any()


def test_torch_compile_fullgraph_and_opcheck():
    fresh_seed()
    x = torch.randn(21, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(3, 16, 32, device=DEVICE, requires_grad=True)
    offs = offsets([5, 0, 16])
    dy = torch.randn(21, 32, device=DEVICE)
    compiled = torch.compile(grouped_mm, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out_c = compiled(x, w, offs)
    grads_c = torch.autograd.grad(out_c, (x, w), dy)
    out_e = grouped_mm(x, w, offs)
    grads_e = torch.autograd.grad(out_e, (x, w), dy)
    for what, a, b in zip(("y", "dx", "dw"), (out_c, *grads_c), (out_e, *grads_e)):
        # inductor may hand the op other strides than eager does (another tile path): the op's tolerance
        assert_close(a, b, "grouped_gemm", torch.float32, f"{what} compiled")
    torch.library.opcheck(torch.ops.anvil.grouped_mm, (x, w, offs))
    torch.library.opcheck(torch.ops.anvil.grouped_mm_weight_grad, (x.detach(), dy, offs, [3, 16, 32], [512, 32, 1]))


# --- on a GPU ----------------------------------------------------------------------------------------

CANDIDATES = arch.gemm_configs(arch.detect()) if ON_GPU else ()


@pytest.mark.tile_sweep
@pytest.mark.skipif(not ON_GPU, reason="compiles the architecture's candidates")
@pytest.mark.parametrize("config", CANDIDATES, ids=str)
def test_every_candidate_configuration(config):
    """Each tile configuration the tuner may pick is right on its own. One that fails to launch here is
    one the tuner skips (a skip), except the first, the untimed default, which must run."""
    seed = fresh_seed()
    group_sizes = [0, 700, 13, 0, 2048, 1, 333]
    x = torch.randn(sum(group_sizes) + 5, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(len(group_sizes), 1024, 768, device=DEVICE, dtype=torch.bfloat16) / 32
    with grouped_gemm.forced_config(config):
        try:
            grouped_mm(x, w, offsets(group_sizes))
        except Exception as exc:  # noqa: BLE001 - compile and resource errors have no common type
            if config == CANDIDATES[0]:
                raise
            pytest.skip(f"does not launch here: {type(exc).__name__}: {str(exc)[:200]}")
        run_and_compare(x, w, offsets(group_sizes), torch.bfloat16, seed, str(config))


@pytest.mark.skipif(not ON_GPU, reason="the tuner times candidates on a GPU")
def test_the_tuner_skips_what_cannot_run(monkeypatch):
    """A candidate that cannot launch (shared memory past any GPU's) is skipped; the fastest of the others
    runs, and the result is right."""
    seed = fresh_seed()
    impossible = arch.GemmConfig(128, 128, 128, 4, 8, 1, tma=True)    # 512 KiB of shared memory a program
    monkeypatch.setattr(grouped_gemm, "_TUNE", True)
    monkeypatch.setattr(arch, "gemm_configs", lambda *args: (impossible, CANDIDATES[0]))
    x = torch.randn(700, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(4, 256, 128, device=DEVICE, dtype=torch.bfloat16) / 16
    run_and_compare(x, w, offsets([0, 300, 1, 399]), torch.bfloat16, seed, "tuned")
    picks = grouped_gemm.chosen()     # forward, input gradient, weight gradient (torch's a candidate on sm_90)
    assert len(picks) == 3 and set(picks.values()) <= {CANDIDATES[0], grouped_gemm.TORCH_GROUPED_MM}, picks


@pytest.mark.skipif(not (ON_GPU and torch.cuda.get_device_capability() >= (9, 0) and not torch.version.hip),
                    reason="torch._grouped_mm runs on CUDA sm_90+")
def test_agrees_with_torch_grouped_mm():
    """The peer the benchmark times: our kernel's products (its default tiles) and torch._grouped_mm's
    within the bf16 tolerance of each other."""
    fresh_seed()
    group_sizes = _group_sizes(8192, None)
    offs = offsets(group_sizes)
    x = torch.randn(8192, 2048, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(64, 2048, 1408, device=DEVICE) / 45).bfloat16().requires_grad_(True)
    dy = torch.randn(8192, 1408, device=DEVICE, dtype=torch.bfloat16)
    with grouped_gemm.forced_config(CANDIDATES[0]):
        ours = (grouped_mm(x, w, offs), *torch.autograd.grad(grouped_mm(x, w, offs), (x, w), dy))
    theirs = (torch._grouped_mm(x, w, offs=offs), *torch.autograd.grad(torch._grouped_mm(x, w, offs=offs), (x, w), dy))
    for what, a, b in zip(("y", "dx", "dw"), ours, theirs):
        assert_close(a, b, "grouped_gemm", torch.bfloat16, what)

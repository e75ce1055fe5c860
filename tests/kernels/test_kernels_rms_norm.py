"""RMSNorm kernel vs an fp64 reference of transformers' LlamaRMSNorm: y, dx, dweight."""

from helpers.kernels import DEVICE, DTYPES, ON_GPU, assert_close, fresh_seed, poisoned_allocations, sizes  # noqa: I001

import importlib

import pytest
import torch

from kernels import RMSNorm, rms_norm
from kernels.arch import detect, row_config


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm in fp64, keeping its one rounding: the normalized x cast to x's dtype."""
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * h.to(x.dtype).double()


def compare_rms_norm(shape, dtype, w_dtype=None, eps=1e-6, make_x=None):
    seed = fresh_seed()
    w_dtype = w_dtype or dtype
    hidden = shape[-1]
    x = make_x(shape, dtype) if make_x else torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    x.requires_grad_(True)
    weight = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(w_dtype).requires_grad_(True)
    with poisoned_allocations():
        y = rms_norm(x, weight, eps)
        dy = torch.randn_like(y)
        y.backward(dy)
    assert y.dtype == torch.promote_types(dtype, w_dtype)

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weight.detach().double().requires_grad_(True)
    y_ref = llama_rms_norm(x_ref, w_ref, eps)
    y_ref.backward(dy.double())
    assert_close(y, y_ref, "rms_norm", dtype, "y", seed)
    assert_close(x.grad, x_ref.grad, "rms_norm", dtype, "dx", seed)
    # dW sums over every row: compare relative to its scale (a sum of `rows` terms).
    rows = x.numel() // hidden
    scale = max(1.0, rows ** 0.5)
    assert_close(weight.grad / scale, w_ref.grad / scale, "rms_norm", dtype, "dweight", seed)


SHAPES = sizes(
    cpu=[(3, 5, 1000), (7, 4095), (2, 2, 64), (33, 1), (5, 96)],
    gpu=[(4, 2048, 4096), (1000, 4095), (4096, 1000), (2048, 16384), (3, 7, 64), (65536, 1), (8192, 8192)],
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype):
    compare_rms_norm(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_weight_promotes_like_hf(dtype):
    compare_rms_norm(sizes((4, 1000), (4096, 4096)), dtype, w_dtype=torch.float32)


def test_eps_is_used():
    # tiny inputs make eps dominate the statistics
    compare_rms_norm((6, 100), torch.float32, eps=0.5,
                    make_x=lambda s, d: 1e-3 * torch.randn(s, dtype=d, device=DEVICE))


def test_row_strided_view():
    # a [rows, H] view into wider rows: the kernel uses the row stride, no copy
    wide = torch.randn(9, 1200, device=DEVICE)
    compare_rms_norm((9, 1000), torch.float32, make_x=lambda s, d: wide[:, : s[1]].to(d))


def test_non_contiguous_columns():
    compare_rms_norm((6, 700), torch.float32,
                    make_x=lambda s, d: torch.randn(s[0], 2 * s[1], dtype=d, device=DEVICE)[:, ::2])


def test_weight_without_grad_and_empty_input():
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    w = torch.ones(64, device=DEVICE)
    rms_norm(x, w).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert rms_norm(torch.randn(0, 64, device=DEVICE), w).shape == (0, 64)


def test_bad_shapes_give_clear_errors():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(4, 64, device=DEVICE), torch.ones(32, device=DEVICE))
    with pytest.raises(ValueError, match="exceeds the largest supported block"):
        row_config(detect(torch.device(DEVICE)), 70000)


def test_module_is_drop_in_for_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(256, eps=1e-5).to(DEVICE)
    ours = RMSNorm(256, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        hf.weight.normal_()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 4, 256, device=DEVICE)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


def test_torch_compile_fullgraph_and_opcheck():
    """The custom ops trace with no graph break and give the eager results and gradients."""
    fresh_seed()
    x = torch.randn(2, 3, 96, device=DEVICE, requires_grad=True)
    w = torch.randn(96, device=DEVICE, requires_grad=True)
    dy = torch.randn(2, 3, 96, device=DEVICE)
    compiled = torch.compile(lambda a, b: rms_norm(a, b, 1e-6), fullgraph=True,
                             backend="inductor" if ON_GPU else "aot_eager")
    y = compiled(x, w)
    (gx, gw) = torch.autograd.grad(y, (x, w), dy)
    y_e = rms_norm(x, w, 1e-6)
    (gx_e, gw_e) = torch.autograd.grad(y_e, (x, w), dy)
    for a, b in [(y, y_e), (gx, gx_e), (gw, gw_e)]:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.library.opcheck(torch.ops.anvil.rms_norm_fwd, (x, w, 1e-6))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: more than 2**31 elements")
def test_int64_offsets_beyond_2g_elements():
    hidden = 16384
    rows = 2**31 // hidden + 64
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    x.requires_grad_(True)
    y = rms_norm(x, w)
    tail = slice(rows - 64, rows)
    assert_close(y[tail], llama_rms_norm(x[tail].detach(), w.detach(), 1e-6), "rms_norm", torch.bfloat16, "y tail")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad[tail]).all() and x.grad[tail].abs().sum() > 0


VARIANTS = {
    "two_rows_fold": dict(bwd_rows=2, bwd_warps=2, fold_dw=True, evict=True, fwd_evict=True),
    "no_prefetch_fold": dict(prefetch=False, fold_dw=True, programs_per_sm=2, stages=3, evict_dx=True),
    "no_prefetch_partials_staged": dict(prefetch=False, programs_per_sm=2, stages=3),
    "fwd_two_rows": dict(fwd_rows=2, fwd_warps=2),
    "no_prefetch_partials": dict(prefetch=False, bwd_rows=2, evict=True),
}


@pytest.fixture
def tuning(request):
    """Run the kernels under one launch variant (as the sweep does), then restore the table's."""
    rn = importlib.import_module("kernels.rms_norm")  # the package's `rms_norm` attribute is the function

    def use(**fields):
        rn.TUNING_OVERRIDE = rn.Tuning(**fields)
        rn._config.cache_clear()
    yield use
    rn.TUNING_OVERRIDE = None
    rn._config.cache_clear()


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("shape", sizes(cpu=[(37, 1000), (5, 3, 96)], gpu=[(8191, 4096), (3001, 1000)]), ids=str)
def test_launch_variants_match_reference(tuning, variant, shape):
    # every tuning branch (row pairs, no prefetch, folded dW by atomics + last-ticket cast) is exact
    tuning(**VARIANTS[variant])
    compare_rms_norm(shape, torch.bfloat16)
    compare_rms_norm(shape, torch.float32)


def test_folded_dw_falls_back_under_deterministic_mode(tuning):
    tuning(fold_dw=True)
    torch.use_deterministic_algorithms(True)
    try:
        compare_rms_norm((9, 200), torch.float32)
    finally:
        torch.use_deterministic_algorithms(False)


def test_pipeline_depth_fits_shared_memory():
    """fp32 rows of 16384 at 3 stages need 256 KiB of tiles: more than an H100/H200 block may have."""
    from kernels.rms_norm import pipeline_stages

    hopper = 232448
    assert pipeline_stages(3, 4096, 1, 2 + 2, hopper) == 3       # bf16 4096: 32 KiB of tiles
    assert pipeline_stages(3, 16384, 1, 4 + 4, hopper) == 2      # fp32 16384: 3 stages would not fit
    assert pipeline_stages(3, 16384, 2, 4 + 4, hopper) == 1
    assert pipeline_stages(1, 65536, 4, 8, 0) == 1

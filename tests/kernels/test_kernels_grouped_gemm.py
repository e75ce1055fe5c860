"""Grouped GEMM (kernels/grouped_gemm.py) against a per-expert loop in fp64: y, dx, dw."""

from helpers.kernels import DEVICE, DTYPES, ON_GPU, assert_close, fresh_seed, poisoned_allocations, sizes  # noqa: I001

import dataclasses

import pytest
import torch

from kernels import arch, grouped_gemm
from kernels.grouped_gemm import grouped_mm


def offsets(group_sizes: list[int]) -> torch.Tensor:
    return torch.tensor(group_sizes, device=DEVICE).cumsum(0).to(torch.int32)


def reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The per-expert loop in fp64; rows past the last offset (no expert's) are zeros."""
    x, w = x.double(), w.double()
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def run_and_compare(x, w, offs, dtype, seed, what=""):
    x.requires_grad_(True)
    w.requires_grad_(True)
    with poisoned_allocations():
        y = grouped_mm(x, w, offs)
        dy = torch.randn_like(y)
        y.backward(dy)
    x_ref = x.detach().double().requires_grad_(True)
    w_ref = w.detach().double().requires_grad_(True)
    y_ref = reference(x_ref, w_ref, offs)
    y_ref.backward(dy.double())
    assert y.dtype == dtype and w.grad.stride() == w.stride()
    assert_close(y, y_ref, "grouped_gemm", dtype, f"y {what}", seed)
    assert_close(x.grad, x_ref.grad, "grouped_gemm", dtype, f"dx {what}", seed)
    assert_close(w.grad, w_ref.grad, "grouped_gemm", dtype, f"dw {what}", seed)


# (T, K, N, rows per expert). Empty experts first, between and last; one expert with every row; rows
# past the last expert's end; odd K and N (no TMA: the pointer path with the same tiles).
CASES = sizes(
    cpu=[(53, 40, 24, [0, 7, 0, 19, 1, 26, 0]), (40, 32, 16, [0, 40, 0]), (37, 24, 40, [5, 0, 20]),
         (33, 37, 19, [3, 17, 13])],
    gpu=[(12288, 2048, 1408, None), (8192, 2048, 768, [0, 8192] + [0] * 62), (4099, 1408, 2048, None),
         (3001, 1000, 777, [1000, 0, 1, 999, 0, 1001])],
)


def _group_sizes(t, sizes_or_none, n_experts=64):
    if sizes_or_none is not None:
        return sizes_or_none
    cuts = torch.randint(0, t + 1, (n_experts - 1,)).sort().values.tolist()   # random, some empty
    return [b - a for a, b in zip([0] + cuts, cuts + [t])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}")
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


def test_rows_of_no_expert_are_zero_whatever_they_hold():
    """Rows past the last expert's end (padding, say) give zero outputs and gradients even if they hold NaN,
    and do not reach the weights' gradient."""
    fresh_seed()
    x = torch.randn(40, 32, device=DEVICE)
    x[33:] = float("nan")
    x.requires_grad_(True)
    w = torch.randn(3, 32, 16, device=DEVICE, requires_grad=True)
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


@pytest.mark.skipif(not (ON_GPU and torch.cuda.get_device_capability() >= (9, 0) and not torch.version.hip),
                    reason="torch._grouped_mm runs on CUDA sm_90+")
def test_agrees_with_torch_grouped_mm():
    """The peer the benchmark times: the same products within the bf16 tolerance of each other."""
    fresh_seed()
    group_sizes = _group_sizes(8192, None)
    offs = offsets(group_sizes)
    x = torch.randn(8192, 2048, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(64, 2048, 1408, device=DEVICE) / 45).bfloat16().requires_grad_(True)
    dy = torch.randn(8192, 1408, device=DEVICE, dtype=torch.bfloat16)
    ours = (grouped_mm(x, w, offs), *torch.autograd.grad(grouped_mm(x, w, offs), (x, w), dy))
    theirs = (torch._grouped_mm(x, w, offs=offs), *torch.autograd.grad(torch._grouped_mm(x, w, offs=offs), (x, w), dy))
    for what, a, b in zip(("y", "dx", "dw"), ours, theirs):
        assert_close(a, b, "grouped_gemm", torch.bfloat16, what)

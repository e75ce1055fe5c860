"""MoE permute / unpermute (kernels/moe_permute.py) against index_select / scatter-add in fp64."""

from helpers.kernels import DEVICE, DTYPES, ON_GPU, assert_close, case_dtypes, fresh_seed, poisoned_allocations, sizes  # noqa: I001

import pytest
import torch

from kernels import moe_permute
from kernels.moe_permute import PermutePlan, permute, permute_reference, unpermute, unpermute_reference


def routing(t: int, k: int, n_experts: int, used: int | None = None) -> torch.Tensor:
    """[T, k] distinct experts per token, drawn from the first `used` experts (the rest stay empty)."""
    used = used or n_experts
    return torch.rand(t, used, device=DEVICE).topk(k, dim=1).indices


# (T, k, E, experts used, D): k = 1, 6, 8; empty experts; odd T and D; more pairs than a plan block
# (test_the_plan_across_many_blocks shrinks the blocks on the CPU).
CASES = sizes(
    cpu=[(29, 1, 4, 3, 37), (33, 6, 64, 20, 48), (40, 8, 10, 9, 16)],
    gpu=[(4093, 8, 128, 100, 2047), (4096, 6, 64, 64, 2048), (8192, 1, 16, 16, 1024), (50000, 2, 160, 160, 64)],
)
PERMUTE_CASE_DTYPES = case_dtypes(CASES)   # the first case is the hardest (odd T and D, empty experts)


def _ids(value) -> str:
    return str(value) if isinstance(value, torch.dtype) else "T{}k{}E{}used{}D{}".format(*value)


def check_plan(plan: PermutePlan, ids: torch.Tensor, n_experts: int) -> None:
    _, expected = permute_reference(torch.zeros(ids.shape[0], 1, device=DEVICE), ids, n_experts)
    for name in PermutePlan._fields:
        got, want = getattr(plan, name), getattr(expected, name)
        assert got.dtype == torch.int32 and torch.equal(got, want), f"plan.{name}: {got} != {want}"


@pytest.mark.parametrize("case, dtype", PERMUTE_CASE_DTYPES, ids=_ids)
def test_permute_matches_reference(case, dtype):
    seed = fresh_seed()
    t, k, n_experts, used, d = case
    ids = routing(t, k, n_experts, used)
    x = torch.randn(t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        x_sorted, plan = permute(x, ids, n_experts)
        dx_sorted = torch.randn_like(x_sorted)
        x_sorted.backward(dx_sorted)
    check_plan(plan, ids, n_experts)
    x_ref = x.detach().double().requires_grad_(True)
    sorted_ref, _ = permute_reference(x_ref, ids, n_experts)
    sorted_ref.backward(dx_sorted.double())
    assert torch.equal(x_sorted.double(), sorted_ref), "a permuted row is not its token's row"
    assert_close(x.grad, x_ref.grad, "moe_permute", dtype, "dx", seed)


@pytest.mark.parametrize("case, dtype", PERMUTE_CASE_DTYPES, ids=_ids)
def test_unpermute_matches_reference(case, dtype):
    seed = fresh_seed()
    t, k, n_experts, used, d = case
    ids = routing(t, k, n_experts, used)
    _, plan = permute(torch.zeros(t, 1, device=DEVICE), ids, n_experts)
    y = torch.randn(t * k, d, device=DEVICE, dtype=dtype, requires_grad=True)
    weights = torch.rand(t, k, device=DEVICE, requires_grad=True)
    with poisoned_allocations():
        out = unpermute(y, plan, weights)
        dout = torch.randn_like(out)
        out.backward(dout)
    y_ref = y.detach().double().requires_grad_(True)
    w_ref = weights.detach().double().requires_grad_(True)
    out_ref = unpermute_reference(y_ref, plan, w_ref)
    out_ref.backward(dout.double())
    assert out.dtype == dtype and weights.grad.dtype == torch.float32
    assert_close(out, out_ref, "moe_permute", dtype, "out", seed)
    assert_close(y.grad, y_ref.grad, "moe_permute", dtype, "dy", seed)
    assert_close(weights.grad, w_ref.grad, "moe_permute_weights", dtype, "dweights", seed)


def test_one_expert_takes_every_token_and_unweighted_sum():
    fresh_seed()
    ids = torch.full((23, 1), 2, device=DEVICE)
    x = torch.randn(23, 12, device=DEVICE)
    x_sorted, plan = permute(x, ids, 5)
    check_plan(plan, ids, 5)
    assert plan.counts.tolist() == [0, 0, 23, 0, 0] and torch.equal(x_sorted, x)
    assert torch.equal(unpermute(x_sorted, plan), x)


def test_the_plan_across_many_blocks(monkeypatch):
    """Small plan blocks and scan steps, so the per-block prefix and the scan's loop carry across many."""
    fresh_seed()
    monkeypatch.setattr(moe_permute, "_PLAN_BLOCK_MIN", 16)
    monkeypatch.setattr(moe_permute, "_SCAN_ROWS", 4)
    ids = routing(61, 3, 7)
    x = torch.randn(61, 4, device=DEVICE)
    x_sorted, plan = permute(x, ids, 7)
    check_plan(plan, ids, 7)
    torch.testing.assert_close(unpermute(x_sorted, plan, torch.full((61, 3), 1 / 3, device=DEVICE)), x)


def test_rows_longer_than_a_chunk(monkeypatch):
    """Rows of several [K_PAD, BLOCK_D] chunks, the last one partial: every chunk moved, the weights' dot
    products summed across chunks."""
    seed = fresh_seed()
    monkeypatch.setattr(moe_permute, "_VECTOR", 1)    # BLOCK_D = one warp's lanes: 80 columns are 3 chunks
    monkeypatch.setattr(moe_permute, "_ROW_WARPS", 1)
    assert moe_permute._row_launch(80, 3, torch.device(DEVICE))["BLOCK_D"] < 40
    ids = routing(13, 3, 5)
    x = torch.randn(13, 80, device=DEVICE, requires_grad=True)
    weights = torch.rand(13, 3, device=DEVICE, requires_grad=True)
    with poisoned_allocations():
        x_sorted, plan = permute(x, ids, 5)
        out = unpermute(x_sorted * 3, plan, weights)
        dout = torch.randn_like(out)
        out.backward(dout)
    x_ref = x.detach().double().requires_grad_(True)
    w_ref = weights.detach().double().requires_grad_(True)
    sorted_ref, _ = permute_reference(x_ref, ids, 5)
    out_ref = unpermute_reference(sorted_ref * 3, plan, w_ref)
    out_ref.backward(dout.double())
    assert torch.equal(x_sorted.double(), sorted_ref)
    assert_close(out, out_ref, "moe_permute", torch.float32, "out", seed)
    assert_close(x.grad, x_ref.grad, "moe_permute", torch.float32, "dx", seed)
    assert_close(weights.grad, w_ref.grad, "moe_permute_weights", torch.float32, "dweights", seed)


def test_a_wrong_row_map_is_caught():
    """The comparisons see two tokens' rows swapped in the plan."""
    fresh_seed()
    ids = routing(12, 2, 4)
    y = torch.randn(24, 8, device=DEVICE)
    weights = torch.rand(12, 2, device=DEVICE)
    _, plan = permute(torch.zeros(12, 1, device=DEVICE), ids, 4)
    out = unpermute(y, plan, weights)
    assert_close(out, unpermute_reference(y, plan, weights), "moe_permute", torch.float32, "out")
    swapped = plan.row_of.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(AssertionError):
        assert_close(out, unpermute_reference(y, plan._replace(row_of=swapped), weights), "moe_permute",
                     torch.float32, "out, swapped")
    with pytest.raises(AssertionError):
        check_plan(plan._replace(row_of=swapped), ids, 4)


def test_bad_inputs_give_clear_errors():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        permute(x, torch.zeros(5, 2, dtype=torch.long, device=DEVICE), 3)
    with pytest.raises(ValueError, match="int32 or int64"):
        permute(x, torch.zeros(4, 2, device=DEVICE), 3)
    _, plan = permute(x, torch.zeros(4, 2, dtype=torch.long, device=DEVICE), 3)
    with pytest.raises(ValueError, match=r"T\*k=8"):
        unpermute(torch.randn(7, 8, device=DEVICE), plan)
    with pytest.raises(ValueError, match="weights"):
        unpermute(torch.randn(8, 8, device=DEVICE), plan, torch.rand(4, 3, device=DEVICE))


def test_torch_compile_fullgraph_and_opcheck():
    fresh_seed()
    ids = routing(9, 2, 4)
    x = torch.randn(9, 16, device=DEVICE, requires_grad=True)
    weights = torch.rand(9, 2, device=DEVICE, requires_grad=True)

    def layer(x, weights):
        x_sorted, plan = permute(x, ids, 4)
        return unpermute(x_sorted * 2, plan, weights)

    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    dout = torch.randn(9, 16, device=DEVICE)
    out_c = compiled(x, weights)
    grads_c = torch.autograd.grad(out_c, (x, weights), dout)
    out_e = layer(x, weights)
    grads_e = torch.autograd.grad(out_e, (x, weights), dout)
    for a, b in zip((out_c, *grads_c), (out_e, *grads_e)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.library.opcheck(torch.ops.anvil.moe_permute, (x, ids, 4))
    _, plan = permute(x, ids, 4)
    y = torch.randn(18, 16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.anvil.moe_unpermute, (y, plan.row_of, weights))
    torch.library.opcheck(torch.ops.anvil.moe_unpermute, (y, plan.row_of, None))

"""MoE router (kernels/router.py): both implementations against transformers' gates, and gradients."""

from helpers.kernels import DEVICE, ON_GPU, assert_close, fresh_seed, poisoned_allocations, sizes, tolerance  # noqa: I001

import pytest
import torch

from kernels import router
from kernels.router import RouterSpec, route, router_reference, router_triton

IMPLEMENTATIONS = {"reference": router_reference, "triton": router_triton}
TIE = 1e-5   # decisions closer than this (relative to the scores) may fall either way between two correct fp32
             # computations: ~100 fp32 ulps; relative, as softmax scores over 128 experts are ~1/128 each


def _hf_gate(model: str, n_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1, **extra):
    """(transformers' router module with random weights, its config), hidden size 32."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    common = dict(hidden_size=32, num_experts_per_tok=top_k, **extra)
    if model == "deepseek_v2":
        config = DeepseekV2Config(n_routed_experts=n_experts, n_group=n_group, topk_group=topk_group, **common)
        gate = DeepseekV2TopkRouter(config)
    elif model == "deepseek_v3":
        config = DeepseekV3Config(n_routed_experts=n_experts, n_group=n_group, topk_group=topk_group, **common)
        gate = DeepseekV3TopkRouter(config)
        gate.e_score_correction_bias.copy_(0.05 * torch.randn(n_experts))
    else:
        config = Qwen3MoeConfig(num_experts=n_experts, **common)
        gate = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(gate.weight, std=0.2)
    return gate.to(DEVICE), config


def _decided(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """[T] bool: the token's groups and experts are chosen by margins wider than TIE (in fp64)."""
    t, e = logits.shape
    scores = logits.double().softmax(-1) if spec.score_func == "softmax" else logits.double().sigmoid()
    choice = scores if bias is None else scores + bias.double()
    decided = torch.ones(t, dtype=torch.bool, device=logits.device)
    if spec.n_group > 1:
        grouped = choice.view(t, spec.n_group, -1)
        group = grouped.max(-1).values if spec.score_func == "softmax" else grouped.topk(2, -1)[0].sum(-1)
        ranked = group.sort(-1, descending=True).values
        if spec.topk_group < spec.n_group:
            decided &= _apart(ranked[:, spec.topk_group - 1], ranked[:, spec.topk_group])
        keep = torch.zeros_like(group).scatter_(1, group.topk(spec.topk_group, -1)[1], 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(e // spec.n_group, 1), float("-inf"))
    ranked = choice.sort(-1, descending=True).values
    return decided & (_apart(ranked[:, spec.top_k - 1], ranked[:, spec.top_k]) | ranked[:, spec.top_k].isinf())


def _apart(last_in: torch.Tensor, first_out: torch.Tensor) -> torch.Tensor:
    """The last chosen and the first left out differ by more than TIE of their size."""
    return last_in - first_out > TIE * torch.maximum(last_in.abs(), first_out.abs())


def assert_same_routing(ours, weights, indices, decided, what, seed=None):
    """Same experts for every decided token (in any order), their weights within the fp32 tolerance."""
    assert decided.float().mean() > 0.97, f"{what}: too many near-ties to compare ({decided.sum()} decided)"
    order, ref_order = ours.indices.sort(-1), indices.sort(-1)
    assert torch.equal(order.values[decided], ref_order.values[decided]), f"{what}: other experts chosen"
    w, w_ref = ours.weights.gather(1, order.indices), weights.float().gather(1, ref_order.indices)
    assert_close(w[decided], w_ref[decided], "router", torch.float32, f"{what} weights", seed)


# (model, experts, top_k, n_group, topk_group, config extras)
GATES = [
    ("deepseek_v2", 16, 6, 1, 1, {"topk_method": "greedy", "routed_scaling_factor": 1.0}),
    ("deepseek_v2", 32, 6, 8, 3, {"topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0}),
    ("deepseek_v3", 64, 8, 8, 4, {"norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    ("deepseek_v3", 24, 3, 4, 2, {"norm_topk_prob": False, "routed_scaling_factor": 1.0}),
    ("qwen3_moe", 128, 8, 1, 1, {"norm_topk_prob": True}),
    ("qwen3_moe", 20, 1, 1, 1, {"norm_topk_prob": False}),
]
TOKENS = sizes(cpu=37, gpu=4099)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("gate_case", GATES, ids=lambda g: f"{g[0]}-E{g[1]}k{g[2]}g{g[3]}")
def test_matches_transformers_gate(gate_case, impl):
    seed = fresh_seed()
    model, n_experts, top_k, n_group, topk_group, extra = gate_case
    gate, config = _hf_gate(model, n_experts, top_k, n_group, topk_group, **extra)
    hidden = torch.randn(TOKENS, 32, device=DEVICE)
    with torch.no_grad():
        logits, hf_weights, hf_indices = gate(hidden)
    spec = RouterSpec.from_config(config)
    bias = getattr(gate, "e_score_correction_bias", None)
    with poisoned_allocations():
        ours = IMPLEMENTATIONS[impl](logits, spec, bias)
    assert ours.weights.dtype == torch.float32 and ours.indices.dtype == torch.int64
    expected_scores = logits.float().softmax(-1) if spec.score_func == "softmax" else logits.float().sigmoid()
    assert_close(ours.scores, expected_scores, "router", torch.float32, "scores", seed)
    assert_same_routing(ours, hf_weights, hf_indices, _decided(logits, spec, bias), f"{model} {impl}", seed)
    best_first = ours.scores.gather(1, ours.indices) + (0 if bias is None else bias[ours.indices])
    assert (best_first[:, :-1] >= best_first[:, 1:]).all(), "indices are not best first"


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", [RouterSpec(6), RouterSpec(8, norm_topk_prob=True),
                                  RouterSpec(4, "sigmoid", 4, 2, True, 2.5),
                                  RouterSpec(3, "softmax", 4, 3, False, 16.0)],
                         ids=lambda s: f"{s.score_func}-k{s.top_k}-g{s.n_group}-norm{s.norm_topk_prob}")
def test_triton_gradients_match_the_reference(spec, logits_dtype):
    """d logits from the weights' and the scores' gradients, through normalization and scaling."""
    seed = fresh_seed()
    n_experts = 32
    logits = (2 * torch.randn(TOKENS, n_experts, device=DEVICE)).to(logits_dtype)
    bias = 0.05 * torch.randn(n_experts, device=DEVICE) if spec.score_func == "sigmoid" else None
    x = logits.clone().requires_grad_(True)
    x_ref = logits.clone().requires_grad_(True)
    with poisoned_allocations():
        ours = router_triton(x, spec, bias)
    ref = router_reference(x_ref, spec, bias)
    decided = _decided(logits, spec, bias)
    assert torch.equal(ours.indices.sort(-1).values[decided], ref.indices.sort(-1).values[decided])
    # each expert's weight gets the same gradient whatever its place among the k (bf16 logits tie often);
    # a near-tie token may pick other experts: none
    per_expert = torch.randn_like(ours.scores) * decided[:, None]
    d_scores = torch.randn_like(ours.scores)
    with poisoned_allocations():
        torch.autograd.backward((ours.weights, ours.scores), (per_expert.gather(1, ours.indices), d_scores))
    torch.autograd.backward((ref.weights, ref.scores), (per_expert.gather(1, ref.indices), d_scores))
    assert x.grad.dtype == logits_dtype
    # the gradient, and with it exp's ulp-level differences (Triton's against torch's), scale with routed_scaling_factor;
    # the softmax's backward subtracts near-equal terms, so they show as absolute, not relative, errors
    slack = {"accumulation": tolerance("router", logits_dtype)["atol"] * spec.routed_scaling_factor}
    assert_close(x.grad, x_ref.grad, "router", logits_dtype, "d logits", seed, **slack)
    # the weights' gradient alone (the scores unused: no aux loss)
    x.grad = None
    router_triton(x, spec, bias).weights.backward(per_expert.gather(1, ours.indices))
    x_ref.grad = None
    router_reference(x_ref, spec, bias).weights.backward(per_expert.gather(1, ref.indices))
    assert_close(x.grad, x_ref.grad, "router", logits_dtype, "d logits, weights only", seed, **slack)


def test_a_missing_bias_is_caught():
    """DeepSeek-V3 routing without its balancing bias chooses other experts, and the comparison says so."""
    fresh_seed()
    gate, config = _hf_gate("deepseek_v3", 32, 4, 4, 2, norm_topk_prob=True)
    gate.e_score_correction_bias.mul_(20)
    with torch.no_grad():
        logits, hf_weights, hf_indices = gate(torch.randn(40, 32, device=DEVICE))
    spec = RouterSpec.from_config(config)
    decided = _decided(logits, spec, gate.e_score_correction_bias)
    assert_same_routing(router_triton(logits, spec, gate.e_score_correction_bias), hf_weights, hf_indices, decided,
                        "with bias")
    with pytest.raises(AssertionError, match="other experts"):
        assert_same_routing(router_triton(logits, spec), hf_weights, hf_indices, decided, "without bias")


@pytest.mark.parametrize("n_experts", [8, 64, 128, 256, 2048])
def test_route_takes_triton_only_where_it_was_measured_to_win(monkeypatch, n_experts):
    """On an NVIDIA GPU from 128 experts (64: a tie with eager on an H100), up to the kernels' 1024; the
    reference on the CPU, on AMD (not measured) and below 128 experts."""
    calls = []
    monkeypatch.setattr(router, "router_triton", lambda *a: calls.append("triton"))
    monkeypatch.setattr(router, "router_reference", lambda *a: calls.append("reference"))
    route(torch.randn(4, n_experts, device=DEVICE), RouterSpec(2))
    nvidia = ON_GPU and not torch.version.hip
    assert calls == (["triton"] if nvidia and 128 <= n_experts <= 1024 else ["reference"])


def test_the_trainers_hook_calls_route(monkeypatch):
    """kernels.patch's router hook goes through route() (the chooser), with the layer's spec."""
    import importlib
    from types import SimpleNamespace

    patch = importlib.import_module("kernels.patch")   # the module (kernels.patch is also the function)
    seen = []
    monkeypatch.setattr(router, "route", lambda logits, spec, bias: seen.append((spec, bias)) or ("w", "i", "s"))
    moe = SimpleNamespace(top_k=4, score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True, route_scale=2.5)
    bias = torch.zeros(16, device=DEVICE)
    assert patch._trainer_route(torch.randn(3, 16, device=DEVICE), moe, bias) == ("w", "i", "s")
    assert seen == [(RouterSpec(4, "sigmoid", 4, 2, True, 2.5), bias)]


def test_bad_specs_give_clear_errors():
    logits = torch.randn(4, 12, device=DEVICE)
    with pytest.raises(ValueError, match="n_group=5"):
        route(logits, RouterSpec(2, n_group=5))
    with pytest.raises(ValueError, match="top_k=7 from 6"):
        route(logits, RouterSpec(7, n_group=4, topk_group=2))
    with pytest.raises(ValueError, match="score_func"):
        route(logits, RouterSpec(2, "relu"))
    with pytest.raises(ValueError, match=r"bias must be \[E=12\]"):
        route(logits, RouterSpec(2), torch.zeros(11, device=DEVICE))
    with pytest.raises(ValueError, match="model_type"):
        RouterSpec.from_config(object())


@pytest.mark.parametrize("entry", [router_triton, route], ids=["router_triton", "route"])
def test_torch_compile_fullgraph_and_opcheck(entry):
    fresh_seed()
    spec = RouterSpec(4, "sigmoid", 4, 2, True, 2.5)
    logits = torch.randn(9, 16, device=DEVICE, requires_grad=True)
    bias = 0.1 * torch.randn(16, device=DEVICE)
    compiled = torch.compile(entry, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    d_weights = torch.randn(9, 4, device=DEVICE)
    out_c = compiled(logits, spec, bias)
    grad_c = torch.autograd.grad(out_c.weights, logits, d_weights)
    out_e = entry(logits, spec, bias)
    grad_e = torch.autograd.grad(out_e.weights, logits, d_weights)
    # router_triton is one custom op either way: bit for bit. route() takes the plain-torch router at this size
    # on a GPU (Triton only where it was measured to win), whose math Inductor fuses: an ulp apart.
    exact = entry is router_triton or not ON_GPU
    torch.testing.assert_close((*out_c, *grad_c), (*out_e, *grad_e),
                               **({"atol": 0, "rtol": 0} if exact else tolerance("router", torch.float32)))
    torch.library.opcheck(torch.ops.anvil.router_fwd, (logits, bias, 4, "sigmoid", 4, 2, True, 2.5))

"""The mixture-of-experts families on one CPU process: their sizes are the published ones, the balance
loss trains the router as if it were added to the loss, the capacity drops what it must, DeepSeek-V3's
bias moves toward balance and is kept in the checkpoint, group-limited routing stays in its groups, and
activation checkpointing neither changes the gradients nor counts the load twice."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import config
from trainer.models import Transformer, flops_per_token, moe
from trainer.models.transformer import inactive_expert_params
from helpers.program import REPO

SMALL = ["model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.ffn_dim=128", "model.vocab_size=128",
         "model.mla={kv_lora_rank: 32, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16}",
         "model.moe={n_routed_experts: 8, n_shared_experts: 1, top_k: 2, ffn_dim: 32, first_k_dense: 1}"]


def small_moe(*sets: str, family: str = "deepseek_v2") -> config.TrainConfig:
    return config.load(REPO / "configs" / "deepseek_v2_debug.yaml", SMALL + [f"model.family={family}", *sets])


def build(cfg, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg.model)


@pytest.mark.parametrize("name, total, active", [("deepseek_v2_lite", 15.71, 2.66), ("deepseek_v2", 235.74, 21.38),
                                                 ("deepseek_v3", 682.64, 38.24), ("qwen3_30b_a3b", 30.53, 3.35)])
def test_the_configs_have_the_published_sizes(name, total, active):
    # DeepSeek-V3: 671.03 B and its multi-token prediction layer (685 B published: that layer's copies of the
    # embedding and the head counted again, 2 x 0.93 B)
    cfg = config.load(REPO / "configs" / f"{name}.yaml")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    n = model.num_params()
    assert round(n / 1e9, 2) == total and round((n - inactive_expert_params(cfg.model)) / 1e9, 2) == active
    assert flops_per_token(cfg.model, model.num_params(True), 4096) > 6 * (n - inactive_expert_params(cfg.model)) / 2


def test_the_balance_loss_trains_the_router_as_part_of_the_loss():
    alpha = 0.5
    cfg = small_moe(f"model.moe.aux_loss_alpha={alpha}")
    x = torch.randint(0, 128, (2, 16))
    injected = build(cfg)
    injected(x, x).backward()
    explicit = build(cfg)
    losses = []
    for _, layer in moe.moe_layers(explicit):   # the same balance loss, added to the loss by hand
        layer.moe = config.MoEConfig(**{**layer.moe.__dict__, "aux_loss_alpha": 0.0})
        original = layer.gate.forward

        def keep(h, original=original, layer=layer):
            weights, indices, scores = original(h)
            losses.append(moe.sequence_balance_loss(scores, indices, 2, layer.gate.moe))
            return weights, indices, scores
        layer.gate.forward = keep
    (explicit(x, x) + alpha * sum(losses)).backward()
    for (name, a), (_, b) in zip(injected.named_parameters(), explicit.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
    assert injected.model.layers[1].mlp.aux_loss_count == 1


def test_a_capacity_drops_the_tokens_an_expert_cannot_take():
    cfg = small_moe("model.moe.capacity_factor=0.25")
    model = build(cfg)
    x = torch.randint(0, 128, (2, 16))
    model(x, x)
    cap = model.model.layers[1].mlp.capacity(32)
    assert cap == 2
    for _, layer in moe.moe_layers(model):
        assert layer.load.max() <= cap and layer.load.sum() < 32 * 2
    dropless = build(small_moe())
    assert not torch.allclose(model(x), dropless(x))


def test_the_v3_bias_moves_toward_balance_and_is_checkpointed():
    cfg = small_moe("model.moe.score_func=sigmoid", "model.moe.bias_update_speed=0.01", "model.moe.n_group=4",
                "model.moe.topk_group=2", "model.moe.norm_topk_prob=true", family="deepseek_v3")
    model = build(cfg)
    x = torch.randint(0, 128, (2, 16))
    model(x, x).backward()
    layer = model.model.layers[1].mlp
    load = layer.step_load.clone()
    moe.update_balance_bias(model)
    bias = layer.gate.e_score_correction_bias
    assert torch.equal(torch.sign(bias), torch.sign(load.mean() - load) * (load != load.mean()))
    assert not layer.step_load.any()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_group_limited_routing_keeps_a_tokens_experts_in_its_best_groups():
    spec = small_moe("model.moe.n_group=4", "model.moe.topk_group=1").model.moe
    logits = torch.randn(64, 8)
    weights, indices, scores = moe.route(logits, spec, None)
    groups = indices // 2
    assert (groups == groups[:, :1]).all()     # one group kept: both experts from it
    best = logits.softmax(-1).view(64, 4, 2).amax(-1).argmax(-1)
    assert torch.equal(groups[:, 0], best)


def test_activation_checkpointing_keeps_the_gradients_and_counts_the_load_once():
    cfg = small_moe("model.moe.aux_loss_alpha=0.1")
    x = torch.randint(0, 128, (2, 16))
    plain, checkpointed = build(cfg), build(cfg)
    for layer in checkpointed.model.layers:
        layer.activation_checkpoint = "full"
    plain(x, x).backward()
    checkpointed(x, x).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
    for (_, a), (_, b) in zip(moe.moe_layers(plain), moe.moe_layers(checkpointed)):
        assert torch.equal(a.load, b.load) and a.load.sum() == 32 * 2
        assert a.aux_loss_count == b.aux_loss_count == 1


def test_the_fused_kernels_train_a_moe_model_as_the_reference_does():
    """--kernels on a DeepSeek-V2 layer stack: the grouped GEMM, the permutation and the router from
    kernels/ (Triton's interpreter here) give the reference's loss and gradients."""
    import kernels

    cfg = small_moe()
    reference, fused = build(cfg), build(cfg)
    kernels.patch(fused)
    assert {"grouped_gemm", "moe_permute", "router", "rope"} <= set(fused._anvil_kernels)
    x = torch.randint(0, 128, (2, 16))
    a, b = reference(x, x), fused(x, x)
    a.backward()
    b.backward()
    assert torch.allclose(a, b, rtol=1e-5)
    for (name, p), (_, q) in zip(reference.named_parameters(), fused.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5), name

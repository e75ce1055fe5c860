"""Qwen3-MoE: grouped-query attention with an RMSNorm on each query and key head, and routed experts
only (no shared expert; softmax scores, the chosen weights normalised) in every layer from
model.moe.first_k_dense on. Names are transformers' Qwen3MoeForCausalLM's; HF_MAPPINGS is its
Hugging Face mapping (the machinery is trainer/hf).
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.hf.errors import InitError
from trainer.hf.mapping import COMMON_FIXED, OMITTED, HFFamily, Key, stacked_experts
from trainer.models.attention import Attention
from trainer.models.blocks import MLP, DecoderLayer
from trainer.models.moe import MoE


def layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    mlp = MoE(cfg) if cfg.moe_layer(layer_id) else MLP(cfg.dim, cfg.ffn_dim)
    return DecoderLayer(cfg, layer_id, Attention(cfg, qk_norm=True), mlp)


def _read_layout(raw: dict, fields: dict, source: str) -> None:
    """transformers puts experts in layer i unless i is in mlp_only_layers or (i + 1) is no multiple
    of decoder_sparse_step; Anvil in every layer from model.moe.first_k_dense on."""
    step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
    if step != 1 or not isinstance(dense, list) or sorted(dense) != list(range(len(dense))):
        raise InitError(f"{source}: mlp_only_layers {dense!r} with decoder_sparse_step {step!r}: Anvil's "
                        f"Qwen3-MoE has experts in every layer from model.moe.first_k_dense on "
                        f"(mlp_only_layers [0, ..., k - 1] or [], decoder_sparse_step 1)")
    fields["moe.first_k_dense"] = len(dense)


def _write_layout(m: ModelConfig, config: dict) -> None:
    config.update(head_dim=m.head_dim, decoder_sparse_step=1, mlp_only_layers=list(range(m.moe.first_k_dense)))


HF_MAPPINGS = {"qwen3_moe": HFFamily(
    "qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe",
    keys=(Key("head_dim_size", "head_dim", default=lambda fields: fields["dim"] // fields["n_heads"]),
          # transformers 5 writes num_local_experts, the Hub's checkpoints num_experts
          Key("moe.n_routed_experts", "num_experts", also=("num_local_experts",)),
          Key("moe.top_k", "num_experts_per_tok"), Key("moe.ffn_dim", "moe_intermediate_size"),
          Key("moe.norm_topk_prob", "norm_topk_prob", bool, False),
          Key("moe.aux_loss_alpha", "router_aux_loss_coef", float, OMITTED, zero_ok=True)),
    fixed={**COMMON_FIXED, "use_sliding_window": False},
    # Qwen3MoeSparseMoeBlock: routed experts only, a softmax over all of them, no balancing bias
    implied={"moe.n_shared_experts": 0, "moe.score_func": "softmax", "moe.route_scale": 1.0, "moe.n_group": 1,
             "moe.topk_group": 1, "moe.bias_update_speed": 0.0},
    rope_types=("yarn",), read=_read_layout, write=_write_layout, derived={"moe.first_k_dense": "mlp_only_layers"},
    weight_rules=(stacked_experts,))}

"""Qwen3-MoE: grouped-query attention with an RMSNorm on each query and key head, and routed experts
only (no shared expert; softmax scores, the chosen weights normalised) in every layer from
model.moe.first_k_dense on. Names are transformers' Qwen3MoeForCausalLM's.
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.models.attention import Attention
from trainer.models.blocks import MLP, DecoderLayer
from trainer.models.moe import MoE


def layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    mlp = MoE(cfg) if cfg.moe_layer(layer_id) else MLP(cfg.dim, cfg.ffn_dim)
    return DecoderLayer(cfg, layer_id, Attention(cfg, qk_norm=True), mlp)

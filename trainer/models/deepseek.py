"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention in every layer; a dense SwiGLU MLP in the
first model.moe.first_k_dense layers and DeepSeekMoE (shared plus routed experts) in the others.

V2 scores experts with a softmax and balances them with the sequence-level auxiliary loss; V3 with
a sigmoid, group-limited routing and the auxiliary-loss-free bias. Both are the same code here: the
difference is model.moe's keys (configs/deepseek_v2*.yaml, configs/deepseek_v3.yaml).
Names are transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM's.
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.models.attention import LatentAttention
from trainer.models.blocks import MLP, DecoderLayer
from trainer.models.moe import MoE


def layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    mlp = MoE(cfg) if cfg.moe_layer(layer_id) else MLP(cfg.dim, cfg.ffn_dim)
    return DecoderLayer(cfg, layer_id, LatentAttention(cfg), mlp)

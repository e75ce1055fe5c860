"""Llama 3 (and the tiny default): grouped-query attention and a SwiGLU MLP in every layer.

Module and parameter names are transformers' LlamaForCausalLM's; its Hugging Face mapping is
trainer/hf (config.py, weights.py).
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.models.attention import Attention
from trainer.models.blocks import MLP, RECOMPUTED_MATMULS, DecoderLayer


def layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    return DecoderLayer(cfg, layer_id, Attention(cfg), MLP(cfg.dim, cfg.ffn_dim), RECOMPUTED_MATMULS)

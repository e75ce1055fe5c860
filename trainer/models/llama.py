"""Llama 3 (and the tiny default): grouped-query attention and a SwiGLU MLP in every layer.

Module and parameter names are transformers' LlamaForCausalLM's, so every tensor goes over to
Hugging Face unchanged (HF_MAPPINGS; the machinery is trainer/hf).
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.hf.errors import InitError
from trainer.hf.mapping import COMMON_FIXED, HFFamily
from trainer.models.attention import Attention
from trainer.models.blocks import MLP, RECOMPUTED_MATMULS, DecoderLayer


def layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    return DecoderLayer(cfg, layer_id, Attention(cfg), MLP(cfg.dim, cfg.ffn_dim), RECOMPUTED_MATMULS)


def _read_head_dim(raw: dict, fields: dict, source: str) -> None:
    dim, heads = fields["dim"], fields["n_heads"]
    head_dim = raw.get("head_dim") or dim / heads
    if dim % heads or head_dim != dim // heads or (dim // heads) % 2:
        raise InitError(f"{source}: head_dim {head_dim!r} with hidden_size {dim} and num_attention_heads "
                        f"{heads}: Anvil's Llama needs head_dim = hidden_size / num_attention_heads, even")


def _write_head_dim(m: ModelConfig, config: dict) -> None:
    config["head_dim"] = m.head_dim


HF_MAPPINGS = {"llama": HFFamily(
    "llama", "Llama", "LlamaForCausalLM", "llama", keys=(), fixed={**COMMON_FIXED, "mlp_bias": False},
    rope_types=("llama3",), read=_read_head_dim, write=_write_head_dim)}

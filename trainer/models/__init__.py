"""The model families, beside each other: llama.py, deepseek.py (V2 and V3), qwen3_moe.py. Each is a
layer recipe over the shared blocks (blocks.py: norms, RoPE, MLP, decoder layer, LM head;
attention.py: grouped-query and latent attention; moe.py: router and experts; multi_token.py:
DeepSeek-V3's multi-token prediction layers), assembled by transformer.py; model.family picks one.

    from trainer.models import Transformer
    model = Transformer(cfg.model)
"""
from trainer.models.blocks import IGNORE_INDEX, LMHead, MLP, RMSNorm, RotaryEmbedding, _SAVE_OPS  # noqa: F401
from trainer.models.blocks import linear_cross_entropy  # noqa: F401
from trainer.models.transformer import FAMILIES, Transformer, flops_per_token  # noqa: F401

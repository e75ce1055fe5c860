"""Hugging Face checkpoints (Llama, DeepSeek-V2, DeepSeek-V3, Qwen3-MoE), both ways: start training
from one (`--init-from DIR`), export to one.

    config.py    config.json <-> ModelConfig (to_hf, from_hf), and load_config: the training config
                 with the model section from checkpoint.init_from's config.json
    weights.py   model.safetensors or a sharded index: headers, checks, provenance
    load.py      the weights into the (possibly FSDP2-sharded) model, one tensor or slice at a time;
                 the checks the runner makes before launch
    mapping.py   what each family's table says (trainer/models/<family>.py HF_MAPPINGS), applied:
                 config.json keys, and how each tensor of ours is made of the Hub's
    errors.py    InitError (exit 2); InexpressibleModel (export of a config the class cannot hold)

Our parameter names are transformers'; most tensors go over unchanged both ways (a tied lm_head is
stored once, as the embedding); the stacked experts and DeepSeek's RoPE rows are rearranged.
"""
from .config import from_hf, init_from_override, load_config, to_hf
from .errors import InitError
from .load import check_before_launch, load_weights, tokenizer_warning
from .weights import HFWeights

__all__ = ["HFWeights", "InitError", "check_before_launch", "from_hf", "init_from_override", "load_config",
           "load_weights", "to_hf", "tokenizer_warning"]

"""Hugging Face Llama checkpoints, both ways: start training from one (`--init-from DIR`), export to one.

    config.py    config.json <-> ModelConfig (to_hf, from_hf), and load_config: the training config
                 with the model section from checkpoint.init_from's config.json
    weights.py   model.safetensors or a sharded index: headers, checks, provenance
    load.py      the weights into the (possibly FSDP2-sharded) model, one tensor or slice at a time;
                 the checks the runner makes before launch
    errors.py    InitError (exit 2)

Our parameter names are LlamaForCausalLM's and RoPE uses its rotate-half layout, so tensors go
over unchanged both ways; only a tied lm_head is stored once (as the embedding).
"""
from .config import from_hf, init_from_override, load_config, to_hf
from .errors import InitError
from .load import check_before_launch, load_weights, tokenizer_warning
from .weights import HFWeights

__all__ = ["HFWeights", "InitError", "check_before_launch", "from_hf", "init_from_override", "load_config",
           "load_weights", "to_hf", "tokenizer_warning"]

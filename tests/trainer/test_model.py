"""The Llama model: shapes, causality, GQA, init, and the same logits and loss as
transformers' LlamaForCausalLM (RoPE with Llama 3.1 scaling, tied and untied)."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.program import REPO
from trainer.config import ModelConfig, RopeScaling
from trainer.hf.config import to_hf as hf_config
from trainer.models import Transformer, flops_per_token

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=97,
             max_seq_len=128)


def small(**kw) -> ModelConfig:
    return ModelConfig(**{**SMALL, **kw})


def hf_twin(model: Transformer):
    """A transformers LlamaForCausalLM with our config and our weights (strict load)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = {k: v for k, v in hf_config(model.cfg, "float32").items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    hf = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="eager")).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def test_shapes_and_parameter_names():
    model = Transformer(small())
    x = torch.randint(0, 97, (3, 17))
    assert model(x).shape == (3, 17, 97)
    names = set(model.state_dict())
    assert "model.layers.1.self_attn.k_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "lm_head.weight" in names
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)  # GQA: 2 KV heads
    assert not any("inv_freq" in n for n in names)


def test_causal():
    torch.manual_seed(0)
    model = Transformer(small()).eval()
    x = torch.randint(0, 97, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % 97
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("kw", [
    dict(tie_embeddings=True, rope_theta=500000.0,
         rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=32)),
    dict(tie_embeddings=False, rope_theta=10000.0, rope_scaling=None, n_kv_heads=1),
    dict(n_kv_heads=4),  # plain multi-head attention
])
def test_same_logits_and_loss_as_transformers(kw):
    torch.manual_seed(0)
    model = Transformer(small(**kw)).eval()
    hf = hf_twin(model)
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    x = torch.randint(0, 97, (2, 100))  # longer than original_max_position_embeddings
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        loss = model(x[:, :-1], x[:, 1:]) / x[:, 1:].numel()
        torch.testing.assert_close(loss, hf(x, labels=x).loss, atol=1e-5, rtol=1e-5)


def test_loss_ignores_minus_100_and_is_a_sum():
    torch.manual_seed(0)
    model = Transformer(small()).eval()
    x = torch.randint(0, 97, (2, 10))
    labels = x.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        logits = model(x)
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        torch.testing.assert_close(model(x, labels), expected)


def test_init_std_and_depth_scaling():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=1024,
                                    vocab_size=1000))
    layers = model.model.layers
    assert layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layers[3].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert layers[0].self_attn.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2), rel=0.05)
    assert torch.all(layers[2].input_layernorm.weight == 1)


@pytest.mark.parametrize("mode", ["selective", "selective_lean", "full"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    model = Transformer(small())
    x = torch.randint(0, 97, (2, 16))

    def grads():
        model.zero_grad()
        model(x, x).backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = grads()
    for layer in model.model.layers:
        layer.activation_checkpoint = mode
    for a, b in zip(reference, grads()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode, recomputed", [("none", 0), ("selective", 0), ("selective_lean", 3), ("full", 6)])
def test_checkpointing_recomputes_only_the_matmuls_its_mode_names(mode, recomputed):
    """Backward runs 2 matmuls per linear (7 a layer), plus the ones recomputed: none for selective
    (down_proj's output is not kept, and the recompute stops before it), k, o and up for
    selective_lean, all but down_proj for full (the same early stop)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.n += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Transformer(small(n_layers=1, tie_embeddings=False))
    for layer in model.model.layers:
        layer.activation_checkpoint = mode
    x = torch.randint(0, 97, (2, 16))
    loss = model(x, x)
    with CountMatmuls():
        loss.backward()
    head = 2                                  # the LM head's two gradient matmuls
    assert CountMatmuls.n == head + 2 * 7 + recomputed


def test_flops_per_token_matches_the_anchor_count():
    """Llama-3.2-1B at 4096 tokens: 9.02 GFLOP/token (torchtitan's formula)."""
    from trainer.config import load
    cfg = load(REPO / "configs" / "llama3_1b.yaml").model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_params() == 1_235_814_400
    assert flops_per_token(cfg, model.num_params(exclude_embedding=True), 4096) / 1e9 == \
        pytest.approx(9.02, abs=0.01)

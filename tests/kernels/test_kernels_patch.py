"""kernels.patch(model) leaves results unchanged: logits, loss and every gradient, trainer and HF Llama."""

from helpers.kernels import DEVICE, fresh_seed  # noqa: I001

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

import kernels
from trainer.config import ModelConfig, RopeScaling
from trainer.models import Transformer

VOCAB, SEQ, BATCH = 96, 12, 2
TOL = dict(atol=2e-5, rtol=2e-4)  # fp32 end to end: only summation order differs


def tiny_trainer_model() -> Transformer:
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB,
                      rope_theta=500000.0, rope_scaling=RopeScaling(original_max_position_embeddings=8))
    return Transformer(cfg).to(DEVICE)


def tiny_hf_model() -> LlamaForCausalLM:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, rope_theta=500000.0, max_position_embeddings=64,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(DEVICE)
    with torch.no_grad():  # RMSNorm weights start at 1: randomize so dW errors show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def batch():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=DEVICE)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device=DEVICE)
    labels[0, :3] = -100  # ignored positions
    return ids, labels


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_grads(got: dict, want: dict):
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"grad {n}: {m}")


def test_trainer_llama_same_logits_loss_and_grads():
    fresh_seed()
    model = tiny_trainer_model()
    ids, labels = batch()
    logits_ref = model(ids).detach()
    loss_ref = model(ids, labels)
    loss_ref.backward()
    grads_ref = grads(model)
    model.zero_grad(set_to_none=True)

    assert kernels.patch(model) is model
    assert sorted(set(model._anvil_kernels)) == ["fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"]
    assert model._anvil_kernels.count("rms_norm") == 5  # 2 per layer + final norm
    torch.testing.assert_close(model(ids), logits_ref, **TOL)
    loss = model(ids, labels)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    assert loss.dtype == torch.float32
    loss.backward()
    compare_grads(grads(model), grads_ref)


def test_hf_llama_same_logits_loss_and_grads(monkeypatch):
    # patch() rebinds modeling_llama.apply_rotary_pos_emb; restore it after the test
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    patch_module = sys.modules["kernels.patch"]
    rope_calls = []
    real_apply_rope = patch_module.apply_rope
    monkeypatch.setattr(patch_module, "apply_rope", lambda *a: rope_calls.append(1) or real_apply_rope(*a))
    fresh_seed()
    model = tiny_hf_model()
    ids, labels = batch()
    model.eval()
    logits_ref = model(ids).logits.detach()
    model.train()
    loss_ref = model(ids, labels=labels).loss
    loss_ref.backward()
    grads_ref = grads(model)
    model.zero_grad(set_to_none=True)

    kernels.patch(model)
    assert sorted(set(model._anvil_kernels)) == ["fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"]
    model.eval()
    torch.testing.assert_close(model(ids).logits, logits_ref, **TOL)
    model.train()
    out = model(ids, labels=labels)
    assert out.logits is None  # training with labels never builds the logits
    torch.testing.assert_close(out.loss, loss_ref, **TOL)
    out.loss.backward()
    compare_grads(grads(model), grads_ref)
    assert len(rope_calls) == 2 * 2  # both layers, eval and train: the attention really uses the kernel


@pytest.mark.slow
def test_patched_trainer_model_compiles_without_graph_breaks():
    fresh_seed()
    model = tiny_trainer_model()
    kernels.patch(model, fused_linear_cross_entropy=False)
    ids, labels = batch()
    eager_loss = model(ids, labels)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, labels), eager_loss, **TOL)


def test_unknown_model_is_refused():
    with pytest.raises(TypeError, match="neither"):
        kernels.patch(torch.nn.Linear(2, 2))


def test_patched_trainer_loss_keeps_an_fp32_sum_for_bf16_activations():
    """A bf16 sum of token losses moves in steps of 1/16 near 12: the logged curve would go flat."""
    from kernels.patch import _trainer_loss

    torch.manual_seed(fresh_seed())
    hidden = torch.randn(64, 32, device=DEVICE).bfloat16()
    weight = (torch.randn(VOCAB, 32, device=DEVICE) * 0.2).bfloat16()
    labels = torch.randint(0, VOCAB, (64,), device=DEVICE)
    loss = _trainer_loss(hidden, weight, labels)
    # The kernel's logits come from a bf16 matmul: the reference rounds them the same way, so what is
    # left is the sum's precision (bf16 would miss by ~1e-3 here; fp32 by ~1e-7).
    logits = (hidden @ weight.T).double()
    reference = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    assert loss.dtype == torch.float32
    assert abs(loss.item() - reference.item()) / reference.item() < 1e-5


def test_hugging_faces_kernels_package_shadowing_ours_is_named(tmp_path):
    """HF's `kernels` (same import name) first on sys.path: --kernels says what happened."""
    import subprocess
    import sys

    from helpers.program import REPO

    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('"""Hugging Face kernels stand-in: hub kernels, no Anvil marker."""\n'
                                      "def get_kernel(name):\n    raise NotImplementedError\n")
    probe = ("from trainer.train import apply_kernels\n"
             "try:\n    apply_kernels(None)\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert "TrainError --kernels: `import kernels` found" in done.stdout, done.stdout + done.stderr
    assert "Hugging Face's package of the same name shadows it" in done.stdout
    import kernels
    assert kernels.__anvil__        # and in this checkout ours is the one imported

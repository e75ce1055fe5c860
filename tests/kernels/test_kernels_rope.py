"""RoPE kernel vs transformers' apply_rotary_pos_emb (fp64) on its [B, H, S, D] layout."""

from helpers.kernels import DEVICE, DTYPES, ON_GPU, assert_close, fresh_seed, poisoned_allocations, sizes  # noqa: I001

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels import apply_rope
from kernels.patch import hf_apply_rotary_pos_emb


def llama31_cos_sin(batch, seq, head_dim, dtype, positions=None):
    """cos/sin [B, S, D] from transformers' Llama rotary embedding, Llama 3.1 scaling, theta 500000."""
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=500000.0,
                      max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    rotary = LlamaRotaryEmbedding(cfg).to(DEVICE)
    if positions is None:  # distinct, large positions: a kernel reading the wrong row shows up
        positions = torch.randint(0, 100000, (batch, seq), device=DEVICE)
    return rotary(torch.empty(1, device=DEVICE, dtype=dtype), positions)


def compare_rope(batch, seq, n_q, n_kv, head_dim, dtype, cos_form="3d", layout="bshd"):
    seed = fresh_seed()
    cos, sin = llama31_cos_sin(batch, seq, head_dim, dtype,
                               positions=None if cos_form == "3d" else torch.arange(seq, device=DEVICE)[None])
    if cos_form == "2d":
        cos, sin = cos[0], sin[0]
    elif cos_form == "2d_fp32":
        cos, sin = cos[0].float(), sin[0].float()
    if layout == "bhsd":  # transformers' layout: the kernel sees a transposed (non-contiguous) view
        q = torch.randn(batch, n_q, seq, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
        k = torch.randn(batch, n_kv, seq, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(batch, seq, n_q, head_dim, device=DEVICE, dtype=dtype)
        k = torch.randn(batch, seq, n_kv, head_dim, device=DEVICE, dtype=dtype)
    q.requires_grad_(True)
    k.requires_grad_(True)
    with poisoned_allocations():
        q_rot, k_rot = apply_rope(q, k, cos, sin)
        dq_out, dk_out = torch.randn_like(q_rot), torch.randn_like(k_rot)
        torch.autograd.backward((q_rot, k_rot), (dq_out, dk_out))

    q_ref = q.detach().double().transpose(1, 2).requires_grad_(True)
    k_ref = k.detach().double().transpose(1, 2).requires_grad_(True)
    c, s = cos.double(), sin.double()
    if c.dim() == 2:
        c, s = c[None], s[None]
    q_rot_ref, k_rot_ref = apply_rotary_pos_emb(q_ref, k_ref, c, s)
    torch.autograd.backward((q_rot_ref, k_rot_ref), (dq_out.double().transpose(1, 2), dk_out.double().transpose(1, 2)))
    assert_close(q_rot, q_rot_ref.transpose(1, 2), "rope", dtype, "q", seed)
    assert_close(k_rot, k_rot_ref.transpose(1, 2), "rope", dtype, "k", seed)
    assert_close(q.grad, q_ref.grad.transpose(1, 2), "rope", dtype, "dq", seed)
    assert_close(k.grad, k_ref.grad.transpose(1, 2), "rope", dtype, "dk", seed)


SHAPES = sizes(  # (batch, seq, q heads, kv heads, head_dim)
    cpu=[(2, 6, 4, 2, 16), (1, 5, 3, 1, 24), (2, 3, 2, 2, 128)],
    gpu=[(4, 4096, 32, 8, 128), (2, 1000, 24, 8, 96), (1, 257, 3, 1, 64), (2, 2048, 64, 8, 128)],
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_transformers(shape, dtype):
    compare_rope(*shape, dtype)


@pytest.mark.parametrize("cos_form", ["2d", "2d_fp32"])
def test_cos_sin_of_shape_s_d(cos_form):
    """[S, D] cos/sin index full rows: position s gets the angle of s (the seed repo read s/2's)."""
    compare_rope(*sizes((2, 9, 4, 2, 16), (2, 4096, 32, 8, 128)), torch.bfloat16, cos_form=cos_form)


def test_transposed_hf_layout():
    compare_rope(*sizes((2, 6, 4, 2, 16), (2, 2048, 32, 8, 128)), torch.float32, layout="bhsd")


def test_hf_signature_adapter():
    fresh_seed()
    q = torch.randn(2, 4, 7, 16, device=DEVICE)
    k = torch.randn(2, 2, 7, 16, device=DEVICE)
    cos, sin = llama31_cos_sin(2, 7, 16, torch.float32)
    for got, want in zip(hf_apply_rotary_pos_emb(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    bshd = hf_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(bshd[0], apply_rotary_pos_emb(q, k, cos, sin)[0].transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_bad_inputs_give_clear_errors():
    q = torch.randn(1, 4, 2, 8, device=DEVICE)
    k = torch.randn(1, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin shape"):
        apply_rope(q, k, torch.randn(4, 4, device=DEVICE), torch.randn(4, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        apply_rope(q, k[:, :3], torch.randn(4, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="constants"):
        apply_rope(q, k, torch.randn(4, 8, device=DEVICE, requires_grad=True), torch.randn(4, 8, device=DEVICE))


def test_torch_compile_fullgraph_and_opcheck():
    fresh_seed()
    q = torch.randn(2, 5, 4, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, device=DEVICE, requires_grad=True)
    cos, sin = llama31_cos_sin(2, 5, 16, torch.float32)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    compiled = torch.compile(apply_rope, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out_c = compiled(q, k, cos, sin)
    grads_c = torch.autograd.grad(out_c, (q, k), (dq, dk))
    out_e = apply_rope(q, k, cos, sin)
    grads_e = torch.autograd.grad(out_e, (q, k), (dq, dk))
    for a, b in zip(out_c + grads_c, out_e + grads_e):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.library.opcheck(torch.ops.anvil.rope, (q, k, cos, sin, False))

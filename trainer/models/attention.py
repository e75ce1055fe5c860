"""The attention blocks: grouped-query attention (Llama; Qwen3 with a norm on each query and key
head) and multi-head latent attention (DeepSeek-V2/V3).

Each takes (x, cos, sin, mask) and returns the output projection's result; `rotary_fn` is the kernel
hook (kernels/patch.py swaps in the fused RoPE), applied to [batch, seq, heads, rotated dims] tensors.
`mask` (masking.AttentionMask, None: causal over the row) keeps attention inside documents.
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.models.blocks import RMSNorm, apply_rotary_emb, yarn_mscale
from trainer.models.masking import attend


class Attention(nn.Module):
    """Grouped-query attention. `qk_norm`: an RMSNorm over each query and key head before RoPE (Qwen3)."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = qk_norm
        self.rotary_fn = apply_rotary_emb  # kernel hook

    def init_weights(self, std: float, depth_std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=depth_std)
        if self.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def forward(self, x, cos, sin, mask=None):
        B, T, _ = x.shape
        # (-1 heads: under tensor parallelism each rank computes n_heads / tp and n_kv_heads / tp of them)
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_fn(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Flash / memory-efficient kernels on GPU; GQA without materialising repeated K/V.
        y = attend(q, k, v, mask, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


# The latents' norms take RMSNorm's default eps in DeepSeek's code and in transformers', whatever
# rms_norm_eps says (the DeepSeek releases' 1e-6 hides the difference)
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2): keys and values come from a kv_lora_rank latent of the
    hidden state (kv_b_proj expands it per head); queries from the hidden state or from a q_lora_rank
    latent of their own. Each query and key head has a part without RoPE (qk_nope_head_dim) and a part
    with it (qk_rope_head_dim), the key's RoPE part one for all heads, taken from the hidden state
    beside the latent (kv_a_proj_with_mqa's last qk_rope_head_dim outputs).

    RoPE is the rotate-half layout here; DeepSeek's checkpoints rotate interleaved pairs, which the
    Hugging Face mapping turns into this by permuting those projections' RoPE rows (trainer/hf)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.mla
        self.n_heads = cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = a.q_lora_rank, a.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.dim, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, cfg.n_heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, cfg.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        self.scale = qk_dim ** -0.5
        rs = cfg.rope_scaling
        if rs is not None and rs.type == "yarn" and rs.mscale_all_dim:   # DeepSeek's softmax scale correction
            self.scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        self.rotary_fn = apply_rotary_emb  # kernel hook

    def init_weights(self, std: float, depth_std: float) -> None:
        for lin in (getattr(self, "q_proj", None), getattr(self, "q_a_proj", None), getattr(self, "q_b_proj", None),
                    self.kv_a_proj_with_mqa, self.kv_b_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=depth_std)
        self.kv_a_layernorm.reset_parameters()
        if self.q_lora_rank:
            self.q_a_layernorm.reset_parameters()

    def forward(self, x, cos, sin, mask=None):
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, self.n_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope, k_rope = self.rotary_fn(q_rope, k_rope.view(B, T, 1, self.rope_dim), cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rope.expand(B, T, self.n_heads, self.rope_dim)), dim=-1).transpose(1, 2)
        y = attend(q, k, v.transpose(1, 2), mask, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

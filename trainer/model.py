"""Llama 3 in plain PyTorch, readable in one sitting.

Module and parameter names are those of transformers' LlamaForCausalLM, so the
state_dict exports to Hugging Face without renaming, and RoPE uses HF's
rotate-half layout. The pieces a fused kernel may replace are separate and
named, and kernels/patch.py relies on exactly these names: RMSNorm modules,
`Attention.rotary_fn`, `MLP.act_fn`, and `Transformer.loss_fn` (LM head +
cross-entropy, sum reduction).
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # normalise in fp32, like HF and Meta's reference
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight.to(dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


# --------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies, with Llama 3.1 scaling when cfg.rope_scaling is set (as HF computes)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                      device=device).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [seq, head_dim] in fp32; inv_freq is a buffer outside the state_dict (as HF)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._cache: tuple | None = None  # (seq_len, inv_freq, cos, sin)

    def reset_parameters(self):
        # Reassigned, not copied: stays fp32 after model.to(bf16) and after meta -> to_empty.
        self.inv_freq = rope_inv_freq(self.cfg, device=self.inv_freq.device)
        self._cache = None

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The tables are constants: built once per (seq_len, inv_freq), not 5 kernels per step.
        # Keyed on the inv_freq tensor itself, so .to(device) / reset_parameters() rebuild them.
        cache = self._cache
        if cache is not None and cache[0] == seq_len and cache[1] is self.inv_freq:
            return cache[2], cache[3]
        t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if not (self.inv_freq.is_meta or torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            self._cache = (seq_len, self.inv_freq, cos, sin)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(q, k, cos, sin):
    """q, k: [batch, seq, heads, head_dim]; cos, sin: [seq, head_dim] (HF rotate-half)."""
    cos = cos[None, :, None, :].to(q.dtype)
    sin = sin[None, :, None, :].to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --------------------------------------------------------------------------- blocks

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.rotary_fn = apply_rotary_emb  # kernel hook

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self.rotary_fn(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Flash / memory-efficient kernels on GPU; GQA without materialising repeated K/V.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up/down are Meta's w1/w3/w2."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.act_fn = silu_mul  # kernel hook
        self.stashes = False    # act_fn keeps gate and up for backward in compact form (kernels.patch)

    def forward(self, x, rebuild: bool = False):
        """`rebuild` (DecoderLayer asks under `none`): where SwiGLU stashes and the layer is compiled,
        run SwiGLU and down in a checkpoint region that keeps the stash alone, so that backward rebuilds
        SwiGLU's float8 output from it (one cast pass) instead of keeping it: Inductor's partitioner
        never recomputes a custom op on its own. Eager checkpointing would keep gate and up instead."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        if rebuild and self.stashes and torch.compiler.is_compiling() and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint
            return checkpoint(self._down, gate, up, use_reentrant=False,
                              context_fn=partial(_selective_context, REBUILT_IN_MLP))
        return self._down(gate, up)

    def _down(self, gate, up):
        return self.down_proj(self.act_fn(gate, up))


def _selective_policy(recomputed: frozenset, counts: dict, ctx, op, *args, **kwargs):
    """Selective activation checkpointing: keep matmul and attention outputs, recompute the rest,
    and recompute the layer's matmuls whose 1-based forward position is in `recomputed`."""
    from torch.utils.checkpoint import CheckpointPolicy
    if _stashes(op):
        return CheckpointPolicy.MUST_SAVE
    if op not in _SAVE_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op in _MATMUL_OPS:
        # Counted apart in forward and in recompute (torchtitan's scheme), so both agree on positions.
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        if counts[key] in recomputed:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _selective_context(recomputed: frozenset):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(partial(_selective_policy, recomputed, {"forward": 0, "recompute": 0}))


_MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default}   # _scaled_mm: precision.fp8
_SAVE_OPS = _MATMUL_OPS | {
    torch.ops.aten.max.default,          # FP8's tensorwise amax: a scalar, saves a pass over x
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}

def _stashes(op) -> bool:
    """A kernel op that returns saved activations in compact form (kernels.swiglu's stash: gate and up
    in float8): keeping its outputs is what lets the tensors it stashed be recomputed, which under
    torch.compile means not kept at all (nothing in backward reads them); what is made from the stash
    (SwiGLU's float8 output, which down reads) is recomputed from it like any other op."""
    return getattr(op, "namespace", None) == "anvil" and getattr(op, "_opname", "").endswith("_stash_fwd")


# A decoder layer's matmuls in forward order: 1 q, 2 k, 3 v, 4 o, 5 gate, 6 up, 7 down. What each
# selective mode recomputes in backward rather than keeps. down's output (7) only feeds the residual
# add, whose backward needs nothing: keeping it is memory for nothing, and the recompute stops
# (checkpoint's early stop) once down's input is rebuilt, so it costs no matmul either.
# selective_lean also recomputes every second matmul (k, o, up: torchtitan's "op" policy), for
# about half the activation memory of `selective` at the price of those three matmuls again.
RECOMPUTED_MATMULS = {"selective": frozenset({7}), "selective_lean": frozenset({2, 4, 6, 7})}
STASHED_MATMULS = frozenset({5, 6})   # gate, up: what an MLP that stashes them keeps instead (MLP.stashes)
REBUILT_IN_MLP = frozenset({1})       # MLP's rebuild region holds one matmul, down: its output feeds no backward


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.activation_checkpoint = "none"  # none | selective | selective_lean | full; set by the trainer

    def _forward(self, x, cos, sin, rebuild: bool = False):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h), rebuild)

    def forward(self, x, cos, sin):
        if self.activation_checkpoint == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin, rebuild=True)
        from torch.utils.checkpoint import checkpoint
        kwargs = {}
        if self.activation_checkpoint in RECOMPUTED_MATMULS:
            recomputed = RECOMPUTED_MATMULS[self.activation_checkpoint]
            if self.mlp.stashes:
                recomputed = recomputed | STASHED_MATMULS
            kwargs["context_fn"] = partial(_selective_context, recomputed)
        return checkpoint(self._forward, x, cos, sin, use_reentrant=False, **kwargs)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(input_ids.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies of lm_head(hidden); logits are upcast to fp32."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


class LMHead(nn.Linear):
    """The output layer. With labels it returns loss_fn(hidden, its weight, labels) instead of the
    logits: the loss reads the weight inside this module's forward, so FSDP2 can shard the head as a
    group of its own (trainer/distributed.py) and free its gradient right after the loss backward."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, loss_fn=None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        weight = self.weight
        if torch.is_autocast_enabled(h.device.type):
            # A fused loss bypasses autocast's F.linear: hand it compute-dtype operands,
            # else the LM head runs in fp32 (fp32 master weights, fp32 residual stream).
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        return loss_fn(h.flatten(0, 1), weight, labels.flatten())


class Transformer(nn.Module):
    """LlamaForCausalLM-shaped: .model (embed_tokens, layers, norm) and .lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = linear_cross_entropy  # kernel hook: fused linear cross-entropy
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Normal(0, init_std) everywhere; output projections scaled by depth (torchtitan)."""
        std = self.cfg.init_std
        nn.init.normal_(self.model.embed_tokens.weight, std=std)
        for layer in self.model.layers:
            depth_std = std / math.sqrt(2 * (layer.layer_id + 1))
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                nn.init.normal_(lin.weight, std=std)
            for lin in (attn.o_proj, mlp.down_proj):
                nn.init.normal_(lin.weight, std=depth_std)
            layer.input_layernorm.reset_parameters()
            layer.post_attention_layernorm.reset_parameters()
        self.model.norm.reset_parameters()
        self.model.rotary_emb.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """labels None -> logits [B, T, V]; else the SUM of token losses (the loop divides)."""
        return self.lm_head(self.model(input_ids), labels, self.loss_fn)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once
        if exclude_embedding and not self.cfg.tie_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> int:
    """torchtitan's count: 6 x non-embedding params + 12 x layers x heads x head_dim x seq.

    A tied embedding counts once, as the LM head; an untied lookup table is free.
    `n_params` comes from Transformer.num_params(exclude_embedding=True).
    """
    return 6 * n_params + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def hf_config(cfg: ModelConfig, torch_dtype: str = "bfloat16") -> dict:
    """config.json for transformers' LlamaForCausalLM with this shape (trainer.hf.config.to_hf,
    the one mapping; --init-from reads it back with from_hf)."""
    from trainer.hf.config import to_hf
    return to_hf(cfg, torch_dtype)

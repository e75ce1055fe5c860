"""The blocks every model family is built from, in plain PyTorch: RMSNorm, RoPE (Llama 3.1's and
YaRN's scaling), the SwiGLU MLP, the decoder layer with its activation checkpointing, the LM head.

Module and parameter names are those of transformers' models, so the state_dict exports to Hugging
Face without renaming, and RoPE uses HF's rotate-half layout. The pieces a fused kernel may replace
are separate and named, and kernels/patch.py relies on exactly these names: RMSNorm modules,
`rotary_fn` (attention), `act_fn` (MLP), and `Transformer.loss_fn` (LM head + cross-entropy, sum
reduction). docs/trainer-hooks.md lists them.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig, RopeScaling

IGNORE_INDEX = -100


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """The tensor an op computes with. A weight kept whole on every tensor-parallel rank is a replicated
    DTensor (trainer/models/tensor_parallel.py) whose rank computes on its own tokens: its local copy,
    with a gradient that is this rank's part of the sum (DTensor adds the parts up over the ranks)."""
    from torch.distributed.tensor import DTensor, Partial
    if isinstance(weight, DTensor):
        return weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
    return weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # normalise in fp32, like HF and Meta's reference
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight_as(dtype)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight to multiply by, in `dtype` (the kernel forward of kernels/patch.py reads it here too)."""
        return local_weight(self.weight).to(dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


# --------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies, with Llama 3.1's or YaRN's scaling when cfg.rope_scaling is set (as HF computes)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                      device=device).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, cfg.rope_theta, rs)
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


def _yarn_inv_freq(extrapolated: torch.Tensor, dim: int, base: float, rs: RopeScaling) -> torch.Tensor:
    """YaRN: dimensions that turn more than beta_fast times over the original context keep their
    frequency, those under beta_slow are interpolated (divided by factor), a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=extrapolated.device) - low)
            / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp
    return extrapolated / rs.factor * (1 - keep) + extrapolated * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 without YaRN): DeepSeek's mscale over mscale_all_dim."""
    rs = cfg.rope_scaling
    if rs is None or rs.type != "yarn":
        return 1.0
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


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
        scale = rope_attention_factor(self.cfg)
        cos, sin = emb.cos() * scale, emb.sin() * scale
        if not (self.inv_freq.is_meta or torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            self._cache = (seq_len, self.inv_freq, cos, sin)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(q, k, cos, sin):
    """q, k: [batch, seq, heads, head_dim]; cos, sin: [seq, head_dim], or [batch, seq, head_dim] where
    positions differ by row (data.position_reset) (HF rotate-half)."""
    if cos.dim() == 2:   # one table for every row
        cos, sin = cos[None], sin[None]
    cos = cos[:, :, None, :].to(q.dtype)   # broadcast over the heads
    sin = sin[:, :, None, :].to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --------------------------------------------------------------------------- blocks

def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up/down are Meta's w1/w3/w2."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
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

    def init_weights(self, std: float, depth_std: float) -> None:
        nn.init.normal_(self.gate_proj.weight, std=std)
        nn.init.normal_(self.up_proj.weight, std=std)
        nn.init.normal_(self.down_proj.weight, std=depth_std)


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
} | ({torch.ops.aten._grouped_mm.default} if hasattr(torch.ops.aten, "_grouped_mm") else set())   # the experts'


def _stashes(op) -> bool:
    """A kernel op that returns saved activations in compact form (kernels.swiglu's stash: gate and up
    in float8): keeping its outputs is what lets the tensors it stashed be recomputed, which under
    torch.compile means not kept at all (nothing in backward reads them); what is made from the stash
    (SwiGLU's float8 output, which down reads) is recomputed from it like any other op."""
    return getattr(op, "namespace", None) == "anvil" and getattr(op, "_opname", "").endswith("_stash_fwd")


# A Llama decoder layer's matmuls in forward order: 1 q, 2 k, 3 v, 4 o, 5 gate, 6 up, 7 down. What each
# selective mode recomputes in backward rather than keeps. down's output (7) only feeds the residual
# add, whose backward needs nothing: keeping it is memory for nothing, and the recompute stops
# (checkpoint's early stop) once down's input is rebuilt, so it costs no matmul either.
# selective_lean also recomputes every second matmul (k, o, up: torchtitan's "op" policy), for
# about half the activation memory of `selective` at the price of those three matmuls again.
# Layers of other shapes (latent attention, experts) keep every matmul's output under both modes.
RECOMPUTED_MATMULS = {"selective": frozenset({7}), "selective_lean": frozenset({2, 4, 6, 7})}
KEEP_EVERY_MATMUL = {"selective": frozenset(), "selective_lean": frozenset()}
STASHED_MATMULS = frozenset({5, 6})   # gate, up: what an MLP that stashes them keeps instead (MLP.stashes)
REBUILT_IN_MLP = frozenset({1})       # MLP's rebuild region holds one matmul, down: its output feeds no backward


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + mlp(norm(h)). The family picks the
    attention (GQA, latent) and the MLP (dense, experts); `recomputed` is what each selective
    checkpointing mode recomputes, by matmul position (RECOMPUTED_MATMULS for a Llama layer)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, attention: nn.Module, mlp: nn.Module,
                 recomputed: dict = KEEP_EVERY_MATMUL):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp
        self.recomputed = recomputed
        self.activation_checkpoint = "none"  # none | selective | selective_lean | full; set by the trainer

    def init_weights(self, std: float) -> None:
        """Normal(0, std); the output projections (attention's and the MLP's) scaled by depth (torchtitan)."""
        depth_std = std / math.sqrt(2 * (self.layer_id + 1))
        self.self_attn.init_weights(std, depth_std)
        self.mlp.init_weights(std, depth_std)
        self.input_layernorm.reset_parameters()
        self.post_attention_layernorm.reset_parameters()

    def _forward(self, x, cos, sin, mask=None, rebuild: bool = False):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        mlp_in = self.post_attention_layernorm(h)
        return h + (self.mlp(mlp_in, rebuild) if isinstance(self.mlp, MLP) else self.mlp(mlp_in))

    def forward(self, x, cos, sin, mask=None):
        """`mask`: trainer.models.masking.AttentionMask (None: causal over the row)."""
        if self.activation_checkpoint == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin, mask, rebuild=True)
        from torch.utils.checkpoint import checkpoint
        kwargs = {}
        if self.activation_checkpoint in self.recomputed:
            recomputed = self.recomputed[self.activation_checkpoint]
            if getattr(self.mlp, "stashes", False):
                recomputed = recomputed | STASHED_MATMULS
            kwargs["context_fn"] = partial(_selective_context, recomputed)
        return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False, **kwargs)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies of lm_head(hidden); logits are upcast to fp32."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


class Embedding(nn.Embedding):
    """The token embedding; its table may be whole on every tensor-parallel rank (local_weight)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, local_weight(self.weight))


class LMHead(nn.Linear):
    """The output layer. With labels it returns loss_fn(hidden, its weight, labels) instead of the
    logits: the loss reads the weight inside this module's forward, so FSDP2 can shard the head as a
    group of its own (trainer/distributed.py) and free its gradient right after the loss backward."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, loss_fn=None) -> torch.Tensor:
        weight = local_weight(self.weight)
        if labels is None:
            return F.linear(h, weight, self.bias)
        if torch.is_autocast_enabled(h.device.type):
            # A fused loss bypasses autocast's F.linear: hand it compute-dtype operands,
            # else the LM head runs in fp32 (fp32 master weights, fp32 residual stream).
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        return loss_fn(h.flatten(0, 1), weight, labels.flatten())

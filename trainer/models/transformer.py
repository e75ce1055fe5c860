"""The causal language model every family shares: token embedding, the family's decoder layers, a
final norm, the LM head. Names as transformers' *ForCausalLM: .model (embed_tokens, layers, norm)
and .lm_head.

    model = Transformer(cfg.model)           # the layers of model.family (trainer/models/__init__.py)
    loss_sum = model(input_ids, labels)      # the SUM of token losses (the loop divides)
    logits = model(input_ids)
    loss_sum = model(input_ids, labels, layout)   # documents and their positions (trainer/models/masking.py)

With model.mtp_depth, model.layers holds the multi-token prediction layers after the model's own
(trainer/models/multi_token.py): a training forward with labels adds their loss to the gradient.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.models import deepseek, llama, multi_token, qwen3_moe
from trainer.models.blocks import Embedding, LMHead, RMSNorm, RotaryEmbedding, linear_cross_entropy
from trainer.models.masking import SequenceLayout

#: model.family -> the module whose layer(cfg, layer_id) builds a decoder layer.
FAMILIES = {"llama": llama, "deepseek_v2": deepseek, "deepseek_v3": deepseek, "qwen3_moe": qwen3_moe}


class Decoded(NamedTuple):
    """What the decoder computed for a batch, for the prediction layers to go on from."""
    hidden: torch.Tensor     # the final norm's output [B, T, D]
    embedded: torch.Tensor   # the token embeddings [B, T, D]
    cos: torch.Tensor
    sin: torch.Tensor
    mask: object             # masking.AttentionMask or None


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        family = FAMILIES[cfg.family]
        self.n_layers = cfg.n_layers   # the model's own; model.mtp_depth prediction layers follow them
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([*(family.layer(cfg, i) for i in range(cfg.n_layers)),
                                     *(multi_token.PredictionLayer(cfg, family.layer(cfg, i))
                                       for i in range(cfg.n_layers, cfg.decoder_layers))])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.attention_kernel = "sdpa"   # with a layout: "flex" or "sdpa" (masking.py; the trainer picks it)

    def forward(self, input_ids: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        return self.decode(input_ids, layout).hidden

    def decode(self, input_ids: torch.Tensor, layout: SequenceLayout | None = None) -> Decoded:
        embedded = h = self.embed_tokens(input_ids)
        if layout is None:
            cos, sin = self.rotary_emb(input_ids.shape[1])
            mask = None
        else:   # the row's tables, read per token where positions restart or the row is split over ranks;
            # the mask built once for every layer
            cos, sin = self.rotary_emb(layout.seq_len)
            positions = layout.query_positions()
            if positions is not None:
                cos, sin = cos[positions], sin[positions]
            device = input_ids.device
            dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else h.dtype
            mask = layout.mask(self.attention_kernel, device, dtype)
        for layer in self.layers[:self.n_layers]:
            h = layer(h, cos, sin, mask)
        return Decoded(self.norm(h), embedded, cos, sin, mask)

    def prediction_layers(self) -> nn.ModuleList:
        return self.layers[self.n_layers:]


class Transformer(nn.Module):
    """*ForCausalLM-shaped: .model (embed_tokens, layers, norm) and .lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = linear_cross_entropy  # kernel hook: fused linear cross-entropy
        # multi-token prediction's loss since the trainer last read it (multi_token.collect_loss)
        self.register_buffer("mtp_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("mtp_tokens", torch.zeros((), dtype=torch.long), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Normal(0, init_std) everywhere; output projections scaled by depth (torchtitan)."""
        std = self.cfg.init_std
        nn.init.normal_(self.model.embed_tokens.weight, std=std)
        for layer in self.model.layers:
            layer.init_weights(std)
        self.model.norm.reset_parameters()
        self.model.rotary_emb.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        self.mtp_loss_sum.zero_()
        self.mtp_tokens.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                layout: SequenceLayout | None = None) -> torch.Tensor:
        """labels None -> logits [B, T, V]; else the SUM of token losses (the loop divides). `layout`:
        where the tokens sit in their rows (None: each row whole, causal over it)."""
        if labels is None or not self.cfg.mtp_depth or not (self.training and torch.is_grad_enabled()):
            return self.lm_head(self.model(input_ids, layout), labels, self.loss_fn)
        d = self.model.decode(input_ids, layout)
        loss = self.lm_head(d.hidden, labels, self.loss_fn)
        extra, tokens = multi_token.prediction_loss(
            self.model.prediction_layers(), d.hidden, d.embedded, d.cos, d.sin, d.mask, labels,
            lambda h, target: self.lm_head(h, target, self.loss_fn), layout)
        with torch.no_grad():
            self.mtp_loss_sum += extra.detach()
            self.mtp_tokens += tokens
        return multi_token.AddWeightedLoss.apply(loss, extra, self.cfg.mtp_loss_weight / self.cfg.mtp_depth)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once
        if exclude_embedding and not self.cfg.tie_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n


def inactive_expert_params(cfg: ModelConfig) -> int:
    """Parameters of the routed experts a token does not go through: (E - top_k) experts a MoE layer."""
    if cfg.moe is None:
        return 0
    moe_layers = sum(cfg.moe_layer(i) for i in range(cfg.decoder_layers))
    return moe_layers * (cfg.moe.n_routed_experts - cfg.moe.top_k) * 3 * cfg.dim * cfg.moe.ffn_dim


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> int:
    """torchtitan's count: 6 x the non-embedding parameters a token goes through (a MoE layer's top_k
    routed experts, not all of them) + 6 x layers x heads x (query/key + value head dims) x seq
    (12 x layers x heads x head_dim x seq for Llama).

    A tied embedding counts once, as the LM head; an untied lookup table is free. Multi-token prediction's
    layers count as layers (their parameters are in n_params), and its depths use the head again.
    `n_params` comes from Transformer.num_params(exclude_embedding=True), every expert counted.
    """
    if cfg.mla is not None:
        qk, v = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    else:
        qk = v = cfg.head_dim
    head_again = 6 * cfg.mtp_depth * cfg.dim * cfg.vocab_size
    return (6 * (n_params - inactive_expert_params(cfg)) + head_again
            + 6 * cfg.decoder_layers * cfg.n_heads * (qk + v) * seq_len)

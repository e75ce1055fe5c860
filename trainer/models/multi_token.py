"""Multi-token prediction (DeepSeek-V3's report, section 2.2): model.mtp_depth more decoder layers after
the last, the k-th predicting the token k + 1 places ahead of each position, for a denser training signal.

Depth k at position i joins what depth k - 1 knows of position i (the model's final hidden state for
k = 1) with the embedding of token i + k, and runs one decoder layer of the family over the row:

    h_k[i] = layer_k(eh_proj([enorm(embed(t[i + k])); hnorm(h_{k-1}[i])]))
    loss_k = sum over i of cross_entropy(lm_head(shared_head.norm(h_k[i])), t[i + k + 1])

The embedding and the LM head are the model's own (shared, as in V3). Token i + k's embedding is the
row's embeddings moved k places left, so the table is read once; the last k positions of a row have no
token k + 1 ahead: their labels are ignored, and causal attention keeps what wrapped round to them from
reaching any earlier position (under context parallelism the row's embeddings and labels are gathered
from the cp ranks first: Ahead). The objective adds mtp_loss_weight / mtp_depth x the depths' summed
losses to the language model's (AddWeightedLoss: the same normalisation as the language-model loss,
whatever the loop divides it by), while the loss the model returns, logs and validates stays the
language model's own; the prediction loss is logged beside it (mtp_loss). Training only: evaluation and
generation run the model without these layers.

Names are DeepSeek-V3's checkpoint's (the layers after the last: model.layers.61 of DeepSeek-V3, with
enorm, hnorm, eh_proj and shared_head.norm beside an ordinary decoder layer's modules; the checkpoint's
copies of the embedding and the head, embed_tokens and shared_head.head, are the model's own here).
The order of the two halves fed to eh_proj, embedding first, is that checkpoint's (as vLLM and
Megatron-LM read it).
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.models.blocks import IGNORE_INDEX, DecoderLayer, RMSNorm
from trainer.models.masking import SequenceLayout


class SharedHead(nn.Module):
    """The norm before the model's LM head (the head itself is the model's: shared_head.head on the Hub)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class PredictionLayer(DecoderLayer):
    """One prediction depth: the family's decoder layer (its attention and MLP, taken from `layer`) fed by
    eh_proj of the normalised next-token embedding and previous hidden state."""

    def __init__(self, cfg: ModelConfig, layer: DecoderLayer):
        super().__init__(cfg, layer.layer_id, layer.self_attn, layer.mlp, layer.recomputed)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.shared_head = SharedHead(cfg)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.normal_(self.eh_proj.weight, std=std)
        for norm in (self.enorm, self.hnorm, self.shared_head.norm):
            norm.reset_parameters()

    def forward(self, hidden, embedded, cos, sin, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the depth's hidden states [B, T, D], the same through shared_head.norm for the head), from the
        previous depth's and the embeddings of the tokens ahead. The norm runs here, inside the layer's
        forward, where FSDP2 has its weight gathered."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        out = super().forward(self.eh_proj(joined), cos, sin, mask)
        return out, self.shared_head.norm(out)


class AddWeightedLoss(torch.autograd.Function):
    """`loss` unchanged forward; backward gives `extra` `weight` x loss's gradient: the extra loss joins
    the objective with the loss's own scale (the loop's division by its tokens), not the value logged."""

    @staticmethod
    def forward(ctx, loss, extra, weight: float):
        ctx.weight = weight
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad * ctx.weight, None


def labels_ahead(labels: torch.Tensor, k: int) -> torch.Tensor:
    """labels [B, T] (token i + 1 at position i) moved k places left: token i + k + 1, ignored where the
    row has none."""
    pad = labels.new_full((labels.shape[0], min(k, labels.shape[1])), IGNORE_INDEX)
    return torch.cat([labels[:, k:], pad], dim=1)


class Ahead:
    """The embeddings and labels k places after each of this rank's tokens in their rows. A whole row: its
    own, moved left. Under context parallelism (the layout's queries, keys and group: the rank holds two
    chunks of each row, trainer/models/context_parallel.py) the row's embeddings are gathered from the cp
    ranks once for every depth (their gradients summed back to their ranks), and its labels too."""

    def __init__(self, embedded: torch.Tensor, labels: torch.Tensor, layout: SequenceLayout | None):
        self.embedded, self.labels_here = embedded, labels
        self.split = layout is not None and layout.context is not None
        if self.split:
            import torch.distributed as dist

            from trainer.models.context_parallel import gather_sequence

            group, order = layout.context, torch.argsort(layout.keys)     # each place's index in gathered order
            self.row = gather_sequence(embedded.unsqueeze(1), group).squeeze(1).index_select(1, order)
            parts = [torch.empty_like(labels) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, labels.contiguous(), group=group)
            self.row_labels = torch.cat(parts, dim=1).index_select(1, order)
            self.places, self.seq_len = layout.queries, layout.seq_len

    def embeddings(self, k: int) -> torch.Tensor:
        if not self.split:
            return torch.roll(self.embedded, -k, dims=1)   # the last k wrap round: their labels are ignored
        return self.row.index_select(1, (self.places + k).clamp(max=self.seq_len - 1))

    def labels(self, k: int) -> torch.Tensor:
        if not self.split:
            return labels_ahead(self.labels_here, k)
        later = self.places + k
        found = self.row_labels.index_select(1, later.clamp(max=self.seq_len - 1))
        return torch.where(later < self.seq_len, found, IGNORE_INDEX)


def prediction_loss(layers, hidden, embedded, cos, sin, mask, labels, head,
                    layout: SequenceLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss of every depth, tokens predicted): `head(h, labels)` is the model's LM head and loss."""
    total = hidden.new_zeros((), dtype=torch.float32)
    count = torch.zeros((), dtype=torch.long, device=labels.device)
    ahead = Ahead(embedded, labels, layout)
    for k, layer in enumerate(layers, start=1):
        hidden, normed = layer(hidden, ahead.embeddings(k), cos, sin, mask)
        target = ahead.labels(k)
        total = total + head(normed, target).float()
        count = count + (target != IGNORE_INDEX).sum()
    return total, count


@torch.no_grad()
def collect_loss(model: nn.Module) -> torch.Tensor:
    """[summed prediction loss, tokens predicted] since the last call, summed over the ranks (one
    all-reduce, no host sync); the counters restart. The trainer reads it as read_loss."""
    packed = torch.stack([model.mtp_loss_sum.float(), model.mtp_tokens.float()])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed)
    model.mtp_loss_sum.zero_()
    model.mtp_tokens.zero_()
    return packed


def read_loss(values: list[float]) -> float | None:
    """collect_loss's values, read: the mean loss of a predicted token (None when none was)."""
    loss_sum, tokens = values
    return loss_sum / tokens if tokens else None

"""Which keys each query of a packed batch attends to, and the attention call that applies it.

A row packs documents end to end. With data.document_mask a token attends only to the tokens before
it in its own document (trainer/sequence.py cuts the documents and makes the layout).

    layout = SequenceLayout(seq_len=T, documents=ids)   # per batch, by the trainer
    mask = layout.mask("flex" or "sdpa", device)         # once per batch (DecoderModel.forward)
    y = attend(q, k, v, mask, scale=..., enable_gqa=...)  # in every attention block

Without a layout, attention is SDPA's causal kernel over the whole row. With one, the kernel is
FlexAttention with a block mask (blocks of 128 x 128 that hold no allowed pair are skipped: shorter
documents cost less) or SDPA with an additive [B, 1, T, T] mask in the compute dtype (0 where a
query sees a key, -inf elsewhere: 2 or 4 x T x T bytes a row). Additive rather than boolean: SDPA turns a boolean mask into
that float inside the graph, where torch.compile's float8 storage of saved activations
(train.float8_activations) would round its -inf to NaN; a graph input is never stored so (nor its cast
to the compute dtype). torch 2.13's FlexAttention has no backward on the CPU, so training there takes
the SDPA mask. A layout always gives its kernel's mask, whatever the documents, so a compiled layer sees
one signature (trainer/sequence.py's Rows alone may drop the layout, or split a batch's rows into those
of one document, on the causal kernel, and the others, and only when not compiled).

Under context parallelism (parallel.cp) a rank holds some of each row's tokens: `queries` are their
places in the row, `keys` the places of every token in the order the ranks gather keys and values
(trainer/models/context_parallel.py), and the mask says which of those a query sees, by place and
document, for either kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Kernel = Literal["flex", "sdpa"]


@dataclass
class AttentionMask:
    """What attention needs beyond q, k and v, built once per batch: one of the two masks."""

    block_mask: object | None = None       # FlexAttention's BlockMask
    dense: torch.Tensor | None = None      # SDPA's additive mask [B, 1, T, T]: 0 where a query sees a key
    cut: torch.Tensor | None = None        # with split rows: the rows `dense` is for ([C, 1, T, T]) ...
    whole: torch.Tensor | None = None      # ... and the rows of one document, causal
    context: object | None = None          # context parallelism: the group keys and values are gathered over


@dataclass
class SequenceLayout:
    """Where a batch's tokens sit in their rows. `seq_len`: a row's tokens. `documents`: [B, seq_len] the
    document index of every token of each row (None: each row is one document). `positions`: [B, seq_len]
    RoPE positions (None: their places in the row). `queries`, `keys`, `context`: under context parallelism,
    the places of this rank's tokens, those of all tokens in gathered order, and the group they are
    gathered over (None: the whole row, in order)."""

    seq_len: int
    documents: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    split_rows: bool = False   # SDPA: the rows of one document apart, on the causal kernel (not compiled)
    queries: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    context: object | None = None

    def query_positions(self) -> torch.Tensor | None:
        """The RoPE positions of the queries this rank computes ([T] or [B, T]; None: 0 .. seq_len - 1)."""
        if self.positions is None or self.queries is None:
            return self.positions if self.queries is None else self.queries
        return self.positions[:, self.queries]

    def mask(self, kernel: Kernel, device: torch.device, dtype: torch.dtype = torch.float32) -> AttentionMask | None:
        """The mask of this layout for `kernel`: a key is seen when it is not after the query in the row
        and is in the query's document. None (SDPA's causal kernel) without documents, unless the row is
        split over cp ranks (their queries and keys are not in the row's order). `dtype`: the SDPA mask's,
        that of the queries (the compute dtype)."""
        docs = self.documents
        if docs is None and self.keys is None:
            return None
        if self.keys is None:
            queries = keys = torch.arange(self.seq_len, device=docs.device)
        else:
            queries, keys = self.queries, self.keys
        if kernel == "flex":
            return AttentionMask(block_mask=_block_mask(docs, queries, keys, device), context=self.context)
        causal = keys[None, :] <= queries[:, None]                    # [Tq, Tk]
        cut = whole = None
        if self.split_rows:   # (reads the documents on the host: for the CPU, uncompiled)
            several = docs[:, -1] > 0
            cut, whole = several.nonzero().flatten(), (~several).nonzero().flatten()
            docs = docs[cut]
        seen = causal[None] if docs is None else causal & (docs[:, queries, None] == docs[:, None, keys])
        zero, hidden = (torch.full((), value, dtype=dtype, device=keys.device) for value in (0.0, float("-inf")))
        return AttentionMask(dense=torch.where(seen, zero, hidden)[:, None], cut=cut, whole=whole,
                             context=self.context)


def _block_mask(docs: torch.Tensor | None, queries: torch.Tensor, keys: torch.Tensor, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def in_document(b, h, q, k):
        seen = keys[k] <= queries[q]
        return seen if docs is None else seen & (docs[b, keys[k]] == docs[b, queries[q]])

    # compiled on a GPU, it visits 128 x 128 blocks instead of materialising the Tq x Tk mask
    rows = None if docs is None else docs.shape[0]
    return create_block_mask(in_document, rows, None, len(queries), len(keys), device=device,
                             _compile=device.type == "cuda")


_COMPILED_FLEX = None


def _flex(q, k, v, **kwargs):
    """FlexAttention compiled once (its eager form is a reference implementation that builds the scores)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention
    if q.device.type == "cpu":
        return flex_attention(q, k, v, **kwargs)
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX(q, k, v, **kwargs)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
           scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, T, D(v)]: causal over the row without a mask. Under
    context parallelism (mask.context) k and v are this rank's tokens', gathered here from every rank."""
    if mask is not None and mask.context is not None:
        from trainer.models.context_parallel import gather_sequence
        k, v = gather_sequence(k, mask.context), gather_sequence(v, mask.context)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if mask.block_mask is not None:
        return _flex(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=enable_gqa)
    dense = mask.dense.to(q.dtype)   # (no copy where it was built in the compute dtype)
    if mask.cut is None or len(mask.whole) == 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=enable_gqa)
    # the masked kernel computes every block of T x T, the causal one skips those above the diagonal
    c, w = mask.cut, mask.whole
    y_cut = F.scaled_dot_product_attention(q[c], k[c], v[c], attn_mask=dense, scale=scale, enable_gqa=enable_gqa)
    y_whole = F.scaled_dot_product_attention(q[w], k[w], v[w], is_causal=True, scale=scale, enable_gqa=enable_gqa)
    return torch.cat((y_cut, y_whole))[torch.cat((c, w)).argsort()]

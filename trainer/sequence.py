"""A batch's rows as the model takes them (trainer/models/masking.py's SequenceLayout): the documents
of each row, cut where the dataset's EOS id is followed by its BOS id, and RoPE positions that restart
in each document (data.position_reset).

    rows = Rows(cut=(bos, eos), position_reset=False)
    x, y, layout = rows(x, y)          # on the device, once per micro-batch

Under context or tensor parallelism (`shard`: a SequenceShard) the ranks that share a batch each take
their tokens of every row, inputs and labels alike, after the documents were cut on the whole row.

A dataset stores each document as BOS, its tokens, EOS (trainer/data/dataset.py), so a document begins
where an EOS is followed by a BOS, and a window's first token begins one (the document it cuts into:
what came before the window is out of reach anyway). Without a BOS id, every token after an EOS
begins one. The labels are not touched: a document's EOS still predicts the next one's BOS, a constant
that says nothing about that document.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainer.models import context_parallel
from trainer.models.masking import SequenceLayout


def document_starts(tokens: torch.Tensor, bos: int | None, eos: int) -> torch.Tensor:
    """[B, T] True where a document begins."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    after_eos = tokens[:, :-1] == eos
    starts[:, 1:] = after_eos if bos is None else after_eos & (tokens[:, 1:] == bos)
    return starts


def document_ids(tokens: torch.Tensor, bos: int | None, eos: int) -> torch.Tensor:
    """[B, T] the index of each token's document in its row (0, 0, ..., 1, 1, ...)."""
    return document_starts(tokens, bos, eos).cumsum(1) - 1


def restarting_positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, T] each token's position in its own document (0 at every document's first token)."""
    places = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    begins = torch.ones_like(documents, dtype=torch.bool)
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(begins, places, torch.zeros_like(places)).cummax(1).values
    return places - first


class Rows:
    """Turns a batch (x, y) into what the model takes: `cut` (bos, eos) cuts documents (None: the rows
    are not cut: the batch goes through untouched, with no layout, causal attention over the row);
    `position_reset` restarts RoPE positions per document. `causal_when_whole`: a batch on the CPU whose
    rows are each one document goes through with no layout either (the causal kernel skips the blocks
    above the diagonal; a mask does not), the common case where documents are longer than a row, and in
    another batch SDPA takes the rows of one document apart on the causal kernel (split_rows). Not
    under torch.compile: a layer compiled for one of the two would run for the other once its guards are
    skipped (trainer/guards.py); nor on a GPU, where the test would wait for the stream."""

    def __init__(self, cut: tuple[int | None, int] | None = None, position_reset: bool = False,
                 causal_when_whole: bool = False, shard: "SequenceShard | None" = None):
        self.cut, self.position_reset, self.causal_when_whole = cut, position_reset, causal_when_whole
        self.shard = shard

    def __call__(self, x: torch.Tensor, y: torch.Tensor):
        x, y, layout = self._whole(x, y)
        return (x, y, layout) if self.shard is None else self.shard(x, y, layout)

    def _whole(self, x: torch.Tensor, y: torch.Tensor):
        if self.cut is None:
            return x, y, None
        documents = document_ids(x, *self.cut)
        if self.causal_when_whole and x.device.type == "cpu" and not bool(documents[:, -1].any()):
            return x, y, None   # every row one document: its positions are its places, its mask causal
        positions = restarting_positions(documents) if self.position_reset else None
        split = self.causal_when_whole and x.device.type == "cpu" and self.shard is None
        return x, y, SequenceLayout(x.shape[1], documents, positions, split_rows=split)


@dataclass
class SequenceShard:
    """This rank's tokens of every row: under context parallelism two of the row's 2 x cp chunks
    (trainer/models/context_parallel.py), of those under tensor parallelism the tp_rank-th of tp equal
    slices. The layout keeps the whole row's length, documents and positions, with the places of the
    queries and keys under cp."""

    cp: int = 1
    cp_rank: int = 0
    tp: int = 1
    tp_rank: int = 0
    cp_group: object | None = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor, layout: SequenceLayout | None):
        T = x.shape[1]
        layout = layout or SequenceLayout(T)
        if self.cp > 1:
            mine = context_parallel.places(T, self.cp, self.cp_rank, x.device)
            layout = replace(layout, queries=mine, keys=context_parallel.gathered_places(T, self.cp, x.device),
                             context=self.cp_group)
            x, y = x[:, mine], y[:, mine]
        if self.tp > 1:
            n = x.shape[1] // self.tp
            x, y = x[:, self.tp_rank * n:(self.tp_rank + 1) * n], y[:, self.tp_rank * n:(self.tp_rank + 1) * n]
        return x, y, layout

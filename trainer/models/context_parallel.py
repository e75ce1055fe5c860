"""Context parallelism (parallel.cp): each of cp ranks holds 1/cp of every row's tokens and attends over
all of them, the keys and values of every rank gathered before attention (Llama 3's choice for its
128k-token training, where ring attention's passes could not keep a document mask).

A row is cut into 2 x cp chunks and rank r holds chunks r and 2cp - 1 - r: under a causal mask the late
chunks see more keys than the early ones, so each rank gets one of each and the same work.

    mine = places(T, cp, rank)            # this rank's places in the row (its queries)
    order = gathered_places(T, cp)        # every place, in the order gather_sequence returns them
    k = gather_sequence(k_local, group)   # [B, H, T/cp, D] -> [B, H, T, D]; backward: summed, then split

Only the projections' outputs of other ranks travel: for grouped-query attention 2 x T x kv_heads x
head_dim values a layer, small beside the queries'; the whole T x T attention still runs, split by
queries. Everything outside attention (norms, MLP, loss) works on the rank's own tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def places(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The places of rank `rank`'s tokens in a row of `seq_len`: chunks rank and 2cp - 1 - rank."""
    chunk = seq_len // (2 * cp)
    return torch.cat((torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)))


def gathered_places(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Every place of the row in the order gather_sequence lays the ranks' tokens out."""
    return torch.cat([places(seq_len, cp, r, device) for r in range(cp)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension (2 of [B, H, T, D]); backward: every rank's gradient for
    this rank's tokens, summed (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        n = grad.shape[2] // size
        if dist.get_backend(group) == "nccl":
            parts = list(grad.contiguous().split(n, dim=2))
            out = torch.empty_like(parts[rank], memory_format=torch.contiguous_format)
            dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group)
            return out, None
        grad = grad.contiguous()   # gloo has no reduce-scatter: the sum everywhere, this rank's part kept
        dist.all_reduce(grad, group=group)
        return grad.narrow(2, rank * n, n), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """x [B, H, T/cp, D] of every rank of `group`, concatenated along T in rank order."""
    return _GatherSequence.apply(x, group)

"""Expert parallelism (parallel.ep): each rank holds n_routed_experts / ep experts, and a MoE layer's
tokens travel to the ranks that hold their experts and back.

    ep_mesh = mesh["ep"]                   # ep consecutive ranks share the experts out
    shard_experts(model, ep_mesh)          # each rank keeps its experts: DTensors Shard(0) over ep
    # then FSDP2 shards them over the ranks that hold the same experts (trainer/distributed.py)

A layer's dispatch, after the router sorted the tokens by expert:
  1. the rows per (destination rank, expert) are exchanged first (all_to_all_single of the counts),
  2. the rows go to their experts' ranks (all_to_all_single; its backward sends the gradients back),
  3. the received rows, grouped by source rank, are regrouped by local expert for the grouped GEMM,
  4. the results take the same way back.
Split sizes need the counts on the host: one device-to-host copy per layer and pass (torchtitan's too).
A router that sends every token to one expert only makes one rank's share large: nothing fails.

The experts' weights are DTensors over the ep mesh, so a checkpoint holds each expert once under its
global index, and loads at any other ep or world size (torch.distributed.checkpoint reshards).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.models.moe import GroupedExperts, moe_layers


class ExpertParallelDispatch:
    """MoE.dispatch under expert parallelism over `group` (ep ranks, each holding `local` experts)."""

    def __init__(self, group, experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local = experts // self.ep

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        counts = counts.to(torch.int64)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)   # [source rank, local expert] counts
        sent_by_rank = counts.view(self.ep, self.local).sum(1)
        received = received.view(self.ep, self.local)
        both = torch.cat([sent_by_rank, received.sum(1), received.flatten()]).tolist()   # one host sync
        send, recv, per_block = both[:self.ep], both[self.ep:2 * self.ep], both[2 * self.ep:]

        mine = all_to_all_single_autograd(x, recv, send, self.group)   # rows grouped by source, then expert
        order = _by_expert(per_block, self.ep, self.local, x.device)
        y = experts(mine[order], received.sum(0))
        back = torch.empty_like(y).index_copy_(0, order, y) if y.shape[0] else y
        return all_to_all_single_autograd(back, send, recv, self.group)


def _by_expert(per_block: list[int], ep: int, local: int, device) -> torch.Tensor:
    """Row order that regroups rows received as (source rank, local expert) blocks by local expert
    (sources in rank order within an expert)."""
    starts, at = [], 0
    for size in per_block:
        starts.append(at)
        at += size
    pieces = [torch.arange(starts[s * local + e], starts[s * local + e] + per_block[s * local + e], device=device)
              for e in range(local) for s in range(ep)]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long, device=device)


def shard_experts(model: nn.Module, ep_mesh) -> None:
    """Keep this rank's experts of every MoE layer, as DTensors sharded on dim 0 over `ep_mesh`, and route
    their tokens through ExpertParallelDispatch. Every rank built the same full weights (same seed)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    group = ep_mesh.get_group()
    for _, moe in moe_layers(model):
        experts = moe.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.shape[0] // ep
            part = full.detach()[rank * local:(rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False)))
        moe.dispatch = ExpertParallelDispatch(group, moe.moe.n_routed_experts)

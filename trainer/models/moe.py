"""Mixture of experts: the router, the routed experts, the shared experts, and what balances them.

    moe = MoE(cfg)          # model.moe: DeepSeekMoE (shared + routed, softmax or sigmoid scores) or Qwen3-MoE
    y = moe(x)              # [batch, seq, dim] -> same

A token's router scores choose its top_k experts (group-limited where model.moe.n_group > 1; with
DeepSeek-V3's balancing bias added for the choice only); their weights are the chosen scores,
normalised where norm_topk_prob says so, times route_scale. The tokens are sorted by expert
(`permute`), each expert's rows go through its SwiGLU in one grouped GEMM, and the results return to
their tokens weighted by the routing weights (`unpermute`); a `dispatch` in between sends them to the
ranks that hold their experts under expert parallelism (trainer/models/expert_parallel.py). Dropless
unless model.moe.capacity_factor caps what an expert takes.

Balance: DeepSeek-V2's sequence-level auxiliary loss (aux_loss_alpha), added to the gradient inside
the layer (AddAuxiliaryLoss); DeepSeek-V3's auxiliary-loss-free bias (bias_update_speed), moved
after each optimizer step against the step's load (update_balance_bias). Every layer counts the
tokens each expert received since the last time they were read (collect_load), for metrics.

The ops a kernel replaces are named hooks, as in the dense blocks: GroupedExperts.grouped_mm,
MoE.permute / MoE.unpermute and Router.route_fn (kernels/patch.py swaps in kernels/grouped_gemm.py,
kernels/moe_permute.py and kernels/router.py).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig, MoEConfig
from trainer.models.blocks import MLP


# --------------------------------------------------------------------------- routing

def route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(weights [T, k] fp32, indices [T, k] int64, scores [T, E] fp32): transformers' DeepSeek-V2/V3 and
    Qwen3-MoE gates, in one function. logits: [T, E] in fp32."""
    scores = logits.softmax(dim=-1) if moe.score_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if moe.n_group > 1:
        grouped = choice.view(-1, moe.n_group, moe.n_routed_experts // moe.n_group)
        # V3 ranks a group by its two best scores, V2 by its best one
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if moe.score_func == "sigmoid" else grouped.amax(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_group, dim=-1)[1], 1.0)
        mask = keep.bool().unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~mask, float("-inf") if moe.score_func == "sigmoid" else 0.0)
    indices = choice.topk(moe.top_k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.route_scale, indices, scores


class Router(nn.Module):
    """The gate: logits = x @ weight.T in fp32 (as the reference models compute them), then `route`.
    `e_score_correction_bias` (DeepSeek-V3) is a buffer: it is in the checkpoint, not the optimizer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.moe = cfg.moe
        self.weight = nn.Parameter(torch.empty(cfg.moe.n_routed_experts, cfg.dim))
        if cfg.moe.bias_update_speed or cfg.moe.score_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.moe.n_routed_experts))
        else:
            self.e_score_correction_bias = None
        self.route_fn = route  # kernel hook

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return self.route_fn(logits, self.moe, bias)


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, moe: MoEConfig) -> torch.Tensor:
    """DeepSeek-V2's sequence-wise balance loss, averaged over the batch's sequences: for each sequence,
    sum over experts of f_i * P_i, f_i = (experts / (top_k * seq)) x tokens routed to i, P_i the mean
    of its (normalised) score."""
    experts, k = moe.n_routed_experts, moe.top_k
    if moe.score_func == "sigmoid":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    per_seq = scores.view(batch, -1, experts)
    seq_len = per_seq.shape[1]
    counts = torch.zeros(batch, experts, device=scores.device, dtype=scores.dtype)
    chosen = indices.reshape(batch, -1)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=scores.dtype))
    f = counts * (experts / (k * seq_len))
    return (f * per_seq.mean(dim=1)).sum(dim=1).mean()


class AddAuxiliaryLoss(torch.autograd.Function):
    """y unchanged forward; backward gives `loss` the gradient `weight` (its coefficient in the step's
    objective), so the balance loss trains the router without passing through the model's output."""

    @staticmethod
    def forward(ctx, y, loss, weight: float):
        ctx.weight, ctx.dtype, ctx.shape = weight, loss.dtype, loss.shape
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.shape, ctx.weight, dtype=ctx.dtype, device=grad.device), None


# --------------------------------------------------------------------------- the experts' tokens

class PermutePlan(NamedTuple):
    """Where each (token, slot) went: kernels/moe_permute.py's plan, field for field."""
    row_of: torch.Tensor   # [T, k]: the row holding token t's j-th copy (-1: dropped by the capacity)
    counts: torch.Tensor   # [E]: rows per expert
    offs: torch.Tensor     # [E] int32: each expert's end row (grouped_mm's offsets)


def permute(x: torch.Tensor, indices: torch.Tensor, experts: int, capacity: int | None = None):
    """Rows of x grouped by expert, in token order within each: (x_sorted [rows, D], PermutePlan). With a
    capacity, an expert keeps its first `capacity` rows and the rest are dropped (they never reach an
    expert, and their slot adds nothing)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))   # (bincount would wait on the host for its max)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        place = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[place < capacity]
        counts = counts.clamp(max=capacity)
    row_of = torch.full_like(flat, -1)
    row_of[order] = torch.arange(order.numel(), device=flat.device)
    plan = PermutePlan(row_of.view_as(indices), counts, torch.cumsum(counts, 0, dtype=torch.int32))
    return take_rows(x, order // indices.shape[1]), plan


def unpermute(y: torch.Tensor, plan: PermutePlan, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over t's kept slots j of weights[t, j] * y[row_of[t, j]]: the inverse of permute."""
    kept = plan.row_of >= 0
    picked = take_rows(y, plan.row_of.clamp(min=0).reshape(-1)).view(*plan.row_of.shape, -1)   # [T, k, D]
    return (picked * (weights * kept).unsqueeze(-1).to(y.dtype)).sum(dim=1)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a 1-D index that repeats rows. On a CPU through index_select, whose backward (index_add_)
    is 13x quicker than indexing's (index_put_ with accumulate) at the seed model's shapes; on a GPU by
    indexing, whose backward sorts and stays deterministic where index_add_'s atomics would not."""
    return x[index] if x.is_cuda else x.index_select(0, index)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [rows, K] grouped by expert, w [E, K, N], offsets [E] each group's end row (int32): x_e @ w_e.
    torch._grouped_mm where it runs (CUDA bf16, what torchtitan uses), else one matmul per expert."""
    if x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w, offs=offsets)
    # split and cat, whose backwards are one cat and one split: slicing x and assigning into an output
    # would give every expert's backward a zero tensor of x's whole size (E full passes a product)
    ends = offsets.tolist()
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)] + [x.shape[0] - (ends[-1] if ends else 0)]
    parts = torch.split(x, sizes)
    outs = [part @ w[e] for e, part in enumerate(parts[:-1])]
    return torch.cat([*outs, x.new_zeros(sizes[-1], w.shape[-1])])   # rows past the last end: no expert's


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: gate_up_proj [E, dim, 2 x ffn] (gate then up along
    the last dim) and down_proj [E, ffn, dim], input-major for the grouped GEMM. Under expert
    parallelism this rank holds the experts of its ep group's share (E / ep)."""

    def __init__(self, experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, dim, 2 * ffn_dim))
        self.down_proj = nn.Parameter(torch.empty(experts, ffn_dim, dim))
        self.grouped_mm = grouped_mm  # kernel hook
        self.act_fn = _silu_mul_halves

    def init_weights(self, std: float, depth_std: float) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=depth_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [rows, dim] grouped by this rank's experts, counts [local experts] rows each."""
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = self.grouped_mm(x, _local(self.gate_up_proj).to(x.dtype), offsets)
        return self.grouped_mm(self.act_fn(gate_up), _local(self.down_proj).to(x.dtype), offsets)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: under expert parallelism the weight is a DTensor sharded over the ep ranks."""
    from torch.distributed.tensor import DTensor
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _silu_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LocalDispatch:
    """Every expert on this rank (no expert parallelism): rows go straight to the experts."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        return experts(x, counts)


class MoE(nn.Module):
    """Shared experts (DeepSeekMoE; none in Qwen3-MoE) plus routed ones. Names as transformers'
    (mlp.gate, mlp.experts, mlp.shared_experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.moe = e = cfg.moe
        self.gate = Router(cfg)
        self.experts = GroupedExperts(e.n_routed_experts, cfg.dim, e.ffn_dim)
        self.shared_experts = MLP(cfg.dim, e.ffn_dim * e.n_shared_experts) if e.n_shared_experts else None
        self.dispatch = LocalDispatch()        # expert parallelism replaces it (trainer/models/expert_parallel.py)
        self.permute, self.unpermute = permute, unpermute   # kernel hooks
        self.aux_weight = e.aux_loss_alpha     # the balance loss's coefficient per micro batch (configure)
        # tokens each expert received since take_load(); the current step's, for the balancing bias
        self.register_buffer("load", torch.zeros(e.n_routed_experts), persistent=False)
        self.register_buffer("step_load", torch.zeros(e.n_routed_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_count", torch.zeros(()), persistent=False)

    def init_weights(self, std: float, depth_std: float) -> None:
        self.gate.init_weights(std)
        self.experts.init_weights(std, depth_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, depth_std)
        for counter in (self.load, self.step_load, self.aux_loss_sum, self.aux_loss_count):
            counter.zero_()   # built on the meta device, they hold whatever memory to_empty got

    def capacity(self, tokens: int) -> int | None:
        e = self.moe
        return None if e.capacity_factor is None else \
            max(1, math.ceil(e.capacity_factor * tokens * e.top_k / e.n_routed_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = x.reshape(-1, D)
        weights, indices, scores = self.gate(h)
        rows, plan = self.permute(h, indices, self.moe.n_routed_experts, self.capacity(B * T))
        if self.training and not _recomputing():
            with torch.no_grad():
                self.load += plan.counts
                if self.moe.bias_update_speed:
                    self.step_load += plan.counts
        out = self.unpermute(self.dispatch(rows, plan.counts, self.experts), plan, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        out = out.view(B, T, D)
        if self.moe.aux_loss_alpha and self.training and torch.is_grad_enabled():
            aux = sequence_balance_loss(scores, indices, B, self.moe)
            if not _recomputing():
                with torch.no_grad():
                    self.aux_loss_sum += aux.detach()
                    self.aux_loss_count += 1
            out = AddAuxiliaryLoss.apply(out, aux, self.aux_weight)
        return out


def _recomputing() -> bool:
    """Inside backward: activation checkpointing running the layer again, whose tokens were counted."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------- the trainer's side

def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(layer id, its MoE) for each mixture-of-experts layer, in order."""
    return [(layer.layer_id, layer.mlp) for layer in model.model.layers if isinstance(layer.mlp, MoE)]


def configure(model: nn.Module, grad_accum: int) -> None:
    """The balance loss is averaged over a step's micro batches, as the language-model loss is."""
    for _, moe in moe_layers(model):
        moe.aux_weight = moe.moe.aux_loss_alpha / grad_accum


@torch.no_grad()
def collect_load(model: nn.Module) -> torch.Tensor | None:
    """Each MoE layer's tokens per expert since the last call, and the balance loss's sum and count, in one
    tensor summed over the ranks (one all-reduce, no host sync: read it later with read_load); the
    counters restart. None for a model without experts."""
    layers = moe_layers(model)
    if not layers:
        return None
    packed = torch.cat([torch.stack([moe.load for _, moe in layers]).flatten(),
                        torch.stack([torch.stack([m.aux_loss_sum, m.aux_loss_count]) for _, m in layers]).sum(0)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed)
    for _, moe in layers:
        moe.load.zero_()
        moe.aux_loss_sum.zero_()
        moe.aux_loss_count.zero_()
    biases = [moe.gate.e_score_correction_bias for _, moe in layers if moe.gate.e_score_correction_bias is not None]
    return torch.cat([packed] + [b.float() for b in biases])   # the biases are alike on every rank: not summed


def read_load(model: nn.Module, values: list[float]) -> dict:
    """collect_load's tensor, read: {"layers": [ids], "load": [[tokens per expert] per layer], "aux_loss",
    "bias": [[the balancing bias per expert] per layer] or None}."""
    layers = moe_layers(model)
    experts = layers[0][1].moe.n_routed_experts
    n = len(layers) * experts
    load = [values[i * experts:(i + 1) * experts] for i in range(len(layers))]
    aux_sum, aux_count = values[n:n + 2]
    biases = values[n + 2:]
    return {"layers": [layer_id for layer_id, _ in layers], "load": load,
            "aux_loss": aux_sum / aux_count if aux_count else None,
            "bias": [biases[i * experts:(i + 1) * experts] for i in range(len(biases) // experts)] or None}


def load_summary(load: list[list[float]]) -> list[dict]:
    """Per layer: the fewest and most tokens an expert got, and the coefficient of variation."""
    out = []
    for row in load:
        mean = sum(row) / len(row)
        std = (sum((v - mean) ** 2 for v in row) / len(row)) ** 0.5
        out.append({"min": min(row), "max": max(row), "cv": std / mean if mean else 0.0,
                    "min_expert": row.index(min(row)), "max_expert": row.index(max(row))})
    return out


@torch.no_grad()
def update_balance_bias(model: nn.Module) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert's bias moves by
    bias_update_speed toward balance (up when it got fewer tokens than the mean this step, down when
    more). The step's counts are summed over the ranks first, so every rank moves its biases alike."""
    layers = [(i, m) for i, m in moe_layers(model) if m.moe.bias_update_speed]
    if not layers:
        return
    step = torch.stack([moe.step_load for _, moe in layers])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(step)
    for row, (_, moe) in zip(step, layers):
        moe.gate.e_score_correction_bias += moe.moe.bias_update_speed * torch.sign(row.mean() - row)
        moe.step_load.zero_()

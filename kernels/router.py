"""The MoE router after the gate's linear layer: scores, (group-limited) top-k, routing weights.

    spec = RouterSpec.from_config(hf_config)       # DeepseekV2 / DeepseekV3 / Qwen3Moe, or by hand
    weights, indices, scores = route(logits, spec, bias=e_score_correction_bias)

logits [T, E] (any float dtype; math in fp32). In order:
1. scores = softmax(logits) or sigmoid(logits), fp32 [T, E] (returned: what an auxiliary loss needs,
   per-token or its per-expert mean; gradients flow back through it).
2. choice = scores + bias: DeepSeek-V3's auxiliary-loss-free balancing, the bias chooses and the
   unbiased scores weigh.
3. With n_group > 1: each group of E / n_group experts is scored by the max of its choice values
   (softmax) or the sum of its top two (sigmoid); the topk_group best groups stay, the others' experts
   are out.
4. indices = the top_k experts by choice (int64 [T, k], best first); weights = their scores, divided
   by their sum (+1e-20) with norm_topk_prob, times routed_scaling_factor (fp32 [T, k]).

This is transformers' DeepseekV2TopkRouter (softmax, "greedy" or "group_limited_greedy"; transformers'
V2 gate never normalizes), DeepseekV3TopkRouter and Qwen3MoeTopKRouter (which rounds its weights to
the logits' dtype at the end: cast them if you need that). Their topk is unsorted except Qwen3's; here
indices are always best first, ties to the lower expert.

Two implementations of one function: router_reference (plain PyTorch, which torch.compile fuses) and
router_triton (a forward and a backward kernel, a block of tokens a program with all E experts in
registers). route() takes the Triton one where _TRITON_ROUTER_MIN_EXPERTS says it was measured to win
(benchmarks/cases_moe.py, router rows), else the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from core.vendor import Vendor
from kernels import arch

# Where route() runs the Triton kernels: from this many experts, per vendor. H100 (torch 2.11, Triton 3.6,
# `python -m benchmarks.kernels --op router`, 8192 tokens, forward + backward): 64 experts 0.313 ms
# against eager's 0.311 (a tie: the reference stays), 128 and 256 experts 1.6-1.8x faster than eager.
# AMD is not measured: the reference everywhere until it is.
_TRITON_ROUTER_MIN_EXPERTS = {Vendor.NVIDIA: 128}
_MAX_EXPERTS = 1024            # all of a token's scores sit in registers
_TILE_ELEMS = 4096             # tokens x padded experts a program holds
_NORM_EPS = 1e-20              # DeepSeek-V3's; 0 in Qwen3, the same in fp32 (its top-k sum >= k / E)


@dataclass(frozen=True)
class RouterSpec:
    top_k: int
    score_func: str = "softmax"          # "softmax" | "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_config(cls, config) -> "RouterSpec":
        """From a transformers DeepseekV2Config, DeepseekV3Config or Qwen3MoeConfig, as its gate reads it."""
        kind = getattr(config, "model_type", None)
        if kind == "deepseek_v2":
            grouped = config.topk_method == "group_limited_greedy"
            return cls(config.num_experts_per_tok, "softmax", config.n_group if grouped else 1,
                       config.topk_group if grouped else 1, False, config.routed_scaling_factor)
        if kind == "deepseek_v3":
            return cls(config.num_experts_per_tok, "sigmoid", config.n_group, config.topk_group,
                       config.norm_topk_prob, config.routed_scaling_factor)
        if kind == "qwen3_moe":
            return cls(config.num_experts_per_tok, "softmax", 1, 1, config.norm_topk_prob, 1.0)
        raise ValueError(f"RouterSpec.from_config: no gate known for model_type {kind!r}")

    def check(self, n_experts: int) -> None:
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"router: score_func must be softmax or sigmoid, got {self.score_func!r}")
        if self.n_group < 1 or n_experts % self.n_group:
            raise ValueError(f"router: {n_experts} experts do not split into n_group={self.n_group} groups")
        if self.n_group > 1 and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"router: topk_group={self.topk_group} of n_group={self.n_group}")
        if self.n_group > 1 and self.score_func == "sigmoid" and n_experts // self.n_group < 2:
            raise ValueError("router: sigmoid groups are scored by their top two experts: at least 2 a group")
        kept = n_experts if self.n_group == 1 else self.topk_group * (n_experts // self.n_group)
        if not 1 <= self.top_k <= kept:
            raise ValueError(f"router: top_k={self.top_k} from {kept} experts open to each token")


class RouterOutput(NamedTuple):
    weights: torch.Tensor   # fp32 [T, k]
    indices: torch.Tensor   # int64 [T, k], best first
    scores: torch.Tensor    # fp32 [T, E], unbiased


def _check(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"router: logits must be a float [T, E], got {logits.dtype} {tuple(logits.shape)}")
    spec.check(logits.shape[1])
    if bias is not None and tuple(bias.shape) != (logits.shape[1],):
        raise ValueError(f"router: bias must be [E={logits.shape[1]}], got {tuple(bias.shape)}")


# --- the reference -----------------------------------------------------------------------------------

def router_reference(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None) -> RouterOutput:
    """The gate in plain PyTorch (transformers' formulas, best-first indices)."""
    _check(logits, spec, bias)
    t, e = logits.shape
    logits = logits.float()
    scores = logits.softmax(dim=-1) if spec.score_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if spec.n_group > 1:
        grouped = choice.view(t, spec.n_group, e // spec.n_group)
        group_scores = (grouped.max(dim=-1).values if spec.score_func == "softmax"
                        else grouped.topk(2, dim=-1)[0].sum(dim=-1))
        group_idx = group_scores.topk(spec.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, e // spec.n_group).reshape(t, e)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    indices = choice.topk(spec.top_k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return RouterOutput(weights * spec.routed_scaling_factor, indices, scores)


# --- the kernels ---------------------------------------------------------------------------------------

@triton.jit
def _scores(LOGITS, rows, cols, T, E: tl.constexpr, stride_t, SIGMOID: tl.constexpr):
    """fp32 scores of a [BLOCK_T, E_PAD] tile; padded experts (and rows past T) score 0."""
    live = (rows[:, None] < T) & (cols[None, :] < E)
    x = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=live, other=0.0).to(tl.float32)
    if SIGMOID:
        return tl.where(live, tl.sigmoid(x), 0.0)
    x = tl.where(cols[None, :] < E, x, float("-inf"))     # padded experts: exp -> 0
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    return tl.where(live, p / tl.sum(p, axis=1)[:, None], 0.0)


@triton.jit
def _at(matrix, cols, index):
    """matrix[r, index[r]] for each row r."""
    return tl.sum(tl.where(cols[None, :] == index[:, None], matrix, 0), axis=1)


@triton.jit
def _column(matrix, cols, j):
    """matrix[:, j]."""
    return tl.sum(tl.where(cols[None, :] == j, matrix, 0), axis=1)


@triton.jit
def _first_max(values, cols, E_PAD: tl.constexpr):
    """(max along axis 1, the lowest column holding it)."""
    best = tl.max(values, axis=1)
    return best, tl.min(tl.where(values == best[:, None], cols[None, :], E_PAD), axis=1)


@triton.jit
def _keep_top_groups(choice, cols, E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                     G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr):
    """choice with the experts of all but the TOPK_GROUP best groups set to -inf. A group scores the max
    of its choice values (softmax) or the sum of its top two (sigmoid); ties go to the lower group."""
    group_of = cols // (E // N_GROUP)
    groups = tl.arange(0, G_PAD)
    group_score = tl.full([choice.shape[0], G_PAD], float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        in_group = tl.where((group_of == g)[None, :], choice, float("-inf"))
        top1, first = _first_max(in_group, cols, E_PAD)
        if SIGMOID:
            s = top1 + tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), in_group), axis=1)
        else:
            s = top1
        group_score = tl.where(groups[None, :] == g, s[:, None], group_score)
    # a group stays if fewer than TOPK_GROUP groups beat it
    mine = group_score[:, :, None]
    other = group_score[:, None, :]
    beats = (other > mine) | ((other == mine) & (groups[None, None, :] < groups[None, :, None]))
    kept = (tl.sum(beats.to(tl.int32), axis=2) < TOPK_GROUP) & (groups[None, :] < N_GROUP)
    keep = tl.zeros(choice.shape, dtype=tl.int1)
    for g in tl.static_range(N_GROUP):
        kept_g = _column(kept.to(tl.int32), groups, g) > 0
        keep = keep | ((group_of == g)[None, :] & kept_g[:, None])
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def _router_fwd_kernel(LOGITS, BIAS, WEIGHTS, INDICES, SCORES, T, stride_t, scale,
                       E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    experts = cols[None, :] < E
    scores = _scores(LOGITS, rows, cols, T, E, stride_t, SIGMOID)
    tl.store(SCORES + rows[:, None].to(tl.int64) * E + cols[None, :], scores, mask=(rows[:, None] < T) & experts)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(BIAS + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(experts, choice, float("-inf"))
    if N_GROUP > 1:
        choice = _keep_top_groups(choice, cols, E, E_PAD, N_GROUP, G_PAD, TOPK_GROUP, SIGMOID)
    choices = tl.arange(0, K_PAD)
    picked = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        _, best = _first_max(choice, cols, E_PAD)
        picked = tl.where(choices[None, :] == j, best[:, None], picked)
        weights = tl.where(choices[None, :] == j, _at(scores, cols, best)[:, None], weights)
        choice = tl.where(cols[None, :] == best[:, None], float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    out = rows[:, None].to(tl.int64) * TOP_K + choices[None, :]
    mask = (rows[:, None] < T) & (choices[None, :] < TOP_K)
    tl.store(WEIGHTS + out, weights * scale, mask=mask)
    tl.store(INDICES + out, picked.to(tl.int64), mask=mask)


@triton.jit
def _router_bwd_kernel(LOGITS, INDICES, D_WEIGHTS, D_SCORES, D_LOGITS, T, stride_t, stride_dt, scale,
                       E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_D_SCORES: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """d logits from d weights (through the gather, the normalization and the scale) and d scores."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    live = (rows[:, None] < T) & (cols[None, :] < E)
    scores = _scores(LOGITS, rows, cols, T, E, stride_t, SIGMOID)
    choices = tl.arange(0, K_PAD)
    pair = rows[:, None].to(tl.int64) * TOP_K + choices[None, :]
    pair_live = (rows[:, None] < T) & (choices[None, :] < TOP_K)
    picked = tl.load(INDICES + pair, mask=pair_live, other=E_PAD).to(tl.int32)   # E_PAD: matches no column
    d_weights = tl.load(D_WEIGHTS + pair, mask=pair_live, other=0.0).to(tl.float32) * scale
    d_scores = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    if HAS_D_SCORES:
        d_scores = tl.load(D_SCORES + rows[:, None].to(tl.int64) * E + cols[None, :], mask=live, other=0.0)
    if NORM:   # w_j = s_j / (S + eps): ds_j = (dw_j - sum_i dw_i w_i) / (S + eps)
        chosen = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            chosen = tl.where(choices[None, :] == j, _at(scores, cols, _column(picked, choices, j))[:, None], chosen)
        total = tl.sum(chosen, axis=1)[:, None] + 1e-20
        d_weights = (d_weights - tl.sum(d_weights * chosen, axis=1)[:, None] / total) / total
    for j in tl.static_range(TOP_K):     # scatter: each chosen expert's weight gradient onto its score
        expert = _column(picked, choices, j)
        d_scores += tl.where(cols[None, :] == expert[:, None], _column(d_weights, choices, j)[:, None], 0.0)
    if SIGMOID:
        d_logits = d_scores * scores * (1.0 - scores)
    else:
        d_logits = scores * (d_scores - tl.sum(d_scores * scores, axis=1)[:, None])
    tl.store(D_LOGITS + rows[:, None].to(tl.int64) * stride_dt + cols[None, :], d_logits.to(D_LOGITS.dtype.element_ty),
             mask=live)


def _launch(t: int, e: int, spec: RouterSpec, device: torch.device) -> tuple[tuple[int], dict]:
    e_pad = arch.next_pow2(e)
    block_t = max(1, min(_TILE_ELEMS // e_pad, arch.next_pow2(t)))
    return (triton.cdiv(t, block_t),), dict(
        E=e, E_PAD=e_pad, TOP_K=spec.top_k, K_PAD=arch.next_pow2(spec.top_k), SIGMOID=spec.score_func == "sigmoid",
        NORM=spec.norm_topk_prob, BLOCK_T=block_t, num_warps=4)


def _forward(logits: torch.Tensor, bias: torch.Tensor | None, spec: RouterSpec
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    t, e = logits.shape
    weights = torch.empty(t, spec.top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(t, spec.top_k, dtype=torch.int64, device=logits.device)
    scores = torch.empty(t, e, dtype=torch.float32, device=logits.device)
    if t:
        grid, consts = _launch(t, e, spec, logits.device)
        _router_fwd_kernel[grid](logits, None if bias is None else bias.contiguous(), weights, indices, scores, t,
                                 logits.stride(0), spec.routed_scaling_factor, N_GROUP=spec.n_group,
                                 G_PAD=arch.next_pow2(spec.n_group), TOPK_GROUP=spec.topk_group,
                                 HAS_BIAS=bias is not None, **consts)
    return weights, indices, scores


def _backward(logits: torch.Tensor, indices: torch.Tensor, d_weights: torch.Tensor | None,
              d_scores: torch.Tensor | None, spec: RouterSpec) -> torch.Tensor:
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    t, e = logits.shape
    d_logits = torch.empty(t, e, dtype=logits.dtype, device=logits.device)
    if d_weights is None:
        d_weights = torch.zeros(indices.shape, dtype=torch.float32, device=logits.device)
    if t:
        grid, consts = _launch(t, e, spec, logits.device)
        _router_bwd_kernel[grid](logits, indices, d_weights.contiguous(),
                                 None if d_scores is None else d_scores.contiguous(), d_logits, t, logits.stride(0),
                                 d_logits.stride(0), spec.routed_scaling_factor, HAS_D_SCORES=d_scores is not None,
                                 **consts)
    return d_logits


# --- autograd: a Function in eager mode, custom ops under torch.compile ----------------------------------

def _spec_args(spec: RouterSpec) -> tuple:
    return (spec.top_k, spec.score_func, spec.n_group, spec.topk_group, spec.norm_topk_prob,
            spec.routed_scaling_factor)


class _RouterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, spec):
        weights, indices, scores = _forward(logits, bias, spec)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, indices)
        ctx.spec = spec
        return weights, indices, scores

    @staticmethod
    def backward(ctx, d_weights, _, d_scores):
        logits, indices = ctx.saved_tensors
        if d_weights is None and d_scores is None:
            return None, None, None
        return _backward(logits, indices, d_weights, d_scores, ctx.spec), None, None


@torch.library.custom_op("anvil::router_fwd", mutates_args=())
def router_fwd_op(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, score_func: str, n_group: int,
                  topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(logits, bias, RouterSpec(top_k, score_func, n_group, topk_group, norm_topk_prob,
                                             routed_scaling_factor))


@router_fwd_op.register_fake
def _(logits, bias, top_k, score_func, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    t, e = logits.shape
    return (logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int64),
            logits.new_empty(t, e, dtype=torch.float32))


@torch.library.custom_op("anvil::router_bwd", mutates_args=())
def router_bwd_op(logits: torch.Tensor, indices: torch.Tensor, d_weights: torch.Tensor | None,
                  d_scores: torch.Tensor | None, top_k: int, score_func: str, n_group: int, topk_group: int,
                  norm_topk_prob: bool, routed_scaling_factor: float) -> torch.Tensor:
    return _backward(logits, indices, d_weights, d_scores,
                     RouterSpec(top_k, score_func, n_group, topk_group, norm_topk_prob, routed_scaling_factor))


@router_bwd_op.register_fake
def _(logits, indices, d_weights, d_scores, *spec):
    return torch.empty_like(logits)


def _router_setup(ctx, inputs, output):
    logits, _, *spec = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.spec_args = spec


def _router_op_backward(ctx, d_weights, _, d_scores):
    logits, indices = ctx.saved_tensors
    return (torch.ops.anvil.router_bwd(logits, indices, d_weights, d_scores, *ctx.spec_args),
            None, None, None, None, None, None, None)


router_fwd_op.register_autograd(_router_op_backward, setup_context=_router_setup)


def router_triton(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None) -> RouterOutput:
    """The gate in two Triton kernels (forward; backward to the logits from the weights and the scores)."""
    _check(logits, spec, bias)
    if logits.shape[1] > _MAX_EXPERTS:
        raise ValueError(f"router_triton: at most {_MAX_EXPERTS} experts, got {logits.shape[1]}")
    if torch.compiler.is_compiling():
        return RouterOutput(*torch.ops.anvil.router_fwd(logits, bias, *_spec_args(spec)))
    return RouterOutput(*_RouterFunction.apply(logits, bias, spec))


def route(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None) -> RouterOutput:
    """(weights fp32 [T, k], indices int64 [T, k], scores fp32 [T, E]): router_triton where it was measured
    to win (_TRITON_ROUTER_MIN_EXPERTS: a vendor's GPUs from so many experts), router_reference elsewhere."""
    if uses_triton(logits):
        return router_triton(logits, spec, bias)
    return router_reference(logits, spec, bias)


def uses_triton(logits: torch.Tensor) -> bool:
    """Whether route() takes router_triton for these logits (device, vendor and number of experts)."""
    # the vendor from torch's build, not arch.detect: this line is traced under torch.compile
    vendor = Vendor.CPU if logits.device.type != "cuda" else Vendor.AMD if torch.version.hip else Vendor.NVIDIA
    least = _TRITON_ROUTER_MIN_EXPERTS.get(vendor)
    return logits.dim() == 2 and least is not None and least <= logits.shape[1] <= _MAX_EXPERTS

"""Token permutation for mixture-of-experts layers: tokens to expert-sorted rows and back.

    x_sorted, plan = permute(x, expert_ids, num_experts)   # x [T, D], expert_ids [T, k] -> [T*k, D]
    y = grouped_mm(x_sorted, w, plan.offs)                 # kernels/grouped_gemm.py
    out = unpermute(y, plan, weights)                      # [T, D] = sum_j weights[t, j] * y[plan.row_of[t, j]]

The rows of x_sorted are grouped by expert, and within an expert ordered by (token, choice): a stable
sort of the flattened expert ids. `plan` carries the row map (row_of [T, k] int32: where token t's j-th
copy went), rows per expert (counts) and their cumulative ends (offs, int32, grouped_mm's offsets).
Everything stays on the device: the plan is a counting sort in three small launches (per-block
histograms, one program scanning them, each block placing its pairs), nothing waits for the GPU.
Expert ids outside [0, num_experts) are not supported (they are clamped, which keeps memory safe).

Gradients: permute's to x (dx[t] = sum_j dx_sorted[row_of[t, j]]), unpermute's to y (dy[row_of[t, j]]
= weights[t, j] * dout[t]) and to the routing weights (dweights[t, j] = <dout[t], y[row_of[t, j]]>).
Every product is one program per token, in fp32 and rounded once: gathers sum without atomics, so the
results do not depend on scheduling. A program moves its token's k rows as one [K_PAD, BLOCK_D] tile a
chunk of D at a time: the k loads (or stores) of a chunk go out together, each thread holding one 16-byte
vector of every row, so the k-sum and the k dot products of the weights' gradient stay in its registers
(the first version looped over the k rows, a cross-warp reduction and a round trip to memory each).

Bytes moved by permute + unpermute, forward and backward, in elements of x's dtype (the floor the
benchmark holds them to), T tokens, k choices, D features:
    permute fwd  read T*D,     write T*k*D
    unpermute    read T*k*D,   write T*D
    unpermute'   read T*D + T*k*D (y, for the weights' gradient), write T*k*D
    permute'     read T*k*D,   write T*D
    total        (4 + 5k) * T * D * itemsize   (+ ids, the row map and weights: O(T*k) words)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import arch

# Pairs (token, choice) a plan program handles, and one-hot elements a step of its rank computation.
_PLAN_BLOCK_MIN = 256
_PLAN_BLOCKS_MAX = 1024
_ONE_HOT_ELEMS = 8192
_SCAN_ROWS = 32
# The row kernels' tile [K_PAD, BLOCK_D]: each thread holds _VECTOR consecutive elements of all K_PAD rows
# (one 16-byte access a row in bf16, the k-sum in registers), _ROW_WARPS warps side by side along D:
# BLOCK_D = 8 x 32 x 4 = 1024 on NVIDIA; longer rows loop over chunks.
_VECTOR = 8
_ROW_WARPS = 4


class PermutePlan(NamedTuple):
    row_of: torch.Tensor   # int32 [T, k]: the row of x_sorted holding token t's j-th copy
    counts: torch.Tensor   # int32 [E]: rows per expert
    offs: torch.Tensor     # int32 [E]: cumulative end row per expert (grouped_mm's offs)


# --- the plan: a stable counting sort of the (token, choice) pairs by expert -------------------------

@triton.jit
def _expert_ids(IDS, pairs, n_pairs, E: tl.constexpr):
    valid = pairs < n_pairs
    ids = tl.load(IDS + pairs, mask=valid, other=0).to(tl.int32)
    return tl.minimum(tl.maximum(ids, 0), E - 1), valid


@triton.jit
def _count_kernel(IDS, BLOCK_COUNTS, n_pairs, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK_COUNTS[b, e]: pairs of block b that chose expert e."""
    b = tl.program_id(0)
    ids, valid = _expert_ids(IDS, b * BLOCK + tl.arange(0, BLOCK), n_pairs, E)
    tl.store(BLOCK_COUNTS + b * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD, mask=valid))


@triton.jit
def _scan_kernel(BLOCK_COUNTS, BLOCK_BEFORE, COUNTS, OFFS, n_blocks, E: tl.constexpr, E_PAD: tl.constexpr,
                 ROWS: tl.constexpr):
    """One program: BLOCK_BEFORE[b, e] = pairs of blocks before b that chose e; COUNTS and OFFS."""
    experts = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for b0 in range(0, n_blocks, ROWS):
        blocks = b0 + tl.arange(0, ROWS)
        ptrs = blocks[:, None] * E_PAD + experts[None, :]
        mask = blocks[:, None] < n_blocks
        counts = tl.load(BLOCK_COUNTS + ptrs, mask=mask, other=0)
        tl.store(BLOCK_BEFORE + ptrs, running[None, :] + tl.cumsum(counts, axis=0) - counts, mask=mask)
        running += tl.sum(counts, axis=0)
    tl.store(COUNTS + experts, running, mask=experts < E)
    tl.store(OFFS + experts, tl.cumsum(running, axis=0), mask=experts < E)


@triton.jit
def _place_kernel(IDS, BLOCK_BEFORE, COUNTS, OFFS, ROW_OF, n_pairs, E: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """ROW_OF[pair]: its expert's first row + pairs of that expert before it (earlier blocks, then earlier
    in this block), CHUNK pairs a step through a [CHUNK, E_PAD] one-hot."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    in_range = experts < E
    expert_start = tl.load(OFFS + experts, mask=in_range, other=0) - tl.load(COUNTS + experts, mask=in_range, other=0)
    next_row = expert_start + tl.load(BLOCK_BEFORE + b * E_PAD + experts)
    for c in range(0, BLOCK, CHUNK):
        pairs = b * BLOCK + c + tl.arange(0, CHUNK)
        ids, valid = _expert_ids(IDS, pairs, n_pairs, E)
        one_hot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
        rank = tl.cumsum(one_hot, axis=0) - 1          # earlier pairs of the same expert in this chunk
        row = tl.sum(one_hot * (next_row[None, :] + rank), axis=1)
        tl.store(ROW_OF + pairs, row, mask=valid)
        next_row += tl.sum(one_hot, axis=0)


def _plan(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_of [T, k], counts [E], offs [E]), int32, by a stable counting sort on the device."""
    ids = expert_ids.contiguous()
    device = ids.device
    n_pairs = ids.numel()
    e_pad = arch.next_pow2(num_experts)
    block = max(_PLAN_BLOCK_MIN, arch.next_pow2(triton.cdiv(n_pairs, _PLAN_BLOCKS_MAX)))
    n_blocks = max(1, triton.cdiv(n_pairs, block))
    row_of = torch.empty(ids.shape, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_counts = torch.empty(n_blocks, e_pad, dtype=torch.int32, device=device)
    block_before = torch.empty_like(block_counts)
    _count_kernel[(n_blocks,)](ids, block_counts, n_pairs, E=num_experts, E_PAD=e_pad, BLOCK=block, num_warps=4)
    _scan_kernel[(1,)](block_counts, block_before, counts, offs, n_blocks, E=num_experts, E_PAD=e_pad,
                       ROWS=_SCAN_ROWS, num_warps=4)
    chunk = min(block, max(16, _ONE_HOT_ELEMS // e_pad))
    _place_kernel[(n_blocks,)](ids, block_before, counts, offs, row_of, n_pairs, E=num_experts, E_PAD=e_pad,
                               BLOCK=block, CHUNK=chunk, num_warps=4)
    return row_of, counts, offs


# --- the rows: one program per token, its k rows as one [K_PAD, BLOCK_D] tile, a chunk of D at a time ----

@triton.jit
def _scatter_kernel(SRC, ROW_OF, WEIGHTS, Y, OUT, DWEIGHTS, D, stride_src, stride_y, stride_out,
                    TOPK: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr,
                    WEIGHT_GRAD: tl.constexpr):
    """OUT[row_of[t, j]] = SRC[t] (WEIGHTED: * WEIGHTS[t, j]); with WEIGHT_GRAD also
    DWEIGHTS[t, j] = <SRC[t], Y[row_of[t, j]]>. permute's forward, unpermute's backward. The k rows are
    one tile: their stores (and Y's loads) go out together, one reduction for the k dot products."""
    t = tl.program_id(0).to(tl.int64)
    choices = tl.arange(0, K_PAD)
    chosen = choices < TOPK
    rows = tl.load(ROW_OF + t * TOPK + choices, mask=chosen, other=0).to(tl.int64)
    if WEIGHTED:
        weights = tl.load(WEIGHTS + t * TOPK + choices, mask=chosen, other=0.0).to(tl.float32)
    dweights = tl.zeros([K_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        in_row = cols < D
        tile = chosen[:, None] & in_row[None, :]
        src = tl.load(SRC + t * stride_src + cols, mask=in_row, other=0.0)
        if WEIGHTED:
            value = (src.to(tl.float32)[None, :] * weights[:, None]).to(OUT.dtype.element_ty)
        else:
            value = tl.broadcast_to(src[None, :], (K_PAD, BLOCK_D)).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :], value, mask=tile)
        if WEIGHT_GRAD:
            y = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            dweights += tl.sum(y * src.to(tl.float32)[None, :], axis=1)
    if WEIGHT_GRAD:
        tl.store(DWEIGHTS + t * TOPK + choices, dweights.to(DWEIGHTS.dtype.element_ty), mask=chosen)


@triton.jit
def _gather_kernel(SRC, ROW_OF, WEIGHTS, OUT, D, stride_src, stride_out, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                   BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr):
    """OUT[t] = sum_j SRC[row_of[t, j]] (WEIGHTED: * WEIGHTS[t, j]), in fp32. unpermute's forward, permute's
    backward. The k rows load as one tile, summed in registers."""
    t = tl.program_id(0).to(tl.int64)
    choices = tl.arange(0, K_PAD)
    chosen = choices < TOPK
    rows = tl.load(ROW_OF + t * TOPK + choices, mask=chosen, other=0).to(tl.int64)
    if WEIGHTED:
        weights = tl.load(WEIGHTS + t * TOPK + choices, mask=chosen, other=0.0).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        in_row = cols < D
        src = tl.load(SRC + rows[:, None] * stride_src + cols[None, :], mask=chosen[:, None] & in_row[None, :],
                      other=0.0).to(tl.float32)
        if WEIGHTED:
            src = src * weights[:, None]
        tl.store(OUT + t * stride_out + cols, tl.sum(src, axis=0).to(OUT.dtype.element_ty), mask=in_row)


def _row_launch(d: int, topk: int, device: torch.device) -> dict:
    """K_PAD, BLOCK_D and num_warps of the [K_PAD, BLOCK_D] tile: _VECTOR elements a thread along D, up to
    _ROW_WARPS warps (fewer for short rows)."""
    a = arch.detect(device)
    lanes = _VECTOR * a.params.warp_size
    warps = arch.clamp_warps(a, max(1, min(_ROW_WARPS, arch.next_pow2(d) // lanes)))
    return {"K_PAD": arch.next_pow2(topk), "BLOCK_D": min(arch.next_pow2(d), lanes * warps), "num_warps": warps}


def _scatter(src: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor | None = None,
             y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [T*k, D] with out[row_of[t, j]] = src[t] (* weights[t, j]), and with `y` the weights' gradient
    <src[t], y[row_of[t, j]]>)."""
    src = src.contiguous()
    t, topk = row_of.shape
    d = src.shape[1]
    out = torch.empty(t * topk, d, dtype=src.dtype, device=src.device)
    dweights = None if y is None else torch.empty(t, topk, dtype=weights.dtype, device=src.device)
    if t and d:
        y = None if y is None else y.contiguous()
        _scatter_kernel[(t,)](src, row_of, weights, y, out, dweights, d, src.stride(0),
                              0 if y is None else y.stride(0), out.stride(0), TOPK=topk,
                              WEIGHTED=weights is not None, WEIGHT_GRAD=y is not None,
                              **_row_launch(d, topk, src.device))
    elif dweights is not None:
        dweights.zero_()
    return out, dweights


def _gather(src: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D]: out[t] = sum_j src[row_of[t, j]] (* weights[t, j])."""
    src = src.contiguous()
    t, topk = row_of.shape
    d = src.shape[1]
    out = torch.empty(t, d, dtype=src.dtype, device=src.device)
    if t and d:
        _gather_kernel[(t,)](src, row_of, weights, out, d, src.stride(0), out.stride(0), TOPK=topk,
                             WEIGHTED=weights is not None, **_row_launch(d, topk, src.device))
    return out


# --- autograd: a Function in eager mode (a few microseconds of Python), custom ops under torch.compile ---

def _unpermute_backward(dout: torch.Tensor, y: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor | None,
                        weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _scatter(dout, row_of, weights, y if weight_grad else None)


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expert_ids, num_experts):
        row_of, counts, offs = _plan(expert_ids, num_experts)
        ctx.mark_non_differentiable(row_of, counts, offs)
        ctx.save_for_backward(row_of)
        return _scatter(x, row_of)[0], row_of, counts, offs

    @staticmethod
    def backward(ctx, dx_sorted, *_):
        (row_of,) = ctx.saved_tensors
        return _gather(dx_sorted, row_of), None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_of, weights):
        ctx.save_for_backward(y, row_of, weights)
        return _gather(y, row_of, weights)

    @staticmethod
    def backward(ctx, dout):
        y, row_of, weights = ctx.saved_tensors
        dy, dweights = _unpermute_backward(dout, y, row_of, weights, ctx.needs_input_grad[2])
        return dy, None, dweights


@torch.library.custom_op("anvil::moe_permute", mutates_args=())
def moe_permute_op(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row_of, counts, offs = _plan(expert_ids, num_experts)
    return _scatter(x, row_of)[0], row_of, counts, offs


@moe_permute_op.register_fake
def _(x, expert_ids, num_experts):
    return (x.new_empty(expert_ids.numel(), x.shape[1]), expert_ids.new_empty(expert_ids.shape, dtype=torch.int32),
            x.new_empty(num_experts, dtype=torch.int32), x.new_empty(num_experts, dtype=torch.int32))


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _permute_op_backward(ctx, dx_sorted, *_):
    (row_of,) = ctx.saved_tensors
    return torch.ops.anvil.moe_unpermute(dx_sorted, row_of, None), None, None


moe_permute_op.register_autograd(_permute_op_backward, setup_context=_permute_setup)


@torch.library.custom_op("anvil::moe_unpermute", mutates_args=())
def moe_unpermute_op(y: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return _gather(y, row_of, weights)


@moe_unpermute_op.register_fake
def _(y, row_of, weights):
    return y.new_empty(row_of.shape[0], y.shape[1])


@torch.library.custom_op("anvil::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward_op(dout: torch.Tensor, y: torch.Tensor, row_of: torch.Tensor,
                              weights: torch.Tensor | None, weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dy, dweights = _unpermute_backward(dout, y, row_of, weights, weight_grad)
    return dy, dweights if dweights is not None else dout.new_empty(0)


@moe_unpermute_backward_op.register_fake
def _(dout, y, row_of, weights, weight_grad):
    dweights = weights.new_empty(row_of.shape) if weight_grad else dout.new_empty(0)
    return dout.new_empty(row_of.numel(), dout.shape[1]), dweights


def _unpermute_setup(ctx, inputs, output):
    y, row_of, weights = inputs
    ctx.save_for_backward(y, row_of, weights)


def _unpermute_op_backward(ctx, dout):
    y, row_of, weights = ctx.saved_tensors
    weight_grad = weights is not None and ctx.needs_input_grad[2]
    dy, dweights = torch.ops.anvil.moe_unpermute_backward(dout, y, row_of, weights, weight_grad)
    return dy, None, dweights if weight_grad else None


moe_unpermute_op.register_autograd(_unpermute_op_backward, setup_context=_unpermute_setup)


# --- the API ---------------------------------------------------------------------------------------

def _check_permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> None:
    if x.dim() != 2 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"permute: x must be [T, D] and expert_ids [T, k], got {tuple(x.shape)} and "
                         f"{tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"permute: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"permute: num_experts must be at least 1, got {num_experts}")


def _check_unpermute(y: torch.Tensor, plan: PermutePlan, weights: torch.Tensor | None) -> None:
    t, topk = plan.row_of.shape
    if y.dim() != 2 or y.shape[0] != t * topk:
        raise ValueError(f"unpermute: y must be [T*k={t * topk}, D], got {tuple(y.shape)}")
    if weights is not None and tuple(weights.shape) != (t, topk):
        raise ValueError(f"unpermute: weights must be [T, k]=[{t}, {topk}], got {tuple(weights.shape)}")


def permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, PermutePlan]:
    """(x_sorted [T*k, D], plan): token t's row copied once per chosen expert, the rows grouped by expert
    (within one, by token then choice). Differentiable in x."""
    _check_permute(x, expert_ids, num_experts)
    if torch.compiler.is_compiling():
        x_sorted, *plan = torch.ops.anvil.moe_permute(x, expert_ids, num_experts)
    else:
        x_sorted, *plan = _PermuteFunction.apply(x, expert_ids, num_experts)
    return x_sorted, PermutePlan(*plan)


def unpermute(y: torch.Tensor, plan: PermutePlan, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D]: out[t] = sum_j weights[t, j] * y[plan.row_of[t, j]] (plain sum without weights), in fp32,
    rounded once to y's dtype. Differentiable in y and weights."""
    _check_unpermute(y, plan, weights)
    if torch.compiler.is_compiling():
        return torch.ops.anvil.moe_unpermute(y, plan.row_of, weights)
    return _UnpermuteFunction.apply(y, plan.row_of, weights)


# --- the plain PyTorch version: the tests' reference and the benchmark's torch.compile peer -------------

def permute_reference(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, PermutePlan]:
    """permute with a stable argsort, index_select and a scatter; the same rows and plan."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                     # sorted row -> pair
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int32))   # bincount would wait for its max
    plan = PermutePlan(row_of.view(expert_ids.shape).int(), counts, counts.cumsum(0).int())
    return x.index_select(0, order // expert_ids.shape[1]), plan


def unpermute_reference(y: torch.Tensor, plan: PermutePlan, weights: torch.Tensor | None = None) -> torch.Tensor:
    """unpermute as a scatter-add of the weighted rows onto their tokens, in fp32."""
    t, topk = plan.row_of.shape
    token_of = torch.empty(t * topk, dtype=torch.long, device=y.device).scatter_(
        0, plan.row_of.reshape(-1).long(), torch.arange(t, device=y.device).repeat_interleave(topk))
    rows = y.float()
    if weights is not None:
        scale = torch.empty(t * topk, dtype=torch.float32, device=y.device).scatter_(
            0, plan.row_of.reshape(-1).long(), weights.reshape(-1).float())
        rows = rows * scale[:, None]
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device).index_add_(0, token_of, rows)
    return out.to(y.dtype)

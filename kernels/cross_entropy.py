"""Cross-entropy over a large vocabulary, loss and gradient in one kernel.

Each row's vocabulary is walked twice by one program: an online softmax (a running
max and sum per lane, or per group of 8 logits on the persistent path, reduced once
at the end, so no cross-warp reduction per block) gives the log-sum-exp, then a
second walk writes the gradient
softmax - onehot (plus the label-smoothing and z-loss terms), already scaled
by 1/normalizer. The second walk runs backwards so the blocks read last in
the first walk, the ones most likely still in L2, are re-read first. Math is
fp32 in registers; no fp32 copy of the logits is ever made.

Modes (the launch path is chosen in `ce_mode`; measurements at `_CE_MODE` and `PersistentConfig`):
- "persistent" (default on sm_90 for rows of 32000 columns or more): ce_row_persistent_kernel,
  the same per-row code (_ce_one_row) in 2-4 programs per SM that loop over rows, so the rows in
  flight about fit in L2 and the second walk can re-read L2: 4.2 GB moved instead of 6.3 at
  8192 x 128256 if every re-read hits. With so few programs an SM the first walk keeps one
  running max per 8 logits (1.125 exps an element, not 2), eviction hints keep the first walk's
  data and drop the second's, and the gradient is stored with the streaming hint.
- "row" (default elsewhere): ce_row_kernel, one program per row, the two walks above. All rows
  are launched at once, so hundreds are in flight, more than L2 holds: the second walk reads HBM.
- "split" / "two_pass": ce_split_kernel, the one-read alternative (a row in chunks held in
  registers, the programs of a row meeting through global memory); correct and tested but
  slower today.

Backward is then only a scale by the incoming gradient, and a kernel that
returns at once when that gradient is 1.0 (the usual `loss.backward()`), read
from device memory so there is no host sync.

Where the gradient goes:
- default (`inplace_grad=False`): a new buffer the size of the logits, made
  in forward; the logits are untouched. Always safe.
- `inplace_grad=True`: the gradient overwrites the logits' storage (Liger's
  trick, no extra memory). The caller gives the logits up: it must not read
  them after the call. The version counter is bumped, so any autograd node
  that saved the logits fails loudly in backward instead of using gradients
  as logits. Under torch.compile the safe path is used (the compiler owns the
  buffers and would clone a mutated input anyway).

Loss semantics are F.cross_entropy's: mean over the non-ignored rows (an
all-ignored batch gives nan, and zero gradients), "sum", "none" (per-row,
0 for ignored rows); the loss has the logits' dtype. Extras: z_loss adds
z_loss * lse**2 per non-ignored row; label_smoothing as torch defines it.
Targets must lie in [0, V) or equal ignore_index (not checked on the device).

Why one module of this size: the two-walk kernel, its one-read alternative and the autograd
function share the same row layout and scaling rules; splitting them would spread one contract
over several files.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from core.vendor import Vendor
from kernels import arch
from kernels.float8 import constants as float8_constants, inverse_of, scale_from_amax, to_float8_grid

_REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _row_loss(lse, x_target, x_sum, n_cols, smoothing, z_loss, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    """One row's loss from its logsumexp, target logit and (smoothing) logit sum."""
    if HAS_SMOOTHING:
        loss = lse - (1.0 - smoothing) * x_target - smoothing / n_cols * x_sum
    else:
        loss = lse - x_target
    if HAS_Z:
        loss += z_loss * lse * lse
    return loss


@triton.jit
def _grad_scales(NORM, lse, n_cols, smoothing, z_loss, SCALE_BY_NORM: tl.constexpr,
                 HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    """dloss/dx = p_scale * softmax - target_term * onehot - uniform_term;
    d/dx [lse + z*lse^2] = (1 + 2 z lse) * softmax."""
    scale = 1.0
    if SCALE_BY_NORM:
        scale = 1.0 / tl.load(NORM).to(tl.float32)
    p_scale = scale
    if HAS_Z:
        p_scale = scale * (1.0 + 2.0 * z_loss * lse)
    target_term = scale
    uniform_term = 0.0
    if HAS_SMOOTHING:
        target_term = scale * (1.0 - smoothing)
        uniform_term = scale * smoothing / n_cols
    return p_scale, target_term, uniform_term


@triton.jit
def _load_block(x_row, offs, mask, POLICY: tl.constexpr):
    """Logits at offs (any shape), -inf where masked: a masked lane never wins a max or adds to a sum."""
    return tl.load(x_row + offs, mask=mask, other=float("-inf"), eviction_policy=POLICY)


@triton.jit
def _finish_lse(m, s, x_sum):
    """(logsumexp, logit sum) of a row from its per-lane (or per-group) running maxes and sums."""
    m_row = tl.max(m, axis=0)
    return m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0)), tl.sum(x_sum, axis=0)


@triton.jit
def _lse_lanes(x_row, n_cols, BLOCK: tl.constexpr, ONE_EXP: tl.constexpr, POLICY: tl.constexpr,
               HAS_SMOOTHING: tl.constexpr):
    """(logsumexp, sum of the logits) of one row: a running max and sum per lane, reduced once at the end.

    ONE_EXP: the online update takes one exp per element, exp(-|x - m|), instead of two
    (exp(m - m_new) and exp(x - m_new)): the new max is either the old one (s += e) or x
    (s = s * e + 1).
    """
    cols = tl.arange(0, BLOCK)
    # Finite start so an all -inf lane gives 0, not nan.
    m = tl.full([BLOCK], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    x_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = _load_block(x_row, start + cols, start + cols < n_cols, POLICY).to(tl.float32)
        if ONE_EXP:
            d = x - m
            e = tl.exp(-tl.abs(d))
            s = tl.where(d > 0, s * e + 1.0, s + e)
            m = tl.maximum(m, x)
        else:
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        if HAS_SMOOTHING:
            x_sum += tl.where(start + cols < n_cols, x, 0.0)
    return _finish_lse(m, s, x_sum)


@triton.jit
def _lse_groups(x_row, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr, POLICY: tl.constexpr,
                HAS_SMOOTHING: tl.constexpr):
    """_lse_lanes with one running max per GROUP adjacent logits (for bf16, 8 of them are a thread's
    own 16-byte load, so the group max needs no shuffles; fp32 ones span two threads, still correct,
    a little slower): the rescale exp(m - m_new) is paid once a group, 1 + 1/GROUP
    exps an element instead of 2. A persistent program has too few neighbours on its SM to hide
    its own exps behind their loads, so it needs the cheaper update; the row path does not."""
    offs = tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    m = tl.full([BLOCK // GROUP], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK // GROUP], tl.float32)
    x_sum = tl.zeros([BLOCK // GROUP], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = _load_block(x_row, start + offs, start + offs < n_cols, POLICY).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
        if HAS_SMOOTHING:
            x_sum += tl.sum(tl.where(start + offs < n_cols, x, 0.0), axis=1)
    return _finish_lse(m, s, x_sum)


@triton.jit
def _ce_one_row(
    row, X, stride_x, T, G, stride_g, LOSS, NORM, n_cols, ignore_index, z_loss, smoothing,
    COMPUTE_GRAD: tl.constexpr, SCALE_BY_NORM: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, ONE_EXP: tl.constexpr, EVICT_HINTS: tl.constexpr,
    GROUP: tl.constexpr = 1, STREAM_STORES: tl.constexpr = False,
    G8=None, stride_g8=0, G8_INV=None, FLOAT8_GRAD: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
    FP8_MIN_NORMAL: tl.constexpr = 2.0 ** -6, FP8_MANTISSA: tl.constexpr = 3, ROUND_IN_KERNEL: tl.constexpr = False,
):
    """Row `row`'s loss into LOSS[row]; with COMPUTE_GRAD its gradient into G (G may be X).

    FLOAT8_GRAD (no z-loss, no smoothing): the gradient is also stored as float8 into G8, scaled per
    row so its |max| lands on FP8_MAX, the inverse scale into G8_INV[row] (kernels.float8.cast_rowwise's
    rule and rounding, applied to the stored G values). The row's |max| is its target entry's,
    (1 - p_target) / n, since the other entries p_j / n sum to it; it is computed before pass 2 as
    pass 2 computes that entry, so no pass measures it.

    GROUP 1: pass 1 is _lse_lanes (with ONE_EXP); GROUP > 1: _lse_groups.
    EVICT_HINTS: pass 1 loads evict_last (keep the row in L2 for pass 2), pass 2 loads
    evict_first (that data is dead once read), so the rows still to be re-read win the L2.
    STREAM_STORES: the gradient is stored with the streaming hint (.cs), so it does not push the
    rows still to be re-read out of L2.
    """
    row = tl.cast(row, tl.int64)  # not row.to(): the interpreter's loop variable is a Python int
    x_row = X + row * stride_x
    g_row = G + row * stride_g
    cols = tl.arange(0, BLOCK)
    target = tl.load(T + row).to(tl.int64)
    # if/else rather than an early return: the persistent kernel calls this inside its row loop.
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, n_cols, BLOCK):
                tl.store(g_row + start + cols, tl.zeros([BLOCK], G.dtype.element_ty), mask=start + cols < n_cols)
                if FLOAT8_GRAD:
                    tl.store(G8 + row * stride_g8 + start + cols, tl.zeros([BLOCK], G8.dtype.element_ty),
                             mask=start + cols < n_cols)
            if FLOAT8_GRAD:
                tl.store(G8_INV + row, inverse_of(scale_from_amax(tl.cast(0.0, tl.float32), FP8_MAX)))
    else:
        keep: tl.constexpr = "evict_last" if EVICT_HINTS else ""
        drop: tl.constexpr = "evict_first" if EVICT_HINTS else ""
        store_hint: tl.constexpr = ".cs" if STREAM_STORES else ""
        if GROUP == 1:
            lse, x_sum = _lse_lanes(x_row, n_cols, BLOCK, ONE_EXP, keep, HAS_SMOOTHING)
        else:
            lse, x_sum = _lse_groups(x_row, n_cols, BLOCK, GROUP, keep, HAS_SMOOTHING)
        x_target = tl.load(x_row + target).to(tl.float32)
        tl.store(LOSS + row, _row_loss(lse, x_target, x_sum, n_cols, smoothing, z_loss, HAS_SMOOTHING, HAS_Z))

        if COMPUTE_GRAD:
            p_scale, target_term, uniform_term = _grad_scales(NORM, lse, n_cols, smoothing, z_loss, SCALE_BY_NORM,
                                                               HAS_SMOOTHING, HAS_Z)
            f8_scale = 1.0
            if FLOAT8_GRAD:
                # the target entry as pass 2 computes and stores it: the row's largest in size
                g_target = (tl.exp(x_target - lse) * p_scale - target_term).to(G.dtype.element_ty).to(tl.float32)
                f8_scale = scale_from_amax(tl.abs(g_target), FP8_MAX)
                tl.store(G8_INV + row, inverse_of(f8_scale))
            n_blocks = tl.cdiv(n_cols, BLOCK)
            # Pass 2, last block first: those are the freshest in L2.
            for i in range(0, n_blocks):
                offs = (n_blocks - 1 - i) * BLOCK + cols
                x = _load_block(x_row, offs, offs < n_cols, drop).to(tl.float32)
                g = tl.exp(x - lse) * p_scale
                if HAS_SMOOTHING:
                    g -= uniform_term
                g = tl.where(offs == target, g - target_term, g).to(G.dtype.element_ty)
                tl.store(g_row + offs, g, mask=offs < n_cols, cache_modifier=store_hint)
                if FLOAT8_GRAD:
                    g8 = to_float8_grid(g, f8_scale, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)
                    tl.store(G8 + row * stride_g8 + offs, g8.to(G8.dtype.element_ty), mask=offs < n_cols,
                             cache_modifier=store_hint)


@triton.jit
def ce_row_kernel(
    X, stride_x, T, G, stride_g, LOSS, NORM, n_cols, ignore_index, z_loss, smoothing,
    COMPUTE_GRAD: tl.constexpr, SCALE_BY_NORM: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, ONE_EXP: tl.constexpr = True,
    EVICT_HINTS: tl.constexpr = False,
    G8=None, stride_g8=0, G8_INV=None, FLOAT8_GRAD: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
    FP8_MIN_NORMAL: tl.constexpr = 2.0 ** -6, FP8_MANTISSA: tl.constexpr = 3, ROUND_IN_KERNEL: tl.constexpr = False,
):
    """One program per row (grid = n_rows); see _ce_one_row."""
    _ce_one_row(tl.program_id(0), X, stride_x, T, G, stride_g, LOSS, NORM, n_cols, ignore_index, z_loss, smoothing,
                COMPUTE_GRAD, SCALE_BY_NORM, HAS_Z, HAS_SMOOTHING, BLOCK, ONE_EXP, EVICT_HINTS, 1, False,
                G8, stride_g8, G8_INV, FLOAT8_GRAD, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA, ROUND_IN_KERNEL)


@triton.jit
def ce_row_persistent_kernel(
    X, stride_x, T, G, stride_g, LOSS, NORM, n_rows, n_cols, ignore_index, z_loss, smoothing,
    COMPUTE_GRAD: tl.constexpr, SCALE_BY_NORM: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, ONE_EXP: tl.constexpr = False,
    EVICT_HINTS: tl.constexpr = True, GROUP: tl.constexpr = 1, STREAM_STORES: tl.constexpr = False,
    G8=None, stride_g8=0, G8_INV=None, FLOAT8_GRAD: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
    FP8_MIN_NORMAL: tl.constexpr = 2.0 ** -6, FP8_MANTISSA: tl.constexpr = 3, ROUND_IN_KERNEL: tl.constexpr = False,
):
    """A few programs an SM, each looping over rows pid, pid + grid, ...; see _ce_one_row.

    Only grid rows are being walked at any time (132 SMs x 2 programs x 256 KB a 128256-entry
    bf16 row: 66 MB, about the 50 MB L2 of an H100/H200), so pass 2 can re-read a row from L2;
    with one program per row hundreds of rows are in flight and pass 2 comes from HBM.
    """
    n_programs = tl.num_programs(0)
    for row in range(tl.program_id(0), n_rows, n_programs):
        _ce_one_row(row, X, stride_x, T, G, stride_g, LOSS, NORM, n_cols, ignore_index, z_loss, smoothing,
                    COMPUTE_GRAD, SCALE_BY_NORM, HAS_Z, HAS_SMOOTHING, BLOCK, ONE_EXP, EVICT_HINTS, GROUP,
                    STREAM_STORES, G8, stride_g8, G8_INV, FLOAT8_GRAD, FP8_MAX, FP8_MIN_NORMAL, FP8_MANTISSA,
                    ROUND_IN_KERNEL)


@triton.jit
def ce_split_kernel(
    X, stride_x, T, G, stride_g, LOSS, NORM, STATS, COUNTS, n_rows, n_cols, ignore_index, z_loss, smoothing,
    N_CHUNKS: tl.constexpr, CP2: tl.constexpr, BLOCK: tl.constexpr,
    DO_STATS: tl.constexpr, DO_GRAD: tl.constexpr, SYNC: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, SCALE_BY_NORM: tl.constexpr, HAS_Z: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
):
    """One program per (row, chunk of BLOCK columns); a row is N_CHUNKS chunks.

    Each program holds its chunk in registers as p = exp(x - chunk max), publishes
    (chunk max, sum p, sum x) to STATS [3, n_rows, N_CHUNKS], and once all chunks of its
    row are there combines them into the row's log-sum-exp and writes its chunk's gradient
    p * exp(chunk max - lse) straight from registers: one read and one write of the logits,
    one exp per element. The program owning the target column writes the row's loss.

    SYNC (one launch, DO_STATS and DO_GRAD): programs take tickets from COUNTS[0] in the
    order they become resident, so row r is the tickets r*N_CHUNKS .. r*N_CHUNKS+N_CHUNKS-1;
    each bumps COUNTS[1 + row] after publishing and spins until it reads N_CHUNKS.
    Deadlock-free when the device can hold N_CHUNKS programs at once (the launcher checks
    sm_count >= N_CHUNKS): a program publishes before it waits, every row below the newest
    ticket's row has all its tickets held by running (or finished) programs and so completes,
    so at most N_CHUNKS - 1 programs (of the newest row) can be waiting and a slot stays free
    for the next ticket. It holds whatever the launch order and with other kernels beside it.
    Not SYNC: two launches, stats (DO_STATS) then gradient (DO_GRAD, re-reading the chunk);
    programs never wait, so it runs under TRITON_INTERPRET=1 (which runs programs one by one).
    """
    if SYNC:
        t = tl.atomic_add(COUNTS, 1).to(tl.int64)  # ticket: residency order, not launch order
    else:
        t = tl.program_id(0).to(tl.int64)
    row = t // N_CHUNKS
    chunk = t % N_CHUNKS
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g_row = G + row * stride_g
    target = tl.load(T + row).to(tl.int64)
    if target == ignore_index:
        if DO_GRAD:
            if chunk == 0:
                tl.store(LOSS + row, 0.0)
            if COMPUTE_GRAD:
                tl.store(g_row + offs, tl.zeros([BLOCK], G.dtype.element_ty), mask=mask)
        return

    x = tl.load(X + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    owner = (target >= chunk * BLOCK) & (target < chunk * BLOCK + BLOCK)
    x_target = 0.0
    if DO_GRAD:
        if owner:
            x_target = tl.sum(tl.where(offs == target, x, 0.0), axis=0)
    m_c = tl.maximum(tl.max(x, axis=0), -1.0e30)  # finite, so an all -inf chunk gives p = 0, not nan
    p = tl.exp(x - m_c)
    stat = STATS + row * N_CHUNKS + chunk
    plane = n_rows * N_CHUNKS
    if DO_STATS:
        tl.store(stat, m_c)
        tl.store(stat + plane, tl.sum(p, axis=0))
        if HAS_SMOOTHING:
            tl.store(stat + 2 * plane, tl.sum(tl.where(mask, x, 0.0), axis=0))
        if SYNC:
            tl.debug_barrier()  # every thread's stores above happen before the release below
            tl.atomic_add(COUNTS + 1 + row, 1, sem="release")
    if DO_GRAD:
        if SYNC:
            n_done = tl.atomic_add(COUNTS + 1 + row, 0, sem="acquire")
            while n_done < N_CHUNKS:
                n_done = tl.atomic_add(COUNTS + 1 + row, 0, sem="acquire")
        cs = tl.arange(0, CP2)
        row_stats = STATS + row * N_CHUNKS + cs
        cmask = cs < N_CHUNKS
        ms = tl.load(row_stats, mask=cmask, other=-1.0e30, volatile=True)
        ss = tl.load(row_stats + plane, mask=cmask, other=0.0, volatile=True)
        m_row = tl.max(ms, axis=0)
        lse = m_row + tl.log(tl.sum(ss * tl.exp(ms - m_row), axis=0))
        if owner:
            x_sum = 0.0
            if HAS_SMOOTHING:
                x_sum = tl.sum(tl.load(row_stats + 2 * plane, mask=cmask, other=0.0, volatile=True), axis=0)
            tl.store(LOSS + row, _row_loss(lse, x_target, x_sum, n_cols, smoothing, z_loss, HAS_SMOOTHING, HAS_Z))
        if COMPUTE_GRAD:
            p_scale, target_term, uniform_term = _grad_scales(NORM, lse, n_cols, smoothing, z_loss, SCALE_BY_NORM,
                                                           HAS_SMOOTHING, HAS_Z)
            g = p * (tl.exp(m_c - lse) * p_scale)  # = exp(x - lse) * p_scale
            if HAS_SMOOTHING:
                g -= uniform_term
            g = tl.where(offs == target, g - target_term, g)
            tl.store(g_row + offs, g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(X, n, n_blocks, S, BLOCK: tl.constexpr):
    """X *= S[0] over a flat contiguous buffer, each program striding over blocks; nothing to do (no
    traffic) when S[0] == 1. A few programs an SM, not one a block: at 8192 x 128256 one a block was
    256K programs that each read S and returned, 0.155 ms of launch for no work (H200)."""
    s = tl.load(S).to(tl.float32)
    if s != 1.0:
        # n_blocks comes from the host: tl.cdiv(n, BLOCK) would overflow an int32 n just under 2**31.
        for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)  # tl.cast: b is a Python int when interpreted
            mask = offs < n
            x = tl.load(X + offs, mask=mask).to(tl.float32)
            tl.store(X + offs, (x * s).to(X.dtype.element_ty), mask=mask)


def ce_config(device: torch.device, n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for ce_row_kernel: 16 elements per thread, capped per arch."""
    a = arch.detect(device)
    if a.vendor is Vendor.CPU:
        return min(1024, arch.next_pow2(n_cols)), 4
    block = min(_CE_BLOCK, arch.next_pow2(n_cols))
    warps = _CE_WARPS or max(1, block // (16 * a.params.warp_size))  # ~16 elements per thread
    return block, arch.clamp_warps(a, warps)


# Chosen on an H200 with `python -m benchmarks.cases_loss --sweep` (8192 x 128256 bf16, fwd+bwd):
# B2048/w4 1.74 ms, B4096/w8 1.77, B8192/w16 1.79, B16384/w32 1.88, B32768/w32 2.99 (Liger's shape).
# Among one-program-a-row launches, small programs, many resident per SM, win (the persistent path
# beat them later by keeping rows in L2 with the cheaper grouped update; see PersistentConfig).
# _CE_WARPS None = derived (16 elements per thread; 2 warps on 64-lane HIP wavefronts).
_CE_BLOCK = 2048
_CE_WARPS: int | None = None
# ONE_EXP measured slower on an H200 (2026-11-22, B2048/w4: 1.854 ms vs 1.742 with two exps): the
# kernel is not bound by the exp unit; the extra abs/select costs more than the exp it saves.
_ROW_ONE_EXP = False

# How a launch is done: "split" (ce_split_kernel, one launch, programs of a row wait for each
# other: one read + one write of the logits), "two_pass" (ce_split_kernel as two launches:
# the second re-reads the logits), "row" (ce_row_kernel: one program per row, two walks) or
# "persistent" (ce_row_persistent_kernel, below). None = ce_mode's choice per device.
# Measured on an H200 (8192 x 128256 bf16, fwd+bwd, 2026-11-22):
# row B2048/w4 1.74 ms; split 2.45 (B4096/w4) to 3.94 ms (B16384/w8); two_pass B8192/w16 2.53.
# The split kernel moves a third fewer bytes but each program is one load -> reduce -> publish ->
# wait -> write chain with no overlap (and 94-202 registers a thread: 2-5 programs an SM), so
# too few bytes are in flight; see ce_split_kernel. It stays, tested, as the one-read design.
# Under the interpreter programs run one by one, so a "split" program waiting for a later one
# would hang: tests run the multi-chunk combine as "two_pass" and "split" with one chunk a row.
_CE_MODE: str | None = None
_CE_MODES = ("split", "two_pass", "row", "persistent")
# Columns per chunk for the split kernel (rounded so chunks are even: 128256 -> 16 x 8192)
# and warps per program (None: ~16 elements per thread).
_SPLIT_BLOCK = 8192
_SPLIT_WARPS: int | None = None


@dataclass(frozen=True)
class PersistentConfig:
    """The persistent path: programs_per_sm x SMs programs, each looping over rows, so only that many
    rows are being walked at once (2 x 132 x 256 KB of 128256-entry bf16 rows: 66 MB, about an
    H100/H200's 50 MB L2) and the second walk mostly re-reads L2, not HBM.

    Measured on an H200 (2026-11-23, 8192 x 128256 bf16, fwd+bwd): the kernel alone 1.42 ms against
    the row path's 1.56, its first walk alone 0.57 ms (3.7 TB/s); through cross_entropy(...).backward()
    1.44 against 1.59 (`python -m benchmarks.cases_loss --sweep persistent`). What each knob costs when
    changed alone from this default: group 1 (per-lane maxes, 2 exps an element) +0.14 ms;
    stream_stores off +0.05; 16 warps +0.25; 1 program an SM +0.28 (its rows fit L2, but too few
    threads hide the exps); 3 programs of 16 warps +0.07; block 16384 +0.03; evict off -0.01 (noise).
    Tried and dropped: Triton's pipeliner (tl.range num_stages 2-4) on both walks +0.3 to +0.6; a
    manual one-block prefetch +0.03; teams of 2 programs sharing a row through global memory (half
    the rows in flight, all in L2) +0.19: the synchronization costs more than the L2 hits save.
    The design's floor, its loads and stores alone (`python -m benchmarks.ce_floor`): 1.345 ms.
    """

    programs_per_sm: int = 2
    block: int = 8192  # columns a walk step
    warps: int = 32  # 2 x 32 warps = 2048 threads, an SM's limit
    evict: bool = True  # walk 1 loads evict_last, walk 2 evict_first
    group: int = 8  # one running max per 8 logits (_lse_groups)
    stream_stores: bool = True  # the gradient stored with .cs

    def __post_init__(self):
        for name in ("block", "group", "warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"PersistentConfig: {name} must be a power of two, got {value}")
        if self.programs_per_sm < 1:
            raise ValueError(f"PersistentConfig: programs_per_sm must be >= 1, got {self.programs_per_sm}")


# The defaults by row length (H200, 2026-11-23, kernel alone, row path / this config): rows of 100K
# columns or more take PersistentConfig() (8192 x 128256: 1.557 / 1.412 ms, where the medium config
# takes 1.461); shorter ones 4 programs of 16 warps an SM with 4096-column steps, more rows in flight
# for the same L2 (8192 x 32000: 0.380 / 0.344; 16384 x 50304: 1.182 / 1.082; 8192 x 65536: 0.779 /
# 0.710, where the long config takes 0.721). _PERSIST, when set (tests, sweeps), is used for every row.
_PERSIST_LONG = PersistentConfig()
_PERSIST_MEDIUM = PersistentConfig(programs_per_sm=4, warps=16, block=4096)
_LONG_ROW_COLS = 100_000
_PERSIST: PersistentConfig | None = None


def persistent_defaults(n_cols: int) -> PersistentConfig:
    """The persistent path's config for rows of n_cols: _PERSIST if set, else by row length."""
    return _PERSIST or (_PERSIST_LONG if n_cols >= _LONG_ROW_COLS else _PERSIST_MEDIUM)


# "SMs" under the interpreter: fewer programs than the tests' rows, so the row loop iterates.
_INTERPRET_SMS = 2


def ce_persistent_config(device: torch.device, n_rows: int, n_cols: int) -> tuple[int, dict]:
    """(programs, the kernel's BLOCK/num_warps/EVICT_HINTS/GROUP/STREAM_STORES) for ce_row_persistent_kernel."""
    a = arch.detect(device)  # sm_count is the device's multi_processor_count
    cfg = persistent_defaults(n_cols)
    per_sm = cfg.programs_per_sm * (_INTERPRET_SMS if a.vendor is Vendor.CPU else 1)  # the CPU arch counts one SM
    programs = arch.persistent_grid(a, n_rows, per_sm)
    block = min(cfg.block, arch.next_pow2(n_cols))
    warps = cfg.warps
    if a.vendor is Vendor.CPU:
        block, warps = min(block, 1024), 4  # small blocks keep numpy fast
    return programs, dict(BLOCK=block, num_warps=arch.clamp_warps(a, warps), EVICT_HINTS=cfg.evict,
                          GROUP=min(cfg.group, block), STREAM_STORES=cfg.stream_stores)


# Where ce_mode picks the persistent path: the architectures it was measured faster on, for rows
# long enough. H200 kernel times (2026-11-23), row / persistent (its defaults above): 8192 x 128256
# 1.558 / 1.420 ms, 4096 x 152064 0.955 / 0.876, 512 x 128256 0.139 / 0.100, 8192 x 32000 0.380 /
# 0.344; but 4096 x 4096 0.033 / 0.039, so rows under 32000 columns keep the row path. A100 (40 MB
# L2, 108 SMs) and the AMD GPUs (4 MB L2 per XCD) were not measured, so they keep the row path,
# which needs no L2 to hold anything.
_PERSISTENT_ARCHS = ("sm_90",)
_PERSISTENT_MIN_COLS = 32000


def ce_mode(device: torch.device, n_cols: int) -> str:
    if _CE_MODE is not None:
        if _CE_MODE not in _CE_MODES:
            raise ValueError(f"cross_entropy: mode must be one of {_CE_MODES}, got {_CE_MODE!r}")
        return _CE_MODE
    if arch.detect(device).name in _PERSISTENT_ARCHS and n_cols >= _PERSISTENT_MIN_COLS:
        return "persistent"
    return "row"


def _check_split_fits(device: torch.device, n_chunks: int) -> None:
    """The split kernel's deadlock-freedom needs N_CHUNKS programs co-resident (one an SM suffices)."""
    a = arch.detect(device)
    if a.vendor is not Vendor.CPU and n_chunks > a.sm_count:
        raise ValueError(f"cross_entropy: split path needs <= {a.sm_count} chunks a row, got {n_chunks}; "
                         "raise _SPLIT_BLOCK or use the row path")


def split_plan(n_cols: int) -> tuple[int, int]:
    """(N_CHUNKS, BLOCK): about _SPLIT_BLOCK columns a chunk, BLOCK a power of two, no empty chunk."""
    block = arch.next_pow2(triton.cdiv(n_cols, triton.cdiv(n_cols, _SPLIT_BLOCK)))
    return triton.cdiv(n_cols, block), block


def float8_grad_fusable(device: torch.device, n_cols: int, z_loss: float, label_smoothing: float) -> bool:
    """Whether launch_ce can also write the gradient as float8 (float8_grad=): the row and persistent
    kernels do, without z-loss or label smoothing (where the target entry is the row's |max|)."""
    return z_loss == 0.0 and label_smoothing == 0.0 and ce_mode(device, n_cols) in ("row", "persistent")


def launch_ce(logits2d: torch.Tensor, target: torch.Tensor, grad: torch.Tensor | None, row_loss: torch.Tensor,
              normalizer: torch.Tensor | None, ignore_index: int, z_loss: float, label_smoothing: float,
              float8_grad: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Loss rows and (grad not None) the gradient of a [N, V] view (unit stride in V). grad may be logits2d.

    float8_grad (values [N, V] float8, unit stride in V; inverse scales [N, 1] fp32): also the gradient
    cast per row as kernels.float8.cast_rowwise would cast the stored grad (see float8_grad_fusable)."""
    n_rows, n_cols = logits2d.shape
    if n_rows == 0:
        return
    g = grad if grad is not None else logits2d
    flags = dict(COMPUTE_GRAD=grad is not None, SCALE_BY_NORM=normalizer is not None, HAS_Z=z_loss != 0.0,
                 HAS_SMOOTHING=label_smoothing != 0.0)
    norm = normalizer if normalizer is not None else row_loss
    mode = ce_mode(logits2d.device, n_cols)
    if float8_grad is not None:
        if grad is None or not float8_grad_fusable(logits2d.device, n_cols, z_loss, label_smoothing):
            raise ValueError("cross_entropy: float8_grad needs the gradient, no z-loss or label smoothing, "
                             f"and the row or persistent path (mode {mode!r})")
        g8, g8_inv = float8_grad
        flags.update(G8=g8, stride_g8=g8.stride(0), G8_INV=g8_inv, FLOAT8_GRAD=True, **float8_constants(g8.dtype))
    if mode == "row":
        b, w = ce_config(logits2d.device, n_cols)
        ce_row_kernel[(n_rows,)](
            logits2d, logits2d.stride(0), target, g, g.stride(0), row_loss, norm, n_cols, ignore_index, z_loss,
            label_smoothing, BLOCK=b, num_warps=w, ONE_EXP=_ROW_ONE_EXP, **flags)
        return
    if mode == "persistent":
        programs, consts = ce_persistent_config(logits2d.device, n_rows, n_cols)
        ce_row_persistent_kernel[(programs,)](
            logits2d, logits2d.stride(0), target, g, g.stride(0), row_loss, norm, n_rows, n_cols, ignore_index,
            z_loss, label_smoothing, ONE_EXP=_ROW_ONE_EXP, **consts, **flags)
        return
    n_chunks, b = split_plan(n_cols)
    if mode == "split":
        _check_split_fits(logits2d.device, n_chunks)
    a = arch.detect(logits2d.device)
    w = 4 if a.vendor is Vendor.CPU else arch.clamp_warps(a, _SPLIT_WARPS or max(1, b // (16 * a.params.warp_size)))
    stats = torch.empty(3, n_rows, n_chunks, device=logits2d.device, dtype=torch.float32)
    counts = torch.zeros(1 + n_rows if mode == "split" else 1, device=logits2d.device, dtype=torch.int32)
    args = (logits2d, logits2d.stride(0), target, g, g.stride(0), row_loss, norm, stats, counts, n_rows, n_cols,
            ignore_index, z_loss, label_smoothing)
    consts = dict(N_CHUNKS=n_chunks, CP2=arch.next_pow2(n_chunks), BLOCK=b, num_warps=w, **flags)
    grid = (n_rows * n_chunks,)
    if mode == "split":
        ce_split_kernel[grid](*args, DO_STATS=True, DO_GRAD=True, SYNC=True, **consts)
    else:
        ce_split_kernel[grid](*args, DO_STATS=True, DO_GRAD=False, SYNC=False, **consts)
        ce_split_kernel[grid](*args, DO_STATS=False, DO_GRAD=True, SYNC=False, **consts)


# Programs an SM for _scale_kernel: 8 x 8 warps keep the SM's 64 warps busy when it does scale.
_SCALE_PROGRAMS_PER_SM = 8


def scale_inplace(x: torch.Tensor, s: torch.Tensor) -> None:
    """x *= s for a scalar tensor s on x's device; free when s == 1."""
    assert x.is_contiguous()
    n = x.numel()
    if n == 0:
        return
    a = arch.detect(x.device)
    block, warps = arch.elementwise_config(a)
    n_blocks = triton.cdiv(n, block)
    programs = arch.persistent_grid(a, n_blocks, _SCALE_PROGRAMS_PER_SM)
    _scale_kernel[(programs,)](x, n, n_blocks, s.reshape(1).to(x.device), BLOCK=block, num_warps=warps)


# ---- custom ops: opaque to torch.compile, so it traces without graph breaks ----

@torch.library.custom_op("anvil::cross_entropy_fwd", mutates_args=())
def _ce_fwd(logits: torch.Tensor, target: torch.Tensor, normalizer: torch.Tensor, ignore_index: int,
            z_loss: float, label_smoothing: float, scale_by_norm: bool, compute_grad: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    row_loss = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
    launch_ce(logits, target, grad if compute_grad else None, row_loss, normalizer if scale_by_norm else None,
              ignore_index, z_loss, label_smoothing)
    return row_loss, grad


@_ce_fwd.register_fake
def _(logits, target, normalizer, ignore_index, z_loss, label_smoothing, scale_by_norm, compute_grad):
    row_loss = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return row_loss, (torch.empty_like(logits) if compute_grad else logits.new_empty(0))


@torch.library.custom_op("anvil::cross_entropy_fwd_inplace", mutates_args=("logits",))
def _ce_fwd_inplace(logits: torch.Tensor, target: torch.Tensor, normalizer: torch.Tensor, ignore_index: int,
                    z_loss: float, label_smoothing: float, scale_by_norm: bool) -> torch.Tensor:
    row_loss = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    launch_ce(logits, target, logits, row_loss, normalizer if scale_by_norm else None,
              ignore_index, z_loss, label_smoothing)
    return row_loss


@_ce_fwd_inplace.register_fake
def _(logits, target, normalizer, ignore_index, z_loss, label_smoothing, scale_by_norm):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("anvil::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor, s: torch.Tensor) -> None:
    """x *= s (s a 0-d tensor); no memory traffic when s == 1."""
    scale_inplace(x, s)


@_scale_.register_fake
def _(x, s):
    return None


def scale_grad(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """grad * grad_output, in place: scalar via the early-exit kernel, per-row by broadcasting."""
    if grad_output.numel() == 1:
        torch.ops.anvil.scale_(grad, grad_output.reshape(()))
        return grad
    return grad.mul_(grad_output.reshape(grad_output.numel(), 1).to(grad.dtype))


class _CrossEntropy(torch.autograd.Function):
    """Returns the reduced loss (fp32); the gradient is made in forward, backward only scales it."""

    @staticmethod
    def forward(ctx, logits2d, target, normalizer, ignore_index, z_loss, label_smoothing, reduction, inplace):
        mean = reduction == "mean"
        if inplace:
            row_loss = torch.ops.anvil.cross_entropy_fwd_inplace(
                logits2d, target, normalizer, ignore_index, z_loss, label_smoothing, mean)
            grad = logits2d
        else:
            row_loss, grad = torch.ops.anvil.cross_entropy_fwd(
                logits2d, target, normalizer, ignore_index, z_loss, label_smoothing, mean, True)
        ctx.save_for_backward(grad)
        return _reduce(row_loss, normalizer, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return scale_grad(grad, grad_loss), None, None, None, None, None, None, None


def _reduce(row_loss: torch.Tensor, normalizer: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return row_loss
    total = row_loss.sum()
    return total / normalizer if reduction == "mean" else total


def _flatten(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} need target {tuple(logits.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"cross_entropy: target must be int64 or int32, got {target.dtype}")
    logits2d = logits.reshape(-1, logits.shape[-1])
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    return logits2d, target.reshape(-1).contiguous()


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  z_loss: float = 0.0, label_smoothing: float = 0.0, inplace_grad: bool = False,
                  num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """F.cross_entropy(logits [..., V], target [...]) with fp32 math and the gradient made in forward.

    num_items: with reduction="mean", divide by this count instead of the number of non-ignored
    targets (transformers' num_items_in_batch for gradient accumulation).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    logits2d, target1d = _flatten(logits, target)
    if num_items is None:
        normalizer = (target1d != ignore_index).sum().to(torch.float32)
    else:
        normalizer = torch.as_tensor(num_items, device=logits.device).to(torch.float32)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    args = (target1d, normalizer, ignore_index, float(z_loss), float(label_smoothing))
    if needs_grad:
        # Overwrite only the caller's own storage (not a copy made by _flatten), never under compile.
        inplace = (inplace_grad and not torch.compiler.is_compiling()
                   and logits2d.data_ptr() == logits.data_ptr() and logits2d.is_contiguous())
        loss = _CrossEntropy.apply(logits2d, *args, reduction, inplace)
    else:
        row_loss, _ = torch.ops.anvil.cross_entropy_fwd(logits2d, *args, reduction == "mean", False)
        loss = _reduce(row_loss, normalizer, reduction)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss.to(logits.dtype)

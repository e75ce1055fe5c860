"""Grouped GEMM for mixture-of-experts layers: y[rows of e] = x[rows of e] @ w[e], with both gradients.

    y = grouped_mm(x, w, offs)     # x [T, K] rows sorted by expert, w [E, K, N], offs int32 [E] -> y [T, N]

`offs` is torch._grouped_mm's convention: cumulative END row of each expert (expert e owns rows
offs[e-1]:offs[e], from row 0 for e = 0), non-decreasing, offs[E-1] <= T. Empty experts are fine, as is one
expert holding every row. Rows from offs[E-1] to T belong to no expert: their output, and their
gradient, is zero. The offsets stay on the device: nothing here waits for the GPU.

Three products, three launches of two kernels, each a persistent loop over (group, tile) work items
that finds its group from `offs` in registers (no host sync, no per-call schedule tensor):
- forward      y_e  = x_e @ w_e                _grouped_mm_kernel, tiles of rows x N
- input grad   dx_e = dy_e @ w_e^T             the same kernel on w's transposed view
- weight grad  dw_e = x_e^T @ dy_e             _grouped_mm_weight_grad_kernel, tiles of K x N, each
                                               summing over its expert's rows (an empty expert: zeros)
Tiles walk N fastest, so the programs in flight share one expert's rows and weight in L2.

Alignment: none per expert. A group may start at any row: the loads cover whole tiles of x and are
masked (pointer loads) or zero-filled past the tensor's end (TMA), and each tile's store is masked to
its own group's rows; the weight gradient masks the rows past its group's end in its last step. The
TMA path (sm_90+) needs what a tensor descriptor needs: 16-byte aligned base addresses and row
strides (K and N multiples of 8 in bf16/fp16, of 4 in fp32) and a unit stride in the last dimension
(w may be [E, K, N] or the transposed view of an [E, N, K] tensor, as transformers stores
gate_up_proj); other shapes take the pointer path, same tiles. No expert's row count needs padding.

Precision: bf16/fp16 inputs accumulate in fp32 and round once; fp32 inputs use TF32 tensor cores
when torch.get_float32_matmul_precision() allows it ("high"/"medium"), else exact fp32 products.

Launch choices: kernels/arch.py gemm_configs lists the candidate tiles per architecture. On a GPU
the first call of each signature (shapes, strides, dtype, which product) compiles and times every
candidate on the real operands and keeps the fastest (one that fails to compile is skipped): seconds
once per process. With names.GROUPED_GEMM_TUNE set to 0, deterministic algorithms or CUDA graph
capture, the table's first runs. The persistent grid is the configuration's programs per SM times the
SMs whatever the problem's size, so each kernel compiles once per configuration and dtype.

The weight gradient on sm_90 in bf16: torch._grouped_mm (CUTLASS) is a candidate too, and the first,
since it was measured faster than our best tiles there (TorchGroupedMm below has the numbers); our
forward and input gradient beat it. chosen() says which ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from core import names
from core.vendor import Vendor
from kernels import arch

_TUNE = os.environ.get(names.GROUPED_GEMM_TUNE, "1") != "0"
_TUNE_ROUNDS = 3


# --- device helpers -------------------------------------------------------------------------------

@triton.jit
def _group_bounds(OFFS, T, E, E_PAD: tl.constexpr):
    """(starts, ends) of rows for groups 0..E_PAD-1: expert g owns [offs[g-1], offs[g]); group E owns the
    rows from offs[E-1] to T that belong to no expert (their output is zeros); later groups are empty."""
    g = tl.arange(0, E_PAD)
    ends = tl.load(OFFS + g, mask=g < E, other=T).to(tl.int32)
    starts = tl.load(OFFS + g - 1, mask=(g >= 1) & (g <= E), other=0).to(tl.int32)
    starts = tl.minimum(tl.where(g > E, T, starts), T)   # clamped: bad offsets give wrong rows, never
    return starts, tl.maximum(tl.minimum(ends, T), starts)   # a write outside y


@triton.jit
def _pick(values, chosen):
    """The element of a vector where `chosen` (a one-hot mask) is set, as a scalar."""
    return tl.sum(tl.where(chosen, values, 0))


@triton.jit
def _dot(a, b, acc, PRECISE_FP32: tl.constexpr, BF16_AS_FP32: tl.constexpr):
    if BF16_AS_FP32:  # Triton's interpreter multiplies bf16 as its uint16 bit patterns; fp32 products are exact
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if PRECISE_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# --- forward and input gradient: y[rows of g] = x[rows of g] @ w[g] ---------------------------------

# T and E only bound loops and masks: not specialized on (their divisibility by 16 changes no code), so
# that each kernel compiles once per configuration and dtype, whatever the rows and experts.
@triton.jit(do_not_specialize=["T", "E"])
def _grouped_mm_kernel(
    X, W, Y, OFFS, X_DESC, W_DESC, T, K, N,
    stride_xt, stride_xk, stride_we, stride_wk, stride_wn, stride_yt, stride_yn,
    E, E_PAD: tl.constexpr, W_K_CONTIGUOUS: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, PRECISE_FP32: tl.constexpr, BF16_AS_FP32: tl.constexpr,
):
    starts, ends = _group_bounds(OFFS, T, E, E_PAD)
    m_tiles = tl.cdiv(ends - starts, BLOCK_M)
    tiles_end = tl.cumsum(m_tiles, axis=0)      # the group's m-tiles end here in the row-tile order
    n_tiles = tl.cdiv(N, BLOCK_N)
    groups = tl.arange(0, E_PAD)
    k_steps = tl.cdiv(K, BLOCK_K)   # the same for every tile, so FLATTEN can fuse the two loops
    for tile in tl.range(tl.program_id(0), tl.sum(m_tiles) * n_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        m_tile = tile // n_tiles
        n_tile = tile % n_tiles                 # N fastest: tiles in flight share x's rows and w[g]
        g = tl.sum((tiles_end <= m_tile).to(tl.int32))
        this = groups == g
        row0 = _pick(starts + (m_tile - tiles_end + m_tiles) * BLOCK_M, this)
        row_end = _pick(ends, this)
        n0 = n_tile * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_rows = tl.where(g < E, K, 0)          # group E has no weight: nothing to load
        for step in range(k_steps):
            k0 = step * BLOCK_K
            if USE_TMA:
                a = X_DESC.load([row0, k0])     # rows past the group: other experts', masked at the store
                if W_K_CONTIGUOUS:              # w[E] (group E, no expert's rows) is past the end: zeros
                    b = W_DESC.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = W_DESC.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(X + rows[:, None].to(tl.int64) * stride_xt + ks[None, :] * stride_xk,
                            mask=(rows[:, None] < T) & (ks[None, :] < K), other=0.0)
                b = tl.load(W + g.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                            mask=(ks[:, None] < w_rows) & (cols[None, :] < N), other=0.0)
            acc = _dot(a, b, acc, PRECISE_FP32, BF16_AS_FP32)
        acc = tl.where(g < E, acc, 0.0)         # rows of no expert: zeros, whatever x holds there
        tl.store(Y + rows[:, None].to(tl.int64) * stride_yt + cols[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & (cols[None, :] < N))


# --- weight gradient: dw[g] = x[rows of g]^T @ dy[rows of g] ---------------------------------------

@triton.jit
def _weight_grad_step(X, DY, X_DESC, DY_DESC, r, row_end, k0, n0, K, N, stride_xt, stride_xk, stride_dyt,
                      stride_dyn, acc, MASK_ROWS: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE_FP32: tl.constexpr,
                      BF16_AS_FP32: tl.constexpr):
    """acc + x[r:r+BLOCK_K, k0:k0+BLOCK_M]^T @ dy[r:r+BLOCK_K, n0:n0+BLOCK_N]; with MASK_ROWS the rows from
    row_end on count as zeros."""
    rows = r + tl.arange(0, BLOCK_K)
    live = rows < row_end
    if USE_TMA:
        x = X_DESC.load([r, k0])
        dy = DY_DESC.load([r, n0])
        if MASK_ROWS:  # the next expert's rows: zero both, so a non-finite value there cannot leak in
            x = tl.where(live[:, None], x, 0.0)
            dy = tl.where(live[:, None], dy, 0.0)
    else:
        ks = k0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xt + ks[None, :] * stride_xk,
                    mask=live[:, None] & (ks[None, :] < K), other=0.0)
        dy = tl.load(DY + rows[:, None].to(tl.int64) * stride_dyt + cols[None, :] * stride_dyn,
                     mask=live[:, None] & (cols[None, :] < N), other=0.0)
    return _dot(tl.trans(x), dy, acc, PRECISE_FP32, BF16_AS_FP32)


@triton.jit(do_not_specialize=["T", "E"])
def _grouped_mm_weight_grad_kernel(
    X, DY, DW, OFFS, X_DESC, DY_DESC, T, K, N,
    stride_xt, stride_xk, stride_dyt, stride_dyn, stride_we, stride_wk, stride_wn,
    E, E_PAD: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, PRECISE_FP32: tl.constexpr, BF16_AS_FP32: tl.constexpr,
):
    """BLOCK_M tiles K, BLOCK_N tiles N, BLOCK_K is the rows summed a step."""
    starts, ends = _group_bounds(OFFS, T, E, E_PAD)
    groups = tl.arange(0, E_PAD)
    k_tiles = tl.cdiv(K, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), E * k_tiles * n_tiles, NUM_PROGRAMS):
        g = tile // (k_tiles * n_tiles)
        k_tile = tile // n_tiles % k_tiles
        n_tile = tile % n_tiles                 # N fastest: tiles in flight share the expert's x and dy rows
        this = groups == g
        row0 = _pick(starts, this)
        row_end = _pick(ends, this)
        k0 = k_tile * BLOCK_M
        n0 = n_tile * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        full_steps = (row_end - row0) // BLOCK_K
        for step in range(full_steps):
            acc = _weight_grad_step(X, DY, X_DESC, DY_DESC, row0 + step * BLOCK_K, row_end, k0, n0, K, N,
                                    stride_xt, stride_xk, stride_dyt, stride_dyn, acc, False, USE_TMA,
                                    BLOCK_M, BLOCK_N, BLOCK_K, PRECISE_FP32, BF16_AS_FP32)
        tail = row0 + full_steps * BLOCK_K     # fewer than BLOCK_K rows left: one masked step
        if tail < row_end:
            acc = _weight_grad_step(X, DY, X_DESC, DY_DESC, tail, row_end, k0, n0, K, N, stride_xt, stride_xk,
                                    stride_dyt, stride_dyn, acc, True, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K,
                                    PRECISE_FP32, BF16_AS_FP32)
        ks = k0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        tl.store(DW + g.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                 acc.to(DW.dtype.element_ty), mask=(ks[:, None] < K) & (cols[None, :] < N))


# --- launchers ------------------------------------------------------------------------------------

def _dot_flags(dtype: torch.dtype, a: arch.Arch) -> dict:
    return {"PRECISE_FP32": dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest",
            "BF16_AS_FP32": dtype == torch.bfloat16 and a.vendor is Vendor.CPU}


def _tma_ready(t: torch.Tensor, inner: int) -> bool:
    """A tensor descriptor can cover t with dimension `inner` innermost: a 16-byte aligned base, a unit
    stride there and 16-byte multiples elsewhere."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and 0 not in t.shape and t.stride(inner) == 1
            and all(s * size % 16 == 0 for d, s in enumerate(t.stride()) if d != inner))


def _k_contiguous(w: torch.Tensor) -> bool:
    """w [E, K, N] is a transposed view of an [E, N, K] tensor (transformers' layout)."""
    return w.stride(2) != 1 and w.stride(1) == 1


def _weight_descriptor(w: torch.Tensor, block_k: int, block_n: int) -> TensorDescriptor:
    """w [E, K, N] as stored: [E, K, N] in blocks of [1, block_k, block_n], or [E, N, K] in blocks of
    [1, block_n, block_k]."""
    e, k, n = w.shape
    if _k_contiguous(w):
        return TensorDescriptor(w, [e, n, k], [w.stride(0), w.stride(2), 1], [1, block_n, block_k])
    return TensorDescriptor(w, [e, k, n], [w.stride(0), w.stride(1), 1], [1, block_k, block_n])


def _programs(a: arch.Arch, c: arch.GemmConfig) -> int:
    """Persistent programs: c.programs_per_sm an SM whatever the problem's size (the extra ones of a small
    problem find no tile and end), so that NUM_PROGRAMS, a constexpr, compiles once per configuration."""
    return a.sm_count * c.programs_per_sm


def _e_pad(e: int) -> int:
    """The group vectors' length, a constexpr: at least 8, so that small expert counts share one compile."""
    return max(8, arch.next_pow2(e + 1))


def _forward_launcher(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, y: torch.Tensor, a: arch.Arch):
    """launch(config) -> y: grouped x @ w with that config's tiles."""
    t, k = x.shape
    e, _, n = w.shape
    w_k_contiguous = _k_contiguous(w)
    tma_ok = _tma_ready(x, 1) and _tma_ready(w, 1 if w_k_contiguous else 2)

    def launch(c: arch.GemmConfig) -> torch.Tensor:
        use_tma = c.tma and tma_ok
        x_desc = w_desc = None
        if use_tma:
            x_desc = TensorDescriptor(x, [t, k], [x.stride(0), 1], [c.block_m, c.block_k])
            w_desc = _weight_descriptor(w, c.block_k, c.block_n)
        programs = _programs(a, c)
        _grouped_mm_kernel[(programs,)](
            x, w, y, offs, x_desc, w_desc, t, k, n, x.stride(0), x.stride(1), *w.stride(), *y.stride(),
            E=e, E_PAD=_e_pad(e), W_K_CONTIGUOUS=w_k_contiguous, USE_TMA=use_tma,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, NUM_PROGRAMS=programs, FLATTEN=c.flatten,
            **_dot_flags(x.dtype, a), **c.launch_options())
        return y
    return launch


@dataclasses.dataclass(frozen=True)
class TorchGroupedMm:
    """The weight gradient through torch._grouped_mm (CUTLASS) in place of our kernel: a candidate the tuner
    times beside our tiles, first (the untimed default) where it was measured faster. On an H100 (torch
    2.11, Triton 3.6, benchmarks/cases_moe.py --sweep) our best tiles took 0.986 against its 0.837 ms
    (Qwen3-30B-A3B gate_up), 0.517 / 0.454 (its down), 1.162 / 1.103 (DeepSeek-V2-Lite gate_up) and
    0.594 / 0.576 (its down); our forward and input gradient beat it at all four."""

    def __str__(self) -> str:
        return "torch._grouped_mm"


TORCH_GROUPED_MM = TorchGroupedMm()
# Architectures where torch._grouped_mm computes the weight gradient (bf16) faster than our kernel.
_TORCH_WEIGHT_GRAD_ARCHS = ("sm_90",)


def _torch_weight_grad_ok(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, a: arch.Arch) -> bool:
    """torch._grouped_mm takes these operands (bf16, int32 offsets, 16-byte aligned rows) on an architecture
    where it was measured faster."""
    return (a.name in _TORCH_WEIGHT_GRAD_ARCHS and a.vendor is Vendor.NVIDIA and hasattr(torch, "_grouped_mm")
            and x.dtype == torch.bfloat16 and offs.dtype == torch.int32 and x.is_contiguous()
            and dy.is_contiguous() and x.shape[1] % 8 == 0 and dy.shape[1] % 8 == 0
            and x.data_ptr() % 16 == 0 and dy.data_ptr() % 16 == 0)


def _weight_grad_launcher(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, w_shape: list[int],
                          w_stride: list[int], a: arch.Arch):
    """launch(config) -> dw laid out as w: grouped x^T @ dy with that config's tiles (block_k: rows a step),
    or through torch._grouped_mm (TORCH_GROUPED_MM)."""
    t, k = x.shape
    e, _, n = w_shape
    tma_ok = _tma_ready(x, 1) and _tma_ready(dy, 1)
    ours: list[torch.Tensor] = []      # our kernel's output, made on its first launch

    def launch(c) -> torch.Tensor:
        if c is TORCH_GROUPED_MM:      # the product as w is laid out: no copy
            if w_stride[2] != 1 and w_stride[1] == 1:
                return torch._grouped_mm(dy.t(), x, offs=offs).transpose(1, 2)
            return torch._grouped_mm(x.t(), dy, offs=offs)
        if not ours:
            ours.append(_weight_like(w_shape, w_stride, x.dtype, x.device))
        dw = ours[0]
        use_tma = c.tma and tma_ok
        x_desc = dy_desc = None
        if use_tma:
            x_desc = TensorDescriptor(x, [t, k], [x.stride(0), 1], [c.block_k, c.block_m])
            dy_desc = TensorDescriptor(dy, [t, n], [dy.stride(0), 1], [c.block_k, c.block_n])
        programs = _programs(a, c)
        _grouped_mm_weight_grad_kernel[(programs,)](
            x, dy, dw, offs, x_desc, dy_desc, t, k, n, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
            *dw.stride(), E=e, E_PAD=_e_pad(e), USE_TMA=use_tma, BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, BLOCK_K=c.block_k, NUM_PROGRAMS=programs, **_dot_flags(x.dtype, a),
            **c.launch_options())
        return dw
    return launch


# --- the choice of tiles ----------------------------------------------------------------------------

# signature -> the config that timed fastest
_chosen: dict[tuple, arch.GemmConfig | TorchGroupedMm] = {}
_forced: arch.GemmConfig | None = None


@contextlib.contextmanager
def forced_config(config: arch.GemmConfig):
    """Every launch inside uses `config`, our kernel with its tiles (tests of each path,
    benchmarks/cases_moe.py's sweep)."""
    global _forced
    previous, _forced = _forced, config
    try:
        yield
    finally:
        _forced = previous


def chosen() -> dict[str, arch.GemmConfig | TorchGroupedMm]:
    """What was chosen so far, by product and shapes (for reports)."""
    return {f"{k[0]} {k[1]} {k[3]}": c for k, c in _chosen.items()}


def _signature(product: str, *tensors: torch.Tensor) -> tuple:
    return (product, tuple(tuple(t.shape) for t in tensors), tuple(tuple(t.stride()) for t in tensors),
            tensors[0].dtype, tensors[0].device, tuple(t.data_ptr() % 16 == 0 for t in tensors))


def _tunable(t: torch.Tensor) -> bool:
    return (_TUNE and t.is_cuda and not torch.cuda.is_current_stream_capturing()
            and not torch.are_deterministic_algorithms_enabled())


def _run(signature: tuple, launch, candidates: tuple, sample: torch.Tensor) -> torch.Tensor:
    """launch() with the forced config, the one chosen for this signature, or (first call on a GPU) the
    fastest candidate, timed in turn on the real operands; returns the last launch's output."""
    if _forced is not None:
        return launch(_forced)
    config = _chosen.get(signature)
    if config is None:
        config = _tune(launch, candidates) if _tunable(sample) and len(candidates) > 1 else candidates[0]
        _chosen[signature] = config
    return launch(config)


def _tune(launch, candidates: tuple):
    """The candidate with the lowest median time over _TUNE_ROUNDS rounds (each round runs all in turn)."""
    working, error = [], None
    for c in candidates:
        try:
            launch(c)                           # compiles; a config the device cannot run fails here
            working.append(c)
        except Exception as exc:  # noqa: BLE001 - Triton's compile and resource errors have no common type
            error = exc
    if not working:
        raise RuntimeError(f"grouped_mm: no launch configuration runs here ({error})") from error
    times: list[list[float]] = [[] for _ in working]
    for _ in range(_TUNE_ROUNDS):
        for i, c in enumerate(working):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(c)
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return working[min(range(len(working)), key=lambda i: statistics.median(times[i]))]


# --- the products ---------------------------------------------------------------------------------

def _check(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm: x must be [T, K] and w [E, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: x has K={x.shape[1]} and w has K={w.shape[1]}")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm: offs must be int32 [E={w.shape[0]}], got {offs.dtype} {tuple(offs.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"grouped_mm: x and w must share one of bf16, fp16, fp32, got {x.dtype} and {w.dtype}")
    if not (x.device == w.device == offs.device):
        raise ValueError(f"grouped_mm: x, w and offs on {x.device}, {w.device}, {offs.device}")


def _forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[T, N]: each expert's rows of x times its weight; the rows of no expert zero."""
    x = x.contiguous()
    t, k = x.shape
    e, _, n = w.shape
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return y
    if k == 0 or e == 0:
        return y.zero_()
    a = arch.detect(x.device)
    return _run(_signature("forward", x, w, offs), _forward_launcher(x, w, offs, y, a),
                arch.gemm_configs(a, x.element_size()), x)


def _weight_like(w_shape: list[int], w_stride: list[int], dtype, device) -> torch.Tensor:
    """An empty tensor shaped and laid out as the weight, so that its gradient flows back through a
    transposed view (transformers' [E, N, K] storage) without a copy."""
    e, k, n = w_shape
    if w_stride[2] != 1 and w_stride[1] == 1:
        return torch.empty(e, n, k, dtype=dtype, device=device).transpose(1, 2)
    return torch.empty(e, k, n, dtype=dtype, device=device)


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, w_shape: list[int],
                 w_stride: list[int]) -> torch.Tensor:
    """[E, K, N], laid out as w: each expert's x rows^T @ its dy rows; zeros for an empty expert."""
    x, dy = x.contiguous(), dy.contiguous()
    if 0 in w_shape or x.shape[0] == 0:
        return _weight_like(w_shape, w_stride, x.dtype, x.device).zero_()
    a = arch.detect(x.device)
    candidates = arch.gemm_configs(a, x.element_size())
    if _torch_weight_grad_ok(x, dy, offs, a):
        candidates = (TORCH_GROUPED_MM, *candidates)
    return _run(_signature("weight_grad", x, dy, offs) + (tuple(w_shape), tuple(w_stride)),
                _weight_grad_launcher(x, dy, offs, w_shape, w_stride, a), candidates, x)


# --- custom ops: what autograd and torch.compile see ------------------------------------------------

@torch.library.custom_op("anvil::grouped_mm", mutates_args=())
def grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _forward(x, w, offs)


@grouped_mm_op.register_fake
def _(x, w, offs):
    _check(x, w, offs)
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("anvil::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad_op(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, w_shape: list[int],
                              w_stride: list[int]) -> torch.Tensor:
    return _weight_grad(x, dy, offs, w_shape, w_stride)


@grouped_mm_weight_grad_op.register_fake
def _(x, dy, offs, w_shape, w_stride):
    return _weight_like(w_shape, w_stride, x.dtype, x.device)


def _setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dx = torch.ops.anvil.grouped_mm(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = (torch.ops.anvil.grouped_mm_weight_grad(x, dy, offs, list(w.shape), list(w.stride()))
          if ctx.needs_input_grad[1] else None)
    return dx, dw, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [T, K] (rows sorted by expert) times w [E, K, N] per expert -> [T, N]; offs int32 [E] the
    cumulative end row of each expert (torch._grouped_mm's convention). Differentiable in x and w."""
    _check(x, w, offs)
    return torch.ops.anvil.grouped_mm(x, w, offs)

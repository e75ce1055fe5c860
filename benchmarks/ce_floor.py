"""The floors of the loss designs: their data movement or matmuls alone, without the softmax.

    python -m benchmarks.ce_floor [--rows 8192] [--vocab 128256] [--json]
    python -m benchmarks.ce_floor --hidden 4096      # the LM head + cross-entropy instead
    python -m benchmarks.ce_floor --hidden 4096 --rounds 3 --kernels   # in turn, 3 times; which kernels run

The persistent cross-entropy (kernels/cross_entropy.py) reads each row of bf16 logits from
HBM once (walk 1), re-reads it from L2 (walk 2, last block first) and writes the gradient
once. `walk_kernel` does exactly those loads and stores, in the same grid (its PersistentConfig:
programs and warps an SM, rows strided over programs, column steps, the cache hints), with one
exp an element and nothing else, so the gap between it and the real kernel is the cost of
the math, and the gap between it and a plain copy is the cost of the design's second read.
Printed beside them: torch's copy, zero-fill and sum of the same bytes (the device's
read + write, write-only and read-only rates), and the real kernel with and without its
gradient.

With --hidden H, the LM head + cross-entropy (kernels/fused_linear_cross_entropy.py) instead: per chunk
of C tokens it runs three cuBLAS GEMMs and the cross-entropy kernel in between. Its floor is the
same loop with the cross-entropy call taken out (the GEMMs then see logits where the gradient would
be: same shapes and kernels). Beside it: the three GEMMs unchunked (all N x V logits kept, the
matmul floor of any method at this shape), each GEMM of the loop alone (the logits GEMMs also into a
V x C chunk: cuBLAS picks its kernel by orientation), the real loop at each C, and torch.compile's
F.cross_entropy(x @ w.T) forward + backward, the anchor, in the same process. --kernels names the GPU
kernels each case launches (torch.profiler, one call after the timing).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
import triton.language as tl

from core import checkout

REPO = checkout.ROOT


@triton.jit
def walk_kernel(X, G, n_rows, n_cols, stride, WALK1: tl.constexpr, READ2: tl.constexpr, WRITE2: tl.constexpr,
                BLOCK: tl.constexpr):
    """Per row: WALK1 reads it (evict_last); walk 2 runs last block first, reading it again (READ2,
    evict_first) and/or storing exp(x - c) (WRITE2, .cs). Without WRITE2 a row's walk-2 sum goes
    to G[row, 0], so the loads cannot be optimized away."""
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x_row = X + tl.cast(row, tl.int64) * stride  # tl.cast: row is a Python int when interpreted
        g_row = G + tl.cast(row, tl.int64) * stride
        c = 0.0
        if WALK1:
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                acc += tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0,
                               eviction_policy="evict_last").to(tl.float32)
            c = tl.sum(acc, axis=0) * 1e-30  # depends on walk 1, changes nothing
        n_blocks = tl.cdiv(n_cols, BLOCK)
        total = tl.zeros([BLOCK], tl.float32)
        for i in range(0, n_blocks):
            offs = (n_blocks - 1 - i) * BLOCK + cols
            x = tl.zeros([BLOCK], tl.float32)
            if READ2:
                x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = tl.exp(x - c)
            if WRITE2:
                tl.store(g_row + offs, g.to(G.dtype.element_ty), mask=offs < n_cols, cache_modifier=".cs")
            else:
                total += tl.where(offs < n_cols, g, 0.0)
        if not WRITE2:
            tl.store(g_row, tl.sum(total, axis=0).to(G.dtype.element_ty))


# (label, WALK1, READ2, WRITE2)
WALKS = (
    ("walk 2 alone: read + write, both HBM", False, True, True),
    ("walk 2 alone: read only", False, True, False),
    ("walk 2 alone: write only", False, False, True),
    ("walk 1 + walk 2 read only (the re-read from L2)", True, True, False),
    ("walk 1 + walk 2 read + write: the design's skeleton", True, True, True),
)


def launch_walks(x, g, walk1: bool, read2: bool, write2: bool, programs: int, block: int, warps: int) -> None:
    n_rows, n_cols = x.shape
    walk_kernel[(programs,)](x, g, n_rows, n_cols, x.stride(0), WALK1=walk1, READ2=read2, WRITE2=write2,
                             BLOCK=block, num_warps=warps)


def measure(rows: int, vocab: int) -> list[dict]:
    import importlib

    import torch
    import triton.testing as tt
    ce = importlib.import_module("kernels.cross_entropy")  # the module; its name is also a function's
    torch.manual_seed(0)
    x = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16)
    g = torch.empty_like(x)
    gib = x.numel() * x.element_size() / 2**30
    # The persistent kernel's own grid, block and warps for this shape (its launch is forced below).
    programs, consts = ce.ce_persistent_config(x.device, rows, vocab)
    block, warps = consts["BLOCK"], consts["num_warps"]
    target = torch.randint(0, vocab, (rows,), device="cuda")
    row_loss = torch.empty(rows, device="cuda")
    norm = torch.tensor(float(rows), device="cuda")
    cases = [(f"torch copy_ ({gib:.2f} GiB read + written)", lambda: g.copy_(x)),
             ("torch zero_ (written)", lambda: g.zero_()),
             ("torch sum (read)", lambda: x.sum(dtype=torch.float32))]
    cases += [(label, lambda w=(w1, r2, w2): launch_walks(x, g, *w, programs, block, warps))
              for label, w1, r2, w2 in WALKS]
    cases += [("Anvil cross-entropy kernel, loss + gradient",
               lambda: ce.launch_ce(x, target, g, row_loss, norm, -100, 0.0, 0.0)),
              ("Anvil cross-entropy kernel, loss only (walk 1)",
               lambda: ce.launch_ce(x, target, None, row_loss, norm, -100, 0.0, 0.0))]
    ce._CE_MODE = "persistent"
    try:
        return [{"what": label, "ms": round(tt.do_bench(fn, warmup=30, rep=200, return_mode="median"), 3)}
                for label, fn in cases]
    finally:
        ce._CE_MODE = None


def lm_head_loop(x, w, target, chunk: int, cross_entropy: bool = True):
    """The LM head + CE forward (which computes both gradients) at `chunk`; cross_entropy=False runs the
    same loop with the cross-entropy call taken out: the design's GEMMs alone."""
    import importlib

    import torch
    flce = importlib.import_module("kernels.fused_linear_cross_entropy")
    norm = torch.tensor(float(x.shape[0]), device=x.device)
    real = flce.launch_ce
    flce.launch_ce = real if cross_entropy else (lambda *args, **kwargs: None)
    try:
        return flce._flce(x, w, target, norm, -100, 0.0, 0.0, True, chunk, True, True)
    finally:
        flce.launch_ce = real


def lm_head_gemms(x, w, logits, gx, gw, which=("logits", "gx", "gw")) -> None:
    """The three GEMMs on all N x V logits at once: what any method multiplies (`which`: some of them)."""
    import torch
    if "logits" in which:
        torch.mm(x, w.t(), out=logits)
    if "gx" in which:
        torch.mm(logits, w, out=gx)
    if "gw" in which:
        torch.mm(logits.t(), x, out=gw)


def lm_head_chunk_gemms(x, w, grad_chunk, gx, which: str) -> None:
    """One of the loop's per-chunk GEMMs alone, once per chunk: "logits" (x_c @ W^T, K = H), "logits V x C"
    (W @ x_c^T: the same product in the other orientation, into the same memory) or "gx" (grad_c @ W,
    K = V); grad_chunk [C, V] stands in for every chunk's logits and gradient."""
    import torch
    chunk, vocab = grad_chunk.shape
    for c0 in range(0, x.shape[0], chunk):
        rows = min(chunk, x.shape[0] - c0)
        if which == "logits":
            torch.mm(x[c0:c0 + rows], w.t(), out=grad_chunk[:rows])
        elif which == "logits V x C":
            torch.mm(w, x[c0:c0 + rows].t(), out=grad_chunk.view(-1)[: vocab * rows].view(vocab, rows))
        else:
            torch.mm(grad_chunk[:rows], w, out=gx[c0:c0 + rows])


def lm_head_gw_updates(x, grad_chunk, gw, tuned: bool = False) -> None:
    """The loop's weight-gradient updates alone: one GEMM per chunk with K = the chunk's tokens, each
    reading and writing all of gW (grad_chunk [C, V] stands in for every chunk's gradient); through
    torch.mm / addmm_, or with `tuned` through kernels.cublaslt.mm as the loop runs them."""
    import torch

    from kernels import cublaslt
    chunk = grad_chunk.shape[0]
    for c0 in range(0, x.shape[0], chunk):
        x_c, g_c = x[c0:c0 + chunk], grad_chunk[: min(chunk, x.shape[0] - c0)]
        if tuned:
            cublaslt.mm(g_c.t(), x_c, gw, accumulate=c0 > 0)
        elif c0 == 0:
            torch.mm(g_c.t(), x_c, out=gw)
        else:
            gw.addmm_(g_c.t(), x_c)


def measure_lm_head(rows: int, hidden: int, vocab: int, rounds: int = 1, kernels: bool = False) -> list[dict]:
    import importlib

    import torch
    import torch.nn.functional as F
    flce = importlib.import_module("kernels.fused_linear_cross_entropy")
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    target = torch.randint(0, vocab, (rows,), device="cuda")
    logits = x @ w.t()  # the gW rows' stand-in gradient: values like the floor loop's
    gx, gw = torch.empty_like(x), torch.empty_like(w)
    default = flce.default_chunk(rows, hidden, vocab)
    chunks = sorted({default, min(2 * default, rows), min(4 * default, rows)})
    cases = [(f"three GEMMs, unchunked ({rows} x {vocab} logits kept)", lambda: lm_head_gemms(x, w, logits, gx, gw))]
    cases += [(f"unchunked: the {name} GEMM alone", lambda k=k: lm_head_gemms(x, w, logits, gx, gw, (k,)))
              for k, name in (("logits", "logits"), ("gx", "hidden-gradient"), ("gw", "weight-gradient"))]
    for c in chunks:
        tag = " (default)" if c == default else ""
        n_chunks = -(-rows // c)
        cases += [(f"C = {c}{tag}: its logits GEMMs alone ({n_chunks}, K = {hidden})",
                   lambda c=c: lm_head_chunk_gemms(x, w, logits[:c], gx, "logits")),
                  (f"C = {c}{tag}: its logits GEMMs into a V x C chunk (the other orientation)",
                   lambda c=c: lm_head_chunk_gemms(x, w, logits[:c], gx, "logits V x C")),
                  (f"C = {c}{tag}: its hidden-gradient GEMMs alone ({n_chunks}, K = {vocab})",
                   lambda c=c: lm_head_chunk_gemms(x, w, logits[:c], gx, "gx")),
                  (f"C = {c}{tag}: its gW updates alone ({n_chunks} GEMMs, K = {c}), torch.mm",
                   lambda c=c: lm_head_gw_updates(x, logits[:c], gw)),
                  (f"C = {c}{tag}: its gW updates alone, tuned cuBLASLt (as the loop runs them)",
                   lambda c=c: lm_head_gw_updates(x, logits[:c], gw, tuned=True)),
                  (f"C = {c}{tag}: the design's GEMMs alone", lambda c=c: lm_head_loop(x, w, target, c, False)),
                  (f"C = {c}{tag}: GEMMs + cross-entropy (Anvil's forward, both gradients)",
                   lambda c=c: lm_head_loop(x, w, target, c))]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled = torch.compile(lambda a, b, t: F.cross_entropy((a @ b.t()).float(), t))
    cases.append(("torch.compile F.cross_entropy(x @ w.T), forward + backward",
                  lambda: compiled(xg, wg, target).backward()))
    times = time_in_rounds(cases, rounds, [xg, wg], warmup=200, rep=1000)
    names = {}
    if kernels:
        from benchmarks.kernels import gpu_kernels
        names = {label: gpu_kernels(fn) for label, fn in cases}
    return [{"what": label, "ms": ms[0] if rounds == 1 else ms, **({"kernels": names[label]} if kernels else {})}
            for label, ms in times.items()]


def time_in_rounds(cases, rounds: int, grad_to_none: list, warmup: int, rep: int) -> dict[str, list[float]]:
    """do_bench medians (ms) of each (label, fn), the whole list run `rounds` times in turn, so a clock
    that drifts during the call shows as a spread between rounds rather than as a difference between cases."""
    import triton.testing as tt
    times = {label: [] for label, _ in cases}
    for _ in range(rounds):
        for label, fn in cases:
            times[label].append(round(tt.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                                  return_mode="median"), 2))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=None, help="measure the LM head + cross-entropy at this width")
    p.add_argument("--rounds", type=int, default=1, help="with --hidden: time every case this many times, in turn")
    p.add_argument("--kernels", action="store_true", help="with --hidden: name the GPU kernels each case launches")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch
    if not torch.cuda.is_available():
        print("benchmarks.ce_floor: needs a GPU", file=sys.stderr)
        return 2
    if args.hidden:
        rows = measure_lm_head(args.rows, args.hidden, args.vocab, max(1, args.rounds), args.kernels)
        shape = f"{args.rows} x {args.hidden} -> {args.vocab}"
    else:
        rows, shape = measure(args.rows, args.vocab), f"{args.rows} x {args.vocab}"
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "shape": shape, "rows": rows}, indent=2))
    else:
        print(torch.cuda.get_device_name(), shape, "bf16")
        print(render(rows))
    return 0


def render(rows: list[dict]) -> str:
    """The rows as a table, a column per round, then each case's kernels where they were asked for."""
    from tabulate import tabulate
    table = [(r["what"], *(r["ms"] if isinstance(r["ms"], list) else [r["ms"]])) for r in rows]
    timed = len(table[0]) - 1
    headers = ("what", *(["ms"] if timed == 1 else [f"round {i + 1} ms" for i in range(timed)]))
    lines = [tabulate(table, headers=headers, tablefmt="github")]
    lines += [f"{r['what']}: {', '.join(r['kernels'])}" for r in rows if "kernels" in r]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

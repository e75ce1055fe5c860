"""The LM head + cross-entropy loop against the variants that were tried to close its gap to torch.compile.

    python -m benchmarks.flce_variants [--rows 8192] [--hidden 4096] [--vocab 128256] [--rounds 3] [--json]
    python -m benchmarks.flce_variants --logits-candidates --rounds 10   # each cuBLASLt logits kernel in the loop

At 8192 x 4096 -> 128256 with chunks of 1024 tokens (1.29 GiB), the loop's GEMMs alone cost about
2 ms more than the same GEMMs unchunked, almost all of it in the eight weight-gradient updates: each
reads all of gW (1 GiB, bf16) as its C operand (`python -m benchmarks.ce_floor --hidden 4096`). The
shipped loop runs them through kernels/cublaslt.py, which picks cuBLASLt's fastest candidate by timing
(a ping-pong kernel, whose epilogue overlaps the other warp group's main loop, on an H100). The
variants here attack the same cost without a larger chunk buffer:

- torch.mm gW: the updates through torch.mm / addmm_ (cuBLAS's one heuristic pick), the loop as it
  was before kernels/cublaslt.py;
- side stream (it and the next two are built on the torch.mm loop): each chunk's hidden-gradient GEMM
  (few output tiles, K = V) runs on a second stream beside the weight-gradient update (many tiles,
  K = C), so one could fill the SMs the other leaves idle and hide the update's C reads;
- torch's cuBLASLt: the updates through torch's cuBLASLt backend (its heuristic's first choice);
- tuned logits / tuned all: the logits GEMMs (and the hidden-gradient GEMMs) through
  kernels/cublaslt.py too: tuned alone, cuBLASLt has faster candidates for them than torch.mm's, and
  these rows say whether that holds inside the loop, beside the cross-entropy kernel;
- with --logits-candidates, a row per candidate cuBLASLt's heuristic offers for the logits GEMM, each
  run in the shipped loop (tuned updates): the candidate that is fastest alone is not the one that is
  fastest beside the cross-entropy kernel and the updates;
- Triton gW: the update as a Triton GEMM that loads its C tile before the K loop and accumulates
  onto it, so the read overlaps the loop instead of following it.

The "shipped" row is the kernel's own loop (benchmarks.ce_floor.lm_head_loop). Every variant runs the
same GEMMs and cross-entropy kernel on the same chunk buffer (its memory is the shipped loop's) and is
checked against the shipped loop before it is timed. The cases run in turn,
`--rounds` times, so a GPU clock that drifts over the call shows as a spread between rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import triton
import triton.language as tl

from core import checkout

REPO = checkout.ROOT


@triton.jit
def gw_update_kernel(G, X, W, K, V, H, stride_g, stride_x, stride_w, ACCUM: tl.constexpr, BV: tl.constexpr,
                     BH: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """W[V, H] (+)= G[K, V]^T @ X[K, H]; ACCUM loads W's tile before the K loop and accumulates onto it.
    K must be a multiple of BK (chunks are)."""
    pid = tl.program_id(0)
    n_v, n_h = tl.cdiv(V, BV), tl.cdiv(H, BH)
    first = (pid // (GROUP * n_h)) * GROUP  # grouped order: GROUP rows of tiles share their X tiles in L2
    size = min(n_v - first, GROUP)
    pv = first + (pid % (GROUP * n_h)) % size
    ph = (pid % (GROUP * n_h)) // size
    ov, oh, ok = pv * BV + tl.arange(0, BV), ph * BH + tl.arange(0, BH), tl.arange(0, BK)
    w_ptrs = W + ov[:, None].to(tl.int64) * stride_w + oh[None, :]
    mask = (ov[:, None] < V) & (oh[None, :] < H)
    if ACCUM:
        acc = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BV, BH), tl.float32)
    g_ptrs = G + ok[:, None] * stride_g + ov[None, :]
    x_ptrs = X + ok[:, None] * stride_x + oh[None, :]
    for _ in range(0, K, BK):
        acc = tl.dot(tl.trans(tl.load(g_ptrs, mask=ov[None, :] < V, other=0.0)), tl.load(x_ptrs), acc)
        g_ptrs += BK * stride_g
        x_ptrs += BK * stride_x
    tl.store(w_ptrs, acc.to(W.dtype.element_ty), mask=mask)


# The best of the three tried on an H100 (128x256x64 with 3 stages, and 128x128x64 with 4, were slower).
GW_CONFIG = {"BV": 128, "BH": 256, "BK": 64, "GROUP": 8, "num_warps": 8, "num_stages": 4}


def gw_update_triton(grad, x, gw, accumulate: bool, config: dict | None = None) -> None:
    cfg = dict(config or GW_CONFIG)
    k, v = grad.shape
    h = x.shape[1]
    grid = (triton.cdiv(v, cfg["BV"]) * triton.cdiv(h, cfg["BH"]),)
    gw_update_kernel[grid](grad, x, gw, k, v, h, grad.stride(0), x.stride(0), gw.stride(0), ACCUM=accumulate, **cfg)


@contextlib.contextmanager
def blas_library(name: str | None):
    import torch
    if name is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def head_loop(x, w, target, chunk: int, variant: str | None = None, side=None, logits_algo=None):
    """kernels.fused_linear_cross_entropy's loop (bf16, both gradients) with its gW updates through
    torch.mm, or one of the VARIANTS built on it; logits_algo (a cublaslt.Matmul for a whole chunk and one
    of its candidates): the shipped loop with its logits GEMMs through that candidate."""
    import torch

    from kernels import cublaslt
    from kernels.cross_entropy import launch_ce
    n, vocab = x.shape[0], w.shape[0]
    norm = torch.tensor(float(n), device=x.device)
    row_loss, gx, gw = torch.empty(n, device=x.device), torch.empty_like(x), torch.empty_like(w)
    buf = torch.empty(min(chunk, n), vocab, device=x.device, dtype=x.dtype)
    main = torch.cuda.current_stream() if variant == "side stream" else None
    tuned_logits = variant in ("tuned logits", "tuned all")
    tuned_gw = tuned_logits or logits_algo is not None
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        x_c, logits = x[c0:c1], buf[: c1 - c0]
        if logits_algo is not None and c1 - c0 == chunk:   # one candidate, forced
            plan, algo = logits_algo
            plan(x_c, w.t(), logits, algo)
        elif tuned_logits:
            cublaslt.mm(x_c, w.t(), logits)
        else:
            torch.mm(x_c, w.t(), out=logits)
        launch_ce(logits, target[c0:c1], logits, row_loss[c0:c1], norm, -100, 0.0, 0.0)
        if variant == "tuned all":
            cublaslt.mm(logits, w, gx[c0:c1])
        elif main is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                torch.mm(logits, w, out=gx[c0:c1])
        else:
            torch.mm(logits, w, out=gx[c0:c1])
        if variant == "Triton gW":
            gw_update_triton(logits, x_c, gw, c0 > 0)
        elif tuned_gw:
            cublaslt.mm(logits.t(), x_c, gw, accumulate=c0 > 0)
        else:
            with blas_library("cublaslt" if variant == "torch's cuBLASLt gW" else None):
                torch.mm(logits.t(), x_c, out=gw) if c0 == 0 else gw.addmm_(logits.t(), x_c)
        if main is not None:
            main.wait_stream(side)  # the next chunk's logits overwrite what the side stream reads
    return row_loss, gx, gw


VARIANTS = ("torch.mm gW", "side stream", "torch's cuBLASLt gW", "tuned logits", "tuned all", "Triton gW")


def measure(rows: int, hidden: int, vocab: int, rounds: int, logits_candidates: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from benchmarks.ce_floor import lm_head_loop, time_in_rounds
    from benchmarks.kernels import peak_memory_gib
    from kernels import cublaslt
    from kernels.fused_linear_cross_entropy import default_chunk
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    target = torch.randint(0, vocab, (rows,), device="cuda")
    chunk = default_chunk(rows, hidden, vocab)
    side = torch.cuda.Stream()
    reference = lm_head_loop(x, w, target, chunk)  # the kernel's own loop
    cases, differences = [("shipped", lambda: lm_head_loop(x, w, target, chunk))], {"shipped": 0.0}
    for variant in VARIANTS:
        out = head_loop(x, w, target, chunk, variant, side)
        differences[variant] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                   for a, b in zip(out, reference))
        cases.append((variant, lambda v=variant: head_loop(x, w, target, chunk, v, side)))
    if logits_candidates:
        from benchmarks.kernels import gpu_kernels
        buf = torch.empty(chunk, vocab, device="cuda", dtype=x.dtype)
        plan = cublaslt.Matmul(x[:chunk], w.t(), buf)
        for i, algo in enumerate(plan.candidates(16)):
            name = gpu_kernels(lambda a=algo: plan(x[:chunk], w.t(), buf, a))[0]
            label = f"logits candidate {i}: {name.removeprefix('nvjet_sm90_tst_')}"
            cases.append((label, lambda a=algo: head_loop(x, w, target, chunk, logits_algo=(plan, a))))
        del buf
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled = torch.compile(lambda a, b, t: F.cross_entropy((a @ b.t()).float(), t))
    cases.append(("torch.compile", lambda: compiled(xg, wg, target).backward()))
    times = time_in_rounds(cases, rounds, [xg, wg], warmup=100, rep=500)
    peaks = {label: round(peak_memory_gib(fn, x.device, [xg, wg]), 2) for label, fn in cases}
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "shape": f"{rows} x {hidden} -> {vocab}", "chunk": chunk,
            "cublaslt": [{"signature": k, "chosen": v} for k, v in cublaslt.choices().items()],
            "rows": [{"what": label, "ms": times[label], "peak_gib": peaks[label],
                      "rel_diff_vs_shipped": differences.get(label)} for label, _ in cases]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logits-candidates", action="store_true",
                   help="add a row per cuBLASLt candidate for the logits GEMM, run inside the loop")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch
    if not torch.cuda.is_available():
        print("benchmarks.flce_variants: needs a GPU", file=sys.stderr)
        return 2
    report = measure(args.rows, args.hidden, args.vocab, max(1, args.rounds), args.logits_candidates)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from tabulate import tabulate
    print(report["device"], f"torch {report['torch']} triton {report['triton']}", report["shape"],
          f"bf16, chunk {report['chunk']}")
    table = [(r["what"], *r["ms"], r["peak_gib"],
              "" if r["rel_diff_vs_shipped"] is None else f"{r['rel_diff_vs_shipped']:.1e}") for r in report["rows"]]
    headers = ("what", *(f"round {i + 1} ms" for i in range(args.rounds)), "peak GiB", "diff vs shipped")
    print(tabulate(table, headers=headers, tablefmt="github"))
    for c in report["cublaslt"]:
        print("cuBLASLt choice:", c["chosen"] or "torch.mm", "for", c["signature"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

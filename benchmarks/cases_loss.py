"""Benchmark cases for the loss kernels: cross-entropy and LM head + cross-entropy.

    python -m benchmarks.cases_loss --sweep     # our variants only: CE block/warps, FLCE chunk sizes

Shapes are the Llama-3 vocabulary (128256) at 8192 tokens. Eager and compile run
the loss as transformers does (logits upcast to fp32 before F.cross_entropy).
Floors: CE reads the logits once and writes their gradient once (2 x N x V x 2 B);
LM head + CE is three N x H x V GEMMs (6 N H V FLOPs).
"""
from __future__ import annotations

import sys

from benchmarks.kernels import Case, Unavailable

N_TOKENS, HIDDEN, VOCAB = 8192, 4096, 128256


def _liger(attr: str):
    try:
        import liger_kernel.transformers as lt
    except ImportError:
        raise Unavailable("liger-kernel not installed") from None
    return getattr(lt, attr)


# ---------------------------------------------------------------- cross-entropy

def _ce_setup(n: int, v: int):
    def setup(device):
        import torch
        return {"logits": torch.randn(n, v, device=device, dtype=torch.bfloat16).requires_grad_(),
                "target": torch.randint(0, v, (n,), device=device)}
    return setup


def _ce_eager(state):
    import torch.nn.functional as F
    logits, target = state["logits"], state["target"]
    return lambda: F.cross_entropy(logits.float(), target).backward()


def _ce_compile(state):
    import torch
    import torch.nn.functional as F
    loss = torch.compile(lambda x, t: F.cross_entropy(x.float(), t))
    logits, target = state["logits"], state["target"]
    return lambda: loss(logits, target).backward()


def _ce_liger(state):
    loss = _liger("LigerCrossEntropyLoss")()
    logits, target = state["logits"], state["target"]
    return lambda: loss(logits, target).backward()


def _ce_anvil(state, block=None, warps=None):
    import importlib
    ce = importlib.import_module("kernels.cross_entropy")  # kernels.cross_entropy is also a function name
    logits, target = state["logits"], state["target"]

    def fn():
        if block:
            ce._CE_BLOCK, ce._CE_WARPS = block, warps
        # The trainer's path: the gradient overwrites the logits (as Liger does).
        ce.cross_entropy(logits, target, inplace_grad=True).backward()
    return fn


def ce_case(n=N_TOKENS, v=VOCAB, anvil=_ce_anvil, label="") -> Case:
    return Case(op="cross_entropy", shape=f"{n}x{v}{label}", setup=_ce_setup(n, v),
                providers={"anvil": anvil, "eager": _ce_eager, "compile": _ce_compile, "liger": _ce_liger},
                bytes_moved=2 * n * v * 2, grad_to_none=lambda s: [s["logits"]])


# ---------------------------------------------------------------- LM head + cross-entropy

def _flce_setup(n: int, h: int, v: int):
    def setup(device):
        import torch
        return {"x": torch.randn(n, h, device=device, dtype=torch.bfloat16).requires_grad_(),
                "w": (torch.randn(v, h, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_(),
                "target": torch.randint(0, v, (n,), device=device)}
    return setup


def _flce_eager(state):
    import torch.nn.functional as F
    x, w, t = state["x"], state["w"], state["target"]
    return lambda: F.cross_entropy((x @ w.t()).float(), t).backward()


def _flce_compile(state):
    import torch
    import torch.nn.functional as F
    loss = torch.compile(lambda x, w, t: F.cross_entropy((x @ w.t()).float(), t))
    x, w, t = state["x"], state["w"], state["target"]
    return lambda: loss(x, w, t).backward()


def _flce_liger(state):
    loss = _liger("LigerFusedLinearCrossEntropyLoss")()
    x, w, t = state["x"], state["w"], state["target"]
    return lambda: loss(w, x, t).backward()


def _flce_anvil(state, chunk=None):
    from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
    x, w, t = state["x"], state["w"], state["target"]
    return lambda: fused_linear_cross_entropy(x, w, t, chunk_size=chunk).backward()


def flce_case(n=N_TOKENS, h=HIDDEN, v=VOCAB, anvil=_flce_anvil, label="") -> Case:
    return Case(op="flce", shape=f"{n}x{h}->{v}{label}", setup=_flce_setup(n, h, v),
                providers={"anvil": anvil, "eager": _flce_eager, "compile": _flce_compile, "liger": _flce_liger},
                flops=6 * n * h * v, grad_to_none=lambda s: [s["x"], s["w"]])


CASES = [ce_case(), flce_case()]


def sweep_cases() -> list[Case]:
    """Our variants alone: CE (BLOCK, num_warps) and FLCE chunk sizes."""
    cases = []
    for block, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32),
                         (32768, 32)):
        cases.append(ce_case(anvil=lambda s, b=block, w=warps: _ce_anvil(s, b, w), label=f" B{block}w{warps}"))
    for chunk in (256, 768, 1024, 1536):
        cases.append(flce_case(anvil=lambda s, c=chunk: _flce_anvil(s, c), label=f" C{chunk}"))
    return cases


if __name__ == "__main__":
    from benchmarks import kernels as kb
    if "--sweep" not in sys.argv:
        sys.exit("usage: python -m benchmarks.cases_loss --sweep")
    import torch
    dev = "cuda"
    ceil = kb.measure_ceilings(dev, quick=True)
    rows = []
    for case in sweep_cases():
        rows += kb.measure_case(case, dev, ceil, quick=True, providers=("anvil",))
    print(kb.render({"device": torch.cuda.get_device_name(), "versions": kb._versions(), "date": "",
                     "ceilings": vars(ceil), "notes": [], "rows": rows}))
    ce_rows = [r for r in rows if r["op"] == "cross_entropy" and r["ms"]]
    if ce_rows:
        best = min(ce_rows, key=lambda r: r["ms"])
        print("BEST_CE", best["shape"].split()[-1], best["ms"])

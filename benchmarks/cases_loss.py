"""Benchmark cases for the loss kernels: cross-entropy and LM head + cross-entropy.

    python -m benchmarks.cases_loss --sweep     # our variants only: CE paths/blocks/warps, FLCE chunk sizes
    python -m benchmarks.cases_loss --sweep ce  # CE variants only
    python -m benchmarks.cases_loss --sweep persistent  # the persistent CE path against the row path

Shapes are the Llama-3 vocabulary (128256) at 8192 tokens. Eager and compile run
the loss as transformers does (logits upcast to fp32 before F.cross_entropy).
Floors: CE reads the logits once and writes their gradient once (2 x N x V x 2 B);
LM head + CE is three N x H x V GEMMs (6 N H V FLOPs). "float8 head" runs two of
them in FP8 (precision.fp8_lm_head).
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


def _ce_anvil(state, mode=None, block=None, warps=None, one_exp=False, persistent=None):
    """mode None: the device's default path; else force ("row"|"split"|"two_pass"|"persistent", block, warps;
    persistent: a kernels.cross_entropy.PersistentConfig)."""
    import importlib
    ce = importlib.import_module("kernels.cross_entropy")  # kernels.cross_entropy is also a function name
    logits, target = state["logits"], state["target"]

    def fn():
        if mode:
            ce._CE_MODE = mode
            if mode == "row":
                ce._CE_BLOCK, ce._CE_WARPS, ce._ROW_ONE_EXP = block, warps, one_exp
            elif mode == "persistent":
                ce._PERSIST, ce._ROW_ONE_EXP = persistent or ce.PersistentConfig(), one_exp
            else:
                ce._SPLIT_BLOCK, ce._SPLIT_WARPS = block, warps
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


def _flce_anvil_float8(state):
    """precision.fp8_lm_head: logits and hidden-gradient GEMMs in float8 (e4m3), per-row scales."""
    import torch
    from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
    x, w, t = state["x"], state["w"], state["target"]
    return lambda: fused_linear_cross_entropy(x, w, t, float8=torch.float8_e4m3fn).backward()


def flce_case(n=N_TOKENS, h=HIDDEN, v=VOCAB, anvil=_flce_anvil, label="") -> Case:
    return Case(op="flce", shape=f"{n}x{h}->{v}{label}", setup=_flce_setup(n, h, v),
                providers={"anvil": anvil, "eager": _flce_eager, "compile": _flce_compile, "liger": _flce_liger},
                flops=6 * n * h * v, grad_to_none=lambda s: [s["x"], s["w"]])


# The second LM head case is the same shape with Anvil's float8 head (its anvil row; the others repeat
# the bf16 anchors in the same run). Not a like-for-like kernel: its hidden gradient carries float8 error.
CASES = [ce_case(), flce_case(), flce_case(anvil=_flce_anvil_float8, label=" float8 head")]


# (mode, block, warps[, one_exp]); H200 2026-11-22 before ONE_EXP: row B2048w4 1.74 ms, two_pass B8192w16
# 2.53, split B2048w4 2.87, B4096w4 2.45, B4096w8 2.69, B8192w4/8/16 3.54/3.08/2.83, B16384w8/16/32 3.94/3.51/3.22.
# Second sweep, row kernel with the one-exp update: B2048w4 1.854 ms (two exps: 1.742), B1024w2 1.924,
# B2048w8 1.779, B4096w8 1.921, B4096w4 2.063; split B4096w4 2.447, B2048w2 2.991.
CE_SWEEP = (("row", 2048, 4, True), ("row", 2048, 4), ("row", 2048, 8), ("two_pass", 8192, 16),
            ("split", 4096, 4), ("split", 8192, 16))


# Persistent path, first round, H200 2026-11-23 (row B2048w4 1.742 ms in the same run), per-lane maxes
# (group 1), no stream stores, with eviction hints / without: P2 B4096w16 2.048/2.063, B8192w16
# 2.087/2.098, B4096w8 2.485/2.521, B2048w8 2.820/2.902, B8192w8 2.855/2.949; P1 B4096w16 2.523/2.552,
# B8192w16 2.639/2.684; the 4-warp ones 3.9-7.9 ms. The second round (grouped maxes, 32 warps, .cs
# stores) is in PersistentConfig's docstring. This sweep: the default, then one knob changed at a time.
PERSISTENT_SWEEP = (dict(), dict(group=1), dict(stream_stores=False), dict(evict=False), dict(warps=16),
                    dict(programs_per_sm=1), dict(programs_per_sm=3, warps=16), dict(block=16384))


def _persistent_case(**changes) -> Case:
    import importlib
    ce = importlib.import_module("kernels.cross_entropy")
    config = ce.PersistentConfig(**changes)
    tag = "-".join(f"{k}={v}" for k, v in changes.items()) or "default"
    return ce_case(anvil=lambda s: _ce_anvil(s, "persistent", persistent=config), label=f" persistent-{tag}")


def sweep_cases(which: str = "all") -> list[Case]:
    """Our variants alone: CE (path, BLOCK, num_warps) and FLCE chunk sizes.

    which: "all", "ce" (every CE variant), "persistent" (the persistent CE path and the row baseline), "flce".
    """
    cases = []
    ce_sweep = CE_SWEEP if which in ("all", "ce") else (("row", 2048, 4),) if which == "persistent" else ()
    for mode, block, warps, *one in ce_sweep:
        one_exp = one[0] if one else False
        cases.append(ce_case(anvil=lambda s, m=mode, b=block, w=warps, o=one_exp: _ce_anvil(s, m, b, w, o),
                             label=f" {mode}-B{block}w{warps}{'-1exp' if one_exp else ''}"))
    for changes in PERSISTENT_SWEEP if which in ("all", "ce", "persistent") else ():
        cases.append(_persistent_case(**changes))
    for chunk in (256, 768, 1024, 1536) if which in ("all", "flce") else ():
        cases.append(flce_case(anvil=lambda s, c=chunk: _flce_anvil(s, c), label=f" C{chunk}"))
    return cases


def _print_kernel_resources() -> None:
    """Registers / spills of each compiled split and persistent CE variant (occupancy is what the sweep trades;
    a persistent program that does not fit programs_per_sm to an SM runs in a second wave)."""
    import importlib
    ce = importlib.import_module("kernels.cross_entropy")
    for tag, kernel in (("SPLIT_KERNEL", ce.ce_split_kernel), ("PERSISTENT_KERNEL", ce.ce_row_persistent_kernel)):
        try:
            for cache in kernel.device_caches.values():
                for key, k in cache[0].items():
                    consts = {n: v for n, v in getattr(k.src, "constants", {}).items() if isinstance(v, (int, bool))}
                    named = {n: consts[n] for n in ("BLOCK", "N_CHUNKS", "EVICT_HINTS") if n in consts}
                    print(tag, named or key, "warps", k.metadata.num_warps, "regs", k.n_regs, "spills", k.n_spills)
        except Exception as exc:  # introspection differs across Triton versions; never fail the sweep for it
            print(tag, "resources unavailable:", type(exc).__name__, exc)


if __name__ == "__main__":
    from benchmarks import kernels as kb
    if "--sweep" not in sys.argv:
        sys.exit("usage: python -m benchmarks.cases_loss --sweep [ce|persistent|flce]")
    which = sys.argv[sys.argv.index("--sweep") + 1] if len(sys.argv) > sys.argv.index("--sweep") + 1 else "all"
    import torch
    dev = "cuda"
    ceil = kb.measure_ceilings(dev, quick=True)
    rows = []
    for case in sweep_cases(which):
        rows += kb.measure_case(case, dev, ceil, quick=True, providers=("anvil",))
    print(kb.render({"device": torch.cuda.get_device_name(), "versions": kb._versions(), "date": "",
                     "ceilings": vars(ceil), "notes": [], "rows": rows}))
    _print_kernel_resources()
    ce_rows = [r for r in rows if r["op"] == "cross_entropy" and r["ms"]]
    if ce_rows:
        best = min(ce_rows, key=lambda r: r["ms"])
        print("BEST_CE", best["shape"].split()[-1], best["ms"])

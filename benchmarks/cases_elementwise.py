"""Benchmark cases for the memory-bound kernels: RMSNorm, RoPE, SwiGLU (forward + backward, bf16).

    python -m benchmarks.kernels --op rms_norm|rope|swiglu     # the table, all providers
    python -m benchmarks.cases_elementwise --sweep [--table-best] [--overhead]  # RMSNorm launch variants alone

Eager and compile run the transformers formulas (LlamaRMSNorm's, apply_rotary_pos_emb on
the [B, H, S, D] view, silu(gate) * up); Liger runs its functional ops with its defaults
(RMSNorm in place, casting mode "llama"). Fewest bytes, forward + backward:
- RMSNorm N x H: read x, write y; read x and dy, write dx: 5 x N x H x 2 B (weight, rstd ~0).
- RoPE: read q, k, write both; read both grads, write both: 4 x (q + k) bytes (cos/sin ~0).
- SwiGLU N x F: read gate, up, write out; read dout, gate, up, write dgate, dup: 8 x N x F x 2 B.
"""

from __future__ import annotations

import sys

from benchmarks.kernels import Case, Unavailable

BF16_BYTES = 2


def _liger_functional():
    try:
        import liger_kernel.transformers.functional as lf
    except ImportError:
        raise Unavailable("liger-kernel not installed") from None
    return lf


def _compiled(fn):
    import torch
    return torch.compile(fn)


# ---------------------------------------------------------------- RMSNorm

def _hf_rms_norm(x, weight, eps=1e-6):
    import torch
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rms_setup(rows: int, hidden: int):
    def setup(device):
        import torch
        return {"x": torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True),
                "w": (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16).requires_grad_(),
                "dy": torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)}
    return setup


def _rms_provider(forward_of):
    def make(state):
        forward = forward_of()
        x, w, dy = state["x"], state["w"], state["dy"]
        return lambda: forward(x, w).backward(dy)
    return make


def _rms_anvil():
    from kernels import rms_norm
    return lambda x, w: rms_norm(x, w, 1e-6)


def _rms_liger():
    lf = _liger_functional()
    return lambda x, w: lf.liger_rms_norm(x, w, 1e-6)


def rms_norm_case(rows: int, hidden: int, label: str = "") -> Case:
    return Case(op="rms_norm", shape=f"{rows}x{hidden}{label}", setup=_rms_setup(rows, hidden),
                providers={"anvil": _rms_provider(_rms_anvil), "eager": _rms_provider(lambda: _hf_rms_norm),
                           "compile": _rms_provider(lambda: _compiled(_hf_rms_norm)),
                           "liger": _rms_provider(_rms_liger)},
                bytes_moved=5 * rows * hidden * BF16_BYTES, grad_to_none=lambda s: [s["x"], s["w"]])


# ---------------------------------------------------------------- RoPE

def _rope_setup(batch: int, seq: int, n_q: int, n_kv: int, head_dim: int):
    def setup(device):
        import torch
        bf16 = dict(device=device, dtype=torch.bfloat16)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, S, D], as LlamaRotaryEmbedding returns
        return {"q": torch.randn(batch, seq, n_q, head_dim, **bf16, requires_grad=True),
                "k": torch.randn(batch, seq, n_kv, head_dim, **bf16, requires_grad=True),
                "cos": emb.cos().to(torch.bfloat16), "sin": emb.sin().to(torch.bfloat16),
                "dq": torch.randn(batch, seq, n_q, head_dim, **bf16),
                "dk": torch.randn(batch, seq, n_kv, head_dim, **bf16)}
    return setup


def _hf_rope_bhsd(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb on the [B, H, S, D] views its attention passes."""
    import torch
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rope_provider(forward_of, layout: str):
    def make(state):
        import torch
        forward = forward_of()
        q, k, cos, sin, dq, dk = (state[n] for n in ("q", "k", "cos", "sin", "dq", "dk"))
        if layout == "bshd":
            return lambda: torch.autograd.backward(forward(q, k, cos, sin), (dq, dk))
        dq_t, dk_t = dq.transpose(1, 2), dk.transpose(1, 2)
        return lambda: torch.autograd.backward(forward(q.transpose(1, 2), k.transpose(1, 2), cos, sin), (dq_t, dk_t))
    return make


def _rope_anvil():
    from kernels import apply_rope
    return apply_rope


def _rope_liger():
    lf = _liger_functional()
    return lambda q, k, cos, sin: lf.liger_rope(q, k, cos, sin)


def rope_case(batch=4, seq=4096, n_q=32, n_kv=8, head_dim=128, label: str = "") -> Case:
    qk_bytes = batch * seq * (n_q + n_kv) * head_dim * BF16_BYTES
    return Case(op="rope", shape=f"B{batch} S{seq} {n_q}q/{n_kv}kv D{head_dim}{label}",
                setup=_rope_setup(batch, seq, n_q, n_kv, head_dim),
                providers={"anvil": _rope_provider(_rope_anvil, "bshd"),
                           "eager": _rope_provider(lambda: _hf_rope_bhsd, "bhsd"),
                           "compile": _rope_provider(lambda: _compiled(_hf_rope_bhsd), "bhsd"),
                           "liger": _rope_provider(_rope_liger, "bhsd")},
                bytes_moved=4 * qk_bytes, grad_to_none=lambda s: [s["q"], s["k"]])


# ---------------------------------------------------------------- SwiGLU

def _swiglu_setup(rows: int, width: int):
    def setup(device):
        import torch
        bf16 = dict(device=device, dtype=torch.bfloat16)
        return {"gate": torch.randn(rows, width, **bf16, requires_grad=True),
                "up": torch.randn(rows, width, **bf16, requires_grad=True),
                "dout": torch.randn(rows, width, **bf16)}
    return setup


def _silu_mul(gate, up):
    import torch.nn.functional as F
    return F.silu(gate) * up


def _swiglu_provider(forward_of):
    def make(state):
        forward = forward_of()
        gate, up, dout = state["gate"], state["up"], state["dout"]
        return lambda: forward(gate, up).backward(dout)
    return make


def _swiglu_anvil():
    from kernels import swiglu
    return swiglu


def _swiglu_liger():
    return _liger_functional().liger_swiglu


def swiglu_case(rows=16384, width=14336, label: str = "") -> Case:
    return Case(op="swiglu", shape=f"{rows}x{width}{label}", setup=_swiglu_setup(rows, width),
                providers={"anvil": _swiglu_provider(_swiglu_anvil), "eager": _swiglu_provider(lambda: _silu_mul),
                           "compile": _swiglu_provider(lambda: _compiled(_silu_mul)),
                           "liger": _swiglu_provider(_swiglu_liger)},
                bytes_moved=8 * rows * width * BF16_BYTES, grad_to_none=lambda s: [s["gate"], s["up"]])


CASES: list[Case] = [
    rms_norm_case(65536, 4096),
    rms_norm_case(16384, 4096),
    rope_case(),
    swiglu_case(),
]


# ---------------------------------------------------------------- launch-parameter sweep

def _clear_config_caches():
    from kernels import arch
    arch._detect.cache_clear()
    for name in ("kernels.rms_norm", "kernels.rope"):
        sys.modules[name]._config.cache_clear()


def overhead(device: str = "cuda") -> list[tuple[str, str, str, float]]:
    """Per-call host cost (tiny shapes, so the GPU waits on the host) and GPU-only time
    (CUDA-graph replay at the real shapes) of one forward + backward, per provider."""
    import time

    import torch
    import triton.testing

    out = []
    tiny = [rms_norm_case(8, 256), rope_case(1, 8, 32, 8, 128), swiglu_case(8, 256)]
    for case in tiny + CASES:
        for name in ("anvil", "liger", "compile"):
            try:
                state = case.setup(device)
                fn = case.providers[name](state)
                leaves = case.grad_to_none(state)
                for _ in range(3):
                    fn()
                if case in tiny:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(200):
                        for t in leaves:
                            t.grad = None
                        fn()
                    torch.cuda.synchronize()
                    out.append((case.shape, name, "host us/call", (time.perf_counter() - start) / 200 * 1e6))
                elif name != "compile":
                    ms = triton.testing.do_bench_cudagraph(fn, rep=50, grad_to_none=leaves, return_mode="median")
                    out.append((case.shape, name, "graph ms", ms))
            except Exception as exc:  # a diagnostic: report and go on
                out.append((case.shape, name, f"failed {type(exc).__name__}: {str(exc)[:60]}", float("nan")))
            finally:
                state = None
                torch.cuda.empty_cache()
    return out


# RMSNorm launch variants (kernels.rms_norm.Tuning fields); "table" (None) is the committed default.
# Measured 2026-11-22 on an H200 and dropped: evict_first on all streams (+0.04 ms), two rows per
# iteration at 4 or 8 warps, 8 warps, 3/5/8/16 programs per SM, 2 pipeline stages (0.68-0.87 ms).
RMS_VARIANTS: dict[str, dict | None] = {
    "table": None,
    "two launches, prefetch": {},
    "fold, prefetch": {"fold_dw": True},
    "fold, prefetch, pps2": {"fold_dw": True, "programs_per_sm": 2},
    "fold, stages3, pps4": {"fold_dw": True, "prefetch": False, "stages": 3},
    "fold, stages4, pps2": {"fold_dw": True, "prefetch": False, "stages": 4, "programs_per_sm": 2},
    "fold, stages3, pps1": {"fold_dw": True, "prefetch": False, "stages": 3, "programs_per_sm": 1},
    "fold, stages3, pps2, 2 rows 8w": {"fold_dw": True, "prefetch": False, "stages": 3, "programs_per_sm": 2,
                                       "bwd_rows": 2, "bwd_warps": 2},
}


def sweep(device: str = "cuda", variants: dict[str, dict] | None = None) -> list[dict]:
    """Our RMSNorm alone under launch variants: fwd+bwd, fwd only and bwd only (do_bench medians, ms),
    and fwd+bwd at 16384x4096 in CUDA-graph replay (GPU time without the host)."""
    import torch
    import triton.testing

    rn = sys.modules["kernels.rms_norm"] if "kernels.rms_norm" in sys.modules else __import__(
        "importlib").import_module("kernels.rms_norm")
    out = []
    try:
        for label, fields in (variants or RMS_VARIANTS).items():
            rn.TUNING_OVERRIDE = None if fields is None else rn.Tuning(**fields)
            _clear_config_caches()
            row = {"variant": label}
            for rows in (65536, 16384):
                state = _rms_setup(rows, 4096)(device)
                x, w, dy = state["x"], state["w"], state["dy"]
                fn = _rms_provider(_rms_anvil)(state)
                fn()
                tag = "" if rows == 65536 else " 16k"
                row["fwd+bwd" + tag] = triton.testing.do_bench(fn, grad_to_none=[x, w], return_mode="median")
                if rows == 65536:
                    with torch.no_grad():
                        y, rstd = rn._forward(x, w, 1e-6)
                        row["fwd"] = triton.testing.do_bench(lambda: rn._forward(x, w, 1e-6), return_mode="median")
                        row["bwd"] = triton.testing.do_bench(lambda: rn._backward(dy, x, w, rstd),
                                                             return_mode="median")
                        dx, dw = rn._backward(dy, x, w, rstd)
                        rn.TUNING_OVERRIDE, saved = None, rn.TUNING_OVERRIDE
                        _clear_config_caches()
                        dx0, dw0 = rn._backward(dy, x, w, rstd)
                        rn.TUNING_OVERRIDE = saved
                        _clear_config_caches()
                        row["max|ddx|"] = (dx.float() - dx0.float()).abs().max().item()
                        row["max|ddw|"] = (dw.float() - dw0.float()).abs().max().item()
                        del y, rstd, dx, dw, dx0, dw0
                else:
                    row["graph 16k"] = triton.testing.do_bench_cudagraph(fn, rep=50, grad_to_none=[x, w],
                                                                         return_mode="median")
                del state, x, w, dy, fn
                torch.cuda.empty_cache()
            out.append(row)
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    finally:
        rn.TUNING_OVERRIDE = None
        _clear_config_caches()
    return out


def phase_times(device: str = "cuda") -> list[tuple[str, str, float]]:
    """Forward-only medians (ms) of anvil and compile, to split a fwd+bwd gap between the passes."""
    import torch
    import triton.testing

    out = []
    for case in CASES:
        for name in ("anvil", "compile"):
            state = case.setup(device)
            fwd = {"rms_norm": lambda: (_rms_anvil() if name == "anvil" else _compiled(_hf_rms_norm)),
                   "rope": lambda: (_rope_anvil() if name == "anvil" else _compiled(_hf_rope_bhsd)),
                   "swiglu": lambda: (_swiglu_anvil() if name == "anvil" else _compiled(_silu_mul))}[case.op]()
            with torch.no_grad():
                if case.op == "rms_norm":
                    fn = lambda: fwd(state["x"], state["w"])  # noqa: E731
                elif case.op == "rope":
                    q, k = (state["q"], state["k"]) if name == "anvil" else (state["q"].transpose(1, 2),
                                                                             state["k"].transpose(1, 2))
                    fn = lambda: fwd(q, k, state["cos"], state["sin"])  # noqa: E731
                else:
                    fn = lambda: fwd(state["gate"], state["up"])  # noqa: E731
                fn()
                out.append((case.shape, name, triton.testing.do_bench(fn, return_mode="median")))
            del state
    return out


if __name__ == "__main__":
    if "--sweep" not in sys.argv:
        sys.exit("usage: python -m benchmarks.cases_elementwise --sweep")
    from tabulate import tabulate

    rows = sweep()
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".4f"))
    if "--table-best" in sys.argv:
        # the full provider table (benchmarks.kernels --op rms_norm) with the fastest variant, same process
        from benchmarks import kernels as kb
        best = min(rows, key=lambda r: r["fwd+bwd"])
        rn = sys.modules["kernels.rms_norm"]
        fields = RMS_VARIANTS[best["variant"]]
        rn.TUNING_OVERRIDE = None if fields is None else rn.Tuning(**fields)
        _clear_config_caches()
        print(f"anvil below = variant {best['variant']!r}")
        print(kb.render(kb.run(op="rms_norm")))
        rn.TUNING_OVERRIDE = None
    if "--overhead" in sys.argv:
        for shape, name, what, value in overhead():
            print(f"{what:14s} {shape:32s} {name:8s} {value:.3f}")

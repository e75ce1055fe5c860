"""Benchmark cases for the memory-bound kernels: RMSNorm, RoPE, SwiGLU (forward + backward, bf16).

    python -m benchmarks.kernels --op rms_norm|rope|swiglu     # the table, all providers
    python -m benchmarks.cases_elementwise --sweep              # our launch parameters alone

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


def sweep(device: str = "cuda") -> dict:
    """Time our kernels alone under variants of this device's arch row (kernels/arch.py)."""
    import dataclasses

    import torch

    from benchmarks import kernels as kb
    from kernels import arch

    base_arch = arch.detect()
    key = base_arch.name if base_arch.name in arch._TABLE else base_arch.vendor
    base = arch._TABLE[key]
    variants = {"table": {}, "pps2": {"programs_per_sm": 2}, "pps8": {"programs_per_sm": 8},
                "ept32": {"elems_per_thread": 32}}
    ceilings = kb.measure_ceilings(device, quick=True)
    rows = []
    for label, change in variants.items():
        arch._TABLE[key] = dataclasses.replace(base, **change)
        _clear_config_caches()
        for case in (rms_norm_case(65536, 4096, f" {label}"), rms_norm_case(16384, 4096, f" {label}")):
            rows += kb.measure_case(case, device, ceilings, quick=True, providers=("anvil",))
    arch._TABLE[key] = base
    _clear_config_caches()
    return {"device": torch.cuda.get_device_name(), "versions": kb._versions(), "date": "", "notes": [],
            "ceilings": {"copy_tbps": ceilings.copy_tbps, "matmul_tflops": ceilings.matmul_tflops}, "rows": rows}


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
    from benchmarks import kernels as kb

    for shape, name, what, value in overhead():
        print(f"{what:14s} {shape:32s} {name:8s} {value:.3f}")
    for shape, name, ms in phase_times():
        print(f"forward only  {shape:32s} {name:8s} {ms:.3f} ms")
    print(kb.render(sweep()))

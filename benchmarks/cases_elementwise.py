"""Benchmark cases for the memory-bound kernels: RMSNorm, RoPE, SwiGLU (forward + backward, bf16).

    python -m benchmarks.kernels --op rms_norm|rope|swiglu     # the table, all providers
    python -m benchmarks.cases_elementwise --sweep [--table-best] [--overhead]  # RMSNorm launch variants (kernels.rms_norm.Tuning fields); "table" (None) is the committed default.
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

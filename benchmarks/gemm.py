"""GEMM throughput: how fast this device multiplies matrices (TFLOP/s).

    python -m benchmarks.gemm [-M 8192] [-N M] [-K M] [--dtype bf16] [--json]   (-M: 1024 on a CPU)

M x K @ K x N, 2*M*N*K FLOPs per product. On a GPU the time is the median of
CUDA/HIP-event timed products after warm-up (random data: zeros run faster on
Hopper and flatter the figure); on CPU a wall-clock median, so the task works
everywhere and says which device it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Default M (also inv bench.gemm's): an 8192^3 bf16 product takes ~5 s on a CPU, 1024^3 ~25 ms.
GPU_ROWS, CPU_ROWS = 8192, 1024


@dataclass
class GemmResult:
    device: str
    dtype: str
    m: int
    n: int
    k: int
    median_ms: float
    tflops: float
    peak_tflops: float | None = None  # from the GPU's env profile, when known

    @property
    def percent_of_peak(self) -> float | None:
        return 100.0 * self.tflops / self.peak_tflops if self.peak_tflops else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["percent_of_peak"] = self.percent_of_peak
        return d


def _timed_ms(fn, device, warmup: int, iters: int) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":  # also HIP: ROCm builds present as "cuda"
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_gemm(m: int, n: int | None = None, k: int | None = None, dtype: str = "bf16",
             warmup: int = 5, iters: int = 20, device: str | None = None,
             peak_tflops: float | None = None) -> GemmResult:
    import torch

    n, k = m if n is None else n, m if k is None else k    # 0 is refused below, not taken for "as M"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if min(m, n, k) <= 0:
        raise ValueError("M, N and K must be positive")
    if iters < 1:
        raise ValueError(f"iters must be 1 or more, got {iters} (the time is a median of them)")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, DTYPES[dtype])
    a = torch.randn(m, k, device=dev, dtype=torch_dtype)
    b = torch.randn(k, n, device=dev, dtype=torch_dtype)
    out = torch.empty(m, n, device=dev, dtype=torch_dtype)
    times = _timed_ms(lambda: torch.matmul(a, b, out=out), dev, warmup, iters)
    median = statistics.median(times)
    tflops = 2.0 * m * n * k / (median * 1e-3) / 1e12
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return GemmResult(name, dtype, m, n, k, median, tflops, peak_tflops)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-M", type=int, help="default: 8192 on a GPU, 1024 on a CPU")
    p.add_argument("-N", type=int)
    p.add_argument("-K", type=int)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.iters < 1:
        p.error("--iters must be 1 or more")
    for flag in ("M", "N", "K"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"-{flag} {getattr(a, flag)}: M, N and K must be positive integers")
    if a.M is None:   # an 8192^3 product takes seconds on a CPU: a CPU-sized default there
        import torch
        a.M = GPU_ROWS if torch.cuda.is_available() else CPU_ROWS
    # The GPU's env profile exports its dense bf16 peak; a CPU has none, even where --gpu named a profile.
    peak = float(os.environ.get("ANVIL_GPU_PEAK_TFLOPS") or 0) or None
    r = run_gemm(a.M, a.N, a.K, a.dtype, iters=a.iters, peak_tflops=peak)
    if r.device == "cpu":
        r.peak_tflops = None
    print(json.dumps(r.to_dict()) if a.json else
          f"{r.device} {r.dtype} {r.m}x{r.n}x{r.k}: {r.median_ms:.3f} ms, {r.tflops:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GEMM throughput: how fast this device multiplies matrices (TFLOP/s).

    python -m benchmarks.gemm [-M 8192] [-N M] [-K M] [--dtype bf16] [--json]   (-M: 1024 on a CPU)

M x K @ K x N, 2*M*N*K FLOPs per product. On a GPU the time is the median of
CUDA/HIP-event timed products after warm-up (random data: zeros run faster on
Hopper and flatter the figure); on CPU a wall-clock median, so the task works
everywhere and says which device it measured.

On a CPU, where a large product takes minutes, stderr says beforehand about how long
one product and the whole run will take (from a small product timed first), then how
far it is every few seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from core import names

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


PROGRESS_AFTER_S = 10.0   # a CPU run expected to take longer says how long, then how far it is
PROGRESS_EVERY_S = 5.0


def _duration(seconds: float) -> str:
    """"1.8 s", "42 s", "3.5 min", "2.1 h", "4.0 days"."""
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def estimate_cpu_seconds(m: int, n: int, k: int, dtype) -> float:
    """About how long one m x n x k product of `dtype` takes on this CPU: a 256^3 product's rate
    (its best of three), scaled by the FLOPs. Small products run below the CPU's peak, so this errs long."""
    import torch

    side = 256
    a, b = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return best * (m * n * k) / side ** 3


class Progress:
    """How far a long CPU run is, on stderr: the estimate first, then a line every PROGRESS_EVERY_S."""

    def __init__(self, total: int, warmup: int, each_s: float, out=None):
        self.total, self.out = total, out if out is not None else sys.stderr
        self.enabled = total * each_s >= PROGRESS_AFTER_S
        self.started = self.last = time.perf_counter()
        if self.enabled:
            self._say(f"gemm on the CPU: about {_duration(each_s)} per product, {total} products ({warmup} "
                      f"warm-up, {total - warmup} timed): about {_duration(total * each_s)} in all")

    def done(self, count: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < PROGRESS_EVERY_S and count < self.total):
            return
        self.last = now
        elapsed = now - self.started
        left = elapsed / count * (self.total - count)
        self._say(f"gemm: {count}/{self.total} products, {_duration(elapsed)}"
                  + (f", about {_duration(left)} left" if count < self.total else ""))

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def _timed_ms(fn, device, warmup: int, iters: int, progress: Progress | None = None) -> list[float]:
    import torch

    for i in range(warmup):
        fn()
        if progress:
            progress.done(i + 1)
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
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if progress:
            progress.done(warmup + i + 1)
    return times


def run_gemm(m: int, n: int | None = None, k: int | None = None, dtype: str = "bf16",
             warmup: int = 5, iters: int = 20, device: str | None = None,
             peak_tflops: float | None = None, progress: bool = False) -> GemmResult:
    """progress: on a CPU, say on stderr how long it will take and how far it is (a long run)."""
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
    meter = None
    if progress and dev.type == "cpu":
        meter = Progress(warmup + iters, warmup, estimate_cpu_seconds(m, n, k, torch_dtype))
    a = torch.randn(m, k, device=dev, dtype=torch_dtype)
    b = torch.randn(k, n, device=dev, dtype=torch_dtype)
    out = torch.empty(m, n, device=dev, dtype=torch_dtype)
    times = _timed_ms(lambda: torch.matmul(a, b, out=out), dev, warmup, iters, meter)
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
    peak = float(os.environ.get(names.GPU_PEAK_TFLOPS) or 0) or None
    try:
        r = run_gemm(a.M, a.N, a.K, a.dtype, iters=a.iters, peak_tflops=peak, progress=True)
    except KeyboardInterrupt:   # a terminal's Ctrl-C reaches the whole group: inv says it, not a traceback here
        return 130
    except (RuntimeError, MemoryError) as exc:   # out of memory (forced past inv's check): one line
        print(f"gemm: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}", file=sys.stderr)
        return 1
    if r.device == "cpu":
        r.peak_tflops = None
    print(json.dumps(r.to_dict()) if a.json else
          f"{r.device} {r.dtype} {r.m}x{r.n}x{r.k}: {r.median_ms:.3f} ms, {r.tflops:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    from core.signals import ctrl_c_once
    ctrl_c_once()   # inv passes on the Ctrl-C the whole group also got
    sys.exit(main())

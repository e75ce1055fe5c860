"""One device, measured on its own: a smoke test and the figures a node screen compares with floors.

    python -m benchmarks.device --device cuda:3 --what smoke --json
    python -m benchmarks.device --device cuda:3 --what perf --json

smoke: the device initialises, 256 MiB can be allocated, a 2048x2048 bf16
       GEMM gives finite values (a GPU with broken HBM or a wedged context fails
       here, in seconds). On a CPU the GEMM is 256x256: a CPU without bf16
       instructions (AVX2 only) takes about a minute for 2048^3 in bf16.
perf:  GEMM TFLOP/s (bf16 8192^3 on a GPU), HBM copy GB/s (bytes read + written
       by a 1 GiB device-to-device copy), host-to-device GB/s (pinned 256 MiB).
       On a CPU the same measurements run smaller, so the plumbing is testable;
       they are not compared with anything.

The caller runs each device in its own process with a timeout, so a hung GPU
costs its timeout, not the whole screen. Prints one JSON object with --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def timed(fn, device, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of fn() on `device` (CUDA/HIP events on a GPU, wall clock on a CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def smoke(device) -> dict:
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)
    block = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device)
    block.fill_(1)
    n = 2048 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    product = a @ a
    finite = bool(torch.isfinite(product).all())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"device": str(device), "allocated_mib": block.numel() // 2 ** 20, "gemm_finite": finite,
            "ok": finite}


def perf(device) -> dict:
    import torch

    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.set_device(device)
    n = 8192 if gpu else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    gemm_s = timed(lambda: torch.matmul(a, b, out=out), device, iters=10 if gpu else 3)
    copy_bytes = 2 ** 30 if gpu else 32 * 2 ** 20
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    h2d_bytes = 256 * 2 ** 20 if gpu else 32 * 2 ** 20
    host = torch.empty(h2d_bytes, dtype=torch.uint8, pin_memory=gpu)
    target = torch.empty(h2d_bytes, dtype=torch.uint8, device=device)
    h2d_s = timed(lambda: target.copy_(host, non_blocking=gpu), device)
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    return {"device": str(device), "name": name,
            "gemm_tflops": round(2 * n ** 3 / gemm_s / 1e12, 3),
            "hbm_gbps": round(2 * copy_bytes / copy_s / 1e9, 2),        # read + write
            "h2d_gbps": round(h2d_bytes / h2d_s / 1e9, 2),
            "sizes": {"gemm_n": n, "copy_bytes": copy_bytes, "h2d_bytes": h2d_bytes}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:N (also ROCm) or cpu")
    parser.add_argument("--what", choices=("smoke", "perf"), default="smoke")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    device = torch.device(args.device)
    try:
        result = smoke(device) if args.what == "smoke" else perf(device)
    except Exception as exc:  # noqa: BLE001 - the device's failure is the result
        result = {"device": args.device, "ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    result.setdefault("ok", True)
    print(json.dumps(result) if args.json else result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

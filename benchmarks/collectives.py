"""Collective bandwidth in the nccl-tests convention (algbw and busbw).

Run one process per GPU (or per CPU rank with gloo) under torchrun:

    torchrun --nproc-per-node 8 -m benchmarks.collectives --op all_reduce --sizes 1M,64M,1G

algbw = bytes / time; busbw = algbw x factor, where the factor makes the
figure comparable to the link speed whatever the rank count
(nccl-tests doc/PERFORMANCE.md): all_reduce 2(n-1)/n, all_gather and
reduce_scatter (n-1)/n with the full array as the size, broadcast 1.
Rank 0 prints one JSON object per size (or a table); every rank checks the
reduced values so a broken fabric fails loudly instead of looking fast.

On GPUs each timed loop is a CUDA graph of the calls, replayed (nccl-tests'
-G), so the figure is the fabric's and NCCL's, as nccl-tests reports it:
eager calls from Python cost the host about 40 us each (two H200s), more
than a 1-4 MiB all-reduce takes, so back-to-back eager calls cannot hide
behind each other below about 8 MiB. --eager times eager calls instead: what
a training loop pays per collective.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from core.files import write_atomic

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}   # torch attribute names, resolved when torch is imported
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64M' -> 67108864; plain integers are bytes."""
    t = text.strip().upper().rstrip("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = t[: -1] if unit else t
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 64M") from None
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def parse_sizes(text: str) -> list[int]:
    """'1M,64M' -> [1048576, 67108864]; an empty list is an error (it would measure nothing and pass)."""
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ValueError(f"no message size in {text!r}: give one or more, e.g. 1M,64M")
    return sizes


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")


def _run_op(op, dist, buf, chunks, out):
    if op == "all_reduce":
        dist.all_reduce(buf)
    elif op == "all_gather":     # torch >= 2.12 names it all_gather_single (the old name warns each call)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, chunks)
    elif op == "reduce_scatter":
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(chunks, buf)
    else:
        dist.broadcast(buf, src=0)


def measure(op: str, sizes: list[int], warmup: int = 5, iters: int = 20, repeats: int = 5,
            graph: bool = False, dtype: str = "") -> list[dict]:
    """Per size: `warmup` calls, then `repeats` loops of `iters` calls back to back.

    Each loop is timed as a whole and divided by `iters`, and a loop's time is
    the slowest rank's, as nccl-tests does: no host synchronisation or barrier
    between calls, so a call's launch hides behind the previous one's transfer.
    Timing each call on its own (sync, barrier, call, sync) added the
    synchronisation and launch latency to every call: 17% at 16 MiB on two
    H200s. The row's time is the median loop. The values are checked after
    timing, in one call from known contents (the timed loops reduce zeros, so
    nothing grows towards overflow however many calls run).

    graph=True captures each loop of `iters` calls once in a CUDA graph and
    times its replays (nccl-tests' -G): what is left is the fabric and NCCL's
    kernels, without the host's cost of a call (the Python call, the process
    group's bookkeeping), which back-to-back eager calls hide only where a call
    moves data for longer than the host needs to launch the next one.

    dtype: "bf16" or "fp32"; by default bf16 on GPUs (what training reduces) and fp32 under gloo.
    """
    import torch
    import torch.distributed as dist

    if iters < 1 or repeats < 1:
        raise ValueError(f"iters and repeats must be 1 or more, got {iters} and {repeats}")
    world = dist.get_world_size()
    gpu = dist.get_backend() != "gloo" and torch.cuda.is_available()
    if graph and not gpu:
        raise ValueError("graph=True needs GPUs under NCCL/RCCL: CUDA graphs capture device work only")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    dtype = getattr(torch, DTYPES[dtype]) if dtype else (torch.bfloat16 if gpu else torch.float32)
    rows = []
    for size in sizes:
        numel = max(world, size // torch.tensor([], dtype=dtype).element_size())
        numel -= numel % world  # reduce_scatter / all_gather need equal shards
        buf = torch.zeros(numel, device=device, dtype=dtype)
        chunk = torch.zeros(numel // world, device=device, dtype=dtype)
        out = torch.empty(numel, device=device, dtype=dtype)
        for _ in range(warmup):
            _run_op(op, dist, buf, chunk, out)
        loop = _captured_loop(op, dist, buf, chunk, out, iters, device) if graph else None
        loops = [_timed_loop(op, dist, buf, chunk, out, iters, device, loop) for _ in range(repeats)]
        t = statistics.median(loops)
        _checked_call(op, dist, buf, chunk, out)
        nbytes = numel * buf.element_size()
        algbw = nbytes / t / 1e9
        rows.append({"op": op, "bytes": nbytes, "ranks": world, "launch": "graph" if graph else "eager",
                     "dtype": str(dtype).removeprefix("torch."),
                     "time_us": t * 1e6,
                     "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, world)})
    return rows


class GraphCaptureError(RuntimeError):
    """The collective library refused to be captured in a CUDA graph."""


def _captured_loop(op, dist, buf, chunk, out, iters: int, device):
    """A CUDA graph of `iters` calls back to back. Captured thread-locally: the process group's
    watchdog thread keeps querying its own events while this thread captures."""
    import torch

    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(iters):
                _run_op(op, dist, buf, chunk, out)
    except RuntimeError as exc:   # a library build that cannot capture its collectives
        raise GraphCaptureError(f"{op} could not be captured in a CUDA graph ({exc}); "
                                "time eager calls instead (--eager)") from None
    torch.cuda.synchronize(device)
    return graph


def _timed_loop(op, dist, buf, chunk, out, iters: int, device, graph=None) -> float:
    """Seconds per call of `iters` calls back to back (or one replay of their captured `graph`);
    the slowest rank's figure."""
    import torch

    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.synchronize(device)
    dist.barrier()
    if gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Line the ranks up on the device, not the host: the processes leave the barrier tens of
        # microseconds apart, and a rank that starts its clock first would count the wait for the
        # other inside its first call (a 20-call loop of 1 MiB all-reduces lasts about 400 us).
        # This collective is queued ahead of the clock and ends on every GPU at once, so the loop
        # behind it starts together wherever the hosts are.
        dist.all_reduce(torch.zeros(1, device=device))
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(iters):
                _run_op(op, dist, buf, chunk, out)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            _run_op(op, dist, buf, chunk, out)
        seconds = (time.perf_counter() - t0) / iters
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _checked_call(op, dist, buf, chunk, out) -> None:
    """One call from known contents (rank r holds r + 1), then every rank checks the result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf.fill_(float(rank + 1))
    chunk.fill_(float(rank + 1))
    _run_op(op, dist, buf, chunk, out)
    _check(op, buf, chunk, out, rank, world)


def _check(op, buf, chunk, out, rank, world):
    """Every rank verifies the collective's result: speed means nothing if the sums are wrong."""
    import torch

    total = world * (world + 1) / 2
    if op == "all_reduce":
        ok = torch.all(buf == total)
    elif op == "all_gather":
        expected = torch.arange(1, world + 1, dtype=out.dtype, device=out.device)
        ok = torch.equal(out.view(world, -1)[:, 0], expected)
    elif op == "reduce_scatter":
        ok = torch.all(chunk == total)
    else:
        ok = torch.all(buf == 1.0)
    if not bool(ok):
        raise RuntimeError(f"{op} returned wrong values on rank {rank}: the fabric or library is broken")


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="timed loops of --iters calls; the median is reported")
    p.add_argument("--eager", action="store_true",
                   help="on GPUs, time eager calls (a training loop's cost per call) instead of replays of "
                        "a CUDA graph of each loop (nccl-tests -G, the fabric's figure)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="",
                   help="element type (default: bf16 on GPUs, fp32 under gloo); nccl-tests' -d float is fp32")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="rank 0 also writes the JSON report to this file (atomically)")
    a = p.parse_args(argv)
    try:
        sizes = parse_sizes(a.sizes)
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    if a.iters < 1 or a.warmup < 0 or a.repeats < 1:
        p.error("--iters and --repeats must be 1 or more and --warmup 0 or more")
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # nccl is RCCL on ROCm builds
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        rows = measure(a.op, sizes, a.warmup, a.iters, a.repeats, graph=backend == "nccl" and not a.eager,
                       dtype=a.dtype)
    except GraphCaptureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        report = {"backend": backend, "results": rows}
        if a.out:
            write_atomic(a.out, json.dumps(report, indent=1))
        if a.json:
            print(json.dumps(report))
        else:
            from tabulate import tabulate

            print(tabulate([[r["op"], r["bytes"], r["ranks"], r["launch"], f"{r['time_us']:.1f}",
                             f"{r['algbw_GBps']:.2f}", f"{r['busbw_GBps']:.2f}"] for r in rows],
                           headers=["op", "bytes", "ranks", "launch", "time us", "algbw GB/s", "busbw GB/s"]))
    return 0


if __name__ == "__main__":
    from core.signals import ctrl_c_once
    ctrl_c_once()   # the agent passes on the Ctrl-C the whole group also got
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # a terminal's Ctrl-C reaches every rank: inv says it once, no traceback per rank
        sys.exit(130)

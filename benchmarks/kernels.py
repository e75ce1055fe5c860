"""Kernel benchmarks: our fused kernels against eager PyTorch, torch.compile and Liger-Kernel.

    python -m benchmarks.kernels [--op rms_norm|rope|swiglu|cross_entropy|flce|grouped_gemm|moe_permute|router|all]
                                 [--json] [--quick] [--out FILE] [--providers anvil,eager,...]

Forward + backward, in one run: the device's ceilings first (a device-to-device
copy, counting bytes read + written, and a bf16 8192^3 matmul), then every case
with every provider on fresh random inputs. Time is the median of
triton.testing.do_bench (on CPU, used by the tests only, a wall-clock median).
Peak memory is measured above what was allocated before the call. Each row
gives its ratio to the best other provider (best other time / this time: above
1 means faster than all the others).

Cases live in benchmarks/cases_loss.py, benchmarks/cases_elementwise.py and
benchmarks/cases_moe.py as `CASES: list[Case]`; a provider's factory raises
Unavailable (-> "n/a") when it cannot run (Liger-Kernel not installed, say). A
case may bring providers beyond PROVIDERS (the MoE cases' torch: torch._grouped_mm);
they are timed after the usual four.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from core import files
from core.errors import UserError

PROVIDERS = ("anvil", "eager", "compile", "liger")
OPS = ("rms_norm", "rope", "swiglu", "cross_entropy", "flce", "grouped_gemm", "moe_permute", "router")
CASE_MODULES = ("benchmarks.cases_elementwise", "benchmarks.cases_loss", "benchmarks.cases_moe")


class Unavailable(Exception):
    """A provider that cannot run here; the message is shown in the table."""


class KernelBenchError(UserError):
    """User-facing failure (no GPU, unknown op, unwritable output)."""


@dataclass
class Case:
    op: str
    shape: str
    setup: Callable[[Any], dict]  # device -> state (fresh random inputs)
    providers: dict[str, Callable[[dict], Callable[[], None]]]  # name -> make(state) -> fn (fwd+bwd once)
    bytes_moved: int | None = None  # fewest bytes for fwd+bwd: TB/s and the memory floor
    flops: int | None = None  # for TFLOP/s and the compute floor
    grad_to_none: Callable[[dict], list] = field(default=lambda state: [])


@dataclass
class Ceilings:
    copy_tbps: float  # device-to-device copy, bytes read + written
    matmul_tflops: float  # bf16 (fp32 on CPU) square matmul

    def floor_ms(self, case: Case) -> float | None:
        if case.flops:
            return case.flops / (self.matmul_tflops * 1e12) * 1e3
        if case.bytes_moved:
            return case.bytes_moved / (self.copy_tbps * 1e12) * 1e3
        return None


# ---------------------------------------------------------------- timing

def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def time_ms(fn: Callable[[], None], device, quick: bool = False, grad_to_none: list | None = None) -> float:
    """Median milliseconds of fn(): do_bench on a GPU, perf_counter on CPU."""
    if _is_cuda(device):
        import triton.testing
        warmup, rep = (25, 100) if quick else (100, 500)
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                             return_mode="median"))
    fn()  # warm-up
    samples = []
    for _ in range(3 if quick else 7):
        for t in grad_to_none or []:
            t.grad = None
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_memory_gib(fn: Callable[[], None], device, grad_to_none: list) -> float | None:
    """Peak allocated during one fn() above what was allocated before it (GPU only)."""
    if not _is_cuda(device):
        return None
    import torch
    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gpu_kernels(fn: Callable[[], None]) -> list[str]:
    """The names of the GPU kernels one fn() launches, each once, in first-launch order (memsets and
    copies left out): which cuBLAS or Triton kernel a call really gets."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()                                   # warm: autotuning and first-call set-up are not the call
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return list(dict.fromkeys(n for n in names if not n.startswith(("Memset", "Memcpy"))))


def measure_ceilings(device, quick: bool = False) -> Ceilings:
    """Copy bandwidth and matmul rate of this device, measured now."""
    import torch
    gpu = _is_cuda(device)
    n_bytes = (1 << 30) if gpu else (32 << 20)
    src = torch.randint(-100, 100, (n_bytes // 2,), dtype=torch.int16, device=device).view(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, quick)
    del src, dst
    m = 8192 if gpu else 256
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    mm_ms = time_ms(lambda: torch.mm(a, b), device, quick)
    return Ceilings(copy_tbps=2 * n_bytes / (copy_ms * 1e-3) / 1e12, matmul_tflops=2 * m**3 / (mm_ms * 1e-3) / 1e12)


# ---------------------------------------------------------------- measuring cases

def load_cases(op: str = "all") -> tuple[list[Case], list[str]]:
    """Cases for `op` from the case modules; notes name modules that could not be imported."""
    if op != "all" and op not in OPS:
        raise KernelBenchError(f"unknown op {op!r}; choose one of {', '.join(OPS)} or all")
    cases, notes = [], []
    for name in CASE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            notes.append(f"{name} not loaded: {exc}")
            continue
        cases += [c for c in module.CASES if op == "all" or c.op == op]
    return cases, notes


def measure_case(case: Case, device, ceilings: Ceilings, quick: bool = False,
                 providers: tuple[str, ...] | None = None) -> list[dict]:
    """One row per provider (default: PROVIDERS, then the case's own others): time, throughput, % of
    ceiling, peak memory (ratio added later)."""
    import torch
    if providers is None:
        providers = (*PROVIDERS, *(p for p in case.providers if p not in PROVIDERS))
    rows = []
    for name in providers:
        make = case.providers.get(name)
        row = {"op": case.op, "shape": case.shape, "provider": name, "ms": None, "throughput": None,
               "unit": "TFLOP/s" if case.flops else "TB/s", "pct_ceiling": None, "peak_gib": None,
               "floor_ms": ceilings.floor_ms(case), "ratio": None, "note": ""}
        rows.append(row)
        if make is None:
            row["note"] = "n/a: no such provider for this op"
            continue
        state = None
        try:
            state = case.setup(device)
            fn = make(state)
            leaves = case.grad_to_none(state)
            fn()  # compile / autotune outside the timing
            row["peak_gib"] = peak_memory_gib(fn, device, leaves)
            row["ms"] = time_ms(fn, device, quick, leaves)
        except Unavailable as exc:
            row["note"] = f"n/a: {exc}"
        except torch.cuda.OutOfMemoryError:
            row["note"] = "out of memory"
        except Exception as exc:  # one provider failing must not lose the others' rows
            row["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        finally:
            del state
            if _is_cuda(device):
                torch.cuda.empty_cache()
        if row["ms"]:
            if case.flops:
                row["throughput"] = case.flops / (row["ms"] * 1e-3) / 1e12
                row["pct_ceiling"] = 100 * row["throughput"] / ceilings.matmul_tflops
            elif case.bytes_moved:
                row["throughput"] = case.bytes_moved / (row["ms"] * 1e-3) / 1e12
                row["pct_ceiling"] = 100 * row["throughput"] / ceilings.copy_tbps
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """ratio = best time among the other providers of the same case / this time."""
    for row in rows:
        others = [r["ms"] for r in rows if r is not row and r["op"] == row["op"] and r["shape"] == row["shape"]
                  and r["ms"]]
        row["ratio"] = min(others) / row["ms"] if others and row["ms"] else None
    return rows


HEADERS = ["op", "shape", "provider", "time (ms)", "achieved", "% of ceiling", "peak mem (GiB)",
           "vs best other", "floor (ms)", "note"]


def table_rows(rows: list[dict]) -> list[list]:
    def f(v, fmt):
        return format(v, fmt) if v is not None else "n/a"
    out = []
    for r in rows:
        achieved = f"{r['throughput']:.2f} {r['unit']}" if r["throughput"] is not None else "n/a"
        out.append([r["op"], r["shape"], r["provider"], f(r["ms"], ".3f"), achieved, f(r["pct_ceiling"], ".1f"),
                    f(r["peak_gib"], ".2f"), f(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else ""),
                    f(r["floor_ms"], ".3f"), r["note"]])
    return out


#: What the table's head and the JSON report carry near their start: an --out file holding either is a
#: report of this benchmark, which --out may replace (core.files.not_ours).
MARKS = ("ceilings measured now: copy", '"ceilings": {')


def check_out(path: str, force: bool = False) -> None:
    """KernelBenchError (one line) before any measuring, for an --out that is a folder or a file this
    benchmark did not write (unless `force`)."""
    if Path(path).is_dir():
        raise KernelBenchError(f"--out {path} is a directory; expected a file path such as {Path(path) / 'kernels.txt'}")
    files.refuse_foreign(path, KernelBenchError, MARKS, "a report bench.kernels wrote", force=force)


def render(report: dict) -> str:
    from tabulate import tabulate
    c = report["ceilings"]
    head = (f"device: {report['device']}  torch {report['versions']['torch']}  triton {report['versions']['triton']}"
            f"  liger {report['versions']['liger_kernel']}  {report['date']}\n"
            f"ceilings measured now: copy {c['copy_tbps']:.2f} TB/s (read + write), "
            f"matmul {c['matmul_tflops']:.1f} TFLOP/s\n")
    notes = "".join(f"note: {n}\n" for n in report["notes"])
    return head + notes + tabulate(table_rows(report["rows"]), headers=HEADERS, tablefmt="github")


def _versions() -> dict:
    import torch
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "liger_kernel", "transformers"):
        try:
            from importlib.metadata import version
            out[name] = version(name.replace("_", "-"))
        except Exception:
            out[name] = "n/a"
    return out


def run(op: str = "all", quick: bool = False, device: str = "cuda", cases: list[Case] | None = None,
        providers: tuple[str, ...] | None = None) -> dict:
    """Measure ceilings then every case (with `providers`, only those); return the report dict (rows,
    ceilings, device, versions)."""
    import torch
    if _is_cuda(device) and not torch.cuda.is_available():
        raise KernelBenchError("bench.kernels needs a CUDA or ROCm GPU, and torch sees none "
                               "(torch.cuda.is_available() is False)")
    notes = []
    if cases is None:
        cases, notes = load_cases(op)
    name = torch.cuda.get_device_name() if _is_cuda(device) else f"cpu ({platform.processor() or 'unknown'})"
    ceilings = measure_ceilings(device, quick)
    rows = []
    for case in cases:
        rows += measure_case(case, device, ceilings, quick, providers)
    return {"device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "versions": _versions(), "command": " ".join(sys.argv), "quick": quick,
            "ceilings": {"copy_tbps": ceilings.copy_tbps, "matmul_tflops": ceilings.matmul_tflops},
            "notes": notes, "rows": rows}


def write_atomic(path: str, text: str) -> None:
    try:
        files.write_atomic(path, text)
    except OSError as exc:
        raise KernelBenchError(f"cannot write {path}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--op", default="all", help=f"one of {', '.join(OPS)}, or all")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="shorter timing (fewer repetitions)")
    parser.add_argument("--out", help="also write the table (or JSON with --json) to this file")
    parser.add_argument("--force", action="store_true", help="write over an --out file this benchmark did not write")
    parser.add_argument("--providers", help="only these, comma-separated (say anvil,eager: no torch.compile)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip()) if args.providers else None
    try:
        if args.out:
            check_out(args.out, args.force)
        report = run(args.op, args.quick, args.device, providers=providers)
        text = json.dumps(report, indent=2) if args.json else render(report)
        if args.out:
            write_atomic(args.out, text + "\n")
    except KernelBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's time went, from one rank's trace: ms per step and share, by category.

    bd = breakdown(trace_or_path, steps=3, wall_ms=812.4)   # wall_ms: the window's measured time
    bd["rows"]      # [{"category": "gemm", "label": "GEMM", "ms": 170.2, "share": 0.629}, ...,
                    #  {"category": "communication", ..., "ms": 3.1 (exposed), "total_ms": 40.2},
                    #  {"category": "idle", "label": "GPU idle", ...}]
    legacy_split(bd, step_time_s)   # the benchmark's columns: matmul, attention, communication, other, idle

A category's time is the sum of its kernels' durations (categories.py says
which kernel is which). Communication is given twice: all of it, and the part
exposed (NCCL/RCCL kernels running while no compute kernel runs), which is
what it costs the step. GPU idle is the window's time with nothing on the GPU:
the measured wall time of the window (StepProfiler measures it, synchronised at
both ends) less the union of all GPU events, or without a wall time the span
from the first GPU event to the last. Per step: divided by the steps profiled.
The rows (communication by its exposed part) add up to the step, less
overlap_ms: the time of kernels that ran at once on several streams (a copy
beside compute), which is in two rows.
"""
from __future__ import annotations

from pathlib import Path

import trainer.profiling.categories as cats
from trainer.profiling.trace import HostStacks, gpu_events, length, load, minus, span, union

TOP = 12


def breakdown(trace: str | Path | dict, steps: int, wall_ms: float | None = None, top: int = TOP) -> dict:
    """The step-time table of one rank's trace of `steps` steps ({"error": ...} when it has no GPU events)."""
    doc = trace if isinstance(trace, dict) else load(trace)
    events = gpu_events(doc)
    if not events:
        return {"error": "no GPU kernels in the trace (a CPU run, or a trace without the CUDA activity)",
                "steps": steps}
    stacks = HostStacks(doc)
    per_cat = dict.fromkeys(cats.KEYS, 0.0)
    compute, comm, totals, by_shape = [], [], {}, {}
    for e in events:
        name = e.get("name", "")
        cat = cats.category(name, stacks.ops(e), e.get("cat", "kernel"))
        start, end = span(e)
        per_cat[cat] += end - start
        (comm if cat == "communication" else compute).append((start, end))
        short = name[:100]
        totals[(cat, short)] = totals.get((cat, short), 0.0) + end - start
        # The launch grid tells same-named kernels of different shapes apart (a GEMM's M x N tiles).
        shaped = (cat, short, str((e.get("args") or {}).get("grid", "")))
        by_shape[shaped] = by_shape.get(shaped, 0.0) + end - start
    compute_u, comm_u = union(compute), union(comm)
    busy = union(compute + comm)
    first, last = busy[0][0], busy[-1][1]
    window_us = wall_ms * 1e3 if wall_ms else last - first
    per_step = 1e-3 / steps
    step_ms = window_us * per_step
    exposed = minus(comm_u, compute_u) * per_step
    idle = max(0.0, window_us - length(busy)) * per_step

    def row(key: str, label: str, ms: float, **extra) -> dict:
        return {"category": key, "label": label, "ms": round(ms, 3), "share": round(ms / step_ms, 4) if step_ms else 0.0,
                **extra}

    rows = []
    for key, label in cats.CATEGORIES:
        ms = per_cat[key] * per_step
        if key == "communication":
            rows.append(row(key, "communication (exposed)", exposed, total_ms=round(ms, 3)))
        else:
            rows.append(row(key, label, ms))
    rows.append(row("idle", "GPU idle", idle))
    # Kernels running at once on several streams (a copy beside compute) are in two rows' time.
    counted = sum(per_cat[k] for k in cats.KEYS if k != "communication") * per_step + exposed
    return {
        "steps": steps,
        "step_ms": round(step_ms, 3),
        "step_source": "wall" if wall_ms else "trace",
        "gpu_busy_ms": round(length(busy) * per_step, 3),
        "trace_span_ms": round((last - first) * per_step, 3),
        "rows": rows,
        "communication_total_ms": round(per_cat["communication"] * per_step, 3),
        "communication_exposed_ms": round(exposed, 3),
        "idle_ms": round(idle, 3),
        "overlap_ms": round(max(0.0, counted - length(busy) * per_step), 3),
        "top_kernels": [[cat, name, round(us * per_step, 3)]
                        for (cat, name), us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]],
        "top_by_category": {cat: [[name, grid, round(us * per_step, 3)]
                                  for (c, name, grid), us in sorted(by_shape.items(), key=lambda kv: -kv[1])
                                  if c == cat][:10]
                            for cat in cats.KEYS if per_cat[cat]},
        "idle_gaps": idle_gaps(events, stacks, steps),
    }


def row_of(bd: dict, key: str) -> dict:
    return next(r for r in bd["rows"] if r["category"] == key)


def ms_of(bd: dict, key: str) -> float:
    """ms per step of a category (communication: all of it, exposed or hidden)."""
    if key == "communication":
        return bd.get("communication_total_ms", 0.0)
    return row_of(bd, key)["ms"]


def legacy_split(bd: dict, step_time_s: float | None = None) -> dict:
    """The benchmark's columns (BENCHMARKS.md's tables): matmul (GEMMs, FP8 ones included), attention,
    communication (all / exposed), other kernels (everything else on the GPU), idle; and with the measured
    step time, everything else = that step less matmul, attention and exposed communication."""
    if "error" in bd:
        return dict(bd)
    matmul = ms_of(bd, "gemm") + ms_of(bd, "gemm_fp8")
    attention = ms_of(bd, "attention")
    other = sum(ms_of(bd, key) for key in cats.KEYS if key not in ("gemm", "gemm_fp8", "attention", "communication"))
    out = {"steps": bd["steps"], "window_ms": bd["trace_span_ms"], "matmul_ms": round(matmul, 3),
           "attention_ms": round(attention, 3), "other_kernels_ms": round(other, 3),
           "communication_ms": bd["communication_total_ms"],
           "exposed_communication_ms": bd["communication_exposed_ms"], "idle_ms": bd["idle_ms"]}
    if step_time_s:
        out["step_ms"] = round(step_time_s * 1000, 2)
        out["everything_else_ms"] = round(step_time_s * 1000 - matmul - attention - out["exposed_communication_ms"],
                                          2)
    return out


def idle_gaps(events: list[dict], stacks: HostStacks, steps: int, min_us: float = 20.0, top: int = TOP) -> dict:
    """Where the GPU sat idle, and what the host was doing meanwhile: every gap of min_us or more with no GPU
    event on any stream, charged to the host ops running at the gap's middle on the thread that launched the
    event after it (its outermost and innermost: the backward runs on the autograd thread, the rest on the
    main one). ms and gaps per step by (outer, inner), the longest gaps, and a histogram of gap lengths."""
    order = sorted(events, key=lambda e: float(e["ts"]))
    busy_until, previous = None, None
    charged: dict = {}
    longest, short_us, total_us, count = [], 0.0, 0.0, 0
    for e in order:
        start, end = span(e)
        if busy_until is not None and start - busy_until >= min_us:
            gap = start - busy_until
            ops = stacks.at(stacks.thread_of(e), (busy_until + start) / 2)
            outer = ops[-1][:60] if ops else "(no host event)"
            inner = ops[0][:60] if ops else ""
            ms, n = charged.get((outer, inner), (0.0, 0))
            charged[(outer, inner)] = (ms + gap, n + 1)
            longest.append((gap, previous, e.get("name", "")[:60], outer, inner))
            total_us += gap
            count += 1
            short_us += gap if gap < 200 else 0.0
        if busy_until is None or end > busy_until:
            busy_until, previous = end, e.get("name", "")[:60]
    per_step = 1e-3 / steps
    return {"min_us": min_us, "gaps_per_step": round(count / steps, 1), "ms_per_step": round(total_us * per_step, 3),
            "short_gap_share": round(short_us / total_us, 3) if total_us else 0.0,
            "by_host_op": [[outer, inner, round(us * per_step, 3), round(n / steps, 1)]
                           for (outer, inner), (us, n) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]],
            "longest": [[round(gap, 1), before, after, outer, inner]
                        for gap, before, after, outer, inner in sorted(longest, key=lambda g: -g[0])[:top]]}

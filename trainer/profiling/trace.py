"""A torch.profiler (Kineto) chrome trace, read for what ran on the GPU and what launched it.

    doc = load(path)                         # .json or .json.gz
    for event in gpu_events(doc): ...         # kernels, memory copies and sets
    stacks = HostStacks(doc)
    stacks.ops(kernel)                        # ["aten::mul", "Optimizer.step#AdamW.step", ...], innermost first

The same format on CUDA (CUPTI) and ROCm (roctracer): GPU events carry
``cat`` kernel / gpu_memcpy / gpu_memset and, in ``args``, the ``External id``
of the host op that launched them and the ``correlation`` of the launch call.
Times are microseconds.
"""
from __future__ import annotations

import gzip
import json
from bisect import bisect_right
from pathlib import Path
from typing import Iterable

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_OP_CATS = ("cpu_op", "user_annotation", "python_function")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


class TraceError(ValueError):
    pass


def load(path: str | Path) -> dict:
    """The trace as a dict; a bare event list (some exporters write one) becomes {"traceEvents": [...]}."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: not a readable chrome trace ({exc})") from None
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{path}: no traceEvents list")
    return doc


def gpu_events(doc: dict) -> list[dict]:
    """Complete events that ran on a GPU (GPU-side annotations, which repeat their kernels' time, are left out)."""
    return [e for e in doc.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "ts" in e]


def span(event: dict) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0) or 0)


class HostStacks:
    """For a GPU event, the host ops around its launch: the op with the event's External id (or, without
    one, the launch call with its correlation id), then the ops enclosing it on its thread, innermost first."""

    def __init__(self, doc: dict):
        self._by_external: dict = {}
        self._launch_by_correlation: dict = {}
        per_thread: dict = {}
        for e in doc.get("traceEvents", []):
            if e.get("ph") != "X" or "ts" not in e:
                continue
            cat = e.get("cat")
            if cat in HOST_OP_CATS:
                per_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
                external = (e.get("args") or {}).get("External id")
                if external is not None and cat != "python_function":
                    self._by_external.setdefault(external, e)
            elif cat in LAUNCH_CATS:
                per_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
                correlation = (e.get("args") or {}).get("correlation")
                if correlation is not None:
                    self._launch_by_correlation[correlation] = e
        # Host events nest on a thread: one sweep in start order (longer first at a tie) with a stack of
        # the open ones gives each its parent.
        self._parent: dict = {}
        self._threads: dict = {}
        for thread, events in per_thread.items():
            events.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0) or 0)))
            stack: list = []
            for e in events:
                start = float(e["ts"])
                while stack and span(stack[-1])[1] < start:
                    stack.pop()
                self._parent[id(e)] = stack[-1] if stack else None
                stack.append(e)
            self._threads[thread] = ([float(e["ts"]) for e in events], events)
        self._cache: dict = {}

    def ops(self, event: dict) -> list[str]:
        args = event.get("args") or {}
        anchor = self._by_external.get(args.get("External id"))
        if anchor is None:
            anchor = self._launch_by_correlation.get(args.get("correlation"))
            if anchor is None:
                return []
        key = id(anchor)
        if key not in self._cache:
            names, at = [], anchor
            if at.get("cat") not in HOST_OP_CATS:      # a launch call: its parents, not itself
                at = self._parent.get(id(at))
            while at is not None and len(names) < 64:
                names.append(at.get("name", ""))
                at = self._parent.get(id(at))
            self._cache[key] = names
        return self._cache[key]

    def thread_of(self, event: dict) -> tuple | None:
        """The host thread that launched a GPU event (pid, tid), or None."""
        launch = self._launch_by_correlation.get((event.get("args") or {}).get("correlation"))
        return (launch.get("pid"), launch.get("tid")) if launch is not None else None

    def at(self, thread: tuple | None, t: float) -> list[str]:
        """The host ops (and runtime call) running on `thread` at time `t`, innermost first."""
        starts, events = self._threads.get(thread, ([], []))
        i = bisect_right(starts, t) - 1
        at = events[i] if i >= 0 else None
        while at is not None and span(at)[1] < t:     # a closed sibling: climb to what still runs
            at = self._parent.get(id(at))
        names = []     # a runtime call the thread is in (cudaStreamSynchronize) is the innermost
        while at is not None and len(names) < 64:
            names.append(at.get("name", ""))
            at = self._parent.get(id(at))
        return names


# ---------------------------------------------------------------- intervals (microseconds)

def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) not covered by union(b); both already unions."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


# ---------------------------------------------------------------- excerpts (test data from a real trace)

_KEPT_ARGS = ("External id", "correlation", "device", "stream", "grid", "Sequence number", "Fwd thread id")


def excerpt(doc: dict, start_us: float, end_us: float, by_launch: bool = False) -> dict:
    """A small trace of [start_us, end_us) that the breakdown reads as it reads the whole: the GPU events
    starting in it (by_launch: launched in it, so that one step's host time picks that step's kernels,
    which run later), their launch calls, the host ops around those launches and around the idle gaps,
    and of every event only the fields the breakdown reads. For tests: a step of a real trace in a few
    hundred KB."""
    events = doc.get("traceEvents", [])
    stacks = HostStacks(doc)

    def when(e):
        if not by_launch:
            return float(e["ts"])
        launch = stacks._launch_by_correlation.get((e.get("args") or {}).get("correlation"))
        return float(launch["ts"]) if launch is not None else float(e["ts"])

    gpu = [e for e in gpu_events({"traceEvents": events}) if start_us <= when(e) < end_us]
    if by_launch and gpu:     # the host ops of the gaps: over the GPU's time of those kernels
        start_us, end_us = min(span(e)[0] for e in gpu), max(span(e)[1] for e in gpu)
    keep: dict = {}
    for e in gpu:
        keep[id(e)] = e
        args = e.get("args") or {}
        anchor = stacks._by_external.get(args.get("External id"))
        launch = stacks._launch_by_correlation.get(args.get("correlation"))
        for at in (anchor, launch):
            while at is not None and id(at) not in keep:
                keep[id(at)] = at
                at = stacks._parent.get(id(at))
    # and what the host was doing in the window's idle gaps (idle_gaps charges them to it)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_OP_CATS + LAUNCH_CATS and "ts" in e:
            s, t = span(e)
            if s < end_us and t > start_us and t - s >= 20:
                keep.setdefault(id(e), e)
    out = []
    for e in keep.values():
        slim = {k: e[k] for k in ("ph", "cat", "name", "pid", "tid", "ts", "dur") if k in e}
        args = {k: v for k, v in (e.get("args") or {}).items() if k in _KEPT_ARGS}
        if args:
            slim["args"] = args
        out.append(slim)
    out.sort(key=lambda e: (float(e["ts"]), str(e.get("pid")), str(e.get("tid"))))
    meta = {k: v for k, v in doc.items() if k in ("schemaVersion", "deviceProperties", "distributedInfo")}
    return {**meta, "traceEvents": out}


def write_gz(doc: dict, path: str | Path) -> Path:
    """A trace as .json.gz (deterministic: no name or time in the gzip header)."""
    from core.files import write_atomic

    data = gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), mtime=0)
    return write_atomic(path, data)

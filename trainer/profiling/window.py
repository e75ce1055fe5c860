"""Rank-targeted profiling of a few training steps: torch.profiler, or a vendor tool's capture range.

Profiling all 1024 ranks of a job buries the one trace you need, so only the
ranks and steps asked for are recorded (LUMI AI guide: profile one rank).
The runner asks through the environment, so the trainer's command line stays
the same under torchrun, srun or a container:

    names.PROFILE_STEPS=3:6     steps 3, 4 and 5 (the first steps include compile and warm-up)
    names.PROFILE_RANKS=0,8     global ranks to profile, or "all" (default 0)
    names.PROFILE_TOOL=ncu      nsys | ncu | rocprofv3 | rocprofv3-counters: the rank runs under that tool
                                (runtime.launch.tools),
                                which records only between the window's start and stop calls

Each profiled rank writes into RUN_DIR/profile/:
  rank{R}.trace.json       the torch.profiler trace (Perfetto, chrome://tracing)
  rank{R}.ops.json         the operators that took the most time
  rank{R}.breakdown.json   step time by category (trainer.profiling.breakdown), the window's wall time
With a vendor tool the tool writes its own files there and the rank writes
rank{R}.window.json (steps, wall time) only: two profilers on one GPU at once
(CUPTI's subscribers) disturb each other.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

from core import names
from core.errors import UserError
from core.files import write_atomic

TOP_OPS = 25
TOOLS = ("nsys", "ncu", "rocprofv3", "rocprofv3-counters")


class ProfileSettingsError(UserError):
    pass


def parse_steps(text: str) -> tuple[int, int]:
    """'3:6' -> (3, 6), end exclusive; '5' -> (5, 6)."""
    try:
        if ":" in text:
            start_text, end_text = text.split(":", 1)
            start, end = int(start_text), int(end_text)
        else:
            start = int(text)
            end = start + 1
    except ValueError:
        raise ProfileSettingsError(f"{names.PROFILE_STEPS}={text!r}: expected START:END, e.g. 3:6") from None
    if start < 1 or end <= start:
        raise ProfileSettingsError(f"{names.PROFILE_STEPS}={text!r}: need 1 <= START < END")
    return start, end


def parse_ranks(text: str) -> set[int] | None:
    """'0,8' -> {0, 8}; 'all' -> None (every rank)."""
    if text.strip().lower() == "all":
        return None
    try:
        return {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        raise ProfileSettingsError(f"{names.PROFILE_RANKS}={text!r}: expected a list like 0,8 or 'all'") from None


def parse_tool(text: str) -> str:
    tool = text.strip().lower()
    if tool and tool not in TOOLS:
        raise ProfileSettingsError(f"{names.PROFILE_TOOL}={text!r}: expected one of {', '.join(TOOLS)} (or empty: "
                                   "torch.profiler)")
    return tool


class StepProfiler:
    """Call ``step_done(step)`` after every optimizer step; it records [start, end)."""

    def __init__(self, run_dir: Path | str, rank: int, start: int, end: int, tool: str = ""):
        self.dir = Path(run_dir) / names.PROFILE_DIR
        self.rank, self.start, self.end, self.tool = rank, start, end, tool
        self._prof = None
        self._capturing = False
        self._recorded = False
        self._t0 = 0.0

    @classmethod
    def from_env(cls, run_dir: Path | str, rank: int, environ=os.environ) -> "StepProfiler | None":
        steps = environ.get(names.PROFILE_STEPS, "").strip()
        if not steps:
            return None
        start, end = parse_steps(steps)
        ranks = parse_ranks(environ.get(names.PROFILE_RANKS, "0"))
        if ranks is not None and rank not in ranks:
            return None
        return cls(run_dir, rank, start, end, parse_tool(environ.get(names.PROFILE_TOOL, "")))

    @property
    def active(self) -> bool:
        return self._prof is not None or self._capturing

    def step_done(self, step: int) -> None:
        """``step`` is the number of optimizer steps completed so far; called once more before the
        first step with the step the run starts from (0, or a resumed run's), so that a window from
        step 1, or one a resumed run starts inside, is recorded too."""
        if not self.active and not self._recorded and self.start - 1 <= step < self.end - 1:
            self._begin()
        elif self.active and step >= self.end - 1:
            self._finish()

    def close(self) -> None:
        """A run that ends inside the window still leaves its trace."""
        if self.active:
            self._finish()

    def _begin(self) -> None:
        import torch

        _synchronize()     # the window starts with the GPU's queue empty, so its wall time is the steps'
        if self.tool:
            capture(self.tool, start=True)
            self._capturing = True
        else:
            from torch.profiler import ProfilerActivity, profile

            # Kineto prints "USDT: ... profiler_start/stop" and stage lines on every trace; its levels put ERROR
            # under those, so only a level past them all is quiet. KINETO_LOG_LEVEL set by the user wins.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():  # CUDA and ROCm (roctracer) both appear as CUDA here
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
            self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _finish(self) -> None:
        _synchronize()
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        self._recorded = True
        self.dir.mkdir(parents=True, exist_ok=True)
        window = {"rank": self.rank, "steps": [self.start, self.end], "wall_ms": round(wall_ms, 3)}
        if self._capturing:
            self._capturing = False
            capture(self.tool, start=False)
            write_atomic(self.dir / f"rank{self.rank}.window.json", json.dumps({**window, "tool": self.tool}, indent=1))
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        trace = self.dir / f"rank{self.rank}.trace.json"
        tmp = trace.with_suffix(".tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        write_atomic(self.dir / f"rank{self.rank}.ops.json",
                     json.dumps({**window, "ops": top_ops(prof)}, indent=1))
        write_atomic(self.dir / f"rank{self.rank}.breakdown.json",
                     json.dumps({**window, "breakdown": _breakdown(trace, self.end - self.start, wall_ms)}, indent=1))


def _breakdown(trace: Path, steps: int, wall_ms: float) -> dict:
    """The step-time table, or {"error": ...}: a failure here must not cost the run its trace."""
    from trainer.profiling.breakdown import breakdown

    try:
        return breakdown(trace, steps, wall_ms)
    except Exception as exc:  # noqa: BLE001 - reported in the file, the trace stays
        return {"error": f"{type(exc).__name__}: {exc}", "steps": steps}


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def capture(tool: str, start: bool) -> None:
    """Open or close the vendor tool's capture range: cudaProfilerStart/Stop for nsys
    (--capture-range=cudaProfilerApi) and ncu (--profile-from-start off); ROCTx's profiler resume/pause
    for rocprofv3 (--selected-regions)."""
    import torch

    if not torch.cuda.is_available():
        if start:
            print(f"anvil profile: no GPU in this process: {tool} has nothing to record", file=sys.stderr, flush=True)
        return
    if tool in ("nsys", "ncu"):
        (torch.cuda.profiler.start if start else torch.cuda.profiler.stop)()
        return
    lib = _roctx()
    if lib is None:
        print("anvil profile: librocprofiler-sdk-roctx is not loadable here: rocprofv3 --selected-regions records "
              "nothing (ROCm 6.2 or later ships it)", file=sys.stderr, flush=True)
        return
    (lib.roctxProfilerResume if start else lib.roctxProfilerPause)(0)


_ROCTX: list = []


def _roctx():
    if not _ROCTX:
        for name in ("librocprofiler-sdk-roctx.so.1", "librocprofiler-sdk-roctx.so"):
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            for fn in ("roctxProfilerResume", "roctxProfilerPause"):
                getattr(lib, fn).argtypes = [ctypes.c_uint64]
                getattr(lib, fn).restype = ctypes.c_int
            _ROCTX.append(lib)
            break
        else:
            _ROCTX.append(None)
    return _ROCTX[0]


def top_ops(prof, limit: int = TOP_OPS) -> list[dict]:
    """The operators with the most self time on the device (GPU) or, without one, the CPU."""
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        rows.append({"name": event.key, "calls": event.count,
                     "self_cpu_ms": event.self_cpu_time_total / 1e3,
                     "self_device_ms": (device_us or 0) / 1e3})
    key = "self_device_ms" if any(r["self_device_ms"] for r in rows) else "self_cpu_ms"
    rows.sort(key=lambda r: r[key], reverse=True)
    return rows[:limit]

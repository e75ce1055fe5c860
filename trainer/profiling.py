"""Rank-targeted profiling of a few training steps (torch.profiler).

Profiling all 1024 ranks of a job buries the one trace you need, so only the
ranks and steps asked for are recorded (LUMI AI guide: profile one rank).
The runner asks through the environment, so the trainer's command line stays
the same under torchrun, srun or a container:

    ANVIL_PROFILE_STEPS=3:6     steps 3, 4 and 5 (the first steps include compile and warm-up)
    ANVIL_PROFILE_RANKS=0,8     global ranks to profile, or "all" (default 0)

Each profiled rank writes RUN_DIR/profile/rank{R}.trace.json (open it in
Perfetto or chrome://tracing) and RUN_DIR/profile/rank{R}.ops.json, the
operators that took the most time, for `inv profile.train` to print.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.errors import UserError
from trainer.files import write_atomic

TOP_OPS = 25


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
        raise ProfileSettingsError(f"ANVIL_PROFILE_STEPS={text!r}: expected START:END, e.g. 3:6") from None
    if start < 1 or end <= start:
        raise ProfileSettingsError(f"ANVIL_PROFILE_STEPS={text!r}: need 1 <= START < END")
    return start, end


def parse_ranks(text: str) -> set[int] | None:
    """'0,8' -> {0, 8}; 'all' -> None (every rank)."""
    if text.strip().lower() == "all":
        return None
    try:
        return {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        raise ProfileSettingsError(f"ANVIL_PROFILE_RANKS={text!r}: expected a list like 0,8 or 'all'") from None


class StepProfiler:
    """Call ``step_done(step)`` after every optimizer step; it records [start, end)."""

    def __init__(self, run_dir: Path | str, rank: int, start: int, end: int):
        self.dir = Path(run_dir) / "profile"
        self.rank, self.start, self.end = rank, start, end
        self._prof = None
        self._recorded = False

    @classmethod
    def from_env(cls, run_dir: Path | str, rank: int, environ=os.environ) -> "StepProfiler | None":
        steps = environ.get("ANVIL_PROFILE_STEPS", "").strip()
        if not steps:
            return None
        start, end = parse_steps(steps)
        ranks = parse_ranks(environ.get("ANVIL_PROFILE_RANKS", "0"))
        if ranks is not None and rank not in ranks:
            return None
        return cls(run_dir, rank, start, end)

    def step_done(self, step: int) -> None:
        """``step`` is the number of optimizer steps completed so far; called once more before the
        first step with the step the run starts from (0, or a resumed run's), so that a window from
        step 1, or one a resumed run starts inside, is recorded too."""
        if self._prof is None and not self._recorded and self.start - 1 <= step < self.end - 1:
            self._begin()
        elif self._prof is not None and step >= self.end - 1:
            self._finish()

    def close(self) -> None:
        """A run that ends inside the window still leaves its trace."""
        if self._prof is not None:
            self._finish()

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        # Kineto prints "USDT: ... profiler_start/stop" and stage lines on every trace; its levels put ERROR
        # under those, so only a level past them all is quiet. KINETO_LOG_LEVEL set by the user wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():  # CUDA and ROCm (roctracer) both appear as CUDA here
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.__enter__()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        self._recorded = True
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.rank}.trace.json"
        tmp = trace.with_suffix(".tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        ops = top_ops(prof)
        write_atomic(self.dir / f"rank{self.rank}.ops.json",
                     json.dumps({"rank": self.rank, "steps": [self.start, self.end], "ops": ops}, indent=1))


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

"""Numeric faults: a step whose loss or gradient norm is NaN/Inf, or whose loss spikes, run again once.

health.on_nonfinite: stop (the default) checks the loss at the log interval, as the loop reads it
anyway, and stops the run on a NaN. rerun checks every step before the optimizer touches the weights
(one scalar read a step: the host waits for the step's kernels, so it no longer runs a step ahead):

- the step's mean loss (all ranks) and its gradient norm are finite, and with health.spike_factor the
  loss is at most that factor over the median of the last WINDOW steps: the step goes on;
- otherwise the same micro-batches run again from the same weights (the gradients cleared);
  - the fault comes back: the batch is at fault. The optimizer step is skipped (the step still counts,
    the learning-rate schedule and the data position move on, so resume stays exact) and the run
    records it: metrics.jsonl kind "skipped" with the step, why, and the global sample indices and
    dataset windows it read;
  - it does not: the hardware is suspect (a bit flip, a faulty GPU). Every rank whose own loss
    changed writes logs/fault-rank<R>.json (rank, host, GPU, step, both readings), and all ranks end
    with EXIT_FAULTY (5); the launcher names the host and GPU and restarts, without that node where
    a spare is held (runtime.jobs.restarts).

Which rank: the all-reduced loss cannot say, so each rank also compares its own loss of the two runs.
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from collections import deque
from pathlib import Path

from core import names
from core.errors import AnvilError
from core.signals import EXIT_FAULTY

#: Steps whose loss the spike test takes the median of.
WINDOW = 50
#: Steps before the spike test starts (a median of a few early, falling losses says little).
WARMUP = 10


class NumericFault(AnvilError):
    """A step's numbers changed when it ran again: the hardware of the ranks named is suspect."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_FAULTY)


def _finite(value: float) -> bool:
    return math.isfinite(value)


class NumericGuard:
    """Decides per step: go on, skip the batch, or blame the hardware (the module doc)."""

    def __init__(self, action: str = "stop", spike_factor: float = 0.0):
        self.action = action
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=WINDOW)

    @classmethod
    def from_config(cls, cfg) -> "NumericGuard":
        return cls(cfg.health.on_nonfinite, cfg.health.spike_factor)

    @property
    def every_step(self) -> bool:
        return self.action == "rerun"

    def fault(self, loss: float, grad_norm: float) -> str | None:
        """What is wrong with a step's (mean loss, gradient norm), or None."""
        if not _finite(loss):
            return f"loss is {loss}"
        if not _finite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if self.spike_factor and len(self.recent) >= WARMUP:
            median = statistics.median(self.recent)
            if median > 0 and loss > self.spike_factor * median:
                return f"loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of the last " \
                       f"{len(self.recent)} steps"
        return None

    def passed(self, loss: float) -> None:
        """A step that went on: its loss joins the spike test's window."""
        self.recent.append(loss)


def sample_window(loader, before: int, after: int, most: int = 4096) -> dict:
    """The global samples a step read (all ranks), [before, after) of the loader's cursor, and the dataset
    windows they are where the loader can say (the first `most`)."""
    record = {"samples": [before, after]}
    window_ids = getattr(loader, "window_ids", None)
    if window_ids is not None and after > before:
        import numpy as np
        record["windows"] = [int(w) for w in window_ids(np.arange(before, min(after, before + most)))]
    return record


def report_fault(run_dir: Path, rank: int, step: int, first: tuple[float, float], second: tuple[float, float],
                 device) -> None:
    """logs/fault-rank<R>.json: this rank's loss changed between the two runs of `step` (on `device`, a
    torch.device)."""
    import torch

    gpu = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = {"index": index, "name": torch.cuda.get_device_name(index),
               "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES")}
    record = {"rank": rank, "host": os.environ.get(names.HOST) or socket.gethostname(), "step": step,
              "gpu": gpu, "first": {"loss": first[0], "grad_norm": first[1]},
              "second": {"loss": second[0], "grad_norm": second[1]}, "time": time.time()}
    logs = Path(run_dir) / names.LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    (logs / names.fault_report(rank)).write_text(json.dumps(record) + "\n", encoding="utf-8")


def read_fault_reports(run_dir: Path) -> list[dict]:
    """The fault reports of a run's ranks (unreadable ones skipped)."""
    out = []
    for path in sorted((Path(run_dir) / names.LOGS_DIR).glob(names.FAULT_REPORTS)):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out

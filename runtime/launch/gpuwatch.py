"""The node agent's GPU watch: a thread that reads this node's GPUs every few seconds while the ranks run.

Every names.GPU_WATCH_S seconds (default 10; 0 = off) it reads each GPU the node's ranks use
(envs.probes.watch: NVML on NVIDIA, amdsmi on AMD) and appends one line to
RUN_DIR/logs/gpu-<node rank>.jsonl (time, host, and per GPU: clocks, power, temperature, the reasons
clocks are held down, uncorrected ECC errors, Xids). A GPU that shows an Xid, new uncorrected ECC
errors or a slowdown is said once on the agent's stderr (the console and the launcher's log) and becomes
an event in the agent's report (gpu_events: GPU, rank, host, what, first and last time seen, samples),
which inv names in the run's summary and report, with the step time it cost (runtime.runs.gpuhealth).
The report also says what the watch cost (gpu_watch: samples, seconds spent reading).

Where no library loads (no GPU, no driver, a CPU run) there is no watch and nothing is written.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from core import names

DEFAULT_INTERVAL_S = 10.0
_VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def gpu_indices(environ, nproc: int) -> list[int]:
    """The library's indices of the GPUs local ranks 0..nproc-1 use (rank i: the i-th visible GPU)."""
    for name in _VISIBLE:
        ids = [v.strip() for v in environ.get(name, "").split(",") if v.strip()]
        if ids and all(v.isdigit() for v in ids):
            return [int(v) for v in ids[:nproc]]
    return list(range(nproc))


class GpuWatcher:
    def __init__(self, watch, run_dir: Path, node_rank: int, host: str, interval: float, first_rank: int,
                 indices: list[int], out=None):
        self.watch, self.node_rank, self.host, self.interval = watch, node_rank, host, interval
        self.path = Path(run_dir) / names.LOGS_DIR / names.gpu_log(node_rank)
        self.rank_of = {index: first_rank + position for position, index in enumerate(indices)}
        self.out = out or sys.stderr
        self.events: dict[tuple[int, str], dict] = {}
        self.ecc_at_start: dict[int, int | None] = {}
        self.samples, self.spent = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="anvil-gpu-watch", daemon=True)

    @classmethod
    def start(cls, environ, nproc: int, node_rank: int, host: str, opener=None) -> "GpuWatcher | None":
        """The watch of this node's GPUs, running; None where it is off or nothing can be read."""
        from envs.probes.watch import open_watch

        run_dir = environ.get(names.RUN_DIR)
        try:
            interval = float(environ.get(names.GPU_WATCH_S, DEFAULT_INTERVAL_S))
        except ValueError:
            interval = DEFAULT_INTERVAL_S
        if not run_dir or interval <= 0:
            return None
        indices = gpu_indices(environ, nproc)
        watch = (opener or open_watch)(indices)
        if watch is None:
            return None
        watcher = cls(watch, Path(run_dir), node_rank, host, interval, node_rank * nproc, indices)
        watcher._thread.start()
        return watcher

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        """One reading of every GPU: a line in the node's file, and any trouble said and counted."""
        from envs.probes.watch import trouble

        began = time.perf_counter()
        try:
            readings = self.watch.read()
        except Exception as exc:   # a library that fails mid-run: said once, the watch ends
            print(f"anvil-agent: the GPU watch on {self.host} stopped: {exc}", file=self.out, flush=True)
            self._stop.set()
            return
        now = time.time()
        self.samples += 1
        for reading in readings:
            self.ecc_at_start.setdefault(reading.index, reading.ecc_uncorrected)
            for what in trouble(reading, self.ecc_at_start[reading.index]):
                kind = what.split(" (")[0] if what.startswith("clocks") else what
                key = (reading.index, kind)
                event = self.events.get(key)
                if event is None:
                    rank = self.rank_of.get(reading.index)
                    self.events[key] = {"gpu": reading.index, "rank": rank, "host": self.host, "what": what,
                                        "first": now, "last": now, "samples": 1}
                    print(f"anvil-agent: GPU {reading.index} (rank {rank}) on {self.host}: {what}", file=self.out,
                          flush=True)
                else:
                    event.update(last=now, samples=event["samples"] + 1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"time": now, "host": self.host, "node_rank": self.node_rank,
                                         "gpus": [r.to_dict() for r in readings]}) + "\n")
        except OSError:
            pass
        self.spent += time.perf_counter() - began

    def stop(self) -> dict:
        """End the watch; what goes into the agent's report."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.watch.close()
        except Exception:
            pass
        return {"gpu_events": list(self.events.values()),
                "gpu_watch": {"vendor": getattr(self.watch, "vendor", ""), "interval_s": self.interval,
                              "samples": self.samples, "seconds": round(self.spent, 4), "pid": os.getpid()}}

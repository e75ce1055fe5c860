"""Run health during training: a hang watchdog and a straggler detector (config section `health:`).

HangWatchdog: a thread in every rank. The loop calls ``beat(step)`` after each step; when no
step finished for ``health.hang_timeout_s`` seconds (default min(300 s, half the collective
timeout ``parallel.timeout_minutes``), so it fires before the collective times out) it

1. writes the Python stacks of every thread of this rank to the rank's log
   (faulthandler; ``py-spy dump --native`` as well where py-spy is installed),
2. dumps torch.distributed's flight recorder (the ring of recent collectives, which
   ``prepare_env`` switches on for NCCL and gloo) to logs/flight-recorder[-nccl]-rank<R>.json,
3. writes logs/hang-rank<R>.json: rank, host, step, seconds without a step, where the
   training thread is ("optim.clip_grad_norm(...) at trainer/train.py:268", innermost frames) and
   its collective count (runtime.runs.outcome compares ranks with it: the rank that issued
   fewest collectives is the one the others wait for),
4. ends the rank with EXIT_HUNG (4); the launcher then stops the other ranks.

Before the first step (model build, torch.compile on the first step) and inside ``busy()``
(checkpoint saves, validation) the limit is the collective timeout instead. A process that
was paused (SIGSTOP, a suspended VM) is not counted as hung for the time it was paused.

StragglerDetector: every ``health.straggler_interval`` steps the ranks all-gather the
median of each rank's recent *own* time per step - loading its batches plus the forward
pass (timed by hooks on the model, with CUDA events on a GPU). Step wall time would not
do: in synchronous data parallel training every rank's step takes as long as the slowest
rank's, the fast ones wait in the gradient all-reduce. Under DDP the forward holds no
collective, so the figure is the rank's own speed; under FSDP it includes the parameter
all-gathers, which wait for slower peers, so a straggler shows less there. A rank more than
``health.straggler_margin`` above the median (and at least 1 ms, below which it is timer
noise) is named on rank 0's log (a WARNING when it becomes one, again every 10th check while
it stays one, an INFO line when it is back) and in metrics.jsonl at every check (kind
"straggler": rank, host, step_time, median, forward_s, data_s, steps). Every check also writes
each rank's figure (kind "rank_times": step_time by rank, median), the spread a report draws.

Why one module of this size: the flight-recorder setup, the straggler detector and the hang
watchdog share the per-step heartbeat and the rank's identity; each is its own class with one job.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from core import checkout, names, runfiles
from core.files import write_json_atomic
from core.host import this_host
from core.signals import EXIT_HUNG

REPO = checkout.ROOT
FLIGHT_RECORDER_ENTRIES = "2000"   # ring size: enough for the last few steps' collectives
DIAGNOSTIC_TIMEOUT_S = 20.0        # each diagnostic (flight recorder, py-spy) gets at most this
MIN_EXCESS_S = 0.001               # a rank less than 1 ms/step above the median is timer noise
REPEAT_EVERY = 10                  # a straggler that stays one is logged again every 10th check


def hang_timeout_s(cfg) -> float:
    """health.hang_timeout_s as used: None -> min(300, half the collective timeout); 0 = off."""
    value = cfg.health.hang_timeout_s
    if value is None:
        return min(300.0, 0.5 * cfg.parallel.timeout_minutes * 60)
    return float(value)


def prepare_env(cfg, run_dir: Path | str) -> None:
    """Before init_process_group: switch torch.distributed's flight recorder on (NCCL, and gloo
    in recent torch) so a hang report can say which collectives each rank issued, and let NCCL
    dump it on its own timeout into the run's logs. Values already in the environment win."""
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    if world < 2 or hang_timeout_s(cfg) <= 0:
        return
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return
    # torch renamed the recorder's variables with its functions (_dump_nccl_trace -> _dump_fr_trace)
    # and warns about the old names
    new = hasattr(c10d, "_dump_fr_trace")
    old_size, old_file = "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
    if not (os.environ.get(old_size) or os.environ.get("TORCH_FR_BUFFER_SIZE")):
        os.environ["TORCH_FR_BUFFER_SIZE" if new else old_size] = FLIGHT_RECORDER_ENTRIES
    if not (os.environ.get(old_file) or os.environ.get("TORCH_FR_DUMP_TEMP_FILE")):
        os.environ["TORCH_FR_DUMP_TEMP_FILE" if new else old_file] = str(Path(run_dir) / names.LOGS_DIR / "nccl-trace-rank")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


# --------------------------------------------------------------------------- where a thread is

def _short(filename: str) -> str:
    """Repository files relative to the checkout, installed ones from their package."""
    path = Path(filename)
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    try:
        return str(path.resolve().relative_to(REPO))
    except (ValueError, OSError):
        return path.name


def _in_repo(filename: str) -> bool:
    """A file of this project (not a virtual environment or other hidden folder in the checkout)."""
    try:
        inside = Path(filename).resolve().relative_to(REPO).parts
    except (ValueError, OSError):
        return False
    return not any(part.startswith(".") or part in ("site-packages", "dist-packages") for part in inside)


_CALL = re.compile(r"[A-Za-z_][\w.]*\(")


def where(frame, depth: int = 8) -> tuple[str, list[str]]:
    """("optim.clip_grad_norm(...) at trainer/train.py:268", innermost frames "name (file:line)")
    of a stack: the call the innermost frame of this project's code is making, and the frames
    below it."""
    stack = traceback.extract_stack(frame)
    frames = [f"{f.name} ({_short(f.filename)}:{f.lineno})" for f in stack[-depth:]][::-1]
    own = [f for f in stack if _in_repo(f.filename)]
    mark = own[-1] if own else (stack[-1] if stack else None)
    if mark is None:
        return "unknown", frames
    line = (mark.line or "").strip()
    call = _CALL.search(line)
    text = call.group(0) + "...)" if call else (line[:60] or mark.name)
    return f"{text} at {_short(mark.filename)}:{mark.lineno}", frames


# --------------------------------------------------------------------------- flight recorder

def dump_flight_recorder(logs: Path, rank: int) -> dict | None:
    """Write torch.distributed's flight recorders to logs/: NCCL's (flight-recorder-nccl-rank<R>.json)
    and the one of the other backends, gloo's (flight-recorder-rank<R>.json). Returns the default
    process group's counters ({last_enqueued, last_completed, pending, last_op, file}) from the
    dump that holds them, or None where nothing was recorded (no process group, no recorder)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    dumps: list[tuple[str, dict]] = []
    for function, label in (("_dump_nccl_trace_json", "nccl-"), ("_dump_fr_trace_json", "")):
        fn = getattr(c10d, function, None)
        if fn is None:
            continue
        try:
            raw = fn(True, False)   # includeCollectives, onlyActive
            data = json.loads(raw)
        except Exception:  # noqa: BLE001 - diagnostics must not fail the report
            continue
        if not isinstance(data, dict) or not data.get("entries"):
            continue
        path = logs / f"flight-recorder-{label}rank{rank}.json"
        try:
            path.write_bytes(raw if isinstance(raw, bytes) else str(raw).encode())
        except OSError:
            continue
        dumps.append((path.name, data))
    if not dumps and not hasattr(c10d, "_dump_fr_trace_json"):   # older torch: pickle only
        fn = getattr(c10d, "_dump_nccl_trace", None)
        if fn is not None:
            try:
                path = logs / f"flight-recorder-nccl-rank{rank}.pkl"
                path.write_bytes(fn())
                return {"last_enqueued": None, "last_completed": None, "last_op": None, "pending": None,
                        "file": path.name}
            except Exception:  # noqa: BLE001
                return None
    for name, data in dumps:
        summary = summarize_flight_recorder(data)
        if summary["last_enqueued"] is not None:
            return summary | {"file": name}
    return None


def summarize_flight_recorder(data: dict) -> dict:
    """The default process group's collective counters from a flight recorder dump."""
    entries = [e for e in data.get("entries") or [] if isinstance(e, dict)]
    default = [e for e in entries if list(e.get("process_group") or [])[1:2] == ["default_pg"]]
    status = (data.get("pg_status") or {}).get(str(default[-1]["process_group"][0])) if default else None
    status = status if isinstance(status, dict) else {}

    def number(key):
        try:
            return int(status.get(key))
        except (TypeError, ValueError):
            return None

    out = {"last_enqueued": number("last_enqueued_collective"),
           "last_completed": number("last_completed_collective"),
           "last_op": default[-1].get("profiling_name") if default else None}
    out["pending"] = (out["last_enqueued"] is not None and out["last_completed"] is not None
                      and out["last_enqueued"] > out["last_completed"])
    return out


def _bounded(fn, timeout: float = DIAGNOSTIC_TIMEOUT_S):
    """fn() in a helper thread, given at most `timeout` seconds (a wedged communicator must not
    keep the watchdog from reporting); None when it did not finish or failed."""
    box: list = []

    def target():
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001
            pass

    helper = threading.Thread(target=target, name="anvil-hang-diagnostic", daemon=True)
    helper.start()
    helper.join(timeout)
    return box[0] if box else None


# --------------------------------------------------------------------------- hang watchdog

class HangWatchdog:
    """Notices a rank that stopped making progress, reports where it is, and ends it."""

    def __init__(self, timeout_s: float, *, run_dir: Path | str | None, rank: int = 0, host: str | None = None,
                 log=None, startup_timeout_s: float | None = None, poll_s: float | None = None,
                 exit=os._exit):
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = max(self.timeout_s, float(startup_timeout_s or 0))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank, self.host, self.log = rank, host or this_host(), log
        self.poll_s = poll_s or min(5.0, max(0.05, self.timeout_s / 10))
        self._exit = exit
        self._target = threading.get_ident()        # the training thread: the one creating us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step: int | None = None                # last finished step
        self._last = self._last_wall = 0.0           # monotonic / wall time of the last progress
        self._phase = "startup"
        self.fired: dict | None = None

    @classmethod
    def from_config(cls, cfg, run_dir, info, log) -> "HangWatchdog":
        return cls(hang_timeout_s(cfg), run_dir=run_dir, rank=info.rank, log=log,
                   startup_timeout_s=cfg.parallel.timeout_minutes * 60)

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    # -- called by the training loop
    def start(self, step: int = 0) -> "HangWatchdog":
        self._step = step
        self._touch()
        self._phase = "startup"
        if self.run_dir is not None:   # a requeued job reuses its run directory
            with contextlib.suppress(OSError):
                (self.run_dir / names.LOGS_DIR / names.hang_report(self.rank)).unlink(missing_ok=True)
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="anvil-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """A step finished (cheap: two assignments and a clock read)."""
        self._step = step
        self._touch()
        self._phase = "training"

    @contextlib.contextmanager
    def busy(self, what: str):
        """Work between steps that may legitimately take long (a checkpoint save, validation):
        limited by the collective timeout rather than hang_timeout_s."""
        before = self._phase
        self._phase = what
        self._touch()
        try:
            yield
        finally:
            self._touch()
            self._phase = before

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 4 + 1)
            self._thread = None

    # -- the watchdog thread
    def _touch(self) -> None:
        self._last = time.monotonic()
        self._last_wall = time.time()

    @property
    def limit_s(self) -> float:
        return self.timeout_s if self._phase == "training" else self.startup_timeout_s

    def stalled_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self._last

    def _run(self) -> None:
        expected = time.monotonic() + self.poll_s
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            late = now - expected
            if late > max(5.0, self.timeout_s / 2):
                self._last += late          # this process was paused: that is not a hang
            expected = now + self.poll_s
            if self.check(now):
                return

    def check(self, now: float | None = None) -> bool:
        """One look: fire when the training thread made no progress within the limit."""
        if self.fired is not None or not self.enabled or self._stop.is_set():
            return False
        stalled = self.stalled_s(now)
        if stalled < self.limit_s:
            return False
        self._fire(stalled)
        return True

    # -- the report
    def _log_stream(self):
        for handler in getattr(self.log, "handlers", []):
            stream = getattr(handler, "stream", None)
            if stream is not None and getattr(handler, "baseFilename", None):
                return stream
        return None

    def _flush_log(self) -> None:
        for handler in getattr(self.log, "handlers", []):
            with contextlib.suppress(Exception):
                handler.flush()

    def report(self, stalled: float) -> dict:
        frame = sys._current_frames().get(self._target)
        call, frames = where(frame) if frame is not None else ("unknown (training thread gone)", [])
        in_progress = None if self._step is None else self._step + (self._phase in ("training", "startup"))
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(),
                "step": in_progress, "last_step": self._step, "phase": self._phase,
                "stalled_s": round(stalled, 1), "limit_s": self.limit_s, "where": call, "frames": frames,
                "last_progress_time": self._last_wall, "time": time.time(),
                "log": f"{names.LOGS_DIR}/{names.rank_log(self.rank)}", "collectives": None}

    def _fire(self, stalled: float) -> None:
        report = self.report(stalled)
        self.fired = report
        what = "before the first step" if self._phase == "startup" else (
            f"in {self._phase}" if self._phase != "training" else f"in step {report['step']}")
        if self.log is not None:
            self.log.warning(f"hang watchdog: no progress for {stalled:.0f} s (limit {report['limit_s']:.0f} s) "
                             f"{what}, at {report['where']}; Python stacks of every thread follow")
            self._flush_log()
        stream = self._log_stream()
        try:
            faulthandler.dump_traceback(file=stream or sys.stderr, all_threads=True)
            (stream or sys.stderr).flush()
        except (ValueError, OSError):
            pass
        logs = self.run_dir / names.LOGS_DIR if self.run_dir is not None else None
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            report["collectives"] = _bounded(lambda: dump_flight_recorder(logs, self.rank))
            try:
                write_json_atomic(logs / names.hang_report(self.rank), report)
            except OSError:
                pass
        self._py_spy(stream)
        if self.log is not None:
            self.log.error(f"hung: no training step for {stalled:.0f} s ({what}, at {report['where']}); "
                           f"stacks above, report {names.LOGS_DIR}/{names.hang_report(self.rank)}; exiting with status {EXIT_HUNG}")
            self._flush_log()
        self._exit(EXIT_HUNG)

    def _py_spy(self, stream) -> None:
        """Native and Python frames of every thread, where py-spy is installed and may attach."""
        exe = shutil.which("py-spy")
        if exe is None or stream is None:
            return
        try:
            out = subprocess.run([exe, "dump", "--native", "--pid", str(os.getpid())], capture_output=True,
                                 text=True, timeout=DIAGNOSTIC_TIMEOUT_S)
            stream.write("py-spy dump --native:\n" + (out.stdout or "") + (out.stderr or ""))
            stream.flush()
        except (OSError, subprocess.SubprocessError, ValueError):
            pass


# --------------------------------------------------------------------------- straggler detector

class StragglerDetector:
    """Times each rank's own part of a step and names ranks well above the median."""

    def __init__(self, interval: int, margin: float, *, rank: int = 0, world_size: int = 1, device=None,
                 run_dir: Path | str | None = None, log=None, group=None, hosts: list[str] | None = None):
        self.interval, self.margin = int(interval), float(margin)
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.log, self.group = log, group
        self.hosts = hosts or [this_host()] * world_size
        self.cuda = device is not None and getattr(device, "type", "") == "cuda"
        self._window: deque = deque(maxlen=max(1, min(self.interval, 200)))
        self._forward: list = []    # this step: seconds (CPU) or (start, end) CUDA event pairs
        self._data = 0.0
        self._pending: tuple | None = None
        self._hooks: list = []
        self._first_step: int | None = None
        self._streak: dict[int, int] = {}   # rank -> checks in a row it was flagged
        self.flagged: list[dict] = []
        self._metrics: runfiles.MetricsWriter | None = None   # opened at the first record

    @classmethod
    def from_config(cls, cfg, run_dir, info, log) -> "StragglerDetector":
        """On every rank (collective: makes a gloo group when the backend is not gloo and
        gathers every rank's host name once)."""
        if not info.distributed or cfg.health.straggler_interval <= 0:
            return cls(0, cfg.health.straggler_margin)
        import torch.distributed as dist
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        hosts: list = [None] * info.world_size
        dist.all_gather_object(hosts, this_host(), group=group)
        return cls(cfg.health.straggler_interval, cfg.health.straggler_margin, rank=info.rank,
                   world_size=info.world_size, device=info.device, run_dir=run_dir, log=log, group=group,
                   hosts=[str(h) for h in hosts])

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and self.world_size > 1

    # -- measuring
    def watch(self, model) -> "StragglerDetector":
        """Time `model`'s training forward passes (hooks on the plain module: under DDP they run
        after DDP's buffer broadcast, so no peer wait is inside)."""
        if self.enabled:
            self._hooks = [model.register_forward_pre_hook(self._before_forward),
                           model.register_forward_hook(self._after_forward)]
        return self

    def _before_forward(self, module, args) -> None:
        if not (module.training and _grad_enabled()):
            return
        if self.cuda:
            import torch
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending = (start,)
        else:
            self._pending = (time.perf_counter(),)

    def _after_forward(self, module, args, output) -> None:
        if self._pending is None:
            return
        (start,) = self._pending
        self._pending = None
        if self.cuda:
            import torch
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._forward.append((start, end))
        else:
            self._forward.append(time.perf_counter() - start)

    @contextlib.contextmanager
    def data_time(self):
        """Around the loop's batch loading (host time: a slow file system shows here). Named in a profile
        (anvil::next_batch) so that GPU idle time spent waiting for data is told apart (trainer.profiling)."""
        from torch.profiler import record_function

        started = time.perf_counter()
        try:
            with record_function("anvil::next_batch"):
                yield
        finally:
            self._data += time.perf_counter() - started

    def step(self, step: int) -> list[dict]:
        """End of a step on every rank; every `interval` steps the ranks compare (collective)."""
        if not self.enabled:
            return []
        if self._first_step is None:
            self._first_step = step
        self._window.append((self._data, self._forward))
        self._data, self._forward = 0.0, []
        if step % self.interval:
            return []
        return self.check(step)

    def _local(self) -> tuple[float, float, float, int]:
        """(median own time, median forward, median data) over the window, seconds."""
        forwards = []
        if self.cuda:
            last = next((pairs[-1][1] for _, pairs in reversed(self._window) if pairs), None)
            if last is not None:
                last.synchronize()     # every N steps: the one host sync this makes
            for _, pairs in self._window:
                forwards.append(sum(s.elapsed_time(e) for s, e in pairs) / 1000.0)
        else:
            forwards = [sum(values) for _, values in self._window]
        datas = [data for data, _ in self._window]
        if not forwards:
            return 0.0, 0.0, 0.0, 0
        totals = [f + d for f, d in zip(forwards, datas)]
        return statistics.median(totals), statistics.median(forwards), statistics.median(datas), len(totals)

    def check(self, step: int) -> list[dict]:
        import torch
        import torch.distributed as dist

        total, forward, data, n = self._local()
        mine = torch.tensor([total, forward, data, float(n)], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        steps = (max(self._first_step or step, step - len(self._window) + 1), step)
        self._window.clear()
        if self.rank != 0:
            return []
        rows = [g.tolist() for g in gathered]
        return self.flag(step, rows, steps)

    def flag(self, step: int, rows: list[list[float]], steps: tuple[int, int]) -> list[dict]:
        """rows[r] = [own time, forward, data, n] of rank r: name those above the median by the
        margin (rank 0's log and metrics.jsonl)."""
        if any(row[3] < 1 for row in rows):
            return []
        median = statistics.median(row[0] for row in rows)
        # every check, flagged or not: the spread across ranks that a report draws (one short line)
        self._write({"kind": "rank_times", "step": step, "time": time.time(), "median": median,
                     "step_time": [row[0] for row in rows], "steps": list(steps)})
        found = []
        for rank, (total, forward, data, _) in enumerate(rows):
            if median <= 0 or total <= median * (1 + self.margin) or total - median < MIN_EXCESS_S:
                continue
            streak = self._streak[rank] = self._streak.get(rank, 0) + 1
            record = {"kind": "straggler", "step": step, "time": time.time(), "rank": rank,
                      "host": self.hosts[rank], "step_time": total, "median": median,
                      "slower": total / median - 1, "forward_s": forward, "data_s": data,
                      "steps": list(steps), "checks_in_a_row": streak}
            found.append(record)
            if self.log is not None and (streak == 1 or streak % REPEAT_EVERY == 0):
                still = f"; {streak} checks in a row" if streak > 1 else ""
                self.log.warning(
                    f"straggler: rank {rank} on {self.hosts[rank]}: {total * 1e3:.1f} ms/step of its own work "
                    f"(forward {forward * 1e3:.1f} + data {data * 1e3:.1f} ms) vs median {median * 1e3:.1f} ms "
                    f"(+{total / median - 1:.0%}), steps {steps[0]}-{steps[1]}{still}")
            self._write(record)
        for rank in sorted(set(self._streak) - {r["rank"] for r in found}):
            if self.log is not None:
                self.log.info(f"straggler: rank {rank} on {self.hosts[rank]} is back within "
                              f"{self.margin:.0%} of the median after {self._streak[rank]} check(s)")
            del self._streak[rank]
        self.flagged.extend(found)
        return found

    def _write(self, record: dict) -> None:
        if self.run_dir is None:
            return
        try:
            if self._metrics is None:
                self._metrics = runfiles.MetricsWriter(self.run_dir)
            self._metrics.write(record)
        except OSError as exc:
            if self.log is not None:
                self.log.warning(f"straggler: cannot write metrics.jsonl: {exc}")

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def _grad_enabled() -> bool:
    import torch
    return torch.is_grad_enabled()

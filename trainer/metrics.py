"""What a run measures and where it goes: metrics.jsonl, TensorBoard, console, summary.

Per log interval (read a step late, DeferredScalars: the loop never drains the GPU's queue): loss, lr, grad norm,
tokens/s, step time, MFU (torchtitan's FLOP count against names.GPU_PEAK_TFLOPS),
GPU memory and utilisation, CPU and process memory.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from core import names, runfiles
from core.runfiles import experts_text, wall_time_text
from trainer import ranklog
from trainer.data.blend import fold, folded

GIB = 1024 ** 3


def peak_tflops_from_env() -> float | None:
    value = os.environ.get(names.GPU_PEAK_TFLOPS, "").strip()
    try:
        peak = float(value)
    except ValueError:
        return None
    return peak if peak > 0 else None


class DeferredScalars:
    """Device scalars read after the next step has been queued, so logging never leaves the GPU idle.

    `.item()` on a CUDA tensor copies it on the training stream, behind every kernel queued so far: the
    host waits for the queue to drain, then the GPU idles while the host starts the next step (its batch,
    its first launches, ahead of which the host has to get again). On one H200 that was 7% of a llama3_1b
    FP8 step at log_interval 1. Here `put` queues a copy into pinned host memory behind the step that made
    the values, with an event; `take`, called once the next step is queued, waits for that event only.
    One reading is pending at a time. On the CPU the values are read at once.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: tuple[torch.Tensor, object, dict] | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def put(self, values: list[torch.Tensor], **context) -> None:
        """Queue these tensors' reading (0-d, or any shape: take() gives their elements in order);
        `context` comes back with them from take()."""
        assert self._pending is None, "take() the pending reading first"
        device = values[0].device   # (a grad norm over no gradients is a CPU tensor)
        stacked = torch.cat([v.detach().float().reshape(-1).to(device) for v in values])
        event = None
        if self.cuda:
            host = torch.empty(stacked.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            stacked = host
        self._pending = (stacked, event, context)

    def take(self) -> tuple[list[float], dict] | None:
        """The pending values as floats (waiting for the step that made them), and their context."""
        if self._pending is None:
            return None
        host, event, context = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        return host.tolist(), context


class GpuMonitor:
    """GPU utilisation through nvidia-ml-py (NVIDIA) or pyrsmi (AMD); None when neither works."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self._read = None
        if not enabled or device.type != "cuda":
            return
        index = device.index or 0
        try:
            if torch.version.hip:
                from pyrsmi import rocml
                rocml.smi_initialize()
                self._read = lambda: float(rocml.smi_get_device_utilization(index))
            else:
                import pynvml
                pynvml.nvmlInit()
                # NVML counts all GPUs; map the torch index through CUDA_VISIBLE_DEVICES.
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
                ids = [v.strip() for v in visible.split(",") if v.strip()]
                if ids and ids[index].isdigit():
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(ids[index]))
                elif ids:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(ids[index])
                else:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._read = lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            self._read()
        except Exception:  # no library, no driver, odd device naming: utilisation is optional
            self._read = None

    def utilization(self) -> float | None:
        if self._read is None:
            return None
        try:
            return self._read()
        except Exception:
            return None


class ProgressBar:
    """One self-overwriting line on a terminal (rank 0); log lines are printed above it."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.out = ranklog.terminal() if enabled else None
        self.enabled = self.out is not None
        self.start = time.perf_counter()
        self.first_step = None

    def update(self, step: int, text: str = "") -> None:
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.start = step, time.perf_counter()
        frac = step / self.total
        width = 30
        filled = int(width * frac)
        done = step - self.first_step
        eta = ""
        if done > 0:
            left = (time.perf_counter() - self.start) / done * (self.total - step)
            eta = f" eta {int(left // 60)}m{int(left % 60):02d}s"
        self.out.write(f"\r\033[K[{'#' * filled}{'.' * (width - filled)}] "
                       f"{step}/{self.total} {frac:4.0%}{eta} {text}")
        self.out.flush()

    def clear(self) -> None:
        if self.enabled:
            self.out.write("\r\033[K")
            self.out.flush()


class Metrics:
    """Rank 0 writes metrics.jsonl / TensorBoard and the console line; every rank may call."""

    def __init__(self, run_dir: Path | None, *, is_main: bool, log, device: torch.device,
                 world_size: int, total_steps: int, flops_per_token: int, tensorboard: bool | None = None,
                 progress: bool = True, gpu_stats: bool = True):
        self.is_main, self.log, self.device = is_main, log, device
        self.world_size, self.total_steps = world_size, total_steps
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops_from_env()
        self.gpu = GpuMonitor(device, gpu_stats)
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        # The whole run's average (summary): from here, just before the loop, to the summary; the
        # step and token count it started from are those before the first logged interval.
        self._started = time.perf_counter()
        self._from_step = self._from_tokens = None
        self.bar = ProgressBar(total_steps, progress and is_main)
        self.moe_load: list[list[float]] = []   # the run's tokens per expert of each MoE layer (moe_step)
        self.moe_layers: list[int] = []
        self._file = None
        self._tb = None
        try:
            import psutil
            self._proc = psutil.Process()
            psutil.cpu_percent(None)  # first call primes the counter
        except ImportError:
            self._proc = None
        if is_main and run_dir is not None:
            self._file = runfiles.MetricsWriter(run_dir)
            if tensorboard is not False:   # None: when installed, without a word when not
                try:
                    from torch.utils.tensorboard import SummaryWriter
                    self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
                except Exception as exc:  # tensorboard not installed: the JSONL has everything
                    self._tb = None
                    if tensorboard:
                        self.log.warning("logging.tensorboard is on but TensorBoard cannot be used here (%s): "
                                     "off for this run; metrics.jsonl has every figure (pip install "
                                     "tensorboard to turn it on)", str(exc).splitlines()[0] if str(exc) else
                                     type(exc).__name__)

    # -- measurements

    def _memory(self) -> dict:
        out = {"gpu_mem_gib": None, "gpu_mem_reserved_gib": None}
        if self.device.type == "cuda":
            out["gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            out["gpu_mem_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
        out["gpu_util"] = self.gpu.utilization()
        if self._proc is not None:
            import psutil
            out["cpu_percent"] = psutil.cpu_percent(None)
            out["rss_gib"] = self._proc.memory_info().rss / GIB
        else:
            out["cpu_percent"] = out["rss_gib"] = None
        return out

    def train_step(self, step: int, *, loss: float, lr: float, grad_norm: float, tokens: int,
                   interval_tokens: int, interval_steps: int, interval_s: float,
                   by_source: dict[str, int] | None = None, at: float | None = None,
                   mtp_loss: float | None = None) -> dict:
        """Record one log interval (interval_tokens over all ranks, interval_s wall seconds); a blend's
        tokens so far from each source (by_source) as tokens/<name>; `at`: the step's wall time when it
        is logged later (default now); `mtp_loss`: multi-token prediction's mean loss over the interval."""
        tps = interval_tokens / interval_s if interval_s > 0 else 0.0
        tps_device = tps / self.world_size
        tflops = self.flops_per_token * tps_device / 1e12
        record = {"kind": "train", "step": step, "time": time.time() if at is None else at, "loss": loss, "lr": lr,
                  "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tps,
                  "tokens_per_s_per_device": tps_device,
                  "step_time_s": interval_s / max(1, interval_steps),
                  "tflops": tflops if self.device.type == "cuda" else None,
                  "mfu": tflops / self.peak_tflops if self.peak_tflops and self.device.type == "cuda"
                  else None}
        if mtp_loss is not None:
            record["mtp_loss"] = mtp_loss
        record.update({f"tokens/{name}": n for name, n in (by_source or {}).items()})
        record.update(self._memory())
        if not self.history:
            self._from_step, self._from_tokens = step - interval_steps, tokens - interval_tokens
        self.history.append(record)
        if self.is_main:
            self._write(record)
            self.bar.clear()
            self.log.info(self._console_line(record))
        return record

    def val_step(self, step: int, val_loss: float, by_source: dict[str, float] | None = None) -> dict:
        """Record a validation: val_loss, and for a blend each source's as val_loss/<name> (val_loss is
        then their mix by the blend's weights)."""
        record = {"kind": "val", "step": step, "time": time.time(), "val_loss": val_loss}
        record.update({f"val_loss/{name}": loss for name, loss in (by_source or {}).items()})
        self.val_history.append(record)
        if self.is_main:
            self._write(record)
            self.bar.clear()
            each = ", ".join(folded([f"{name} {loss:.4f}" for name, loss in (by_source or {}).items()]))
            self.log.info(f"step {step}/{self.total_steps} | val_loss {val_loss:.4f}"
                          + (f" (mixed; {each})" if each else ""))
        return record

    def moe_step(self, step: int, stats: dict) -> dict:
        """Record the experts' load since the last log step (trainer.models.moe.read_load): the tokens per
        expert of each MoE layer (the report's heatmap), each layer's fewest and most and their
        coefficient of variation, the balance loss and the balancing bias where there are."""
        from trainer.models.moe import load_summary
        per_layer = load_summary(stats["load"])
        record = {"kind": "moe", "step": step, "time": time.time(), "layers": stats["layers"],
                  "load": stats["load"], "load_min": [r["min"] for r in per_layer],
                  "load_max": [r["max"] for r in per_layer], "load_cv": [r["cv"] for r in per_layer],
                  "aux_loss": stats["aux_loss"]}
        if stats.get("bias"):
            record["bias_min"] = [min(row) for row in stats["bias"]]
            record["bias_max"] = [max(row) for row in stats["bias"]]
        self.moe_load = [[a + b for a, b in zip(old, new)] for old, new in zip(self.moe_load, stats["load"])] \
            if self.moe_load else [list(row) for row in stats["load"]]
        self.moe_layers = stats["layers"]
        if self.is_main:
            self._write(record)
            worst = max(range(len(per_layer)), key=lambda i: per_layer[i]["cv"])
            self.log.info(f"step {step}/{self.total_steps} | experts: load CV {statistics.mean(record['load_cv']):.2f} "
                          f"(highest {per_layer[worst]['cv']:.2f}, layer {stats['layers'][worst]})"
                          + (f" | balance loss {stats['aux_loss']:.4f}" if stats["aux_loss"] is not None else ""))
        return record

    def experts_summary(self) -> dict | None:
        """The run's least and most loaded experts (their layer, and their share of that layer's tokens),
        and the mean coefficient of variation of the layers' loads."""
        if not self.moe_load:
            return None
        from trainer.models.moe import load_summary
        per_layer = load_summary(self.moe_load)

        def place(which: str) -> dict:
            i = (min if which == "min" else max)(range(len(per_layer)),
                                                  key=lambda i: per_layer[i][which] / (sum(self.moe_load[i]) or 1))
            total = sum(self.moe_load[i]) or 1
            return {"layer": self.moe_layers[i], "expert": per_layer[i][f"{which}_expert"],
                    "share": per_layer[i][which] / total}

        return {"least": place("min"), "most": place("max"),
                "load_cv": statistics.mean(r["cv"] for r in per_layer)}

    def progress(self, step: int) -> None:
        if self.is_main:
            last = self.history[-1]["loss"] if self.history else None
            self.bar.update(step, f"loss {last:.4f}" if last is not None else "")

    def resumed(self, step: int, checkpoint: str | Path) -> None:
        """Record where the run resumed: the checkpoint's step, from which its curve goes on (a report's and
        a plot's resume mark), before the first step it logs."""
        if self.is_main:
            self._write({"kind": "resume", "step": step, "time": time.time(), "checkpoint": str(checkpoint)})

    def skipped(self, step: int, why: str, window: dict) -> None:
        """Record a step whose optimizer update was skipped (trainer.numeric: the batch was at fault), with
        the samples it read; a warning on the console."""
        if self.is_main:
            self._write({"kind": "skipped", "step": step, "time": time.time(), "why": why, **window})
            self.log.warning(f"step {step}: {why}, again when run a second time: the batch is at fault; its "
                             f"update is skipped (samples {window['samples'][0]}-{window['samples'][1] - 1}, "
                             f"listed in {names.METRICS})")

    def _console_line(self, r: dict) -> str:
        parts = [f"step {r['step']}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        if r.get("mtp_loss") is not None:
            parts.append(f"mtp_loss {r['mtp_loss']:.4f}")
        parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}",
                 f"{_si(r['tokens_per_s'])} tok/s", f"{r['step_time_s'] * 1000:.0f} ms/step"]
        if r["mfu"] is not None:
            parts.append(f"mfu {r['mfu']:.1%}")
        if r["gpu_mem_gib"] is not None:
            parts.append(f"mem {r['gpu_mem_gib']:.1f} GiB")
        if r["gpu_util"] is not None:
            parts.append(f"util {r['gpu_util']:.0f}%")
        if r["rss_gib"] is not None and r["gpu_mem_gib"] is None:
            parts.append(f"rss {r['rss_gib']:.2f} GiB")
        return " | ".join(parts)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(record)
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("kind", "step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    # -- end of run

    def summary(self, **extra) -> dict:
        """Final figures: throughput, step time and MFU are medians over the log intervals after the
        first (the first holds compilation and warm-up), `median_steps` the steps they cover; beside
        them the whole run's averages (tokens_per_s_avg, step_time_s_avg: the tokens and steps of this
        run over its time from the first step to the summary, compilation, validation and
        checkpoints included)."""
        steady = self.history[1:] or self.history

        def med(key):
            values = [r[key] for r in steady if r.get(key) is not None]
            return statistics.median(values) if values else None

        averages = {}
        if self.history:
            elapsed = time.perf_counter() - self._started
            steps = (extra.get("steps") or self.history[-1]["step"]) - self._from_step
            tokens = (extra.get("tokens") or self.history[-1]["tokens"]) - self._from_tokens
            first = self.history[0]["step"] + 1 if len(self.history) > 1 else self._from_step + 1
            averages = {"median_steps": [first, self.history[-1]["step"]], "warmup_in_median": len(self.history) < 2,
                        "tokens_per_s_avg": tokens / elapsed if elapsed > 0 else None,
                        "step_time_s_avg": elapsed / steps if steps > 0 else None}

        peaks = [r["gpu_mem_gib"] for r in self.history if r.get("gpu_mem_gib") is not None]
        last = self.history[-1] if self.history else {}
        out = {"steps": last.get("step"), "final_loss": last.get("loss"),
               "val_loss": self.val_history[-1]["val_loss"] if self.val_history else None,
               "tokens": last.get("tokens"), "tokens_per_s": med("tokens_per_s"),
               "tokens_per_s_per_device": med("tokens_per_s_per_device"),
               "step_time_s": med("step_time_s"), **averages, "mfu": med("mfu"), "tflops": med("tflops"),
               "peak_mem_gib": max(peaks) if peaks else None,
               "peak_rss_gib": max((r["rss_gib"] for r in self.history if r.get("rss_gib")),
                                   default=None)}
        if last.get("mtp_loss") is not None:
            out["final_mtp_loss"] = last["mtp_loss"]
        experts = self.experts_summary()
        if experts:
            out["experts"] = experts
        sources = extra.pop("sources", None)
        if sources:   # a blend: each source's last val loss beside its shares
            last_val = self.val_history[-1] if self.val_history else {}
            out["sources"] = {name: {**figures, "val_loss": last_val.get(f"val_loss/{name}")}
                              for name, figures in sources.items()}
        out.update(extra)
        return out

    def close(self) -> None:
        self.bar.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def wall_times(segment_s: float, prior_s: float = 0.0, prior_segments: int = 0) -> dict:
    """The summary's wall time: wall_s is this segment's (this process, from start to summary);
    a run resumed from a checkpoint also says how many segments it took and their total
    (the earlier ones up to the checkpoint it resumed from)."""
    return {"wall_s": segment_s, "segments": prior_segments + 1, "wall_s_total": prior_s + segment_s}


def summary_table(summary: dict) -> str:
    """Two-column tabulate table of a summary dict (None shown as n/a)."""
    from tabulate import tabulate

    labels = [("status", "status", "{}"), ("steps", "steps", "{}"),
              ("final_loss", "final train loss", "{:.4f}"),
              ("final_mtp_loss", "final multi-token prediction loss", "{:.4f}"), ("val_loss", "val loss", "{:.4f}"),
              ("tokens", "tokens", "{:,}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
              ("tokens_per_s_per_device", "tokens/s per device (median)", "{:,.0f}"),
              ("step_time_s", "step time", "{:.3f} s"), ("tflops", "TFLOP/s per device", "{:.1f}"),
              ("mfu", "MFU", "{:.1%}"), ("peak_mem_gib", "peak GPU memory", "{:.2f} GiB"),
              ("peak_rss_gib", "peak process RSS", "{:.2f} GiB"), ("params", "parameters", "{:,}"),
              ("world_size", "processes", "{}"), ("device", "device", "{}"),
              ("data", "data", "{}"), ("experts", "experts' load", "{}"), ("init_from", "started from", "{}"),
              ("wall_s", "wall time", "{:.1f} s"),
              ("checkpoint", "last checkpoint", "{}")]
    rows = []
    for key, label, fmt in labels:
        if key not in summary:
            continue
        value = summary[key]
        if key == "wall_s":
            rows.append([label, wall_time_text(summary)])
            continue
        if key == "experts" and value:
            rows.append([label, experts_text(value)])
            continue
        if key == "init_from" and isinstance(value, dict):   # --init-from: the Hugging Face directory
            value = value.get("path")
        if key in ("tokens_per_s", "step_time_s") and value is not None and summary.get("median_steps"):
            rows.append([label, median_and_average(summary, key, fmt)])
            continue
        rows.append([label, "n/a" if value is None else fmt.format(value)])
        if key == "data":
            kept, hidden = fold(list((summary.get("sources") or {}).items()))
            rows += [[f"  {name}", runfiles.source_text(figures)] for name, figures in kept]
            rows += [[f"  ... {hidden} more", "in summary.json"]] if hidden else []
    return tabulate(rows, tablefmt="simple_outline")


def median_and_average(summary: dict, key: str, fmt: str) -> str:
    """"22,250 (median, steps 11-100, after warm-up); 5,412 average over the run": what each
    figure is, beside the run's average (which holds the compilation, validation and checkpoints)."""
    first, last = summary["median_steps"]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    what = f"median, {steps}" + (", warm-up included: one log interval" if summary.get("warmup_in_median")
                                 else ", after warm-up")
    text = f"{fmt.format(summary[key])} ({what})"
    average = summary.get(f"{key}_avg")
    return text + (f"; {fmt.format(average)} average over the run" if average is not None else "")



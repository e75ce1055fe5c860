"""preflight.perf: is each GPU of this node as fast as its model should be?

Per GPU, each in its own process with a timeout (benchmarks/device.py perf):
bf16 GEMM TFLOP/s, HBM copy GB/s, host-to-device GB/s; then the node's local
all-reduce bus bandwidth (benchmarks.collectives, 1 GiB, one rank per GPU).
Each is judged (runtime.preflight.rules) against the GPU model's floors in its
envs profile (or --floor NAME=VALUE) and, when given, a baseline recorded on a
known-good node with --save-baseline FILE (--baseline FILE, --tolerance).
On a machine without GPUs the same measurements run small on the CPU and are
reported, not judged.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from core import names
from core.host import this_host
from runtime.preflight import rules
from runtime.preflight.result import WARN, CheckResult
from runtime.preflight.screen import devices_of, label, per_device
from core.errors import AnvilError, UserError

PERF_TIMEOUT_S = 120.0
METRICS = (("gemm_tflops", "perf.gemm", "TFLOP/s"), ("hbm_gbps", "perf.hbm_copy", "GB/s"),
           ("h2d_gbps", "perf.h2d", "GB/s"))
ALLREDUCE = ("allreduce_gbps", "perf.allreduce", "GB/s")
FLOOR_NAMES = tuple(m[0] for m in METRICS) + (ALLREDUCE[0],)
BASELINE_FORMAT = "anvil-perf-baseline/1"      # a --save-baseline file's "format"


def floors_for(machine, overrides: dict) -> tuple[dict, str, int, str]:
    """({metric: floor}, where the floors are, GPUs the all-reduce floor is for, how they were set)."""
    import envs.profiles as profiles

    model = profiles.MODELS.get(machine.profile or "") if machine.has_gpu else None
    floors = dict(model.floors.as_dict()) if model and model.floors else {}
    source = f"envs/profiles/{model.key}.py ({model.name})" if floors else ""
    why = model.floors.ref if floors else ""
    gpus = model.floors.allreduce_gpus if floors else 0
    if overrides:
        floors.update(overrides)
        source = "--floor " + ", ".join(f"{k}={v:g}" for k, v in overrides.items()) + (f"; else {source}"
                                                                                       if source else "")
    return {k: v for k, v in floors.items() if v is not None}, source, gpus, why


def measure(inp) -> dict:
    """{"devices": {label: {metric: value}}, "allreduce_gbps": float | None, "errors": {label: text}}."""
    devices = devices_of(inp.machine)
    raw = per_device("perf", devices, inp.timeout or PERF_TIMEOUT_S, dict(inp.environ))
    out: dict = {"devices": {}, "errors": {}, "allreduce_gbps": None, "allreduce_ranks": 0}
    for device, result in raw.items():
        if result.get("ok"):
            out["devices"][label(device)] = {m: result[m] for m, _, _ in METRICS if m in result}
        else:
            out["errors"][label(device)] = result.get("error", "failed")
    busbw, ranks, error = local_allreduce(inp)
    out["allreduce_gbps"], out["allreduce_ranks"] = busbw, ranks
    if error:
        out["errors"]["all-reduce"] = error
    return out


def local_allreduce(inp) -> tuple[Optional[float], int, Optional[str]]:
    """busbw (GB/s) of one all-reduce over this node's GPUs (2 gloo ranks on a CPU)."""
    from runtime.launch import LaunchSpec, agent_command, processes_per_node

    gpu = inp.machine.has_gpu
    ranks = inp.machine.count if gpu else 2
    if ranks < 2:
        return None, ranks, None
    size = "1G" if gpu else "4M"
    with tempfile.TemporaryDirectory(prefix="anvil-perf-") as tmp:
        out = Path(tmp) / names.COLLECTIVES
        spec = LaunchSpec(module="benchmarks.collectives", nproc=ranks, gpus=inp.machine.count,
                          vendor=inp.machine.vendor,
                          args=["--sizes", size, "--iters", "10", "--eager", "--out", str(out)])
        env = dict(inp.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            proc = subprocess.run(agent_command(spec, processes_per_node(spec, env)), env=env, capture_output=True,
                                  text=True, timeout=inp.timeout or PERF_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None, ranks, f"the all-reduce did not finish within {inp.timeout or PERF_TIMEOUT_S:g} s"
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            return None, ranks, f"the all-reduce failed: {tail[:200]}"
        rows = json.loads(out.read_text()).get("results", [])
    return (float(rows[-1]["busbw_GBps"]) if rows else None), ranks, None


def run(inp) -> list[CheckResult]:
    measured = measure(inp)
    inp.measured = measured           # kept for --save-baseline
    floors, source, floor_gpus, why = floors_for(inp.machine, inp.floors)
    baseline = (inp.baseline or {}).get("measured", {})
    baseline_ref = (inp.baseline or {}).get("source", "")
    results = []
    for metric, name, unit in METRICS:
        values = {d: v[metric] for d, v in measured["devices"].items() if metric in v}
        results.append(rules.judge(name, unit, values, floor=floors.get(metric), floor_ref=source,
                                   baseline=baseline.get(metric), baseline_ref=baseline_ref,
                                   tolerance=inp.tolerance, floor_why=why))
    metric, name, unit = ALLREDUCE
    busbw, ranks = measured["allreduce_gbps"], measured["allreduce_ranks"]
    if busbw is not None:
        floor = floors.get(metric) if (ranks == floor_gpus or metric in inp.floors) else None
        row = rules.judge(name, unit, {f"{ranks} ranks": busbw}, floor=floor, floor_ref=source,
                          baseline=baseline.get(metric), baseline_ref=baseline_ref, tolerance=inp.tolerance,
                          floor_why=why)
        if floors.get(metric) is not None and floor is None and row.status != "FAIL":
            row.reason += f" (the floor is for {floor_gpus} GPUs; this node has {ranks})"
        results.append(row)
    for where, error in measured["errors"].items():
        results.append(CheckResult(f"perf.{where.lower()}", "FAIL", None, f"{where}: {error}",
                                   "drain the node and look at the device"))
    if not inp.machine.has_gpu:
        results.append(CheckResult("perf.judged", WARN, "cpu", "no GPU: the figures above are the CPU's, "
                                   "not compared with any floor", "run on a GPU node to screen it"))
    return results


def baseline_document(inp) -> dict:
    """What --save-baseline writes: the node's median per metric (per GPU) and its all-reduce."""
    measured = getattr(inp, "measured", None) or {}
    devices = measured.get("devices", {})
    medians = {}
    for metric, _, _ in METRICS:
        values = [v[metric] for v in devices.values() if metric in v]
        if values:
            medians[metric] = statistics.median(values)
    if measured.get("allreduce_gbps") is not None:
        medians[ALLREDUCE[0]] = measured["allreduce_gbps"]
    host = this_host(inp.environ)
    return {"format": BASELINE_FORMAT, "host": host, "gpu": inp.machine.name, "gpus": inp.machine.count,
            "measured": medians, "source": f"baseline of {host} ({inp.machine.summary()})"}


class PerfOptionError(UserError):
    """A bad --floor, --baseline or --tolerance."""


def parse_floors(items) -> dict:
    """["gemm_tflops=700", ...] -> {"gemm_tflops": 700.0}."""
    floors = {}
    for item in items or []:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if not sep or name not in FLOOR_NAMES:
            raise PerfOptionError(f"--floor {item!r}: expected NAME=VALUE with NAME one of {', '.join(FLOOR_NAMES)}")
        try:
            number = float(value)
        except ValueError:
            raise PerfOptionError(f"--floor {item!r}: {value!r} is not a number") from None
        if not number > 0 or number == float("inf"):
            raise PerfOptionError(f"--floor {item!r}: expected a positive number")
        floors[name] = number
    return floors


def read_baseline(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PerfOptionError(f"--baseline {path}: no such file (record one with --save-baseline FILE)") from None
    except (OSError, ValueError) as exc:
        raise PerfOptionError(f"--baseline {path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT \
            or not isinstance(data.get("measured"), dict):
        raise PerfOptionError(f"--baseline {path}: not a baseline written by `inv preflight.perf --save-baseline`")
    data["source"] = f"{path}: {data.get('source', '')}".rstrip(": ")
    return data


def check_tolerance(tolerance) -> float:
    """--tolerance as a fraction: 0.05, or "5%" for the same; [0, 1)."""
    text = str(tolerance).strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1:
        raise PerfOptionError(f"--tolerance {tolerance}: expected a fraction in [0, 1) such as 0.05 for 5% "
                              f"(or write 5%)")
    return value


def check_save_path(path: str, force: bool = False) -> None:
    """Refuse a --save-baseline FILE that could not be written, before minutes of measuring, or that
    is a file other than a baseline (unless `force`). Missing folders are fine (the writer makes
    them) when the nearest existing one takes a new file."""
    from core.files import file_in_the_way, refuse_foreign

    target = Path(path)
    if target.is_dir():
        raise PerfOptionError(f"--save-baseline {path}: is a directory; expected a file path such as "
                              f"{target / 'baseline.json'}")
    blocker = file_in_the_way(target)
    if blocker is not None:
        raise PerfOptionError(f"--save-baseline {path}: {blocker} is a file, not a folder")
    refuse_foreign(target, PerfOptionError, (f'"format": "{BASELINE_FORMAT}"',), "a baseline preflight.perf wrote",
                   force=force, option="--save-baseline")
    folder = next(p for p in target.absolute().parents if p.exists())
    try:
        # A real file, not os.access: root passes access() where no file can be made (/proc, a read-only mount).
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".anvil-write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PerfOptionError(f"--save-baseline {path}: cannot write a file in {folder} "
                              f"({exc.strerror or exc})") from None


def save_baseline(inp, path: str) -> dict:
    """Write this node's baseline_document to `path` (atomically); the document written."""
    from core.files import write_json_atomic

    document = baseline_document(inp)
    try:
        write_json_atomic(path, document)
    except OSError as exc:   # checked before measuring; this is the folder changing meanwhile
        raise AnvilError(f"--save-baseline {path}: cannot write it ({exc.strerror or exc})", 1) from None
    return document

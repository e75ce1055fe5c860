"""preflight.gpu: the GPUs are there, known, free, cool and error-free."""
from __future__ import annotations

import os

from core import names
from runtime.preflight.result import FAIL, PASS, WARN, CheckResult

MIN_FREE_GIB = 1.0  # Primus preflight's PRIMUS_PREFLIGHT_MIN_FREE_MEM_GB default
USED_WARN_FRACTION = 0.05
HOT_C = 85.0


def run(inp) -> list[CheckResult]:
    import envs
    from envs.resolve import unknown_gpu_message

    m = inp.machine
    if not m.has_gpu:
        if inp.require_gpu:
            return [CheckResult("gpu.present", FAIL, "none", "no GPU on this machine and --require-gpu was given",
                                "run on a GPU node, or drop --require-gpu for a CPU run")]
        return [CheckResult("gpu.present", WARN, "none", "no GPU on this machine: CPU only (gloo, no MFU)",
                            "fine for CPU runs and tests; use a GPU node for real training")]
    results = [CheckResult("gpu.count", PASS, m.count, f"{m.count} x {m.name} ({m.arch or '?'}) via {m.source}")]
    if m.unknown_gpu:
        allowed = inp.allow_unknown_gpu or inp.environ.get(names.ALLOW_UNKNOWN_GPU) == "1"
        results.append(CheckResult("gpu.model", WARN if allowed else FAIL, m.name,
                                   unknown_gpu_message(m) + (" (allowed)" if allowed else ""),
                                   "" if allowed else "add a profile, or pass --allow-unknown-gpu"))
    else:
        results.append(CheckResult("gpu.model", PASS, m.model, f"profile envs/profiles/{m.profile}.py"))
    asked = inp.env.machine if inp.env is not None else m
    if asked is not m and asked.model != m.model:
        results.append(CheckResult("gpu.profile_match", WARN, asked.model,
                                   f"environment resolved for {asked.model} but this node has {m.model or m.name}",
                                   "drop --gpu to validate the environment this node gets"))

    status = envs.gpu_status(m)
    if status is None:
        results.append(CheckResult("gpu.status", WARN, None, "no probe reported memory or processes",
                                   "install pyrsmi / nvidia-ml-py, or put rocm-smi / nvidia-smi on PATH"))
        return results
    results += _memory(status) + _processes(status) + _health(status)
    return results


def _memory(status) -> list[CheckResult]:
    frees = [(d.index, d.memory_total_gib - d.memory_used_gib, d.memory_used_gib / d.memory_total_gib)
             for d in status.devices if d.memory_total_gib and d.memory_used_gib is not None]
    if not frees:
        return [CheckResult("gpu.memory_free", WARN, None, f"{status.source} reported no memory figures", "")]
    low = [f"GPU{i} {free:.1f} GiB" for i, free, _ in frees if free < MIN_FREE_GIB]
    busy = [f"GPU{i} {used:.0%}" for i, _, used in frees if used > USED_WARN_FRACTION]
    least = min(free for _, free, _ in frees)
    if low:
        return [CheckResult("gpu.memory_free", FAIL, f"{least:.1f} GiB", "almost no free memory: " + ", ".join(low),
                            "find what holds it (rocm-smi --showpids / nvidia-smi) and stop it")]
    if busy:
        return [CheckResult("gpu.memory_free", WARN, f"{least:.1f} GiB", "memory already in use: " + ", ".join(busy),
                            "another job may share these GPUs")]
    return [CheckResult("gpu.memory_free", PASS, f"{least:.1f} GiB", f"least free of {len(frees)} GPUs")]


def _processes(status) -> list[CheckResult]:
    foreign = sorted({p for p in status.pids if p != os.getpid()})
    if foreign:
        return [CheckResult("gpu.processes", FAIL, ",".join(map(str, foreign)),
                            f"{len(foreign)} process(es) already computing on the GPUs",
                            f"stop them (kill {' '.join(map(str, foreign[:8]))}) or pick idle nodes")]
    return [CheckResult("gpu.processes", PASS, 0, f"no compute processes ({status.source})")]


def _health(status) -> list[CheckResult]:
    results = []
    temps = [(d.index, d.temperature_c) for d in status.devices if d.temperature_c is not None]
    if temps:
        hot = [f"GPU{i} {t:.0f}C" for i, t in temps if t >= HOT_C]
        hottest = max(t for _, t in temps)
        results.append(CheckResult("gpu.temperature", WARN if hot else PASS, f"{hottest:.0f}C",
                                   ("hot while idle: " + ", ".join(hot)) if hot else "hottest GPU",
                                   "check cooling before a long run" if hot else ""))
    ecc = [(d.index, d.ecc_uncorrected) for d in status.devices if d.ecc_uncorrected is not None]
    if ecc:
        bad = [f"GPU{i}: {n}" for i, n in ecc if n > 0]
        results.append(CheckResult("gpu.ecc", WARN if bad else PASS, sum(n for _, n in ecc),
                                   ("uncorrected ECC errors since boot: " + ", ".join(bad)) if bad
                                   else "no uncorrected ECC errors",
                                   "check dmesg; reset or drain the GPU" if bad else ""))
    return results

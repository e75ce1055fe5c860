"""preflight.screen: the fast per-node screen (seconds, no rendezvous).

- screen.devices: every GPU in its own process with a timeout (a hung GPU
  costs its timeout, not the screen): it initialises, takes 256 MiB, and a
  2048x2048 bf16 GEMM is finite (benchmarks/device.py smoke). On a machine
  without GPUs the same smoke runs on the CPU, so the path is exercised.
- screen.kernel_log: the kernel log (dmesg) scanned for GPU faults (NVIDIA
  Xid, AMD GPU resets and page faults), machine checks and hung tasks. Where
  the log is not readable (containers without CAP_SYSLOG) it says so and passes.
The host-level items of the screen (RDMA ports active, memlock, /dev/shm,
processes holding GPU memory) are the host, network and gpu checks.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Iterable

from runtime.preflight.result import FAIL, PASS, WARN, CheckResult

SMOKE_TIMEOUT_S = 30.0
DEVICE_MODULE = "benchmarks.device"

# Xids that mean the hardware (memory, bus, NVLink), not the application: NVIDIA's Xid catalogue.
HARDWARE_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}
KERNEL_PATTERNS = (
    ("nvidia_xid", re.compile(r"NVRM: Xid \([^)]*\): (\d+)")),
    ("amd_gpu_fault", re.compile(r"amdgpu.*(GPU reset|page fault|PROTECTION_FAULT|ring \S+ timeout|GPU hang)",
                                 re.IGNORECASE)),
    ("machine_check", re.compile(r"Machine check|mce: \[Hardware Error\]|\[Hardware Error\]", re.IGNORECASE)),
    ("hung_task", re.compile(r"blocked for more than \d+ seconds|hung_task_timeout")),
)


def devices_of(machine) -> list[str]:
    """torch device names to screen: cuda:0.. (ROCm presents as cuda too), or cpu."""
    return [f"cuda:{i}" for i in range(machine.count)] if machine.has_gpu else ["cpu"]


def per_device(what: str, devices: Iterable[str], timeout: float, environ=None) -> dict[str, dict]:
    """Run benchmarks.device `what` for each device in its own process; {device: result or error}."""
    results: dict[str, dict] = {}
    for device in devices:
        argv = [sys.executable, "-m", DEVICE_MODULE, "--device", device, "--what", what, "--json"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=environ,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            results[device] = {"ok": False, "error": f"no answer within {timeout:g} s (hung)"}
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        try:
            results[device] = json.loads(lines[-1])
        except (IndexError, ValueError):
            tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            results[device] = {"ok": False, "error": tail[:200]}
    return results


def label(device: str) -> str:
    return "GPU" + device.split(":", 1)[1] if device.startswith("cuda:") else device.upper()


def run(inp) -> list[CheckResult]:
    return [_devices(inp), kernel_log_check(_read_kernel_log())]


def _devices(inp) -> CheckResult:
    devices = devices_of(inp.machine)
    results = per_device("smoke", devices, inp.timeout or SMOKE_TIMEOUT_S, dict(inp.environ))
    bad = {d: r for d, r in results.items() if not r.get("ok")}
    what = f"{len(devices)} device(s)" if inp.machine.has_gpu else "no GPU: the smoke ran on the CPU"
    if bad:
        detail = "; ".join(f"{label(d)}: {r.get('error') or 'GEMM result not finite'}" for d, r in bad.items())
        return CheckResult("screen.devices", FAIL, f"{len(bad)} of {len(devices)} failed", detail,
                           "drain the node; reset the GPU (nvidia-smi -r / amd-smi reset) or call the vendor")
    return CheckResult("screen.devices", PASS, f"{len(devices)} ok",
                       f"{what}: init, 256 MiB, finite bf16 GEMM, each in its own process")


def _read_kernel_log() -> str | None:
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def scan_kernel_log(text: str) -> dict[str, list[str]]:
    """{kind: [matching line, ...]} for the fault patterns above."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        for kind, pattern in KERNEL_PATTERNS:
            if pattern.search(line):
                found.setdefault(kind, []).append(line.strip())
    return found


def kernel_log_check(text: str | None) -> CheckResult:
    if text is None:
        return CheckResult("screen.kernel_log", PASS, "unreadable",
                           "dmesg is not readable here (no CAP_SYSLOG or kernel.dmesg_restrict): not scanned")
    found = scan_kernel_log(text)
    if not found:
        return CheckResult("screen.kernel_log", PASS, "clean", "no GPU faults, machine checks or hung tasks")
    xid_of = {line: int(m.group(1)) for line in found.get("nvidia_xid", [])
              for m in [KERNEL_PATTERNS[0][1].search(line)] if m}
    xids = sorted(set(xid_of.values()))
    severe = found.get("amd_gpu_fault", []) + found.get("machine_check", []) + \
        [line for line, xid in xid_of.items() if xid in HARDWARE_XIDS]
    counts = ", ".join(f"{kind} x{len(lines)}" for kind, lines in found.items())
    last = severe[-1] if severe else [line for lines in found.values() for line in lines][-1]
    reason = f"{counts}" + (f" (Xid {', '.join(map(str, xids))})" if xids else "") + f"; last: {last[:160]}"
    if severe:
        return CheckResult("screen.kernel_log", FAIL, counts, reason,
                           "drain the node: hardware faults since boot (reboot or RMA after the vendor's triage)")
    return CheckResult("screen.kernel_log", WARN, counts, reason, "read the lines; application Xids or hung "
                       "tasks may be from an earlier job")

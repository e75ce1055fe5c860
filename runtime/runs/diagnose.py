"""Known failure signatures: read a failed run's logs and say what to change.

A small table, not a rule engine: each row is a regular expression seen in
real logs and the advice that fixes it most often.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from core import names


@dataclass(frozen=True)
class Signature:
    name: str
    pattern: re.Pattern
    advice: str


def _sig(name: str, pattern: str, advice: str) -> Signature:
    return Signature(name, re.compile(pattern, re.IGNORECASE), advice)


SIGNATURES: tuple[Signature, ...] = (
    _sig("nccl-socket",
         r"(NCCL|RCCL) WARN.*(socket|connect|Connection refused|Bootstrap)|"
         r"ncclSystemError|ncclRemoteError|socketStartConnect|Call to connect returned Connection refused",
         "NCCL/RCCL could not open its sockets: set NCCL_SOCKET_IFNAME to an interface that routes "
         "between the nodes (inv env.show; inv preflight.network), check firewalls and MASTER_ADDR."),
    _sig("nccl-ib",
         r"NET/IB.*(failed|error)|ibv_\w+ failed|No device found for NCCL_IB_HCA",
         "InfiniBand/RoCE setup failed: check NCCL_IB_HCA names active ports (inv preflight.network) "
         "and the memlock limit (ulimit -l unlimited)."),
    _sig("collective-timeout",
         r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*[Tt]imeout|"
         r"collective operation timeout|DistBackendError.*timed out|Timed out .*(rendezvous|store)",
         "A collective timed out: one rank died or hung (read every logs/rank*.log, not just rank 0); "
         "check that all ranks run the same steps; raise the timeout only if ranks are merely slow."),
    _sig("hang",
         r"hung: no training step for|hang watchdog: no progress",
         "A rank stopped making progress and the hang watchdog ended it: logs/hang-rank<R>.json says "
         "where, its Python stacks are in logs/rank<R>.log, logs/flight-recorder*-rank<R>.json list "
         "its last collectives. The rank that stopped first is the cause (the others wait for it in a "
         "collective): a stuck data read or file system, a GPU fault (dmesg, nvidia-smi -q / amd-smi), "
         "or code only some ranks run. Raise health.hang_timeout_s if steps are legitimately slower."),
    _sig("straggler",
         r"straggler: rank \d+ on \S+",
         "One rank was consistently slower than the others, and every rank waits for it: check that "
         "host (inv -H HOST preflight.all: clocks, thermals, other jobs, its disk) and leave it out "
         "with --exclude HOST."),
    _sig("oom",
         r"CUDA out of memory|HIP out of memory|OutOfMemoryError|hipErrorOutOfMemory|"
         r"Tried to allocate [\d.]+ [GM]iB",
         "Out of GPU memory: lower the micro batch size or sequence length, enable activation "
         "checkpointing, or shard more (FSDP); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
         "helps fragmentation."),
    _sig("host-oom",
         r"Killed process|oom-kill|SIGKILL.*(memory|oom)|exitcode\s*:\s*-9",
         "A process was killed (exit -9), usually by the host's OOM killer: fewer data loader "
         "workers, smaller prefetch, or more host memory per rank."),
    _sig("miopen-lock",
         r"MIOpen.*(lock|database is locked|sqlite)|miopen.*(udb|ufdb).*locked",
         "MIOpen's cache is locked by another process (shared file system): give each node its own "
         "MIOPEN_USER_DB_PATH / MIOPEN_CUSTOM_CACHE_DIR (the GPU env profile does this per node)."),
    _sig("address-in-use",
         r"Address already in use|EADDRINUSE|The server socket has failed to listen",
         "The rendezvous port is taken: pick another MASTER_PORT or wait for the old job to exit."),
    _sig("no-gpu",
         r"No CUDA GPUs are available|no ROCm-capable device|hipErrorNoDevice|CUDA driver version is insufficient",
         "No usable GPU for this process: check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / "
         "ROCR_VISIBLE_DEVICES and the driver (inv preflight.gpu)."),
)


@dataclass
class Finding:
    signature: str
    advice: str
    source: str   # file the match came from
    line: str     # the matching line, trimmed


def scan_text(text: str, source: str = "") -> list[Finding]:
    findings, seen = [], set()
    for line in text.splitlines():
        for signature in SIGNATURES:
            if signature.name not in seen and signature.pattern.search(line):
                seen.add(signature.name)
                findings.append(Finding(signature.name, signature.advice, source, line.strip()[:200]))
    return findings


def scan(paths: Iterable[Path], extra_text: str = "", max_bytes: int = 2_000_000) -> list[Finding]:
    """One finding per signature, across the given log files (tails only) and text."""
    findings: dict[str, Finding] = {}
    sources = [(str(p), p) for p in paths] + ([("error", None)] if extra_text else [])
    for label, path in sources:
        if path is None:
            text = extra_text
        else:
            try:
                with open(path, "rb") as handle:
                    handle.seek(0, 2)
                    size = handle.tell()
                    handle.seek(max(0, size - max_bytes))
                    text = handle.read().decode("utf-8", "replace")
            except OSError:
                continue
        for finding in scan_text(text, label):
            findings.setdefault(finding.signature, finding)
    return list(findings.values())


def log_files(run_dir: Path) -> list[Path]:
    logs = Path(run_dir) / names.LOGS_DIR
    return sorted(logs.glob("*.log")) + sorted(logs.glob("*.txt")) if logs.is_dir() else []

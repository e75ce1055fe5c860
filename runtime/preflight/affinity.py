"""preflight.affinity: which NUMA node (and CPUs) each GPU hangs off, and where ranks would run.

Reads /sys/bus/pci/devices/<bdf>/numa_node and /sys/devices/system/node/node<N>/cpulist.
LUMI-G is the cautionary tale: GCD0-1 sit on NUMA 3, GCD2-3 on NUMA 1, ...
(LUMI user guide, distribution-binding), so "rank i on the i-th core block"
puts ranks on the far socket.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from runtime.preflight.result import PASS, WARN, CheckResult

FIX = ("bind each rank next to its GPU: torchrun --numa-binding=exclusive, srun --cpu-bind=map_cpu/mask_cpu, "
       "or numactl --cpunodebind=N --membind=N")


def parse_cpulist(text: str) -> set[int]:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def gpu_numa_node(root: Path, bus_id: Optional[str]) -> Optional[int]:
    if not bus_id:
        return None
    try:
        node = int((root / "sys/bus/pci/devices" / bus_id / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the platform does not say


def node_cpus(root: Path, node: int) -> set[int]:
    try:
        return parse_cpulist((root / f"sys/devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return set()


def run(inp) -> list[CheckResult]:
    root, m = inp.root, inp.machine
    numa_nodes = len(list((root / "sys/devices/system/node").glob("node[0-9]*"))) or 1
    if not m.has_gpu:
        return [CheckResult("affinity.gpu_numa", PASS, f"{numa_nodes} NUMA node(s)", "no GPU: nothing to map")]
    mapping = {g.index: gpu_numa_node(root, g.bus_id) for g in m.gpus}
    known = {i: n for i, n in mapping.items() if n is not None}
    if not known:
        return [CheckResult("affinity.gpu_numa", PASS if numa_nodes == 1 else WARN, "unknown",
                            "the platform does not report GPU NUMA nodes" if numa_nodes > 1 else "one NUMA node",
                            "" if numa_nodes == 1 else "check BIOS NUMA settings (numa_node = -1)")]
    value = ", ".join(f"GPU{i}->NUMA{n}" for i, n in sorted(known.items()))
    results = [CheckResult("affinity.gpu_numa", PASS, value, f"GPU to NUMA node over {numa_nodes} node(s)")]
    results.append(_binding(inp, known, numa_nodes))
    return results


def _binding(inp, known: dict, numa_nodes: int) -> CheckResult:
    allowed = set(inp.cpus) if inp.cpus is not None else os.sched_getaffinity(0)
    every = set().union(*(node_cpus(inp.root, n) for n in set(known.values())), set())
    local_rank = inp.environ.get("LOCAL_RANK") or inp.environ.get("SLURM_LOCALID")
    if local_rank is not None and local_rank.isdigit() and int(local_rank) in known:
        gpu = int(local_rank)
        near = node_cpus(inp.root, known[gpu])
        if allowed and near and not allowed & near:
            return CheckResult("affinity.binding", WARN, f"rank {gpu}: CPUs {_span(allowed)}",
                               f"local rank {gpu} runs on the far socket: its GPU is on NUMA{known[gpu]} "
                               f"(CPUs {_span(near)})", FIX)
        return CheckResult("affinity.binding", PASS, f"rank {gpu}: CPUs {_span(allowed)}",
                           f"local rank {gpu} runs next to GPU{gpu} (NUMA{known[gpu]})")
    if numa_nodes > 1 and len(set(known.values())) > 1 and allowed and every and every <= allowed:
        return CheckResult("affinity.binding", WARN, f"unbound ({len(allowed)} CPUs)",
                           "ranks started from here are not bound: each may run on the far socket from its GPU",
                           FIX)
    return CheckResult("affinity.binding", PASS, f"{len(allowed)} CPUs" if allowed else None,
                       "one NUMA node holds the GPUs" if len(set(known.values())) == 1 else "CPU binding")


def _span(cpus: set[int]) -> str:
    ordered = sorted(cpus)
    return f"{ordered[0]}-{ordered[-1]}" if len(ordered) > 1 else str(ordered[0]) if ordered else "-"

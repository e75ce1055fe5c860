"""preflight.topology: the node's GPU <-> NIC <-> NUMA map, held against the GPU profile.

Two findings are a WARN with the fix:
- a GPU pair without the fast link its profile expects (`gpu_link` in envs/profiles/<model>.py:
  NVLink on HGX boards, XGMI on Instinct OAM boards): collectives between them fall back to
  PCIe at a tenth of the bandwidth or less;
- a NIC on the wrong NUMA node for its GPUs: an RDMA NIC whose own GPUs (the ones on its PCIe
  switch, PIX/PXB in nvidia-smi topo -m) sit on another node, or GPUs on a node with no RDMA
  NIC while other nodes have them; every inter-node transfer of those GPUs crosses the socket
  interconnect.
The map itself goes into the run as topology.json (CheckInputs.topology), which
`inv snapshot.report` draws.
"""
from __future__ import annotations

from envs import profiles, topology
from runtime.preflight.result import PASS, WARN, CheckResult

LINK_FIX = {
    "NVLink": "check the links: nvidia-smi nvlink -s and nvidia-smi -q | grep -i -A2 fabric (on HGX boards "
              "nvidia-fabricmanager must be running); a GPU that lost its links needs a reset, else drain the node",
    "XGMI": "check the links: amd-smi xgmi -l (or rocm-smi --showtopo) and the kernel log for XGMI errors; a GPU "
            "without its links needs a reset (amd-smi reset -G N), else drain the node",
}
NUMA_FIX = ("inter-node traffic of those GPUs crosses the CPU interconnect: check the BIOS NUMA setting (NPS) "
            "and the slot layout against the board manual; meanwhile let NCCL/RCCL take the NIC nearest each GPU "
            "(NCCL_IB_HCA unset, or the local NICs first) and bind each rank next to its GPU")


def run(inp) -> list[CheckResult]:
    topo = topology.probe(inp.machine, inp.root)
    inp.topology = topo
    return judge(topo, inp.machine)


def judge(topo: topology.Topology, machine=None) -> list[CheckResult]:
    rdma = [n for n in topo.nics if n.kind == "rdma"]
    value = (f"{len(topo.gpus)} GPU(s), {len(rdma)} RDMA NIC(s), {len(topo.nics) - len(rdma)} other NIC(s), "
             f"{len(topo.numa_nodes) or '?'} NUMA node(s)")
    results = [CheckResult("topology.map", PASS, value, f"from {topo.source or 'nothing'}"
                           + (f"; {'; '.join(topo.notes)}" if topo.notes else ""))]
    if not topo.gpus:
        return results
    results.append(_links(topo, machine))
    results.append(_nic_numa(topo, rdma))
    return results


def expected_link(machine) -> tuple[str, str]:
    """(the link the machine's profile expects between its GPUs, its source); ("", why not)."""
    model = next((m for m in profiles.MODELS.values() if m.name == getattr(machine, "model", None)), None)
    if model is None:
        return "", "no GPU profile for this machine"
    name = getattr(machine, "name", "") or ""
    exempt = next((word for word in model.link_exempt if word.lower() in name.lower()), None)
    if exempt:
        return "", f"{name}: the {exempt} form factor has no {model.gpu_link} between every pair"
    if not model.gpu_link:
        return "", f"the {model.name} profile expects no GPU link (PCIe cards)"
    return model.gpu_link, model.gpu_link_ref


def _links(topo, machine) -> CheckResult:
    link, why = expected_link(machine)
    pairs = {key: code for key, code in topo.links.items()}
    if len(topo.gpus) < 2:
        return CheckResult("topology.gpu_links", PASS, "one GPU", "no GPU pair to link")
    if not pairs:
        return CheckResult("topology.gpu_links", PASS, "unknown", "the vendor tool gave no GPU pairs; not checked")
    fast = sum(topology.is_fast(code) for code in pairs.values())
    value = f"{fast} of {len(pairs)} pairs {link or 'NVLink/XGMI'}"
    if not link:
        return CheckResult("topology.gpu_links", PASS, value, why)
    slow = [f"GPU{k.replace('-', '-GPU')} {code}" for k, code in sorted(pairs.items(), key=_pair_order)
            if not topology.is_fast(code)]
    if not slow:
        return CheckResult("topology.gpu_links", PASS, value, f"every GPU pair has {link} ({why})")
    shown = ", ".join(slow[:6]) + (f", ... ({len(slow)} in all)" if len(slow) > 6 else "")
    return CheckResult("topology.gpu_links", WARN, value,
                       f"{len(slow)} GPU pair(s) without {link}, which the profile expects ({why}): {shown}",
                       LINK_FIX.get(link, ""))


def _pair_order(item):
    a, b = item[0].split("-")
    return int(a), int(b)


def _nic_numa(topo, rdma) -> CheckResult:
    if not rdma:
        return CheckResult("topology.nic_numa", PASS, "no RDMA NIC", "no RDMA NIC to place")
    gpu_numa = topo.gpu_numa()
    problems = []
    for nic in rdma:                       # a NIC's own GPUs (same PCIe switch) on another node
        near = topo.near_gpus(nic)
        away = [g for g in near if nic.numa is not None and gpu_numa.get(g) not in (None, nic.numa)]
        if away:
            problems.append(f"{nic.name} is on NUMA{nic.numa} but its GPUs (same PCIe switch) "
                            + ", ".join(f"GPU{g} on NUMA{gpu_numa[g]}" for g in away))
    nic_nodes = {n.numa for n in rdma if n.numa is not None}
    if nic_nodes:
        for node in sorted(set(gpu_numa.values()) - nic_nodes):
            gpus = sorted(g for g, n in gpu_numa.items() if n == node)
            problems.append(f"GPU{','.join(map(str, gpus))} on NUMA{node} have no RDMA NIC on their node "
                            f"(the NICs are on NUMA{','.join(map(str, sorted(nic_nodes)))})")
    value = ", ".join(f"{n.name}->NUMA{n.numa if n.numa is not None else '?'}" for n in rdma)
    if problems:
        return CheckResult("topology.nic_numa", WARN, value, "; ".join(problems), NUMA_FIX)
    if not nic_nodes:
        return CheckResult("topology.nic_numa", PASS, value, "the platform does not report the NICs' NUMA nodes")
    return CheckResult("topology.nic_numa", PASS, value, "every GPU's NUMA node has an RDMA NIC")


def tables(topo: topology.Topology) -> list[tuple[str, list[str], list[list]]]:
    """(title, headers, rows) for the terminal: GPUs, NICs, NUMA nodes (inv env.topology)."""
    gpu_rows = []
    for gpu in topo.gpus:
        others = [(other.index, topo.link(gpu.index, other.index)) for other in topo.gpus if other.index != gpu.index]
        codes = sorted({code for _, code in others if code})
        links = (f"{codes[0]} to all" if len(codes) == 1 and len(others) > 1 else
                 " ".join(f"{i}:{code}" for i, code in others if code)) or "-"
        nics = [n.name for n in topo.nics if gpu.index in topo.near_gpus(n)]
        gpu_rows.append([f"GPU{gpu.index}", _num(gpu.numa), gpu.cpus or "-", gpu.bus_id or "-", links,
                         ", ".join(nics) or "-"])
    nic_rows = [[n.name, n.kind, _num(n.numa), n.netdev or "-", n.bus_id or "-",
                 ", ".join(f"GPU{g}" for g in topo.near_gpus(n)) or "-"] for n in topo.nics]
    numa_rows = [[node, cpus or "-", ", ".join(f"GPU{g.index}" for g in topo.gpus if g.numa == node) or "-",
                  ", ".join(n.name for n in topo.nics if n.numa == node) or "-"]
                 for node, cpus in sorted(topo.numa_nodes.items())]
    return [("GPUs", ["GPU", "NUMA", "CPUs", "PCI bus", "links to the other GPUs", "NICs on its switch"], gpu_rows),
            ("NICs", ["NIC", "kind", "NUMA", "netdev", "PCI bus", "GPUs on its switch"], nic_rows),
            ("NUMA nodes", ["node", "CPUs", "GPUs", "NICs"], numa_rows)]


def _num(value) -> str:
    return "?" if value is None else str(value)

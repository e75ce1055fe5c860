"""The node topology as a picture: one inline SVG (no script, no font files).

One box per NUMA node with its CPUs, its GPUs in a row and its NICs below them. Above the GPUs, a
band when every GPU pair has NVLink/XGMI (else one arc per fast pair); a NIC is joined to the
GPUs on its PCIe switch (PIX/PXB), in orange when they sit on another NUMA node. What the tool
did not say (a GPU or NIC whose NUMA node is unknown) goes in a box of its own.
"""
from __future__ import annotations

from html import escape

from envs.topology import Topology, is_fast

GPU_W, GPU_H, NIC_W, NIC_H, GAP, PAD = 70, 44, 86, 30, 12, 16
COLORS = {"gpu": "#2b6cb0", "nic": "#2f855a", "fast": "#805ad5", "near": "#2f855a", "far": "#dd6b20",
          "slow": "#c53030", "box": "#f7fafc", "edge": "#a0aec0", "text": "#1a202c"}


def _text(x, y, text, size=12, anchor="middle", weight="normal", color=COLORS["text"]) -> str:
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{color}" font-family="sans-serif">{escape(str(text))}</text>')


def draw(topo: Topology, title: str = "") -> str:
    nodes = sorted(topo.numa_nodes) or sorted({g.numa for g in topo.gpus if g.numa is not None}) or []
    unknown = [g for g in topo.gpus if g.numa not in nodes] + [n for n in topo.nics if n.numa not in nodes]
    groups = [(node, [g for g in topo.gpus if g.numa == node], [n for n in topo.nics if n.numa == node])
              for node in nodes]
    if unknown:
        groups.append((None, [g for g in topo.gpus if g.numa not in nodes],
                       [n for n in topo.nics if n.numa not in nodes]))
    top = 66                                    # title, then the link band and its label above the boxes
    gpu_y = top + GAP
    nic_y = gpu_y + (GPU_H + 2 * GAP if topo.gpus else 0)
    height = (nic_y - top) + (NIC_H + GAP if topo.nics else 0) + 26
    parts, centers, nic_at = [], {}, {}
    x = PAD
    for node, gpus, nics in groups:
        width = max(len(gpus) * (GPU_W + GAP), len(nics) * (NIC_W + GAP), 200) + GAP
        label = f"NUMA {node}" if node is not None else "NUMA node unknown"
        cpus = topo.numa_nodes.get(node, "") if node is not None else ""
        parts.append(f'<rect x="{x}" y="{top}" width="{width}" height="{height}" rx="8" fill="{COLORS["box"]}" '
                     f'stroke="{COLORS["edge"]}"/>')
        parts.append(_text(x + 10, top + height - 9, label + (f" · CPUs {cpus}" if cpus else ""), 12, "start",
                           "bold"))
        gx = x + GAP
        for gpu in gpus:
            centers[gpu.index] = (gx + GPU_W / 2, gpu_y)
            parts.append(f'<rect class="gpu" x="{gx}" y="{gpu_y}" width="{GPU_W}" height="{GPU_H}" rx="5" '
                         f'fill="{COLORS["gpu"]}"/>')
            parts.append(_text(gx + GPU_W / 2, gpu_y + 19, f"GPU{gpu.index}", 13, weight="bold", color="#fff"))
            parts.append(_text(gx + GPU_W / 2, gpu_y + 35, (gpu.bus_id or "")[-7:], 9, color="#e2e8f0"))
            gx += GPU_W + GAP
        nx = x + GAP
        for nic in nics:
            nic_at[nic.name] = (nx + NIC_W / 2, nic_y)
            parts.append(f'<rect class="nic" x="{nx}" y="{nic_y}" width="{NIC_W}" height="{NIC_H}" rx="5" '
                         f'fill="{COLORS["nic"] if nic.kind == "rdma" else "#718096"}"/>')
            parts.append(_text(nx + NIC_W / 2, nic_y + 19, nic.name[:12], 11, color="#fff"))
            nx += NIC_W + GAP
        x += width + GAP
    heading = title or (f"{len(topo.gpus)} GPU(s), {len(topo.nics)} NIC(s), {len(nodes)} NUMA node(s); from "
                        f"{topo.source or 'no source'}")
    total_w = max(x + PAD - GAP, 8 * len(heading) + 2 * PAD, 560)
    total_h = top + height + 30
    lines = _gpu_links(topo, centers, top) + _nic_links(topo, centers, nic_at)
    legend = _text(PAD, total_h - 10, "purple: NVLink/XGMI · green line: NIC on the GPU's PCIe switch · orange: "
                   "across NUMA nodes · red: GPU pairs without a fast link", 10, "start", color="#4a5568")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="topology" width="{total_w:.0f}" height="{total_h:.0f}" '
            f'viewBox="0 0 {total_w:.0f} {total_h:.0f}" role="img" aria-label="node topology">'
            f'<rect width="100%" height="100%" fill="#fff"/>' + _text(PAD, 20, heading, 13, "start", "bold")
            + "".join(parts + lines) + legend + "</svg>")


def _gpu_links(topo: Topology, centers: dict, top: int) -> list[str]:
    if len(centers) < 2 or not topo.links:
        return []
    pairs = {tuple(map(int, key.split("-"))): code for key, code in topo.links.items()}
    fast = {p for p, code in pairs.items() if is_fast(code)}
    xs = [c[0] for c in centers.values()]
    out = []
    if len(fast) == len(pairs):                    # a fabric: every pair linked
        codes = sorted(set(pairs.values()))
        y = top - 10
        out.append(f'<line x1="{min(xs):.0f}" y1="{y}" x2="{max(xs):.0f}" y2="{y}" stroke="{COLORS["fast"]}" '
                   f'stroke-width="5"/>')
        out += [f'<line x1="{cx:.0f}" y1="{y}" x2="{cx:.0f}" y2="{cy:.0f}" stroke="{COLORS["fast"]}" '
                f'stroke-width="2"/>' for cx, cy in centers.values()]
        out.append(_text(min(xs), y - 8, f"{'/'.join(codes)} between every pair", 11, "start", color=COLORS["fast"]))
        return out
    for (a, b), code in sorted(pairs.items()):
        if a not in centers or b not in centers:
            continue
        (x1, y1), (x2, _) = centers[a], centers[b]
        if (a, b) in fast:
            rise = 10 + abs(x2 - x1) / 12
            out.append(f'<path d="M{x1:.0f},{y1:.0f} Q{(x1 + x2) / 2:.0f},{y1 - rise:.0f} {x2:.0f},{y1:.0f}" '
                       f'fill="none" stroke="{COLORS["fast"]}" stroke-width="2"><title>GPU{a}-GPU{b} {escape(code)}'
                       f'</title></path>')
    if fast:      # some pairs linked, others not: name the ones left out
        slow = [f"GPU{a}-GPU{b} {code}" for (a, b), code in sorted(pairs.items()) if (a, b) not in fast]
        out.append(_text(PAD, top - 24, "no fast link: " + ", ".join(slow[:8]) + (" ..." if len(slow) > 8 else ""),
                         11, "start", color=COLORS["slow"]))
    return out


def _nic_links(topo: Topology, centers: dict, nic_at: dict) -> list[str]:
    out = []
    numa = topo.gpu_numa()
    for nic in topo.nics:
        if nic.name not in nic_at:
            continue
        nx, ny = nic_at[nic.name]
        for gpu in topo.near_gpus(nic):
            if gpu not in centers:
                continue
            gx, gy = centers[gpu]
            far = nic.numa is not None and numa.get(gpu) not in (None, nic.numa)
            out.append(f'<line x1="{nx:.0f}" y1="{ny:.0f}" x2="{gx:.0f}" y2="{gy + GPU_H:.0f}" '
                       f'stroke="{COLORS["far"] if far else COLORS["near"]}" stroke-width="{3 if far else 1.5}"/>')
    return out

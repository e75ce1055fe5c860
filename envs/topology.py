"""The node's GPU <-> NIC <-> NUMA <-> CPU map.

    topo = probe(machine)              # Topology: from nvidia-smi topo -m / rocm-smi --showtopo + sysfs
    topo = parse_nvidia_topo(text)     # the parsers, for recorded outputs
    topo.to_dict() / Topology.from_dict(d)

Where each fact comes from:
- GPU pairs: `nvidia-smi topo -m` (NV<n> = n bonded NVLinks; PIX, PXB, PHB, NODE, SYS = PCIe paths
  of growing length) on NVIDIA; `rocm-smi --showtopo`'s "Link Type between two GPUs" (XGMI or
  PCIE) on AMD.
- GPU NUMA nodes and CPUs: the tool's columns, else /sys/bus/pci/devices/<bus>/numa_node.
- NICs: RDMA devices in /sys/class/infiniband (and their netdevs), else the physical network
  interfaces in /sys/class/net; each with its PCI device's numa_node.
- NUMA nodes and their CPUs: /sys/devices/system/node/node<N>/cpulist.
A fact no source gives stays None and is said in `notes`; nothing here raises on odd output.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from core.vendor import Vendor
from envs.probes import amd, nvidia

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PCIE_CODES = ("PIX", "PXB", "PHB", "NODE", "SYS", "PCIE", "SOC")


@dataclass
class TopoGpu:
    index: int
    numa: Optional[int] = None
    cpus: str = ""            # the CPU list next to it, "0-23,96-119"
    bus_id: Optional[str] = None
    name: str = ""


@dataclass
class TopoNic:
    name: str                 # mlx5_0 (RDMA) or eth0
    numa: Optional[int] = None
    kind: str = "net"         # "rdma" | "net"
    netdev: str = ""          # the RDMA device's network interface, when it has one
    bus_id: Optional[str] = None
    column: str = ""          # its column in nvidia-smi topo -m ("NIC0")


@dataclass
class Topology:
    vendor: Vendor = Vendor.CPU   # a string is read with Vendor.parse
    gpus: list[TopoGpu] = field(default_factory=list)
    nics: list[TopoNic] = field(default_factory=list)
    numa_nodes: dict[int, str] = field(default_factory=dict)   # node -> CPU list text
    links: dict[str, str] = field(default_factory=dict)         # "0-1" -> "NV18" / "XGMI" / "SYS" ...
    nic_links: dict[str, str] = field(default_factory=dict)     # "0-mlx5_0" -> "PIX" ...
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.vendor = Vendor.parse(self.vendor)

    # -- queries
    def link(self, a: int, b: int) -> Optional[str]:
        return self.links.get(f"{min(a, b)}-{max(a, b)}")

    def gpu_numa(self) -> dict[int, int]:
        return {g.index: g.numa for g in self.gpus if g.numa is not None}

    def near_gpus(self, nic: TopoNic) -> list[int]:
        """The GPUs this NIC shares a PCIe switch with (PIX/PXB), from the tool's matrix."""
        return sorted(g.index for g in self.gpus
                      if self.nic_links.get(f"{g.index}-{nic.name}") in ("PIX", "PXB"))

    # -- (de)serialising: run files and the report
    def to_dict(self) -> dict:
        data = asdict(self)
        data["numa_nodes"] = {str(k): v for k, v in self.numa_nodes.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        data = dict(data or {})
        gpus = [TopoGpu(**g) for g in data.pop("gpus", []) or [] if isinstance(g, dict)]
        nics = [TopoNic(**n) for n in data.pop("nics", []) or [] if isinstance(n, dict)]
        nodes = {int(k): str(v) for k, v in (data.pop("numa_nodes", {}) or {}).items()}
        known = {k: v for k, v in data.items() if k in ("vendor", "links", "nic_links", "source", "notes")}
        return cls(gpus=gpus, nics=nics, numa_nodes=nodes, **known)


def is_fast(code: Optional[str]) -> bool:
    """NVLink (NV<n>) or Infinity Fabric (XGMI): a GPU pair that does not go over PCIe."""
    return bool(code) and (re.fullmatch(r"NV\d+", code) is not None or code == "XGMI")


def _int(text: str) -> Optional[int]:
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) and int(text) >= 0 else None


# ---------------------------------------------------------------- nvidia-smi topo -m

def parse_nvidia_topo(text: str) -> Topology:
    """`nvidia-smi topo -m`: the matrix over GPU<i> and NIC<j> columns, then CPU Affinity, NUMA
    Affinity (and GPU NUMA ID on newer drivers); the NIC Legend names each NIC<j>."""
    topo = Topology(vendor=Vendor.NVIDIA, source="nvidia-smi topo -m")
    lines = [ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_at is None:
        topo.notes.append("nvidia-smi topo -m: no GPU0 column header found")
        return topo
    header = [h.strip() for h in re.split(r"\t|\s{2,}", lines[header_at].strip()) if h.strip()]
    devices = [h for h in header if re.fullmatch(r"(GPU|NIC)\d+", h)]
    legend = {m.group(1): m.group(2) for m in (re.match(r"^\s*(NIC\d+):\s*(\S+)", line) for line in lines) if m}
    nic_names = {col: legend.get(col, col) for col in devices if col.startswith("NIC")}
    topo.nics = [TopoNic(name=nic_names[col], kind="rdma" if nic_names[col] != col else "net", column=col)
                 for col in devices if col.startswith("NIC")]
    extra = header[len(devices):]            # CPU Affinity, NUMA Affinity, GPU NUMA ID
    for line in lines[header_at + 1:]:
        cells = line.split()
        if not cells or not re.fullmatch(r"(GPU|NIC)\d+", cells[0]):
            if cells and cells[0].startswith("Legend"):
                break
            continue
        row, values = cells[0], cells[1:]
        matrix, rest = values[:len(devices)], values[len(devices):]
        if row.startswith("GPU"):
            index = int(row[3:])
            gpu = TopoGpu(index=index)
            columns = dict(zip(extra, rest))
            gpu.cpus = columns.get("CPU Affinity", "")
            numa = columns.get("NUMA Affinity", columns.get("NUMA", ""))
            gpu.numa = _int(numa) if numa else None
            topo.gpus.append(gpu)
            for col, code in zip(devices, matrix):
                if col.startswith("GPU") and col != row:
                    other = int(col[3:])
                    topo.links[f"{min(index, other)}-{max(index, other)}"] = code
                elif col.startswith("NIC"):
                    topo.nic_links[f"{index}-{nic_names[col]}"] = code
    if not topo.gpus:
        topo.notes.append("nvidia-smi topo -m: no GPU rows")
    return topo


# ---------------------------------------------------------------- rocm-smi --showtopo

def _rocm_matrix(lines: list[str], title: str) -> dict[tuple[int, int], str]:
    start = next((i for i, line in enumerate(lines) if title in line), None)
    if start is None:
        return {}
    cells: dict[tuple[int, int], str] = {}
    columns: list[int] = []
    for line in lines[start + 1:]:
        parts = line.split()
        if not parts:
            if columns and cells:
                break
            continue
        if line.startswith("="):
            break
        if all(re.fullmatch(r"GPU\d+", p) for p in parts):
            columns = [int(p[3:]) for p in parts]
            continue
        if re.fullmatch(r"GPU\d+", parts[0]) and columns:
            row = int(parts[0][3:])
            for col, value in zip(columns, parts[1:]):
                cells[(row, col)] = value
    return cells


def parse_rocm_topo(text: str) -> Topology:
    """`rocm-smi --showtopo`: the weight, hops and link-type matrices and each GPU's NUMA node."""
    topo = Topology(vendor=Vendor.AMD, source="rocm-smi --showtopo")
    lines = [ANSI.sub("", line).rstrip() for line in text.splitlines()]
    kinds = _rocm_matrix(lines, "Link Type between two GPUs")
    numa: dict[int, int] = {}
    for line in lines:
        m = re.match(r"^GPU\[(\d+)\]\s*:\s*\(Topology\)\s*Numa Node:\s*(-?\d+)", line.strip())
        if m and int(m.group(2)) >= 0:
            numa[int(m.group(1))] = int(m.group(2))
    indices = sorted({a for a, _ in kinds} | set(numa))
    topo.gpus = [TopoGpu(index=i, numa=numa.get(i)) for i in indices]
    for (a, b), code in kinds.items():
        if a != b:
            topo.links[f"{min(a, b)}-{max(a, b)}"] = code.upper()
    if not indices:
        topo.notes.append("rocm-smi --showtopo: no GPU found in its output")
    return topo


# ---------------------------------------------------------------- sysfs

def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def numa_nodes(root: Path = Path("/")) -> dict[int, str]:
    out = {}
    for node in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        out[int(node.name[4:])] = _read(node / "cpulist")
    return out


def pci_numa(root: Path, bus_id: Optional[str]) -> Optional[int]:
    return _int(_read(root / "sys/bus/pci/devices" / bus_id / "numa_node")) if bus_id else None


PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _pci_device(device: Path) -> Optional[Path]:
    """The PCI function a class device hangs off: itself, or the nearest parent named like
    0000:17:00.0 (a virtio NIC's "device" is virtio2, under its PCI function)."""
    try:
        real = device.resolve()
    except OSError:
        return None
    return next((p for p in (real, *real.parents) if PCI_ADDRESS.fullmatch(p.name)), None)


def _device_numa(device: Path) -> tuple[Optional[int], Optional[str]]:
    pci = _pci_device(device)
    if pci is None:
        return _int(_read(device / "numa_node")), None
    return _int(_read(pci / "numa_node")), pci.name


def sysfs_nics(root: Path = Path("/")) -> list[TopoNic]:
    """RDMA devices (with their netdevs), then physical network interfaces that no RDMA device owns."""
    nics, owned = [], set()
    for dev in sorted((root / "sys/class/infiniband").glob("*")):
        netdevs = sorted(p.name for p in (dev / "device" / "net").glob("*"))
        owned.update(netdevs)
        numa, bus = _device_numa(dev / "device")
        nics.append(TopoNic(name=dev.name, numa=numa, kind="rdma", netdev=",".join(netdevs), bus_id=bus))
    for dev in sorted((root / "sys/class/net").glob("*")):
        if dev.name in owned or not (dev / "device").exists():     # lo, bridges, veths have no device
            continue
        numa, bus = _device_numa(dev / "device")
        nics.append(TopoNic(name=dev.name, numa=numa, kind="net", bus_id=bus))
    return nics


def merge_sysfs(topo: Topology, machine=None, root: Path = Path("/")) -> Topology:
    """Add what sysfs knows: NUMA nodes, GPU bus ids and NUMA nodes the tool did not give, NICs
    (a tool's NIC keeps its column; sysfs adds its NUMA node and netdev)."""
    topo.numa_nodes = topo.numa_nodes or numa_nodes(root)
    gpus = {g.index: g for g in topo.gpus}
    for reported in getattr(machine, "gpus", None) or []:
        gpu = gpus.get(reported.index)
        if gpu is None:
            gpu = gpus[reported.index] = TopoGpu(index=reported.index)
            topo.gpus.append(gpu)
        gpu.bus_id = gpu.bus_id or reported.bus_id
        gpu.name = gpu.name or reported.name
        if gpu.numa is None:
            gpu.numa = pci_numa(root, gpu.bus_id)
    topo.gpus.sort(key=lambda g: g.index)
    for gpu in topo.gpus:
        if not gpu.cpus and gpu.numa is not None:
            gpu.cpus = topo.numa_nodes.get(gpu.numa, "")
    found = {n.name: n for n in sysfs_nics(root)}
    for nic in topo.nics:
        seen = found.pop(nic.name, None)
        if seen is not None:
            nic.numa, nic.netdev, nic.bus_id = seen.numa, seen.netdev, seen.bus_id
            nic.kind = seen.kind
    topo.nics += list(found.values())
    if not topo.numa_nodes:
        topo.notes.append("no NUMA information in sysfs (/sys/devices/system/node)")
    return topo


# ---------------------------------------------------------------- a recorded output, this machine

def parse(text: str) -> Topology:
    """A recorded tool output, recognised by its content: rocm-smi's banner or matrices, else nvidia-smi's."""
    if "between two GPUs" in text or "ROCm System Management Interface" in text:
        return parse_rocm_topo(text)
    return parse_nvidia_topo(text)


def from_file(path: str | Path) -> Topology:
    """The map in a saved `nvidia-smi topo -m` / `rocm-smi --showtopo` output (no sysfs: it may be
    another node's). EnvError (exit 2) when the file cannot be read or holds neither."""
    from envs.errors import EnvError

    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise EnvError(f"--tool-output {path}: cannot read it ({exc.strerror or exc})") from None
    topo = parse(text)
    if not topo.gpus:
        raise EnvError(f"--tool-output {path}: no GPU found; expected the output of `nvidia-smi topo -m` or "
                       f"`rocm-smi --showtopo`")
    topo.source += f" (recorded: {Path(path).name})"
    for gpu in topo.gpus:          # the NUMA nodes the recording names, with the CPUs it gives them
        if gpu.numa is not None and not topo.numa_nodes.get(gpu.numa):
            topo.numa_nodes[gpu.numa] = gpu.cpus
    return topo


# ---------------------------------------------------------------- this machine

def probe(machine=None, root: Path = Path("/")) -> Topology:
    """This node's map: the vendor tool's matrix (when it runs) merged with sysfs."""
    vendor = Vendor.parse(getattr(machine, "vendor", None))
    topo = Topology(vendor=vendor, source="sysfs")
    text = {Vendor.NVIDIA: nvidia.topology_text, Vendor.AMD: amd.topology_text}.get(vendor, lambda: None)()
    if text:
        topo = parse_nvidia_topo(text) if vendor is Vendor.NVIDIA else parse_rocm_topo(text)
        topo.source += " + sysfs"
    elif vendor.has_gpu:
        tool = "nvidia-smi topo -m" if vendor is Vendor.NVIDIA else "rocm-smi --showtopo"
        topo.notes.append(f"{tool} gave nothing: GPU pairs unknown")
    return merge_sysfs(topo, machine, root)

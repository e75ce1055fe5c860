"""What the network looks like from this node: routes, interfaces, RDMA ports.

Readers take their input (text, or a root directory standing in for "/") so
the same code runs on this machine and on sample files in tests. Nothing
here raises on a machine without the file or tool: it returns empty results.
"""
from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path("/")


# ---- routes -----------------------------------------------------------------

def parse_proc_net_route(text: str) -> list[tuple[str, ipaddress.IPv4Network, int]]:
    """Parse /proc/net/route into (iface, network, metric); hex fields are little-endian."""
    routes = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        iface, dest_hex, _gw, flags_hex, _ref, _use, metric, mask_hex = fields[:8]
        try:
            if not int(flags_hex, 16) & 0x1:  # RTF_UP
                continue
            dest = ipaddress.IPv4Address(int(dest_hex, 16).to_bytes(4, "little"))
            mask = ipaddress.IPv4Address(int(mask_hex, 16).to_bytes(4, "little"))
            network = ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)
        except ValueError:
            continue
        routes.append((iface, network, int(metric)))
    return routes


def route_from_table(text: str, address: str) -> Optional[str]:
    """The interface /proc/net/route sends `address` through: longest prefix, then lowest metric."""
    try:
        target = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    if target.is_loopback:
        return "lo"  # the local table, which /proc/net/route does not show
    matches = [(net.prefixlen, -metric, iface) for iface, net, metric in parse_proc_net_route(text)
               if target in net]
    return max(matches)[2] if matches else None


def parse_ip_route_get(text: str) -> Optional[str]:
    """The `dev` of `ip route get ADDR` output ("10.0.0.2 via 10.0.0.1 dev eth0 src ...")."""
    words = text.split()
    for word, following in zip(words, words[1:]):
        if word == "dev":
            return following
    return None


def resolve_host(name: str) -> Optional[str]:
    """IPv4 address for a host name or address, None when it does not resolve."""
    try:
        return socket.gethostbyname(name)
    except (OSError, UnicodeError):
        return None


@dataclass
class Route:
    address: str  # the IPv4 address routed to
    iface: Optional[str]
    how: str  # which method answered


def route_to(host: str, root: Path = ROOT) -> Optional[Route]:
    """Which interface traffic to `host` leaves through; None when `host` does not resolve.

    On the live system `ip route get` answers (it knows policy routing and the
    local table); otherwise /proc/net/route under `root`. A route to one of
    this node's own addresses goes through `lo`, which is useless for NCCL on
    the master node of a multi-node job: answer with the interface that owns
    the address instead.
    """
    address = resolve_host(host)
    if address is None:
        return None
    iface, how = None, ""
    if root == ROOT and shutil.which("ip"):
        try:
            out = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True,
                                 text=True, timeout=5)
            if out.returncode == 0:
                iface, how = parse_ip_route_get(out.stdout), "ip route get"
        except (OSError, subprocess.SubprocessError):
            pass
    if iface is None:
        try:
            iface = route_from_table((root / "proc/net/route").read_text(), address)
            how = "/proc/net/route"
        except OSError:
            pass
    if iface == "lo" and not ipaddress.IPv4Address(address).is_loopback:
        owner = interface_owning(address)
        if owner:
            iface, how = owner, f"{how}; {address} is this node's own address on {owner}"
    return Route(address, iface, how)


def default_route_iface(root: Path = ROOT) -> Optional[str]:
    """The interface of the default route (lowest metric), from /proc/net/route."""
    try:
        routes = parse_proc_net_route((root / "proc/net/route").read_text())
    except OSError:
        return None
    defaults = sorted((metric, iface) for iface, net, metric in routes if net.prefixlen == 0)
    return defaults[0][1] if defaults else None


# ---- interfaces ---------------------------------------------------------------

def interfaces() -> dict[str, bool]:
    """Interface name -> is up, for this machine."""
    try:
        import psutil
        return {name: stats.isup for name, stats in psutil.net_if_stats().items()}
    except Exception:  # psutil missing or /proc unreadable: fall back to names only
        return {name: True for _, name in socket.if_nameindex()}


def interface_owning(address: str) -> Optional[str]:
    try:
        import psutil
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == address for a in addrs):
                return name
    except Exception:
        pass
    return None


def match_ifname_list(spec: str, names: list[str]) -> tuple[list[str], list[str]]:
    """Apply NCCL_SOCKET_IFNAME rules to `names`: (selected, entries that match nothing).

    NCCL: comma-separated prefixes; a leading "^" excludes, a leading "="
    means exact names (NCCL docs, Environment Variables, NCCL_SOCKET_IFNAME).
    """
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    entries = [e.strip() for e in spec.split(",") if e.strip()]

    def hit(entry: str, name: str) -> bool:
        return name == entry if exact else name.startswith(entry)

    unmatched = [] if exclude else [e for e in entries if not any(hit(e, n) for n in names)]
    if exclude:
        selected = [n for n in names if not any(hit(e, n) for e in entries)]
    else:
        selected = [n for n in names if any(hit(e, n) for e in entries)]
    return selected, unmatched


# ---- RDMA ---------------------------------------------------------------------

@dataclass
class RdmaPort:
    device: str
    port: int
    state: str  # "ACTIVE", "DOWN", "INIT", ...
    link_layer: str  # "InfiniBand", "Ethernet" (RoCE), ""

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def __str__(self) -> str:
        return f"{self.device}:{self.port} {self.state}" + (f" ({self.link_layer})" if self.link_layer else "")


def parse_port_state(text: str) -> str:
    """sysfs port state "4: ACTIVE" -> "ACTIVE"."""
    return text.strip().split(":", 1)[-1].strip()


def rdma_ports(root: Path = ROOT) -> list[RdmaPort]:
    """Every port of every RDMA device under root/sys/class/infiniband."""
    ports = []
    for device_dir in sorted((root / "sys/class/infiniband").glob("*")):
        for port_dir in sorted((device_dir / "ports").glob("*")):
            try:
                state = parse_port_state((port_dir / "state").read_text())
                port = int(port_dir.name)
            except (OSError, ValueError):
                continue
            try:
                link = (port_dir / "link_layer").read_text().strip()
            except OSError:
                link = ""
            ports.append(RdmaPort(device_dir.name, port, state, link))
    return ports


def parse_ib_hca(spec: str) -> tuple[bool, list[tuple[str, Optional[int]]]]:
    """NCCL_IB_HCA "^=mlx5_0:1,mlx5_1" -> (exclude, [(name prefix, port or None)])."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^").lstrip("=")
    entries = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, port = part.partition(":")
        entries.append((name, int(port) if port.isdigit() else None))
    return exclude, entries

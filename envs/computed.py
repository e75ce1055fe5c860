"""Values computed from the machine a profile is resolved on.

Each function takes the resolution context (`envs.resolve.Context`) and
returns a value, (value, detail) or None when it has nothing to say here.
"""
from __future__ import annotations

import getpass

from envs import netinfo


def socket_ifname(ctx):
    """The interface that reaches MASTER_ADDR, else the default route's interface."""
    master = ctx.get("MASTER_ADDR")
    if master:
        route = netinfo.route_to(master, ctx.root)
        if route and route.iface:
            return route.iface, f"route to MASTER_ADDR={master} ({route.address}) via {route.iface} [{route.how}]"
        return None
    iface = netinfo.default_route_iface(ctx.root)
    if iface:
        return iface, f"MASTER_ADDR unset; default route via {iface}"
    return None


def ib_hca(ctx):
    """Active RDMA ports as NCCL_IB_HCA wants them: "mlx5_0:1,mlx5_1:1"."""
    active = [p for p in netinfo.rdma_ports(ctx.root) if p.active]
    if not active:
        return None
    value = ",".join(f"{p.device}:{p.port}" for p in active)
    return value, f"{len(active)} ACTIVE port(s) in /sys/class/infiniband"


def node_id(ctx) -> str:
    return ctx.get("SLURM_NODEID") or ctx.hostname


def user(ctx) -> str:
    try:
        return ctx.get("USER") or getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        return "anvil"


def miopen_cache_dir(ctx):
    """A node-local MIOpen database/cache directory: /tmp/<user>-miopen-cache-<node>."""
    path = f"/tmp/{user(ctx)}-miopen-cache-{node_id(ctx)}"
    return path, f"node id {node_id(ctx)!r} (SLURM_NODEID, else host name)"


def hostname(ctx):
    # Under `inv -H` the fan-out names each host as the user typed it (ANVIL_HOST);
    # keep that so log lines and hooks match the -H list, not the machine's own name.
    return ctx.get("ANVIL_HOST") or ctx.hostname

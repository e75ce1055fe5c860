"""Values computed from the machine a profile is resolved on.

Each function takes the resolution context (`envs.resolve.Context`) and
returns a value, (value, detail) or None when it has nothing to say here.
"""
from __future__ import annotations

import getpass

from core import names
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
    # Under `inv -H` the fan-out names each host as the user typed it (names.HOST);
    # keep that so log lines and hooks match the -H list, not the machine's own name.
    return ctx.get(names.HOST) or ctx.hostname


# ---- TunableOp (--tune-gemm): its results file, in a cache keyed by what makes the results valid

TUNABLEOP_FILE = "tunableop_results%d.csv"   # TunableOp puts each process's device ordinal for %d


def torch_build(find_spec=None) -> dict:
    """torch's version and the CUDA/HIP it was built for, read from torch/version.py without importing
    torch (importing it costs seconds; this package never does)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = (find_spec or importlib.util.find_spec)("torch")
    if spec is None or not spec.origin:
        return {}
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return {}
    out = {}
    for key in ("__version__", "cuda", "hip"):
        match = re.search(rf"^{key}(?:\s*:\s*[^=]+)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if match:
            out[key.strip("_")] = match.group(1)
    return out


def tunableop_key(machine, build: dict) -> str | None:
    """'H200-torch2.11.0+cu130-cuda13.0': the GPU model, torch, and the CUDA or ROCm (HIP) it was built for; the
    three TunableOp itself checks a results file against (its Validator lines). None without a GPU."""
    import re

    if not machine.has_gpu or not build.get("version"):
        return None
    runtime = (f"rocm{build['hip']}" if build.get("hip") else f"cuda{build['cuda']}" if build.get("cuda")
               else "no-gpu-build")
    key = f"{machine.model or machine.name}-torch{build['version']}-{runtime}"
    return re.sub(r"[^A-Za-z0-9.+_-]+", "_", key)


def cache_root(ctx):
    """names.CACHE_DIR, else $XDG_CACHE_HOME/anvil, else ~/.cache/anvil (on a cluster: a home shared by the
    nodes, so every node reads the same results)."""
    from pathlib import Path

    if ctx.get(names.CACHE_DIR):
        return Path(ctx.get(names.CACHE_DIR))
    base = ctx.get("XDG_CACHE_HOME") or str(Path(ctx.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "anvil"


def tunableop_file(ctx, build: dict | None = None):
    """The TunableOp results file of this GPU model, torch and CUDA/ROCm build, reused by every later run with
    the same key."""
    build = torch_build() if build is None else build
    key = tunableop_key(ctx.machine, build)
    if key is None:
        return None
    path = cache_root(ctx) / "tunableop" / key / TUNABLEOP_FILE
    return str(path), f"key {key}"

"""preflight.network: the interfaces and RDMA ports NCCL/gloo are told to use exist and are up."""
from __future__ import annotations

from envs import netinfo
from runtime.preflight.result import FAIL, PASS, WARN, CheckResult


def run(inp) -> list[CheckResult]:
    names = netinfo.interfaces()
    ports = netinfo.rdma_ports(inp.root)
    return [
        _interfaces(names),
        _socket_ifname(inp, names, "network.nccl_ifname", "NCCL_SOCKET_IFNAME", nccl_rules=True),
        _socket_ifname(inp, names, "network.gloo_ifname", "GLOO_SOCKET_IFNAME", nccl_rules=False),
        _rdma(ports),
        _ib_hca(inp, ports),
        _ib_disable(inp, ports),
        _master_addr(inp),
    ]


def _interfaces(names: dict) -> CheckResult:
    up = sorted(n for n, is_up in names.items() if is_up and n != "lo")
    if not up:
        return CheckResult("network.interfaces", WARN, "lo", "only loopback is up: single-node runs only",
                           "bring up the cluster interface")
    return CheckResult("network.interfaces", PASS, ",".join(up), f"{len(up)} interface(s) up besides lo")


def _socket_ifname(inp, names: dict, check: str, var: str, nccl_rules: bool) -> CheckResult:
    spec = inp.var(var)
    if not spec:
        return CheckResult(check, PASS, None, f"{var} unset: the library picks an interface")
    known = sorted(names)
    fix = f"use one of: {', '.join(known)} (e.g. inv ... --env {var}={_suggest(names, inp.root)})"
    if nccl_rules:
        selected, unmatched = netinfo.match_ifname_list(spec, known)
    else:  # gloo takes exact names, comma-separated
        entries = [e.strip() for e in spec.split(",") if e.strip()]
        selected, unmatched = [e for e in entries if e in names], [e for e in entries if e not in names]
    if unmatched:
        return CheckResult(check, FAIL, spec, f"{var} names no interface on this node: {', '.join(unmatched)}", fix)
    down = [n for n in selected if not names.get(n)]
    if selected and len(down) == len(selected):
        return CheckResult(check, FAIL, spec, f"{var} selects only interfaces that are down: {', '.join(down)}", fix)
    return CheckResult(check, PASS, spec, f"{var} selects {', '.join(selected)}")


def _suggest(names: dict, root) -> str:
    default = netinfo.default_route_iface(root)
    if default and names.get(default):
        return default
    up = [n for n, is_up in sorted(names.items()) if is_up and n != "lo"]
    return up[0] if up else "lo"


def _rdma(ports) -> CheckResult:
    if not ports:
        return CheckResult("network.rdma", PASS, "none", "no RDMA devices: NCCL/RCCL use TCP sockets between nodes")
    value = ", ".join(str(p) for p in ports)
    inactive = [str(p) for p in ports if not p.active]
    if inactive:
        return CheckResult("network.rdma", WARN, value, f"{len(inactive)} RDMA port(s) not ACTIVE",
                           "check cables/switch (ibstat); leave them out of NCCL_IB_HCA")
    return CheckResult("network.rdma", PASS, value, f"{len(ports)} RDMA port(s) ACTIVE")


def _ib_hca(inp, ports) -> CheckResult:
    spec = inp.var("NCCL_IB_HCA")
    if not spec:
        return CheckResult("network.ib_hca", PASS, None, "NCCL_IB_HCA unset: NCCL uses every RDMA device")
    exclude, entries = netinfo.parse_ib_hca(spec)
    exact = "=" in spec.lstrip("^")[:1]
    active = [f"{p.device}:{p.port}" for p in ports if p.active]
    fix = f"set NCCL_IB_HCA to active ports: {','.join(active) or '(none here: unset it)'}"
    if exclude:
        return CheckResult("network.ib_hca", PASS, spec, "exclusion list (not checked against devices)")
    problems = []
    for name, port in entries:
        matching = [p for p in ports if (p.device == name if exact else p.device.startswith(name))
                    and (port is None or p.port == port)]
        if not matching:
            problems.append(f"{name}{':' + str(port) if port else ''} does not exist")
        elif not any(p.active for p in matching):
            problems.append(f"{name}{':' + str(port) if port else ''} is not ACTIVE")
    if problems:
        return CheckResult("network.ib_hca", FAIL, spec, "NCCL_IB_HCA: " + "; ".join(problems), fix)
    return CheckResult("network.ib_hca", PASS, spec, "every NCCL_IB_HCA entry is an ACTIVE port")


def _ib_disable(inp, ports) -> CheckResult:
    disabled = inp.var("NCCL_IB_DISABLE") == "1"
    if disabled and any(p.active for p in ports):
        return CheckResult("network.ib_disable", WARN, "1", "NCCL_IB_DISABLE=1 with ACTIVE RDMA ports: "
                           "inter-node traffic falls back to TCP sockets", "unset NCCL_IB_DISABLE")
    return CheckResult("network.ib_disable", PASS, "1" if disabled else None,
                       "IB transport disabled (no active RDMA ports)" if disabled else "IB transport allowed")


def _master_addr(inp) -> CheckResult:
    master = inp.var("MASTER_ADDR")
    if not master:
        return CheckResult("network.master_addr", PASS, None,
                           "MASTER_ADDR unset (single node, or the launcher sets it)")
    route = netinfo.route_to(master, inp.root)
    if route is None:
        return CheckResult("network.master_addr", FAIL, master, f"MASTER_ADDR={master} does not resolve",
                           "use the first node's address (Slurm: scontrol show hostnames | head -1)")
    if not route.iface:
        return CheckResult("network.master_addr", FAIL, master, f"no route to MASTER_ADDR={master}",
                           "check the network between the nodes")
    value = f"{master} via {route.iface}"
    spec = inp.var("NCCL_SOCKET_IFNAME")
    if spec and route.iface != "lo":
        selected, _ = netinfo.match_ifname_list(spec, [route.iface])
        if not selected:
            return CheckResult("network.master_addr", WARN, value,
                               f"MASTER_ADDR is reached via {route.iface}, which NCCL_SOCKET_IFNAME={spec} leaves out",
                               f"include {route.iface} in NCCL_SOCKET_IFNAME")
    return CheckResult("network.master_addr", PASS, value, f"route to MASTER_ADDR ({route.how})")

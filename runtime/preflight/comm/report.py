"""The comm check's verdict and report: from the marked pairs, which node or link is slow (verdict,
describe); the CommReport with its per-node rows; and its text (render)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from runtime.preflight.result import FAIL, PASS, WARN, CheckResult
from runtime.preflight.comm.measurement import Measurement
from runtime.preflight.comm.rounds import NodeState, node_states


@dataclass
class NodeRow:
    host: str
    check: CheckResult

    def to_dict(self) -> dict:
        return {"host": self.host, **self.check.to_dict()}


@dataclass
class CommReport:
    hosts: list[str]
    transport: str
    size: str
    iters: int
    allreduce: Measurement | None
    pairs: list[Measurement]
    rounds: int
    reference_busbw: float | None
    ratio: float
    rows: list[NodeRow]                      # per node, in host order: comm.pair (or comm.reach)
    links: list[NodeRow]                     # comm.link WARN rows: slow pairs whose both ends are fine
    failing: dict[str, list[str]]            # host -> reasons (runtime.runs.nodes.write)
    passing: list[str]
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.failing) or self.allreduce_row.status == FAIL

    @property
    def allreduce_row(self) -> CheckResult:
        m = self.allreduce
        if m is None:
            return CheckResult("comm.allreduce", WARN, None, "not run: fewer than two nodes reachable")
        if m.busbw is None:
            return CheckResult("comm.allreduce", FAIL, None, f"all-reduce over {len(m.hosts)} node(s) failed: "
                               f"{m.error}", "see the pairs below for the node or link that holds it up")
        return CheckResult("comm.allreduce", PASS, f"{m.busbw:.3g} GB/s busbw",
                           f"{len(m.hosts)} node(s), {m.ranks} rank(s), {_human_bytes(m.bytes)} x {self.iters}, "
                           f"{m.seconds:.1f} s")

    def to_dict(self) -> dict:
        ar = self.allreduce_row
        return {
            "status": FAIL if self.failed else (WARN if any(r.check.status == WARN for r in self.rows + self.links)
                                                else PASS),
            "hosts": self.hosts, "transport": self.transport, "size": self.size, "iters": self.iters,
            "allreduce": {**(self.allreduce.to_dict() if self.allreduce else {}), **ar.to_dict(),
                          "busbw_GBps": self.allreduce.busbw if self.allreduce else None},
            "reference_busbw_GBps": self.reference_busbw, "ratio": self.ratio, "rounds": self.rounds,
            "pairs": [m.to_dict() for m in self.pairs],
            "checks": [r.to_dict() for r in self.rows + self.links],
            "passing": self.passing, "failing": self.failing, "seconds": round(self.seconds, 2),
        }


def _gbps(value: float | None) -> str:
    return "failed" if value is None else f"{value:.3g} GB/s"


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= 0.99 * scale:                 # 1 MiB less a few bytes (equal shards) is 1 MiB
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def describe(m: Measurement, ref: float | None, first: str | None = None) -> str:
    """'n3<->n1 0.02 GB/s, 4% of median' (first: the node to name first)."""
    hosts = m.hosts if first is None or m.hosts[0] == first else tuple(reversed(m.hosts))
    text = f"{hosts[0]}<->{hosts[1]} {_gbps(m.busbw)}"
    if m.busbw is None:
        return f"{text} ({m.error})" if m.error else text
    if ref:
        text += f", {100 * m.busbw / ref:.0f}% of median"
    if m.attempts > 1:
        text += f" (best of {m.attempts})"
    return text


def verdict(nodes: Sequence[str], measurements: Sequence[Measurement], ref: float | None,
            unreachable: Mapping[str, str] | None = None) -> tuple[list[NodeRow], list[NodeRow], dict[str, list[str]]]:
    """(per-node rows, slow-link rows, failing {host: reasons}) from marked pair measurements."""
    states = node_states(nodes, measurements)
    pairs = [m for m in measurements if len(m.hosts) == 2]
    rows, links, failing = [], [], {}
    unreachable = dict(unreachable or {})

    def of(node, slow):
        return [m for m in pairs if node in m.hosts and m.slow is slow]

    for node in list(nodes) + [h for h in unreachable if h not in nodes]:
        if node in unreachable:
            reason = f"cannot run the check there: {unreachable[node]}"
            rows.append(NodeRow(node, CheckResult("comm.reach", FAIL, None, reason,
                                                  "check SSH / the node; it was left out of the screen")))
            failing[node] = [f"comm.reach: {unreachable[node]}"]
            continue
        state = states[node]
        slow_ms = of(node, True)
        if state.good:
            best = max(of(node, False), key=lambda m: m.busbw or 0.0)
            reason = f"fast with {', '.join(state.fast)}"
            slow_sides = [p for p in state.slow if not states[p].good]
            slow_links = [p for p in state.slow if states[p].good]
            if slow_sides:
                reason += f"; slow with {', '.join(slow_sides)} (that side is slow)"
            if slow_links:
                reason += f"; slow link to {', '.join(slow_links)} (see comm.link)"
            rows.append(NodeRow(node, CheckResult("comm.pair", PASS, describe(best, ref, node), reason)))
        elif state.named:
            worst = min(slow_ms, key=lambda m: m.busbw or 0.0)
            reason = f"slow with {len(state.slow)} different partners: " + "; ".join(
                describe(m, ref, node) for m in slow_ms)
            rows.append(NodeRow(node, CheckResult("comm.pair", FAIL, describe(worst, ref, node), reason,
                                                  "check this node's NIC, cable, switch port and driver; "
                                                  "leave it out (--exclude-from) meanwhile")))
            failing[node] = [f"comm.pair: {reason}"]
        elif state.slow and not states.get(state.slow[0], NodeState()).named:
            m = slow_ms[0]
            partner = state.slow[0]
            if states.get(partner, NodeState()).good:
                reason = (f"slow with {partner}, which is fast with {', '.join(states[partner].fast)}; "
                          "no second partner was left to confirm")
                rows.append(NodeRow(node, CheckResult("comm.pair", FAIL, describe(m, ref, node), reason,
                                                      "check this node's network; run the check again with "
                                                      "more nodes to confirm")))
                failing[node] = [f"comm.pair: {reason}: {describe(m, ref, node)}"]
            else:
                reason = f"slow with {partner} and no fast partner left to tell which side is slow"
                rows.append(NodeRow(node, CheckResult("comm.pair", FAIL, describe(m, ref, node), reason,
                                                      "run the check with more nodes to tell which side")))
                failing[node] = [f"comm.pair: {reason}: {describe(m, ref, node)}"]
        elif state.met:
            # Not cleared: slow only with a node named slow, and/or figures that could not be judged.
            unjudged = of(node, None)
            m = max(unjudged, key=lambda m: m.busbw or 0.0) if unjudged else slow_ms[0]
            parts = []
            if unjudged:
                parts.append("not judged (every pair with a figure shares a node: nothing to compare it with)")
            if state.slow:
                parts.append(f"slow with {', '.join(state.slow)}, which is slow itself")
            rows.append(NodeRow(node, CheckResult("comm.pair", WARN, describe(m, ref, node),
                                                  "; ".join(parts) + "; not cleared",
                                                  "run the check over three or more good nodes")))
        else:
            rows.append(NodeRow(node, CheckResult("comm.pair", WARN, None,
                                                  "not measured (no partner left within the rounds)")))
    for m in pairs:
        if m.slow is True and all(states[h].good for h in m.hosts):
            links.append(NodeRow(m.label, CheckResult(
                "comm.link", WARN, describe(m, ref),
                "both ends are fast with other nodes: this link (cable, switch path) is slow",
                "check the path between these two nodes")))
    return rows, links, failing


# ---- printing ----------------------------------------------------------------------------------------

def render(report: CommReport, run_dir: Path | str | None = None) -> str:
    from tabulate import tabulate

    from runtime.runs.nodes import node_lists_footer

    out = []
    ar = report.allreduce_row
    out.append(f"all-reduce: {ar.status}  " + (f"{ar.value}  " if ar.value else "") + f"({ar.reason})")
    table = []
    for row in report.rows + report.links:
        c = row.check
        note = c.reason + (f"\n  fix: {c.fix}" if c.fix and c.status != PASS else "")
        table.append([row.host, c.name, c.status, "" if c.value is None else str(c.value), note])
    out.append(tabulate(table, headers=["node", "check", "status", "value", "reason / fix"], disable_numparse=True))
    median = f"{report.reference_busbw:.3g} GB/s" if report.reference_busbw else "n/a"
    retested = sum(m.attempts > 1 for m in report.pairs)
    out.append(f"{len(report.pairs)} pair(s) in {report.rounds} round(s)"
               + (f", {retested} slow pair(s) measured again" if retested else "")
               + f"; median pair busbw {median}, slow under {100 * report.ratio:.0f}% of it; {report.seconds:.1f} s")
    out.append("")
    out += node_lists_footer(report.passing, report.failing, run_dir)
    return "\n".join(out)

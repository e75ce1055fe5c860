"""preflight.comm: find the one slow link or node among N nodes.

    report = screen_links(hosts, SshTransport(options, work_dir), size="64M", iters=10, progress=print)
    run_comm_check(c, hosts=None, slurm=False, size="64M", iters=10)     # the task's body: a run directory

1. Reach every node (and count its GPUs): a node that cannot be reached FAILs
   at once and is left out of the rest.
2. One all-reduce across all nodes (one rank per GPU, one per node on CPU over
   gloo): the figure a training job would see (nccl-tests busbw).
3. Node-to-node all-reduces (two nodes each) in a few rounds. Round 1 pairs
   disjoint neighbours (n1-n2, n3-n4, ...); the pairs of a round run at the
   same time, each on its own port. A pair is slow under RATIO (0.7) x the
   median (the median over nodes of each node's best pair figure, so a slow
   node measured several times does not pull it down), or when it failed or
   timed out. Figures are judged only once no single node is in every pair
   measured (were that node slow, it would set the median: 3 nodes need all
   three pairs; 2 nodes can only fail outright). Each later round pairs every
   node not yet cleared (one slow pair and no fast one, not judged, or not
   measured yet: the odd one out) with a node known to be good (one with a
   fast pair) it has not met yet, else with another uncleared node. A node in
   a fast pair passes; a node slow with two different partners is named
   (FAIL). A slow pair whose both ends are fast with others is a slow link
   (WARN).
4. A CommReport: per-node CheckResult rows ("comm.pair": "n3<->n1 0.02 GB/s,
   4% of median"), the all-reduce row, the failing nodes with their reasons
   (runtime.runs.nodes.write), the pairs measured.

Transports run the same measurement, `python -m runtime.launch.agent ... --
python -m benchmarks.collectives --sizes S --iters K --out FILE`, on the
nodes: SshTransport over Fabric (the agent started on both hosts at once,
master = the first host, rank 0 writes FILE on the shared file system), and
SlurmTransport with one `srun --nodes=2 --nodelist=a,b --ntasks-per-node=1
... agent --slurm` step per pair inside an allocation. Every launch has a
timeout (a dead link costs its timeout, never a hang): `timeout -k 5 T` on
the node for SSH, the srun step killed for Slurm.

Why one module of this size: the pairing rounds, the verdict, both transports (SSH and srun) and
the run directory are one algorithm read top to bottom; the pure parts (pairing, judging) are
separate functions tested with a fake transport (tests/test_preflight_comm.py).
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

from runtime.preflight.result import FAIL, PASS, WARN, CheckResult
from trainer.errors import AnvilError, UserError

RATIO = 0.7                 # a pair under 0.7 x the median is slow
MAX_ROUNDS = 4              # pairwise rounds at most (3 nodes need 3 to name a slow one)
TIMEOUT_S = 120.0           # per launch (probe: PROBE_TIMEOUT_S)
PROBE_TIMEOUT_S = 60.0
WARMUP = 3
# Recomputed on each node by the agent (route to MASTER_ADDR): the interface gloo / NCCL bind.
NODE_LOCAL = "GLOO_SOCKET_IFNAME,NCCL_SOCKET_IFNAME,NCCL_IB_HCA"
_GPU_PROBE = "import torch; print('anvil-comm-gpus', torch.cuda.device_count())"
_GPU_PROBE_HOST = ("import socket, torch; "
                   "print('anvil-comm-gpus', torch.cuda.device_count(), socket.gethostname())")
_TIMED_OUT = (124, 137)     # coreutils timeout: timed out / killed after the grace

Pair = tuple[str, str]
Progress = Callable[[str], None]


class CommError(UserError):
    """Bad input for the comm check (too few hosts, a bad size, no allocation)."""


class CommFailed(AnvilError):
    """The screen ran and a node (or the all-reduce across all of them) failed: exit status 1."""

    exit_code = 1


# ---- what is measured ------------------------------------------------------------------------

@dataclass
class Measurement:
    """One all-reduce over `hosts` (two for a pair): its busbw, or why there is none."""
    hosts: tuple[str, ...]
    busbw: float | None = None       # GB/s (nccl-tests busbw); None: failed or timed out
    seconds: float = 0.0             # wall time of the launch
    error: str | None = None
    ranks: int = 0
    bytes: int = 0
    round: int = 0
    slow: bool | None = None         # set by mark_slow: None while nothing can be compared with it

    @property
    def label(self) -> str:
        return "<->".join(self.hosts)

    def to_dict(self) -> dict:
        return {**asdict(self), "hosts": list(self.hosts)}


@dataclass
class Probe:
    host: str
    ok: bool
    gpus: int = 0
    error: str | None = None
    seconds: float = 0.0


class Transport(Protocol):
    name: str

    def probe(self, hosts: Sequence[str], timeout: float) -> dict[str, Probe]: ...

    def allreduce(self, hosts: Sequence[str], size: str, iters: int, timeout: float) -> Measurement: ...

    def pairs(self, pairs: Sequence[Pair], size: str, iters: int, timeout: float,
              round_no: int) -> list[Measurement]: ...


# ---- the round logic (pure) --------------------------------------------------------------------

def first_round(nodes: Sequence[str]) -> list[Pair]:
    """Disjoint neighbours: n1-n2, n3-n4, ...; an odd one out waits for round 2 (a good partner)."""
    return [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]


def established(measurements: Sequence[Measurement]) -> bool:
    """Can the pairs be judged yet? Not while one node is in every pair that gave a figure: if that
    node were slow, every figure would be slow and look normal (3 nodes: after n1-n2 and n1-n3,
    only n2-n3 tells whether n1 is slow; 2 nodes: never)."""
    done = [set(m.hosts) for m in measurements if m.busbw is not None and len(m.hosts) == 2]
    return bool(done) and not set.intersection(*done)


def reference(measurements: Sequence[Measurement]) -> float | None:
    """The median the pairs are compared with: over nodes, each node's best pair busbw
    (upper median). A slow node is measured more often than the others; a plain
    median over pairs would sink towards it."""
    best: dict[str, float] = {}
    for m in measurements:
        if m.busbw is None:
            continue
        for host in m.hosts:
            best[host] = max(best.get(host, 0.0), m.busbw)
    return statistics.median_high(best.values()) if best else None


def mark_slow(measurements: Sequence[Measurement], ratio: float = RATIO, min_busbw: float = 0.0) -> float | None:
    """Set .slow on every measurement: True when it failed, is under min_busbw, or under ratio x the
    reference; False when it is not; None (not judged) while the reference is not established.
    Returns the reference (None while not established)."""
    ref = reference(measurements) if established(measurements) else None
    for m in measurements:
        if m.busbw is None or (min_busbw > 0 and m.busbw < min_busbw):
            m.slow = True
        else:
            m.slow = None if ref is None else m.busbw < ratio * ref
    return ref


@dataclass
class NodeState:
    fast: list[str] = field(default_factory=list)      # partners in a fast pair
    slow: list[str] = field(default_factory=list)      # partners in a slow pair (distinct)
    met: set = field(default_factory=set)              # every partner measured with (judged or not)

    @property
    def good(self) -> bool:
        return bool(self.fast)

    @property
    def named(self) -> bool:
        return not self.fast and len(self.slow) >= 2

    @property
    def open(self) -> bool:
        """Not cleared, not named: one slow pair and no fast one, not judged, or not measured."""
        return not self.fast and len(self.slow) < 2


def node_states(nodes: Sequence[str], measurements: Sequence[Measurement]) -> dict[str, NodeState]:
    """Per node: fast and slow partners (measurements already marked by mark_slow)."""
    states = {n: NodeState() for n in nodes}
    for m in measurements:
        if len(m.hosts) != 2:
            continue
        a, b = m.hosts
        for me, other in ((a, b), (b, a)):
            state = states.setdefault(me, NodeState())
            state.met.add(other)
            if m.slow is None:
                continue
            bucket = state.slow if m.slow else state.fast
            if other not in bucket:
                bucket.append(other)
    return states


def next_round(nodes: Sequence[str], measurements: Sequence[Measurement]) -> list[Pair]:
    """Pairs for the next round: every open node with a partner it has not met, a node known to be
    good first, else another node not named slow; each node in one pair at most. [] when done."""
    states = node_states(nodes, measurements)
    busy: set[str] = set()
    pairs: list[Pair] = []
    open_nodes = [n for n in nodes if states[n].open]
    # Nodes measured before go first (they have one slow pair: the second tells), then the untested.
    open_nodes.sort(key=lambda n: 0 if states[n].met else 1)
    for node in open_nodes:
        if node in busy:
            continue
        candidates = ([n for n in nodes if states[n].good]
                      + [n for n in nodes if states[n].open and not states[n].met]
                      + [n for n in nodes if states[n].open and states[n].met])
        partner = next((p for p in candidates if p != node and p not in busy and p not in states[node].met), None)
        if partner is None:
            continue
        busy.update((node, partner))
        pairs.append((partner, node) if states[partner].good else (node, partner))
    return pairs


def rounds_left(nodes: Sequence[str], measurements: Sequence[Measurement], planned: Sequence[Pair],
                limit: int, ratio: float = RATIO, min_busbw: float = 0.0) -> int:
    """Rounds still to run, this one included, if every pair from here on is as fast as the best so
    far (a lower bound that grows only when a suspect shows up): the "R" of "round k/R"."""
    simulated = [replace(m) for m in measurements]
    typical = max((m.busbw for m in measurements if m.busbw is not None), default=1.0)
    count, plan = 0, list(planned)
    while plan and count < limit:
        count += 1
        simulated += [Measurement((a, b), busbw=typical) for a, b in plan]
        mark_slow(simulated, ratio, min_busbw)
        plan = next_round(nodes, simulated)
    return max(count, 1)


# ---- the verdict --------------------------------------------------------------------------------

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


def describe(m: Measurement, ref: float | None, first: str | None = None) -> str:
    """'n3<->n1 0.02 GB/s, 4% of median' (first: the node to name first)."""
    hosts = m.hosts if first is None or m.hosts[0] == first else tuple(reversed(m.hosts))
    text = f"{hosts[0]}<->{hosts[1]} {_gbps(m.busbw)}"
    if m.busbw is None:
        return f"{text} ({m.error})" if m.error else text
    if ref:
        text += f", {100 * m.busbw / ref:.0f}% of median"
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


# ---- the screen ---------------------------------------------------------------------------------

def screen_links(hosts: Sequence[str], transport: Transport, size: str = "64M", iters: int = 10,
                 progress: Progress | None = None, *, timeout: float = TIMEOUT_S, ratio: float = RATIO,
                 max_rounds: int = MAX_ROUNDS, min_busbw: float = 0.0) -> CommReport:
    """Probe, all-reduce over all nodes, then pairwise rounds; see the module doc."""
    say = progress or (lambda _line: None)
    started = time.monotonic()
    hosts = list(dict.fromkeys(hosts))
    if len(hosts) < 2:
        raise CommError(f"the comm check needs at least 2 nodes, got {len(hosts)}: {', '.join(hosts) or '(none)'}")
    if not 0 < ratio < 1:
        raise CommError(f"ratio must be between 0 and 1, got {ratio}")

    unreachable: dict[str, str] = {}
    probe = getattr(transport, "probe", None)
    if probe is not None:
        say(f"reaching {len(hosts)} node(s) over {transport.name} ...")
        for host, p in probe(hosts, min(timeout, PROBE_TIMEOUT_S)).items():
            if not p.ok:
                unreachable[host] = p.error or "no answer"
                say(f"  {host}: unreachable: {unreachable[host]}")
    nodes = [h for h in hosts if h not in unreachable]

    allreduce = None
    round_estimate = None
    if len(nodes) >= 2:
        say(f"all-reduce over {len(nodes)} node(s) ({size}, {iters} iters) ...")
        allreduce = transport.allreduce(nodes, size, iters, timeout)
        round_estimate = allreduce.seconds
        say(f"  all-reduce: {_gbps(allreduce.busbw)} busbw"
            + (f" ({allreduce.error})" if allreduce.error else f", {allreduce.ranks} rank(s)")
            + f", {allreduce.seconds:.1f} s")

    measured: list[Measurement] = []
    round_no = 0
    plan = first_round(nodes)
    while plan and round_no < max_rounds:
        round_no += 1
        total = round_no - 1 + rounds_left(nodes, measured, plan, max_rounds - round_no + 1, ratio, min_busbw)
        left = (f", ~{round_estimate * (total - round_no + 1):.0f} s left" if round_estimate is not None
                else "")
        say(f"round {round_no}/{total}: {len(plan)} pair(s){left}")
        t0 = time.monotonic()
        results = transport.pairs(plan, size, iters, timeout, round_no)
        round_estimate = max([time.monotonic() - t0] + [m.seconds for m in results])
        for m in results:
            m.round = round_no
        measured += results
        ref = mark_slow(measured, ratio, min_busbw)
        for m in results:
            say(f"  {describe(m, ref)}{'  SLOW' if m.slow else ''} ({m.seconds:.1f} s)")
        plan = next_round(nodes, measured)

    ref = mark_slow(measured, ratio, min_busbw)
    rows, links, failing = verdict(nodes, measured, ref, unreachable)
    order = {h: i for i, h in enumerate(hosts)}
    rows.sort(key=lambda r: order.get(r.host, len(order)))
    passing = [r.host for r in rows if r.host not in failing]
    return CommReport(hosts=hosts, transport=transport.name, size=size, iters=iters, allreduce=allreduce,
                      pairs=measured, rounds=round_no, reference_busbw=ref, ratio=ratio, rows=rows, links=links,
                      failing=failing, passing=passing, seconds=time.monotonic() - started)


# ---- reading a measurement ----------------------------------------------------------------------

def read_result(out: Path, hosts: Sequence[str], seconds: float, problems: Sequence[str]) -> Measurement:
    """The rank-0 JSON of benchmarks.collectives (--out), or a failed Measurement with the first problem."""
    try:
        report = json.loads(Path(out).read_text())
        row = report["results"][0]
        return Measurement(tuple(hosts), busbw=float(row["busbw_GBps"]), seconds=round(seconds, 2),
                           ranks=int(row.get("ranks", 0)), bytes=int(row.get("bytes", 0)))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return Measurement(tuple(hosts), seconds=round(seconds, 2), error=f"unreadable result {out}: {exc}")
    error = "; ".join(p for p in problems if p) or "no result written (see the launch logs)"
    return Measurement(tuple(hosts), seconds=round(seconds, 2), error=error)


def _last_line(text: str | None) -> str:
    noise = ("socket.cpp", "[W", "Warning:")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    meaningful = [ln for ln in lines if not ln.startswith(noise) and "c10d" not in ln]
    return (meaningful or lines or [""])[-1][:200]


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= 0.99 * scale:                 # 1 MiB less a few bytes (equal shards) is 1 MiB
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _collectives_args(size: str, iters: int, out: Path) -> list[str]:
    return ["-m", "benchmarks.collectives", "--op", "all_reduce", "--sizes", size, "--iters", str(iters),
            "--warmup", str(min(WARMUP, max(1, iters))), "--out", str(out)]


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


class _Ports:
    """Distinct master ports for the launches of one screen (two launches never share one)."""

    def __init__(self, base: int = 0):
        self._next = itertools.count(base or random.randrange(21000, 31000, 10))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            return next(self._next)


class _Launcher:
    """What both transports share: one folder per launch under work_dir (pairs/NNN_<label>/ with
    collectives.json, the agents' logs/ and the launch's output), distinct ports, ranks per node."""

    name = "?"

    def __init__(self, work_dir: Path, nproc: int = 0, python: str = "", base_port: int = 0):
        self.work_dir = Path(work_dir)
        self.nproc = nproc
        self.python = python
        self.gpus: dict[str, int] = {}          # from the probe
        self.ports = _Ports(base_port)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def _folder(self, label: str) -> Path:
        with self._lock:
            folder = self.work_dir / f"{next(self._counter):03d}_{_safe(label)}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def nproc_for(self, nodes: Sequence[str]) -> int:
        """Ranks per node: --nproc, else one per GPU (the fewest any of these nodes has), one on CPU."""
        if self.nproc > 0:
            return self.nproc
        return max(1, min((self.gpus.get(h, 0) for h in nodes), default=0))

    @staticmethod
    def _result(out: Path, nodes: Sequence[str], seconds: float, problems: list[str]) -> Measurement:
        result = read_result(out, nodes, seconds, problems)
        if result.busbw is not None and problems:   # a figure, yet a node failed: do not trust it
            result = Measurement(tuple(nodes), seconds=round(seconds, 2), error="; ".join(problems))
        return result

    def launch(self, nodes: Sequence[str], label: str, size: str, iters: int, timeout: float) -> Measurement:
        raise NotImplementedError

    def allreduce(self, hosts, size, iters, timeout) -> Measurement:
        return self.launch(list(hosts), f"all-{len(hosts)}", size, iters, timeout)

    def pairs(self, pairs, size, iters, timeout, round_no) -> list[Measurement]:
        """The pairs of one round at the same time (each launch on its own port)."""
        with ThreadPoolExecutor(max_workers=max(1, len(pairs))) as pool:
            return list(pool.map(lambda p: self.launch(list(p), f"r{round_no}_{p[0]}-{p[1]}", size, iters,
                                                       timeout), pairs))


# ---- over SSH (Fabric) ----------------------------------------------------------------------------

class SshTransport(_Launcher):
    """The agent started on every host of a launch at once over Fabric; rank 0 writes the JSON into
    work_dir (a run directory on the file system all hosts share, as the checkout is). The remote
    python is the one beside remote_inv (default: this one)."""

    name = "ssh"

    def __init__(self, options, work_dir: Path, nproc: int = 0, python: str = "", base_port: int = 0,
                 config=None):
        from runtime.program import ssh

        remote_inv = options.remote_inv or ssh.local_inv()
        super().__init__(work_dir, nproc, python or str(Path(remote_inv).with_name("python")), base_port)
        self.options = options
        self.config = config

    # -- plumbing
    def _config(self):
        if self.config is None:
            from runtime.program import ssh
            ssh._quiet_paramiko()
            self.config = ssh.fabric_config(self.options.ssh_config)
        return self.config

    def _run(self, host: str, command: str, timeout: float) -> tuple[int | None, str, str, str | None]:
        """(exit status, stdout, stderr, error) of one command on one host; never raises."""
        from runtime.program import ssh

        return ssh.run_command(host, command, self.options, self._config(), timeout=timeout)

    def _prefix(self, host: str) -> str:
        return f"cd {shlex.quote(self.options.remote_path)} && ANVIL_HOST={shlex.quote(host)}"

    def command(self, host: str, nodes: Sequence[str], rank: int, port: int, size: str, iters: int,
                out: Path, timeout: float, nproc: int) -> str:
        """The shell line one host runs for one launch (every piece quoted)."""
        from runtime.program.results import slurm_name

        agent = [self.python, "-m", "runtime.launch.agent", "--nproc", str(nproc), "--nnodes", str(len(nodes)),
                 "--node-rank", str(rank), "--master-addr", slurm_name(nodes[0]), "--master-port", str(port),
                 "--", self.python, *_collectives_args(size, iters, out)]
        return (f"{self._prefix(host)} ANVIL_NODE_LOCAL={NODE_LOCAL} ANVIL_RUN_DIR={shlex.quote(str(out.parent))} "
                f"timeout -k 5 {int(max(1, timeout))} {shlex.join(agent)}")

    # -- the three steps
    def probe(self, hosts: Sequence[str], timeout: float) -> dict[str, Probe]:
        code = _GPU_PROBE if self.nproc <= 0 else "print('anvil-comm-gpus', -1)"

        def one(host):
            t0 = time.monotonic()
            line = f"{self._prefix(host)} {shlex.quote(self.python)} -c {shlex.quote(code)}"
            exit_code, out, err, error = self._run(host, line, timeout)
            seconds = time.monotonic() - t0
            if error:
                return Probe(host, False, error=error, seconds=seconds)
            if exit_code != 0:
                return Probe(host, False, error=f"exit {exit_code}: {_last_line(err) or _last_line(out)}",
                             seconds=seconds)
            gpus = next((int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("anvil-comm-gpus")), 0)
            return Probe(host, True, gpus=max(gpus, 0), seconds=seconds)

        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            found = dict(zip(hosts, pool.map(one, hosts)))
        self.gpus.update({h: p.gpus for h, p in found.items() if p.ok})
        return found

    def launch(self, nodes: Sequence[str], label: str, size: str, iters: int, timeout: float) -> Measurement:
        port = self.ports.take()
        folder = self._folder(label)
        out = folder / "collectives.json"
        nproc = self.nproc_for(nodes)
        started = time.monotonic()

        def one(rank_host):
            rank, host = rank_host
            return self._run(host, self.command(host, nodes, rank, port, size, iters, out, timeout, nproc),
                             timeout + 30)

        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            ran = list(pool.map(one, enumerate(nodes)))
        seconds = time.monotonic() - started
        problems, logs = {}, {}
        for (rank, host), (exit_code, stdout, stderr, error) in zip(enumerate(nodes), ran):
            logs[host] = {"exit_code": exit_code, "error": error, "stdout": stdout[-4000:], "stderr": stderr[-4000:]}
            if error:
                problems[host] = error
            elif exit_code in _TIMED_OUT:
                problems[host] = f"timed out after {timeout:.0f} s"
            elif exit_code:
                problems[host] = f"exit {exit_code}: {_last_line(stderr) or _last_line(stdout)}"
        (folder / "hosts.json").write_text(json.dumps(logs, indent=1))
        if len(problems) == len(nodes) and len(set(problems.values())) == 1:
            merged = [next(iter(problems.values()))]          # "timed out after 20 s" on every host: say it once
        else:
            merged = [f"{host}: {text}" for host, text in problems.items()]
        return self._result(out, nodes, seconds, merged)


# ---- inside a Slurm allocation (srun) ----------------------------------------------------------------

class SlurmTransport(_Launcher):
    """One srun step per launch inside the allocation: `srun --nodes=K --nodelist=a,b
    --ntasks-per-node=1 python -m runtime.launch.agent --slurm --nproc N --master-port P -- ...`.
    The steps of one round run at the same time on their disjoint nodes."""

    name = "srun"

    def __init__(self, work_dir: Path, settings=None, env: Mapping[str, str] | None = None, nproc: int = 0,
                 python: str = "", base_port: int = 0):
        super().__init__(work_dir, nproc, python or sys.executable, base_port)
        self.settings = settings
        self.env = dict(os.environ if env is None else env)

    def _srun(self, nodes: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
        checkout = self.settings.root if self.settings is not None else os.getcwd()
        options = [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}", "--ntasks-per-node=1",
                   "--kill-on-bad-exit=1", f"--chdir={checkout}"]
        if self.settings is not None:
            options += list(self.settings.slurm_extra)
        return ["srun", *options, *extra]

    def _step(self, argv: list[str], timeout: float, run_dir: Path | None = None) -> tuple[int | None, str, str, bool]:
        """(exit status, stdout, stderr, timed out) of one srun step; killed at the timeout."""
        env = {**self.env, "ANVIL_NODE_LOCAL": NODE_LOCAL}
        if run_dir is not None:
            env["ANVIL_RUN_DIR"] = str(run_dir)          # the agents write logs/agent-<node rank>.json there
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err, False
        except subprocess.TimeoutExpired:
            proc.terminate()                 # srun passes it on and ends the step
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            return proc.returncode, out, err, True

    def probe(self, hosts, timeout):
        if self.nproc > 0:
            return {h: Probe(h, True) for h in hosts}
        code = _GPU_PROBE_HOST
        exit_code, out, err, timed_out = self._step(self._srun(hosts) + [self.python, "-c", code], timeout)
        found = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "anvil-comm-gpus":
                found[parts[2].split(".")[0]] = int(parts[1])
        result = {}
        for host in hosts:
            if host in found:
                self.gpus[host] = found[host]
                result[host] = Probe(host, True, gpus=found[host])
            else:
                why = "timed out" if timed_out else f"srun exit {exit_code}: {_last_line(err) or 'no answer'}"
                result[host] = Probe(host, False, error=f"no answer from this node ({why})")
        return result

    def command(self, nodes: Sequence[str], port: int, size: str, iters: int, out: Path) -> list[str]:
        nproc = self.nproc_for(nodes)
        gpus = min((self.gpus.get(h, 0) for h in nodes), default=0)
        extra = [f"--gpus-per-node={nproc}"] if gpus else []
        agent = [self.python, "-m", "runtime.launch.agent", "--slurm", "--nproc", str(nproc),
                 "--master-port", str(port), "--", self.python, *_collectives_args(size, iters, out)]
        return self._srun(nodes, extra) + agent

    def launch(self, nodes, label, size, iters, timeout) -> Measurement:
        folder = self._folder(label)
        out = folder / "collectives.json"
        started = time.monotonic()
        exit_code, stdout, stderr, timed_out = self._step(self.command(nodes, self.ports.take(), size, iters, out),
                                                          timeout, folder)
        seconds = time.monotonic() - started
        (folder / "srun.json").write_text(json.dumps({"exit_code": exit_code, "timed_out": timed_out,
                                                      "stdout": stdout[-4000:], "stderr": stderr[-4000:]}, indent=1))
        problems = []
        if timed_out:
            problems.append(f"timed out after {timeout:.0f} s")
        elif exit_code:
            problems.append(f"srun exit {exit_code}: {_last_line(stderr) or _last_line(stdout)}")
        return self._result(out, nodes, seconds, problems)


# ---- printing ----------------------------------------------------------------------------------------

def render(report: CommReport, run_dir: Path | str | None = None) -> str:
    from tabulate import tabulate

    from runtime.program.results import node_lists_footer

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
    out.append(f"{len(report.pairs)} pair(s) in {report.rounds} round(s); median pair busbw {median}, slow under "
               f"{100 * report.ratio:.0f}% of it; {report.seconds:.1f} s")
    out.append("")
    out += node_lists_footer(report.passing, report.failing, run_dir)
    return "\n".join(out)


# ---- the task body --------------------------------------------------------------------------------

def _slurm_hosts(hosts: Sequence[str], env: Mapping[str, str]) -> list[str]:
    from runtime.launch.commands import in_allocation
    from runtime.launch.slurm import hostnames
    from runtime.program.allocation import require_slurm

    if not in_allocation(env):
        raise CommError("preflight.comm with runtime slurm runs inside an allocation: salloc -N<nodes> inv "
                        "preflight.comm --runtime slurm (the pairs are srun steps of that allocation)")
    require_slurm(env)
    members = hostnames(env.get("SLURM_JOB_NODELIST", ""), env)
    if hosts:
        missing = [h for h in hosts if h not in members]
        if missing:
            raise CommError(f"--hosts {','.join(missing)}: not in this allocation ({','.join(members)})")
        return list(hosts)
    return members


def run_comm_check(c, hosts: list[str] | str | None, slurm: bool, size: str = "64M", iters: int = 10, *,
                   json: bool = False, timeout: float = 0.0, nproc: int = 0, ratio: float = RATIO,
                   max_rounds: int = MAX_ROUNDS, run_options=None, env: Mapping[str, str] | None = None,
                   options=None, transport: Transport | None = None) -> dict:
    """`inv preflight.comm`: the screen as a run (runs/<time>_preflight.comm/) with report.json,
    report.txt, pairs/ (every launch's JSON and output) and nodes/{pass,fail}.txt, fail.json; prints
    the table and the exclude line (or the JSON with json=True). Returns the report's dict when every
    node passes; on a failing node (or a failed all-reduce) the run ends failed and RunFailed carries
    exit status 1. Bad input: CommError (exit 2), before any run directory. options: FanoutOptions
    for SSH (default: from the anvil settings); transport: measure through this one instead."""
    import json as jsonlib

    from benchmarks.collectives import parse_size
    from runtime import settings as settings_mod
    from runtime.program import ssh
    from runtime.program.results import slurm_name
    from runtime.runs import nodes as nodes_mod
    from runtime.runs.run import RunSpec, execute

    env = dict(os.environ if env is None else env)
    try:
        if "," in str(size):
            raise ValueError(f"bad size {size!r}: one size, e.g. 64M")
        parse_size(str(size))
    except ValueError as exc:
        raise CommError(f"--size: {exc}") from None
    if int(iters) < 1:
        raise CommError(f"--iters must be >= 1, got {iters}")
    if timeout < 0:
        raise CommError(f"--timeout must be >= 0, got {timeout}")
    if not 0 < ratio < 1:
        raise CommError(f"--slow-below must be between 0 and 100 (% of the median), got {100 * ratio:g}")
    settings = settings_mod.load(c)
    default = settings.hosts
    given = settings_mod.split_list(hosts) if hosts else []
    if slurm:
        host_list = _slurm_hosts(given, env)
    else:
        try:
            host_list = ssh.parse_hosts(given or default, default)
        except ssh.FanoutError as exc:
            raise CommError(f"--hosts: {exc} (or set anvil.hosts in invoke.yaml)") from None
    if len(host_list) < 2:
        raise CommError(f"the comm check needs at least 2 nodes, got {len(host_list)}: {','.join(host_list)}")
    limit = timeout or TIMEOUT_S

    def body(run):
        work = run.path / "pairs"
        if transport is not None:
            via = transport
        elif slurm:
            via = SlurmTransport(work, settings, env, nproc=nproc)
        else:
            fanout = options or ssh.FanoutOptions(
                remote_path=settings.remote_path or str(settings.root), remote_inv=settings.remote_inv,
                user=settings.user or None, key_filename=list(settings.key_filename),
                connect_timeout=float(settings.connect_timeout))
            via = SshTransport(fanout, work, nproc=nproc)

        def progress(line):
            print(f"preflight.comm: {line}", file=sys.stderr, flush=True)

        print(f"preflight.comm on {len(host_list)} node(s) over {via.name}: {', '.join(host_list)}; "
              f"run directory {run.path}", file=sys.stderr, flush=True)
        report = screen_links(host_list, via, size, int(iters), progress, timeout=limit, ratio=ratio,
                              max_rounds=max_rounds)
        document = {"task": "preflight.comm", "run_dir": str(run.path), **report.to_dict()}
        run.write_json("report.json", document)
        nodes_mod.write(run.path, [slurm_name(h) for h in report.passing],
                        {slurm_name(h): reasons for h, reasons in report.failing.items()})
        text = render(report, run.path)
        run.write_text("report.txt", text + "\n")
        print(jsonlib.dumps(document, indent=2) if json else text, flush=True)
        run.update_metadata(hosts=report.hosts, passing=report.passing, failing=list(report.failing))
        if report.failed:
            what = (f"{len(report.failing)} of {len(report.hosts)} node(s) failing: {', '.join(report.failing)}"
                    if report.failing else "the all-reduce across all nodes failed")
            raise CommFailed(what)
        return document

    extra = {"hosts_checked": host_list, "size": size, "iters": int(iters), "transport": "srun" if slurm else "ssh"}
    spec = (run_options.spec("preflight.comm", extra=extra) if run_options is not None
            else RunSpec(task="preflight.comm", extra=extra))
    return execute(c, spec, body)

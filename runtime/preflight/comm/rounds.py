"""The round logic of the comm check, pure (no I/O): which node pairs to measure first and next
(first_round, next_round), when the figures can be judged and which are slow (established, reference,
mark_slow), each node's fast and slow partners (node_states), how many rounds are left
(rounds_left), and the retest of the slow pairs that would name a node (retest_plan, keep_best).
Tested with a fake transport (tests/runner/test_preflight_comm.py)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence

from runtime.preflight.comm.measurement import Measurement, Pair

RATIO = 0.7                 # a pair under 0.7 x the median is slow


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


def mark_slow(measurements: Sequence[Measurement], ratio: float = RATIO, min_busbw: float = 0.0,
              fixed_reference: float | None = None) -> float | None:
    """Set .slow on every measurement: True when it failed, is under min_busbw, or under ratio x the
    reference; False when it is not; None (not judged) while the reference is not established.
    Returns the reference (None while not established). fixed_reference: judge against this one
    (the screen's, after a retest: a retest's better figure must not move the bar for the others)."""
    ref = fixed_reference if fixed_reference is not None else \
        reference(measurements) if established(measurements) else None
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


def retest_plan(measurements: Sequence[Measurement], suspects: set[str]) -> list[list[Pair]]:
    """The slow pairs with a figure that name a suspect node, not retested yet, in rounds of disjoint
    pairs. A figure taken while something else loaded a node or its link (another job's burst, a
    busy host) must not be the only evidence to drain a node; a pair that failed or timed out is
    not retested (that is no noise, and another timeout would double the wait)."""
    rounds: list[list[Pair]] = []
    for m in measurements:
        if not (len(m.hosts) == 2 and m.slow and m.busbw is not None and m.attempts == 1
                and suspects & set(m.hosts)):
            continue
        spot = next((r for r in rounds if not any(set(m.hosts) & set(p) for p in r)), None)
        if spot is None:
            rounds.append(spot := [])
        spot.append((m.hosts[0], m.hosts[1]))
    return rounds


def keep_best(measurements: Sequence[Measurement], retests: Sequence[Measurement]) -> list[Measurement]:
    """Fold retest figures into the pairs they repeat: each keeps the better of its two figures.
    Returns those pairs, in the order of `retests`."""
    by_pair = {frozenset(m.hosts): m for m in measurements if len(m.hosts) == 2}
    kept = []
    for r in retests:
        m = by_pair[frozenset(r.hosts)]
        m.attempts += 1
        if r.busbw is not None and (m.busbw is None or r.busbw > m.busbw):
            m.busbw, m.seconds, m.ranks, m.bytes, m.error = r.busbw, r.seconds, r.ranks, r.bytes, None
        kept.append(m)
    return kept

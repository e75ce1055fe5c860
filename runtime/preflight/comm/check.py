"""screen_links: the comm check end to end over one transport: reach the nodes, one all-reduce over
all of them, the pairwise rounds, the verdict (the steps are in the package doc)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

from runtime.preflight.comm.errors import CommError
from runtime.preflight.comm.measurement import Measurement, Transport
from runtime.preflight.comm.report import CommReport, _gbps, describe, verdict
from runtime.preflight.comm.rounds import (RATIO, first_round, keep_best, mark_slow, next_round, retest_plan,
                                           rounds_left)

MAX_ROUNDS = 4              # pairwise rounds at most (3 nodes need 3 to name a slow one)
TIMEOUT_S = 120.0           # per launch (probe: PROBE_TIMEOUT_S)
PROBE_TIMEOUT_S = 60.0

Progress = Callable[[str], None]


def screen_links(hosts: Sequence[str], transport: Transport, size: str = "64M", iters: int = 10,
                 progress: Progress | None = None, *, timeout: float = TIMEOUT_S, ratio: float = RATIO,
                 max_rounds: int = MAX_ROUNDS, min_busbw: float = 0.0) -> CommReport:
    """Probe, all-reduce over all nodes, then pairwise rounds; see the package doc (comm/__init__.py)."""
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
    if ref is not None:
        # Before naming a node: its slow pairs once more, each keeping its better figure, judged
        # against the screen's median.
        retests = retest_plan(measured, set(verdict(nodes, measured, ref)[2]))
        for k, plan in enumerate(retests, 1):
            say(f"retest {k}/{len(retests)}: {len(plan)} slow pair(s) again before naming a node")
            results = transport.pairs(plan, size, iters, timeout, round_no + k)
            kept = keep_best(measured, results)
            mark_slow(measured, ratio, min_busbw, fixed_reference=ref)
            for m, pair in zip(results, kept):   # a pair slow before is slow now if its new figure is
                say(f"  {describe(m, ref)}{'  SLOW again' if pair.slow else '  fast this time'} ({m.seconds:.1f} s)")
    rows, links, failing = verdict(nodes, measured, ref, unreachable)
    order = {h: i for i, h in enumerate(hosts)}
    rows.sort(key=lambda r: order.get(r.host, len(order)))
    passing = [r.host for r in rows if r.host not in failing]
    return CommReport(hosts=hosts, transport=transport.name, size=size, iters=iters, allreduce=allreduce,
                      pairs=measured, rounds=round_no, reference_busbw=ref, ratio=ratio, rows=rows, links=links,
                      failing=failing, passing=passing, seconds=time.monotonic() - started)

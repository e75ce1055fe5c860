"""A made-up transport for preflight.comm's round logic (tests/runner/test_preflight_comm.py) and its
report (tests/reports/test_report.py): every pair measures FAST unless a slow node or link is in it."""
from __future__ import annotations

from runtime.preflight.comm import Measurement, Probe

FAST, SLOW = 10.0, 1.0


class FakeTransport:
    """Pairs of `slow` nodes (or over `slow_links`) measure SLOW; `dead` nodes fail; `gone` are unreachable."""
    name = "fake"

    def __init__(self, slow=(), slow_links=(), dead=(), gone=(), seconds=2.0, busy=()):
        self.slow, self.dead, self.gone = set(slow), set(dead), set(gone)
        self.busy = {node: 2 for node in busy}        # slow for its first two pairs only: a passing load
        self.slow_links = {frozenset(link) for link in slow_links}
        self.seconds = seconds
        self.rounds: list[list[tuple[str, str]]] = []
        self.allreduce_hosts = None

    def probe(self, hosts, timeout):
        return {h: Probe(h, h not in self.gone, error="unreachable: connection refused" if h in self.gone else None)
                for h in hosts}

    def _one(self, hosts):
        if self.dead & set(hosts):
            return Measurement(tuple(hosts), error="timed out after 120 s", seconds=120.0)
        slow = (self.slow & set(hosts)) or (len(hosts) == 2 and frozenset(hosts) in self.slow_links)
        for node in set(hosts) & set(self.busy) if len(hosts) == 2 else ():
            slow, self.busy[node] = slow or self.busy[node] > 0, self.busy[node] - 1
        return Measurement(tuple(hosts), busbw=SLOW if slow else FAST, seconds=self.seconds, ranks=len(hosts),
                           bytes=1 << 20)

    def allreduce(self, hosts, size, iters, timeout):
        self.allreduce_hosts = list(hosts)
        return self._one(hosts)

    def pairs(self, pairs, size, iters, timeout, round_no):
        assert len(self.rounds) == round_no - 1
        used = [h for p in pairs for h in p]
        assert len(used) == len(set(used)), f"a node twice in one round: {pairs}"
        self.rounds.append(list(pairs))
        return [self._one(p) for p in pairs]

"""preflight.comm: find the one slow link or node among N nodes.

    report = screen_links(hosts, OverCluster(transport, work_dir), size="64M", iters=10, progress=print)
    run_comm_check(c, hosts=None, runtime=None, size="64M", iters=10)   # the task's body: a run directory

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
   (WARN). Before a node is named, each slow pair (with a figure) that names
   it is measured once more and keeps the better figure, judged against the
   same median: one figure taken during someone else's burst drains no node.
4. A CommReport: per-node CheckResult rows ("comm.pair": "n3<->n1 0.02 GB/s,
   4% of median"), the all-reduce row, the failing nodes with their reasons
   (runtime.runs.nodes.write), the pairs measured.

Each measurement is one launch of `python -m benchmarks.collectives --sizes S
--iters K --out FILE` through a cluster transport (runtime.cluster): one agent
per node, rank 0 writing FILE into the run directory (a shared file system).
Over SSH the hosts are named (--hosts, -H, anvil.hosts); inside a Slurm
allocation each launch is an srun step on its nodes (--nodelist). Every launch
has a timeout (a dead link costs its timeout, never a hang): the remote end of
the SSH session, or srun, ends it.

The package, one job a module (each imports only modules above it in this list):

    errors.py        CommError (bad input, exit 2), CommFailed (a node failed, exit 1)
    measurement.py   Measurement, Probe, the Transport protocol, read_result (the rank-0 JSON)
    rounds.py        the round logic, pure: first_round, next_round, mark_slow, node_states, rounds_left,
                     retest_plan, keep_best
    report.py        the verdict (verdict, describe) and the report: NodeRow, CommReport, render
    measure.py       OverCluster: probe, all-reduce and pairs as launches through a cluster transport
    check.py         screen_links: the steps above over one transport
    task.py          run_comm_check: the body of `inv preflight.comm` (hosts, transport, run directory)

The pure parts (pairing, judging) are tested with a fake transport (tests/runner/test_preflight_comm.py).
"""
from __future__ import annotations

from runtime.preflight.comm.check import MAX_ROUNDS, PROBE_TIMEOUT_S, TIMEOUT_S, Progress, screen_links
from runtime.preflight.comm.errors import CommError, CommFailed
from runtime.preflight.comm.measurement import Measurement, Pair, Probe, Transport, read_result
from runtime.preflight.comm.report import CommReport, NodeRow, describe, render, verdict
from runtime.preflight.comm.rounds import (RATIO, NodeState, established, first_round, keep_best, mark_slow,
                                           next_round, node_states, reference, retest_plan, rounds_left)
from runtime.preflight.comm.task import run_comm_check
from runtime.preflight.comm.measure import NODE_LOCAL, WARMUP, OverCluster

__all__ = ["CommError", "CommFailed", "CommReport", "MAX_ROUNDS", "Measurement", "NODE_LOCAL", "NodeRow", "NodeState",
           "OverCluster", "PROBE_TIMEOUT_S", "Pair", "Probe", "Progress", "RATIO", "TIMEOUT_S",
           "Transport", "WARMUP", "describe", "established", "first_round", "keep_best", "mark_slow", "next_round",
           "node_states", "read_result", "reference", "render", "retest_plan", "rounds_left", "run_comm_check",
           "screen_links", "verdict"]

"""preflight.comm (runtime/preflight/comm/): find the one slow link or node among N nodes.

Two halves:
- the round logic with made-up measurements (a fake transport: every pair's figure
  is 10 GB/s unless a slow node or link is in it): which pairs each round makes,
  how many rounds, who is named, the progress line with its ETA;
- for real: three SSH hosts in network namespaces (tests/helpers/cluster.py), one of them
  made slow with tc (Cluster.slow_link), the screen over Fabric + the agent +
  benchmarks.collectives (gloo) names that host and passes the other two, and
  writes the run directory with report.json and the node lists.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from runtime.cluster import Runtime
from runtime.preflight import comm
from runtime.runs.nodes import failing

from helpers.cluster import _cmdline
from helpers.comm import FAST, FakeTransport

# ---- the round logic, with a fake transport ---------------------------------------------------

def nodes(n):
    return [f"n{i}" for i in range(1, n + 1)]


def screen(n, **fake):
    lines = []
    transport = FakeTransport(**fake)
    report = comm.screen_links(nodes(n), transport, "1M", 5, lines.append)
    return report, transport, lines


def status_by_host(report):
    return {r.host: r.check.status for r in report.rows}


def met(transport, report):
    """The pairs of the screening rounds (the retests after them repeat some)."""
    return [frozenset(p) for rnd in transport.rounds[:report.rounds] for p in rnd]


def test_first_round_pairs_disjoint_neighbours():
    assert comm.first_round(nodes(4)) == [("n1", "n2"), ("n3", "n4")]
    assert comm.first_round(nodes(5)) == [("n1", "n2"), ("n3", "n4")]      # n5 waits for a good partner
    assert comm.first_round(nodes(2)) == [("n1", "n2")]


@pytest.mark.parametrize("n, rounds", [(3, 3), (4, 1), (5, 2), (8, 1), (9, 2)])
def test_no_slow_node_everyone_passes(n, rounds):
    report, transport, _ = screen(n)
    assert report.failing == {} and report.passing == nodes(n)
    assert set(status_by_host(report).values()) == {"PASS"} and report.links == []
    # one round, one more for the odd one out (paired with a node of a fast pair); three nodes
    # need all three pairs: until n2-n3 is measured, a slow n1 would look like the norm
    assert report.rounds == rounds
    assert not report.failed and report.to_dict()["status"] == "PASS"


def test_four_nodes_one_slow_found_in_two_rounds():
    report, transport, lines = screen(4, slow={"n3"})
    assert transport.rounds[0] == [("n1", "n2"), ("n3", "n4")]
    # round 2: each side of the slow pair with a known-good node
    assert {frozenset(p) for p in transport.rounds[1]} == {frozenset({"n1", "n3"}), frozenset({"n2", "n4"})}
    assert report.rounds == 2
    assert list(report.failing) == ["n3"] and report.passing == ["n1", "n2", "n4"]
    assert status_by_host(report) == {"n1": "PASS", "n2": "PASS", "n3": "FAIL", "n4": "PASS"}
    row = next(r for r in report.rows if r.host == "n3").check
    assert row.name == "comm.pair" and row.value.startswith("n3<->") and "10% of median" in row.value
    assert "slow with 2 different partners" in row.reason
    assert report.failing["n3"][0].startswith("comm.pair: slow with 2 different partners: n3<->n4 1 GB/s")
    assert report.reference_busbw == FAST and report.failed


def test_five_nodes_the_odd_one_slow_needs_a_third_round():
    report, transport, lines = screen(5, slow={"n5"})
    assert transport.rounds[0] == [("n1", "n2"), ("n3", "n4")]
    assert transport.rounds[1] == [("n1", "n5")]            # the odd one out with a node of a fast pair
    assert transport.rounds[2] == [("n2", "n5")]            # slow again with a second, different partner
    assert list(report.failing) == ["n5"] and report.passing == nodes(4)
    # the progress line: round k/R with R the rounds still needed if all goes well, and an ETA
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert rounds == ["round 1/2: 2 pair(s), ~4 s left", "round 2/2: 1 pair(s), ~2 s left",
                      "round 3/3: 1 pair(s), ~2 s left"]


def test_a_node_slow_only_while_busy_is_retested_and_passes():
    report, transport, lines = screen(4, busy={"n3"})
    assert report.rounds == 2 and report.failing == {} and report.passing == nodes(4)
    assert transport.rounds[2:] == [[("n3", "n4")], [("n1", "n3")]]    # each slow pair once more, one a round
    assert [ln for ln in lines if ln.startswith("retest")] == [
        "retest 1/2: 1 slow pair(s) again before naming a node",
        "retest 2/2: 1 slow pair(s) again before naming a node"]
    assert sum("fast this time" in ln for ln in lines) == 2
    retested = [m for m in report.pairs if m.attempts == 2]
    assert [m.busbw for m in retested] == [FAST, FAST] and all(m.slow is False for m in retested)
    assert "2 slow pair(s) measured again" in comm.render(report)


def test_a_slow_node_stays_named_after_its_retest():
    report, transport, lines = screen(4, slow={"n3"})
    assert list(report.failing) == ["n3"]
    retests = transport.rounds[report.rounds:]
    assert sum(map(len, retests)) == 2
    assert {frozenset(p) for r in retests for p in r} == {frozenset({"n1", "n3"}), frozenset({"n3", "n4"})}
    assert sum("SLOW again" in ln for ln in lines) == 2
    assert "(best of 2)" in report.failing["n3"][0]
    assert report.to_dict()["pairs"][1]["attempts"] == 2


def test_failed_pairs_are_not_retested_and_the_bar_does_not_move():
    report, transport, _ = screen(4, dead={"n3"})
    assert len(transport.rounds) == report.rounds                       # a timeout is no noise: no retest
    pairs = [comm.Measurement(("a", "b"), busbw=10.0), comm.Measurement(("c", "d"), busbw=10.0),
             comm.Measurement(("a", "c"), busbw=4.0), comm.Measurement(("b", "d"), busbw=6.5)]
    ref = comm.mark_slow(pairs, 0.7)
    assert ref == 10.0 and [m.slow for m in pairs] == [False, False, True, True]
    assert comm.retest_plan(pairs, {"b"}) == [[("b", "d")]]             # only the pairs naming a suspect
    assert comm.retest_plan(pairs, {"a", "d"}) == [[("a", "c"), ("b", "d")]]    # disjoint: one round
    comm.keep_best(pairs, [comm.Measurement(("d", "b"), busbw=30.0)])
    comm.mark_slow(pairs, 0.7, fixed_reference=ref)   # 30 GB/s once does not make 10 GB/s pairs slow
    assert [m.slow for m in pairs] == [False, False, True, False] and pairs[3].attempts == 2
    assert comm.retest_plan(pairs, {"b", "d"}) == []                     # once only


def test_five_nodes_one_slow_in_a_pair():
    report, transport, _ = screen(5, slow={"n2"})
    assert list(report.failing) == ["n2"] and set(report.passing) == {"n1", "n3", "n4", "n5"}
    assert report.rounds <= 3
    assert frozenset({"n2", "n1"}) in met(transport, report) and sum("n2" in p for p in met(transport, report)) == 2


def test_eight_nodes_one_slow():
    report, transport, _ = screen(8, slow={"n6"})
    assert report.rounds == 2 and len(transport.rounds[1]) == 2      # only the slow pair's two nodes again
    assert list(report.failing) == ["n6"] and len(report.passing) == 7


def test_eight_nodes_two_slow_in_different_pairs():
    report, transport, _ = screen(8, slow={"n2", "n5"})
    assert report.rounds == 2
    assert sorted(report.failing) == ["n2", "n5"] and len(report.passing) == 6


def test_two_slow_in_the_same_pair_are_both_named():
    report, transport, _ = screen(8, slow={"n3", "n4"})
    assert transport.rounds[0][1] == ("n3", "n4")
    assert sorted(report.failing) == ["n3", "n4"] and report.rounds == 2


@pytest.mark.parametrize("slow", ["n1", "n2", "n3"])
def test_three_nodes_any_one_slow(slow):
    report, transport, _ = screen(3, slow={slow})
    assert list(report.failing) == [slow] and report.passing == [n for n in nodes(3) if n != slow]
    assert report.rounds == 3                                   # three nodes: one pair per round
    assert len(set(met(transport, report))) == len(met(transport, report))      # no pair measured twice


def test_a_slow_link_between_two_good_nodes_is_a_warning_not_a_node():
    report, transport, _ = screen(4, slow_links=[("n1", "n2")])
    assert report.failing == {} and report.passing == nodes(4)
    assert [(r.host, r.check.name, r.check.status) for r in report.links] == [("n1<->n2", "comm.link", "WARN")]
    assert report.to_dict()["status"] == "WARN"


def test_a_dead_node_fails_every_pair_and_is_named_with_the_timeout():
    report, transport, _ = screen(4, dead={"n4"})
    assert list(report.failing) == ["n4"]
    assert "timed out after 120 s" in report.failing["n4"][0]
    assert report.allreduce.busbw is None and report.allreduce_row.status == "FAIL"


def test_three_nodes_one_dead_the_other_two_are_kept_but_not_cleared():
    report, transport, _ = screen(3, dead={"n3"})
    assert list(report.failing) == ["n3"] and report.passing == ["n1", "n2"]
    assert status_by_host(report) == {"n1": "WARN", "n2": "WARN", "n3": "FAIL"}    # n1-n2 alone: nothing to compare


def test_an_unreachable_node_is_left_out_at_once():
    report, transport, _ = screen(4, gone={"n2"})
    assert transport.allreduce_hosts == ["n1", "n3", "n4"]
    assert all("n2" not in p for p in met(transport, report))
    assert report.failing == {"n2": ["comm.reach: unreachable: connection refused"]}
    assert [r.host for r in report.rows] == nodes(4)                # host order kept
    assert status_by_host(report)["n2"] == "FAIL"


def test_two_nodes_cannot_tell_a_slow_side_but_a_failed_pair_fails_both():
    report, _, _ = screen(2, slow={"n2"})
    assert report.failing == {} and report.passing == ["n1", "n2"]     # nothing to compare the pair with
    assert status_by_host(report) == {"n1": "WARN", "n2": "WARN"}
    assert "not judged" in report.rows[0].check.reason and report.reference_busbw is None
    report, _, _ = screen(2, dead={"n2"})
    assert sorted(report.failing) == ["n1", "n2"]
    assert "no fast partner left to tell which side" in report.failing["n1"][0]


def test_bad_input():
    with pytest.raises(comm.CommError, match="at least 2 nodes"):
        comm.screen_links(["n1"], FakeTransport(), "1M", 5)
    with pytest.raises(comm.CommError, match="ratio"):
        comm.screen_links(nodes(3), FakeTransport(), "1M", 5, ratio=1.5)


def test_run_comm_check_refuses_bad_input_before_any_run_directory(tmp_path):
    from invoke import Config, Context

    c = Context(config=Config(overrides={"anvil": {"runs_dir": str(tmp_path / "runs")}}))
    for kwargs, message in [(dict(hosts="a,b", size="lots"), "--size: bad size"),
                            (dict(hosts="a,b", size="1M,4M"), "one size"),
                            (dict(hosts="a,b", iters=0), "--iters must be >= 1"),
                            (dict(hosts="a"), "at least 2 nodes"),
                            (dict(hosts=None), "no hosts given"),
                            (dict(hosts="a,b", ratio=1.5), "--slow-below must be between 0 and 100"),
                            (dict(hosts="a,b", runtime=Runtime.parse("slurm")), "inside an allocation"),
                            (dict(hosts="a,b", runtime=Runtime.parse("container")), "not a container's")]:
        args = {"runtime": None, "size": "1M", "iters": 5, **kwargs}
        with pytest.raises(comm.CommError, match=message):
            comm.run_comm_check(c, args.pop("hosts"), args.pop("runtime"), env={}, **args)
    assert not (tmp_path / "runs").exists()


def test_run_comm_check_writes_the_run_directory(tmp_path, capsys):
    """The task body with made-up measurements: report.json, node lists, exit 1, --json output."""
    from invoke import Config, Context

    from runtime.runs.run import RunFailed

    c = Context(config=Config(overrides={"anvil": {"runs_dir": str(tmp_path / "runs"), "hosts": "n1,n2,n3,n4"}}))
    with pytest.raises(RunFailed) as failed:
        comm.run_comm_check(c, None, None, "1M", 5, transport=FakeTransport(slow={"n3"}), json=True)
    assert failed.value.exit_code == 1 and "1 of 4 node(s) failing: n3" in str(failed.value)
    out = capsys.readouterr()
    printed = json.loads(out.out)
    run = _run_dir(tmp_path / "runs")
    assert printed == json.loads((run / "report.json").read_text())
    assert printed["failing"] == {"n3": printed["failing"]["n3"]} and printed["status"] == "FAIL"
    assert (run / "nodes" / "fail.txt").read_text() == "n3\n"
    assert (run / "nodes" / "pass.txt").read_text() == "n1\nn2\nn4\n"
    assert failing(run)["n3"][0].startswith("comm.pair: slow with 2")
    assert "round 2/2: 2 pair(s)" in out.err
    metadata = json.loads((run / "metadata.json").read_text())
    assert metadata["status"] == "failed" and metadata["failing"] == ["n3"] and metadata["exit_code"] == 1
    # all fast: the document comes back, the run is ok
    document = comm.run_comm_check(c, "n1,n2,n3,n4", None, "1M", 5, transport=FakeTransport())
    assert document["status"] == "PASS" and document["passing"] == nodes(4)
    assert "failing hosts: (none)" in capsys.readouterr().out


def test_render_names_the_failing_node_and_the_exclude_line():
    report, _, _ = screen(4, slow={"n3"})
    text = comm.render(report, "runs/x_preflight.comm")
    assert "failing hosts: n3" in text and "passing hosts: n1,n2,n4" in text
    assert "srun --exclude=n3" in text and "--exclude-from runs/x_preflight.comm" in text
    assert "all-reduce: PASS" in text


# ---- for real: three SSH hosts, one slowed with tc ----------------------------------------------

# The namespace hosts share this machine's two cores with whatever else runs (other test suites):
# a healthy pair has measured at half the median here under load, while the slowed host's pairs
# measure 2-8% of it (50 Mbit/s). The real tests judge at 40% (the default 0.7 is for idle nodes).
NOISY_RATIO = 0.4
# The slowed tests measure 256 KiB: a slowed pair's launch runs 53 calls (3 warm-up, 5 timed loops of 10)
# at the shaper's 6 MB/s, about 12 s at 1 MiB against 2 s for a healthy pair; at 256 KiB the slowed pair
# still measures a few % of the median and its launches cost a quarter of that.
SLOWED_SIZE = "256K"


@pytest.fixture(scope="module")
def comm_cluster(netns_prerequisites, tmp_path_factory):
    """Three SSH hosts (the session cluster has two), for this module."""
    from conftest import _session_cluster

    yield from _session_cluster(tmp_path_factory.mktemp("comm"), n_hosts=3, n_down=0)


def _context(cluster, repo, runs):
    from invoke import Config, Context

    settings = json.loads(cluster.invoke_yaml(repo, connect_timeout=5))["anvil"]
    settings["runs_dir"] = str(runs)
    return Context(config=Config(overrides={"anvil": settings}))


def _slow_down(cluster, host) -> str:
    """netem delay where the kernel has it, else a 50 Mbit/s shaper (tbf)."""
    from helpers.cluster import ClusterError

    try:
        return cluster.slow_link(host, 30)
    except ClusterError as exc:
        if "sch_netem" not in str(exc):
            raise
        return cluster.slow_link(host, None, rate="50mbit")


def _run_dir(runs: Path) -> Path:
    found = sorted(runs.glob("*_preflight.comm*"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.netns
def test_screen_over_ssh_names_the_slowed_host(comm_cluster, repo, tmp_path, capsys):
    from runtime.runs.run import RunFailed

    hosts = [h.address for h in comm_cluster.hosts]
    slow = comm_cluster.hosts[1]                      # in round 1's pair: no node is known good after it
    qdisc = _slow_down(comm_cluster, slow)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunFailed) as failed:
            comm.run_comm_check(_context(comm_cluster, repo, tmp_path / "runs"), hosts, None, SLOWED_SIZE, 10,
                                timeout=60, ratio=NOISY_RATIO)
        seconds = time.monotonic() - t0
    finally:
        comm_cluster.slow_link(slow, None)
    out = capsys.readouterr()
    assert failed.value.exit_code == 1
    assert f"1 of 3 node(s) failing: {slow.address}" in str(failed.value)
    # (three nodes: all three pairs, one a round; with no slow node the same rounds pass everyone, as
    # the fake transport's cases above show: one real screen is enough here)
    assert "round 1/3: 1 pair(s)" in out.err, out.err
    run = _run_dir(tmp_path / "runs")
    report = json.loads((run / "report.json").read_text())
    assert list(report["failing"]) == [slow.address], out.out
    assert report["passing"] == [h for h in hosts if h != slow.address]
    rows = {c["host"]: c for c in report["checks"] if c["name"] == "comm.pair"}
    assert rows[slow.address]["status"] == "FAIL" and "slow with 2 different partners" in rows[slow.address]["reason"]
    assert all(rows[h]["status"] == "PASS" for h in report["passing"])
    assert report["allreduce"]["busbw_GBps"] > 0          # recorded (slowed by the slow node, but it ran)
    # the node lists the next launch reads
    assert (run / "nodes" / "fail.txt").read_text().split() == [slow.address]
    assert (run / "nodes" / "pass.txt").read_text().split() == report["passing"]
    assert list(failing(run)) == [slow.address]
    assert f"srun --exclude={slow.address}" in out.out and "failing hosts: " + slow.address in out.out
    assert json.loads((run / "metadata.json").read_text())["status"] == "failed"
    slow_pairs = [p for p in report["pairs"] if p["slow"]]
    assert len(slow_pairs) == 2 and all(slow.address in p["hosts"] for p in slow_pairs)
    fast = [p["busbw"] for p in report["pairs"] if not p["slow"]]
    print(f"3-node screen, {slow.name} slowed ({qdisc}): {seconds:.1f} s; fast pair {fast} GB/s, slow pairs "
          f"{[p['busbw'] for p in slow_pairs]} GB/s; all-reduce {report['allreduce']['busbw_GBps']:.3g} GB/s")


@pytest.mark.netns
def test_a_launch_past_its_timeout_is_ended_on_the_nodes(comm_cluster, repo, tmp_path):
    """A dead link must not hang the screen: the launch is killed on both hosts at its timeout."""
    from runtime.cluster import Options, Runtime, SshOptions

    a, b = (h.address for h in comm_cluster.hosts[:2])
    options = SshOptions(remote_path=str(repo), remote_inv=str(repo / ".venv" / "bin" / "inv"),
                         key_filename=[comm_cluster.key_file], connect_timeout=5)
    transport = comm.OverCluster(Runtime("ssh").open(Options(hosts=[a, b], ssh=options)), tmp_path / "pairs", nproc=1)
    t0 = time.monotonic()
    m = transport.launch([a, b], "timeout", "1M", 5, timeout=1)     # python + torch take longer than 1 s
    assert time.monotonic() - t0 < 20
    assert m.busbw is None and "timed out after 1 s" in m.error, m
    time.sleep(1)
    marker = str(tmp_path / "pairs")
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker in " ".join(_cmdline(int(p.name)))]
    assert left == [], "processes left behind on the nodes"


@pytest.mark.netns
def test_screen_in_a_slurm_allocation_names_the_slowed_node(slurm_prerequisites, repo, tmp_path):
    """The same screen as srun steps inside `salloc -N3` on a real Slurm cluster (its own three nodes)."""
    from helpers.cluster import Cluster

    script = tmp_path / "screen.py"
    script.write_text(
        "import json, sys\n"
        "from invoke import Config, Context\n"
        "from runtime.cluster import Runtime\n"
        "from runtime.preflight.comm import run_comm_check\n"
        f"c = Context(config=Config(overrides={{'anvil': {{'runs_dir': {str(tmp_path / 'runs')!r}}}}}))\n"
        "try:\n"
        f"    run_comm_check(c, None, Runtime.parse('slurm'), {SLOWED_SIZE!r}, 10, timeout=60, ratio={NOISY_RATIO})\n"
        "except Exception as exc:\n"
        "    print('raised', type(exc).__name__, getattr(exc, 'exit_code', None))\n")
    with Cluster.start(tmp_path / "cluster", n_hosts=3, n_down=0, slurm=True) as cluster:
        slow = cluster.hosts[2]
        _slow_down(cluster, slow)
        t0 = time.monotonic()
        done = cluster.slurm_run("salloc", "-N3", sys.executable, str(script), cwd=repo, timeout=300)
        seconds = time.monotonic() - t0
    assert "raised RunFailed 1" in done.stdout, done.stdout + done.stderr
    report = json.loads((_run_dir(tmp_path / "runs") / "report.json").read_text())
    assert report["transport"] == "srun" and report["hosts"] == ["node1", "node2", "node3"]
    assert list(report["failing"]) == [slow.name] and report["passing"] == ["node1", "node2"], done.stdout
    assert report["allreduce"]["busbw_GBps"] > 0
    assert (_run_dir(tmp_path / "runs") / "nodes" / "fail.txt").read_text() == f"{slow.name}\n"
    print(f"3-node screen under Slurm, {slow.name} slowed: {seconds:.1f} s (salloc included)")

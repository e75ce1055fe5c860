"""`inv -H` for real: the installed inv fans out over SSH to hosts in network
namespaces (tests/helpers/cluster.py), each running this same checkout's inv, as on
a cluster with a shared home.

SSH settings travel the way a user passes them: the key with -i, the rest in
a runner settings file given with -f (remote_path, remote_inv,
connect_timeout, runs_dir), which the runner forwards to the hosts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import cluster as cluster_mod
from helpers.interrupts import LONG_GEMM
from helpers.processes import alive, start_as_from_a_terminal, wait_until
from helpers.program import explain

pytestmark = [pytest.mark.netns]


@dataclass
class Fanout:
    inv: Path
    repo: Path
    settings: Path
    key: str
    up: list[str]        # addresses with sshd
    down: str            # an address in our namespace with no sshd (refused)
    work: Path

    def argv(self, hosts: list[str], *task: str) -> list[str]:
        return [str(self.inv), "-f", str(self.settings), "-i", self.key, "-H", ",".join(hosts), *task]

    def run(self, hosts: list[str], *task: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(hosts, *task), cwd=self.repo, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)

    def start(self, hosts: list[str], *task: str) -> subprocess.Popen:
        """As typed on a terminal: os.killpg(proc.pid, SIGINT) is its Ctrl-C."""
        return start_as_from_a_terminal(self.argv(hosts, *task), cwd=self.repo, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

    @property
    def runs(self) -> Path:
        return self.work / "runs"


@pytest.fixture
def fanout(netns_cluster, inv_bin, repo, tmp_path) -> Fanout:
    settings = json.loads(netns_cluster.invoke_yaml(repo, connect_timeout=5))
    del settings["anvil"]["key_filename"]          # the key comes with -i
    settings["anvil"]["runs_dir"] = str(tmp_path / "runs")
    path = tmp_path / "anvil-hosts.yaml"
    path.write_text(json.dumps(settings))
    return Fanout(inv=inv_bin, repo=repo, settings=path, key=netns_cluster.key_file,
                  up=[h.address for h in netns_cluster.hosts],
                  down=netns_cluster.down_hosts[0].address, work=tmp_path)


def listed(result: subprocess.CompletedProcess, label: str) -> list[str]:
    """The host list after 'passing hosts:' / 'failing hosts:' in the text report."""
    match = re.search(rf"^{label} hosts: (.*)$", result.stdout, re.M)
    assert match, f"no '{label} hosts:' line in:\n{result.stdout}"
    return [] if match.group(1) == "(none)" else match.group(1).split(",")


# ---- a plain task: per-host JSON comes back --------------------------------------------------

def test_plain_task_runs_on_every_host_and_returns_its_json(fanout):
    result = fanout.run(fanout.up, "env.detect", "--json")
    assert result.returncode == 0, explain(result)
    report = json.loads(result.stdout)
    assert report["task"] == "env.detect"
    assert report["passing"] == fanout.up and report["failing"] == []
    for host in fanout.up:
        entry = report["hosts"][host]
        assert entry["exit_code"] == 0 and entry["error"] is None
        assert entry["output"]["vendor"] == "cpu"      # each host ran detection for real
        assert entry["output"]["count"] == 0


def test_unreachable_host_is_reported_and_the_others_finish(fanout):
    hosts = [*fanout.up, fanout.down]
    result = fanout.run(hosts, "env.detect")
    assert result.returncode != 0, explain(result)
    assert listed(result, "passing") == fanout.up, explain(result)
    assert listed(result, "failing") == [fanout.down], explain(result)
    down_row = next(line for line in result.stdout.splitlines() if line.startswith(fanout.down + " "))
    assert "UNREACHABLE" in down_row and "Unable to connect to port 22" in down_row, down_row
    for host in fanout.up:      # their own output still came back, each with exit 0
        assert f"=== {host} (exit 0) ===" in result.stdout, explain(result)
    assert "Traceback" not in result.stdout + result.stderr


def test_input_every_host_refuses_is_one_line_and_fails_no_node(fanout):
    """A typo is the user's, not the hosts': exit 2, the task's own message once, no failing node list."""
    result = fanout.run(fanout.up, "bench.gemm", "-M", "abc")
    assert result.returncode == 2, explain(result)
    lines = [line for line in result.stderr.splitlines() if "-M" in line and "abc" in line]
    assert len(lines) == 1 and "every host refused the input" in lines[0], explain(result)
    assert "Traceback" not in result.stdout + result.stderr and "failing hosts" not in result.stdout
    (run,) = (fanout.work / "runs").iterdir()
    assert not (run / "nodes").exists()                       # nothing for --exclude-from to exclude
    metadata = json.loads((run / "metadata.json").read_text())
    assert metadata["status"] == "failed" and metadata["exit_code"] == 2 and "abc" in metadata["error"]


# ---- preflight.all: one merged table -------------------------------------------------------

def test_preflight_all_on_two_hosts_merges_one_table(fanout):
    result = fanout.run(fanout.up, "preflight.all")
    assert result.returncode == 0, explain(result)
    assert listed(result, "passing") == fanout.up and listed(result, "failing") == [], explain(result)
    table = result.stdout.split("passing hosts:")[0]
    header = next(line for line in table.splitlines() if line.startswith("check "))
    assert header.split() == ["check", "host", "status", "value", "reason", "/", "fix"]
    # Check by check, host by host: each check's row, then the next host's row under it (after the
    # wrapped rest of a long reason / fix, if any).
    lines = table.splitlines()
    for check in ("gpu.present", "host.memory", "software.torch", "network.interfaces"):
        at = next(i for i, line in enumerate(lines) if line.startswith(check + " "))
        assert lines[at].split()[1] == fanout.up[0], lines[at:at + 3]
        following = [line.split()[0] for line in lines[at + 1:at + 4] if line.strip()]
        assert fanout.up[1] in following and not any(line.startswith(check) for line in lines[at + 1:at + 4])
        host_row = lines[at + 1 + following.index(fanout.up[1])]
        assert host_row.startswith(" ") and host_row.split()[1] in ("PASS", "WARN"), lines[at:at + 3]
    assert "gpu.present" in table and "no GPU" in table    # says plainly there is no GPU


def test_preflight_all_json_has_every_check_from_both_hosts(fanout):
    result = fanout.run(fanout.up, "preflight.all", "--json")
    assert result.returncode == 0, explain(result)
    report = json.loads(result.stdout)
    assert report["passing"] == fanout.up and report["failing"] == []
    names = [c["name"] for c in report["checks"]]
    assert {"gpu.present", "host.memory", "software.torch", "network.interfaces"} <= set(names)
    for check in report["checks"]:
        assert set(check["hosts"]) == set(fanout.up)
        assert all(check["hosts"][h]["status"] in ("PASS", "WARN") for h in fanout.up), check
    by_name = {c["name"]: c for c in report["checks"]}
    # Same checkout, same torch on both: the software fingerprint must not differ.
    assert by_name["software.torch"]["differs"] is False
    # Each host ran in its own namespace: it saw its own eth0 address, not this machine's.
    for host in fanout.up:
        assert report["hosts"][host]["output"]["host"] == host


def test_comm_under_dash_h_runs_once_across_the_hosts(fanout):
    """preflight.comm reaches the nodes itself: -H hands it the hosts and inv's SSH key (-i; the
    settings file has none), and it runs one all-reduce across both, not one screen per host."""
    result = fanout.run(fanout.up, "preflight.comm", "--size", "1M", "--iters", "5", "--slow-below", "40",
                        "--json")
    assert result.returncode == 0, explain(result)
    report = json.loads(result.stdout)
    assert report["hosts"] == fanout.up and report["passing"] == fanout.up and report["failing"] == {}
    assert report["allreduce"]["ranks"] == 2 and report["allreduce"]["busbw_GBps"] > 0
    assert len(list((fanout.work / "runs").glob("*_preflight.comm*"))) == 1
    clash = fanout.run(fanout.up, "preflight.comm", "--hosts", fanout.up[0])
    assert clash.returncode == 2 and "name the hosts once" in clash.stderr, explain(clash)


def test_preflight_all_with_a_down_host_reports_it_and_fails(fanout):
    hosts = [fanout.up[0], fanout.down, fanout.up[1]]
    result = fanout.run(hosts, "preflight.all")
    assert result.returncode == 1, explain(result)
    assert listed(result, "passing") == fanout.up, explain(result)
    assert listed(result, "failing") == [fanout.down], explain(result)
    assert f"srun --exclude={fanout.down}" in result.stdout
    down_row = next(line for line in result.stdout.splitlines() if line.startswith(fanout.down + " "))
    assert "UNREACHABLE" in down_row and "Unable to connect to port 22" in down_row, down_row
    # The reachable hosts still finished their checks: their rows are in the merged table.
    table = result.stdout.split("passing hosts:")[0]
    assert sum(line.split()[:2] == ["software.torch", fanout.up[0]] for line in table.splitlines()) == 1
    assert "Traceback" not in result.stdout + result.stderr


BARRIER = """\
# Fan-out test barrier (a --patch file): record arrival, then wait until every
# host has arrived. Hosts run one after another -> the first waits alone and fails.
dir={dir}
me=$(hostname)-$$
date +%s.%N > "$dir/$me.arrived"
for _ in $(seq 600); do
    [ "$(ls "$dir" | grep -c '\\.arrived$')" -ge {count} ] && {{ date +%s.%N > "$dir/$me.left"; exit 0; }}
    sleep 0.1
done
echo "barrier: still alone after 60+ s; arrived: $(ls "$dir")"
exit 1
"""


def test_hosts_run_at_the_same_time(fanout):
    """Evidence, not a stopwatch: each host's pre-run barrier lets it through only
    once every host has arrived, which serial execution can never satisfy."""
    barrier = fanout.work / "barrier"
    barrier.mkdir()
    patch = fanout.work / "barrier.sh"
    patch.write_text(BARRIER.format(dir=barrier, count=len(fanout.up)))
    result = fanout.run(fanout.up, "preflight.all", "--json", "--patch", str(patch))
    assert result.returncode == 0, explain(result)
    arrived = {p.stem: float(p.read_text()) for p in barrier.glob("*.arrived")}
    left = {p.stem: float(p.read_text()) for p in barrier.glob("*.left")}
    assert len(arrived) == len(left) == len(fanout.up), (arrived, left)
    assert {name.split("-")[0] for name in arrived} == {"node1", "node2"}   # one per namespace host
    # Every host was inside its run while every other host had already started.
    assert max(arrived.values()) <= min(left.values())
    spread = max(arrived.values()) - min(arrived.values())
    print(f"\nhosts arrived within {spread:.2f} s of each other: {arrived}")


# ---- Ctrl-C, and a dropped connection --------------------------------------------------------

def _host_runs(fanout: Fanout, task: str) -> dict[str, Path]:
    """Each host's own run of `task`, under the fan-out's run (RUN/hosts/<host>/<run>)."""
    found = {}
    for host in fanout.up:
        runs = sorted(fanout.runs.glob(f"*_{task}/hosts/{host}/*_{task}"))
        if runs and (runs[-1] / "metadata.json").is_file():
            found[host] = runs[-1]
    return found




def _remote_pids(runs: dict[str, Path]) -> list[int]:
    return [json.loads((run / "metadata.json").read_text())["pid"] for run in runs.values()]


def _start_long_gemm(fanout: Fanout) -> tuple[subprocess.Popen, dict[str, Path]]:
    """The fan-out, once every host's task is well under way (its run made, its products timed)."""
    proc = fanout.start(fanout.up, *LONG_GEMM)
    started = wait_until(lambda: len(_host_runs(fanout, "bench.gemm")) == len(fanout.up), proc)
    assert started, proc.communicate(timeout=60)
    time.sleep(2)
    assert proc.poll() is None, proc.communicate(timeout=60)
    return proc, _host_runs(fanout, "bench.gemm")


def test_ctrl_c_stops_the_task_on_every_host_and_records_it(fanout):
    proc, runs = _start_long_gemm(fanout)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err and "interrupted: stopping the task on 2 host(s)" in err, err
    for host in fanout.up:
        assert re.search(rf"^{re.escape(host)}\s+INTERRUPTED\s", err, re.M), err
    (run,) = fanout.runs.glob("*_bench.gemm")
    metadata = json.loads((run / "metadata.json").read_text())
    assert (metadata["status"], metadata["exit_code"]) == ("interrupted", 130)
    assert not (run / "nodes").exists()          # nobody failed: no list for --exclude-from
    for host, own in runs.items():               # each host's run ended as at a Ctrl-C there
        assert json.loads((own / "metadata.json").read_text())["status"] == "interrupted", host
        assert json.loads((run / "hosts" / f"{host}.json").read_text())["interrupted"] is True
    assert not any(alive(pid) for pid in _remote_pids(runs))


def test_sigterm_stops_the_task_on_every_host_and_records_it(fanout):
    """A scheduler ends inv alone: the fan-out stops as at a Ctrl-C, exit 143 (SIGTERM's 128+N). It used
    to kill inv at once: the hosts' tasks went on unwatched and the run stayed "running"."""
    proc, runs = _start_long_gemm(fanout)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err and "interrupted: stopping the task on 2 host(s)" in err, err
    for host in fanout.up:
        assert re.search(rf"^{re.escape(host)}\s+INTERRUPTED\s", err, re.M), err
    (run,) = fanout.runs.glob("*_bench.gemm")
    metadata = json.loads((run / "metadata.json").read_text())
    assert (metadata["status"], metadata["exit_code"], metadata["error"]) == ("interrupted", 143,
                                                                              "interrupted (SIGTERM)")
    for host, own in runs.items():               # each host's run ended as at a Ctrl-C there
        assert json.loads((own / "metadata.json").read_text())["status"] == "interrupted", host
    assert not any(alive(pid) for pid in _remote_pids(runs))


def test_a_dropped_connection_stops_the_task_on_the_hosts(fanout):
    proc, runs = _start_long_gemm(fanout)
    proc.kill()                                  # inv gone at once: its SSH connections drop
    proc.communicate(timeout=30)
    pids = _remote_pids(runs)
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=60), "a remote task kept running"
    for own in runs.values():
        assert json.loads((own / "metadata.json").read_text())["status"] == "interrupted"


# ---- the testbed itself ----------------------------------------------------------------------

def test_leftovers_of_a_killed_cluster_are_removed(netns_prerequisites):
    """A run killed with SIGKILL leaves namespaces, a bridge and sshds behind;
    the next cluster's start (remove_stale) must clear exactly those."""
    child = subprocess.Popen([sys.executable, cluster_mod.__file__, "up", "--hosts", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             stdin=subprocess.DEVNULL)
    first = child.stdout.readline()
    match = re.match(r"cluster (\d+): up (\S+); down (\S+)", first)
    if not match:
        child.kill()
        pytest.fail(f"cluster.py up printed: {first}{child.communicate()[0]}")
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    stale = cluster_mod.Cluster.load(cluster_mod.STATE_DIR / f"{match.group(1)}.json")
    sshd_pid = int(Path(stale.hosts[0].pidfile).read_text())
    assert cluster_mod._process_start(sshd_pid), "the killed run's sshd should still be running"
    try:
        assert stale.number in cluster_mod.remove_stale()
        assert not cluster_mod._process_start(sshd_pid)
        namespaces = cluster_mod._ip("netns", "list")
        assert all(h.netns not in namespaces.split() for h in stale.all_hosts)
        assert not Path(f"/sys/class/net/{stale.bridge}").exists()
        assert not (cluster_mod.STATE_DIR / f"{stale.number}.json").exists()
    finally:
        shutil.rmtree(stale.workdir, ignore_errors=True)

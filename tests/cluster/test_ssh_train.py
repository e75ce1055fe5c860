"""`inv -H a,b train.pretrain`: training across SSH hosts without a scheduler (runtime ssh).

The hosts are network-namespace hosts (tests/helpers/cluster.py) sharing this checkout
and file system, as a cluster with a shared home; the ranks talk gloo between
the namespaces. Covers: two hosts train like one host of the same world size
(and a replay trains there again); the master named with --master takes node
rank 0; a preemption signal and Ctrl-C reach every host, which checkpoints, and
--resume auto continues the same curve; a host whose ranks die ends the job in
bounded time and is named (a lost host; a frozen rank, not the one that waited for it); a host that fails twice gives its place to a spare; --exclude-from a preflight run leaves its failing
host out; bad input is one line before any run directory.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.cluster import _cmdline, _netns_pids, kill_trainers, trainer_pids
from helpers.processes import start_as_from_a_terminal, wait_until
from helpers.program import explain, failure_line, inv_environ
from helpers.training import MOE_ARGS, assert_same_curve, last_step, steps_after_restart, train_args, train_losses
from runtime.runs.nodes import failing

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@dataclass
class Hosts:
    inv: Path
    repo: Path
    settings: Path
    key: str
    up: list[str]          # addresses with sshd (node1, node2 inside)
    netns: list[str]       # their network namespaces
    down: str              # an address whose sshd is not there
    runs: Path

    def argv(self, hosts: list[str], *task: str) -> list[str]:
        return [str(self.inv), "-f", str(self.settings), "-i", self.key, "-H", ",".join(hosts), *task]

    def run(self, hosts: list[str], *task: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(hosts, *task), cwd=self.repo, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout, env=hosts_environ())

    def start(self, hosts: list[str], *task: str) -> subprocess.Popen:
        """As typed on a terminal: os.killpg(proc.pid, SIGINT) is its Ctrl-C."""
        return start_as_from_a_terminal(self.argv(hosts, *task), cwd=self.repo, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                                        env=hosts_environ())

    def only_run(self, pattern: str = "*_train.pretrain_*") -> Path:
        (run,) = sorted(self.runs.glob(pattern))
        return run


def hosts_environ(**extra: str) -> dict[str, str]:
    """inv's environment here: none of this shell's settings (the hosts' come with -f), an agent that waits
    3 s for its ranks to end, `extra`."""
    return inv_environ(env={"ANVIL_AGENT_GRACE": "3", **extra}, clean=True)


@pytest.fixture
def hosts(netns_cluster, inv_bin, repo, tmp_path) -> Hosts:
    settings = json.loads(netns_cluster.invoke_yaml(repo, connect_timeout=5))
    del settings["anvil"]["key_filename"]          # the key comes with -i
    settings["anvil"]["runs_dir"] = str(tmp_path / "runs")
    path = tmp_path / "anvil-hosts.yaml"
    path.write_text(json.dumps(settings))
    return Hosts(inv=inv_bin, repo=repo, settings=path, key=netns_cluster.key_file,
                 up=[h.address for h in netns_cluster.hosts], netns=[h.netns for h in netns_cluster.hosts],
                 down=netns_cluster.down_hosts[0].address, runs=tmp_path / "runs")


def _steps_of(runs: Path, pattern: str) -> int:
    """The last step the newest run under `runs` matching `pattern` logged (0 before it has one)."""
    found = sorted(runs.glob(pattern)) if runs.is_dir() else []
    return last_step(found[-1]) if found else 0


def test_two_hosts_train_like_one_host_and_a_replay_trains_there_again(hosts, dataset, four_process_losses):
    started = time.monotonic()
    result = hosts.run(hosts.up, "train.pretrain", "--nproc", "2", "--name", "two", *train_args(dataset))
    elapsed = time.monotonic() - started
    assert result.returncode == 0, explain(result)
    run = hosts.only_run()
    md = json.loads((run / "metadata.json").read_text())
    assert (md["status"], md["runtime"], md["hosts"], md["world_size"], md["nodes"]) == \
        ("ok", "ssh", hosts.up, 4, 2), md      # each host as -H named it, not its own host name (node1, node2)
    for rank, host in ((0, hosts.up[0]), (1, hosts.up[0]), (2, hosts.up[1]), (3, hosts.up[1])):   # and in each log
        assert f"[{host} r{rank}/l{rank % 2}]" in (run / "logs" / f"rank{rank}.log").read_text()
    launched = [line for line in (run / "logs" / "launcher.log").read_text().splitlines() if line.startswith("$ ")]
    assert len(launched) == 2 and all(f"--master-addr {hosts.up[0]} " in line for line in launched)
    assert launched[0].startswith(f"$ {hosts.up[0]}: ") and "--node-rank 0 " in launched[0]
    assert launched[1].startswith(f"$ {hosts.up[1]}: ") and "--node-rank 1 " in launched[1]
    assert "OMP_NUM_THREADS" not in (run / "logs" / "launcher.log").read_text()   # values go over stdin
    assert not (run / "config.yaml").exists()             # the one config: configs/train.yaml
    assert "[c10d]" not in result.stderr and "RuntimeWarning" not in result.stderr   # no noise to act on
    assert_same_curve(train_losses(run), four_process_losses)
    print(f"2 hosts x 2 processes over SSH: {elapsed:.1f} s wall")

    # A replay keeps -H (the hosts were the task's input): the same hosts, the same curve.
    replay = subprocess.run([str(hosts.inv), "-f", str(hosts.settings), "snapshot.replay", str(run)], cwd=hosts.repo,
                            capture_output=True, text=True, timeout=600, env=hosts_environ())
    assert replay.returncode == 0, explain(replay)
    (again,) = [p for p in hosts.runs.iterdir() if p != run]
    md = json.loads((again / "metadata.json").read_text())
    assert (md["status"], md["hosts"], md["world_size"], md["replay_of"]) == ("ok", hosts.up, 4, str(run))
    assert train_losses(again) == train_losses(run)


def test_runtime_ssh_trains_on_anvil_hosts_and_the_master_named_takes_node_rank_0(hosts, dataset):
    """anvil.hosts with --runtime ssh says what -H says; --master names the host of node rank 0."""
    result = subprocess.run([str(hosts.inv), "-f", str(hosts.settings), "-i", hosts.key, "train.pretrain",
                             "--runtime", "ssh", "--nproc", "1", "--master", hosts.up[1], *train_args(dataset, steps=2)],
                            cwd=hosts.repo, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                            env=hosts_environ(INVOKE_ANVIL_HOSTS=",".join(hosts.up)))
    assert result.returncode == 0, explain(result)
    run = hosts.only_run()
    # each host by the name it was reached by (its address in anvil.hosts), the master first
    assert f"[{hosts.up[1]} r0/l0]" in (run / "logs" / "rank0.log").read_text()
    assert f"[{hosts.up[0]} r1/l0]" in (run / "logs" / "rank1.log").read_text()
    assert json.loads((run / "metadata.json").read_text())["hosts"] == [hosts.up[1], hosts.up[0]]


def test_a_preemption_signal_reaches_every_host_and_resume_auto_continues_the_curve(hosts, dataset,
                                                                                     four_process_losses):
    proc = hosts.start(hosts.up, "train.pretrain", "--nproc", "2", "--name", "pre", *train_args(dataset))
    try:
        assert wait_until(lambda: _steps_of(hosts.runs, "*_pre") >= 4, proc, timeout=300), \
            proc.communicate(timeout=60)
        os.kill(proc.pid, signal.SIGUSR2)            # to inv alone, as a scheduler's warning would come
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, f"exit {proc.returncode}\n{err[-4000:]}"
    first = hosts.only_run("*_pre")
    md = json.loads((first / "metadata.json").read_text())
    assert md["status"] == "preempted" and md["hosts"] == hosts.up, md     # as -H named them
    typed = shlex.join(hosts.argv(hosts.up, "train.pretrain", "--nproc", "2", "--name", "pre",
                                  *train_args(dataset))[1:])
    assert f"continue where it ran with `inv {typed} --resume {first}`" in err, err[-3000:]   # -H and its flags kept
    stopped = max(train_losses(first))
    assert stopped < 16 and (first / "checkpoints" / f"step_{stopped}" / "COMPLETE").is_file()
    for node in (0, 1):          # every host's ranks stopped on the signal, after the checkpoint
        agent = json.loads((first / "logs" / f"agent-{node}.json").read_text())
        assert agent["exit_code"] == 3 and set(agent["ranks"].values()) == {3} and agent["signal"] == "SIGUSR2"

    resumed = hosts.run(hosts.up, "train.pretrain", "--nproc", "2", "--name", "pre", "--resume", "auto",
                        *train_args(dataset))
    assert resumed.returncode == 0, explain(resumed)
    (second,) = [p for p in hosts.runs.glob("*_pre") if p != first]
    assert f"resumed from {first / 'checkpoints' / f'step_{stopped}'}" in (second / "logs" / "rank0.log").read_text()
    assert_same_curve({**train_losses(first), **train_losses(second)}, four_process_losses)


def test_ctrl_c_checkpoints_on_every_host(hosts, dataset):
    proc = hosts.start(hosts.up, "train.pretrain", "--nproc", "2", "--name", "intr", *train_args(dataset, steps=100000))
    try:
        assert wait_until(lambda: _steps_of(hosts.runs, "*_intr") >= 3, proc, timeout=300), \
            proc.communicate(timeout=60)
        os.killpg(proc.pid, signal.SIGINT)           # the terminal's Ctrl-C, to inv's whole group
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{err[-4000:]}"
    assert "Traceback" not in err
    run = hosts.only_run("*_intr")
    md = json.loads((run / "metadata.json").read_text())
    assert md["status"] == "interrupted" and md["hosts"] == hosts.up, md
    assert list((run / "checkpoints").glob("step_*/COMPLETE"))
    for node in (0, 1):
        assert json.loads((run / "logs" / f"agent-{node}.json").read_text())["exit_code"] == 130


def test_a_lost_host_ends_the_job_and_is_named(hosts, dataset):
    """Every process of the second host but its sshd killed at once (agent, ranks: a node lost)."""
    proc = hosts.start(hosts.up, "train.pretrain", "--nproc", "2", "--name", "dies", *train_args(dataset, steps=100000))
    try:
        assert wait_until(lambda: _steps_of(hosts.runs, "*_dies") >= 3, proc, timeout=300), \
            proc.communicate(timeout=60)
        killed = time.monotonic()
        for pid in _netns_pids(hosts.netns[1]):
            if "sshd" not in " ".join(_cmdline(pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode not in (0, None), err[-3000:]
    line = failure_line(err)   # the lost host first, as -H named it; not the host that saw it go
    assert line.startswith(f"train.pretrain failed: node rank(s) 1 ({hosts.up[1]}) left no report"), line
    assert f"on {hosts.up[0]} failed first" not in line, line
    assert "Traceback" not in err and ended < 180
    run = hosts.only_run("*_dies")
    assert json.loads((run / "metadata.json").read_text())["status"] == "failed"
    assert not [pid for netns in hosts.netns for pid in _netns_pids(netns) if "-m" in _cmdline(pid)
                and str(run) in " ".join(_cmdline(pid))], "a rank or agent outlived the job"
    print(f"a host lost to the job's end: {ended:.1f} s")


def test_a_frozen_rank_on_another_host_is_the_one_named(hosts, dataset):
    """A rank of the second host stopped with SIGSTOP: the first host's rank, waiting for it, is ended by
    its watchdog; the line names the frozen rank and its host, not the one that waited."""
    proc = hosts.start(hosts.up, "train.pretrain", "--nproc", "1", "--name", "frozen",
                       *train_args(dataset, "--set", "health.hang_timeout_s=5", steps=100000))
    try:
        assert wait_until(lambda: _steps_of(hosts.runs, "*_frozen") >= 3, proc, timeout=300), \
            proc.communicate(timeout=60)
        for pid in trainer_pids(hosts.netns[1]):
            os.kill(pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=240)
    finally:
        for pid in trainer_pids(hosts.netns[1]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 4, err[-3000:]
    line = failure_line(err)
    assert line.startswith(f"train.pretrain failed: rank 1 on {hosts.up[1]} stopped first and wrote no hang report "
                           f"(stopped, or stuck where Python cannot run): rank 0 on {hosts.up[0]} waited for it"), line


def test_a_host_that_fails_twice_is_swapped_for_the_spare_and_the_run_ends_ok(hosts, dataset):
    """health.spares=1 holds the last host back: the second host's ranks are killed in two attempts (a
    restart after each), the spare takes its place, the run finishes. The spare is the second host by
    another name (root@ADDRESS): to the launcher, another node."""
    spare = f"root@{hosts.up[1]}"
    proc = hosts.start([*hosts.up, spare], "train.pretrain", "--nproc", "1", "--name", "spare",
                       *train_args(dataset, "--set", "checkpoint.interval=10", "--set", "health.spares=1", steps=40))
    err = _second_host_killed_twice(hosts, proc, "*_spare")
    assert proc.returncode == 0, err[-3000:]
    run = hosts.only_run("*_spare")
    md = json.loads((run / "metadata.json").read_text())
    assert md["status"] == "ok" and md["hosts"] == [hosts.up[0], spare] and md["left_out"] == [hosts.up[1]]
    first, second = md["restarts"]
    assert (first["host"], first["step"], "left_out" in first) == (hosts.up[1], 10, False), first
    assert (second["host"], second["step"], second["left_out"]) == (hosts.up[1], 20, hosts.up[1]), second
    assert f"{hosts.up[1]} is left out, a spare takes its place" in err
    assert max(train_losses(run)) == 40


def test_without_a_spare_the_world_shrinks_and_keeps_its_global_batch(hosts, dataset):
    """No spare: the second host's ranks killed in two attempts, the run goes on on the first host alone with
    twice the gradient accumulation (the same global batch, so the same tokens a step) and finishes."""
    proc = hosts.start(hosts.up, "train.pretrain", "--nproc", "1", "--name", "shrink",
                       *train_args(dataset, "--set", "checkpoint.interval=10", steps=40))
    err = _second_host_killed_twice(hosts, proc, "*_shrink")
    assert proc.returncode == 0, err[-3000:]
    run = hosts.only_run("*_shrink")
    md = json.loads((run / "metadata.json").read_text())
    assert md["status"] == "ok" and md["hosts"] == [hosts.up[0]] and md["left_out"] == [hosts.up[1]]
    second = md["restarts"][1]
    assert second["shrunk_to"] == {"nodes": 1, "args": ["--set", "data.grad_accum=2"]}, second
    assert f"{hosts.up[1]} is left out: 1 node(s) train on with the same global batch (data.grad_accum=2)" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 2 * 4 * 32   # steps x ranks x batch x seq_len


def _second_host_killed_twice(hosts: Hosts, proc: subprocess.Popen, pattern: str) -> str:
    """The second host's ranks killed in the first two attempts of the run matching `pattern`, each past a
    checkpoint of its own (steps 13 and 23, checkpoints every 10); inv's stderr once it ended."""
    try:
        for attempt, step in ((0, 13), (1, 23)):
            assert wait_until(lambda: steps_after_restart(hosts.runs, pattern, attempt) >= step, proc,
                              timeout=300), proc.communicate(timeout=60)
            kill_trainers(hosts.netns[1])
        return proc.communicate(timeout=400)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_exclude_from_a_preflight_run_leaves_the_failing_host_out(hosts, dataset):
    everyone = [*hosts.up, hosts.down]
    preflight = hosts.run(everyone, "preflight.all")
    assert preflight.returncode == 1, explain(preflight)
    checked = hosts.only_run("*_preflight.all")
    assert list(failing(checked)) == [hosts.down]
    train = hosts.run(everyone, "train.pretrain", "--nproc", "1", "--exclude-from", str(checked),
                      *train_args(dataset, steps=4))
    assert train.returncode == 0, explain(train)
    assert f"excluding 1 node(s) that failed preflight in {checked}" in train.stderr
    md = json.loads((hosts.only_run("*_train.pretrain_*") / "metadata.json").read_text())
    assert md["status"] == "ok" and md["hosts"] == hosts.up and list(md["excluded_nodes"]) == [hosts.down]


def test_bad_ssh_input_is_one_line_before_any_run_directory(hosts, dataset):
    for hosts_given, extra, said in (
            ([*hosts.up, hosts.down], [], f"cannot reach {hosts.down} (unreachable: "),
            (hosts.up, ["--master", "10.9.9.9"], "--master 10.9.9.9: not one of the hosts"),
            (hosts.up, ["--runtime", "slurm"], "-H names the hosts to train on over SSH"),
            (hosts.up, ["--nodes", "2"], "--nodes, --partition, --account, --time and --no-wait need --runtime slurm"),
            (hosts.up, ["--runtime", "bogus"], "--runtime 'bogus': expected direct | ssh | slurm")):
        result = hosts.run(hosts_given, "train.pretrain", *extra, *train_args(dataset, steps=2), timeout=120)
        assert result.returncode == 2, explain(result)
        assert said in result.stderr and "Traceback" not in result.stderr, explain(result)
    assert not hosts.runs.exists()


def test_the_seed_model_trains_on_two_hosts_with_its_experts_split_and_resumes(hosts, dataset):
    """DeepSeek-V2 in miniature over -H, one rank a host, parallel.ep=2: each host holds half the experts and
    the tokens cross between the namespaces; the loss falls, and a resume from its middle checkpoint on
    the same hosts continues the same curve."""
    args = ["train.pretrain", "--nproc", "1", *MOE_ARGS]
    first = hosts.run(hosts.up, *args, "--name", "moe", *train_args(dataset, "--set", "checkpoint.interval=3", steps=6))
    assert first.returncode == 0, explain(first)
    run = hosts.only_run("*_moe")
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1], losses
    assert json.loads((run / "metadata.json").read_text())["hosts"] == hosts.up
    again = hosts.run(hosts.up, *args, "--name", "moe_resumed", *train_args(dataset, steps=6),
                      "--resume", str(run / "checkpoints" / "step_3"))
    assert again.returncode == 0, explain(again)
    assert_same_curve(train_losses(hosts.only_run("*_moe_resumed")), {s: losses[s] for s in (4, 5, 6)})


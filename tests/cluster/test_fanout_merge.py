"""Fan-out merging on synthetic per-host results (runtime/jobs/fanout.py), and the SSH pieces of the
transports (runtime/cluster/ssh/): host lists, the remote line, the far end of a session.

Real SSH fan-out is tested in test_fanout_netns.py (namespace hosts) and
runner/test_cli.py (unreachable host through the installed inv).
"""
from __future__ import annotations

import json
import os
import shlex

import pytest
from invoke import Collection, task
from invoke.parser import Parser

from runtime.cluster import SshOptions, results, ssh
from runtime.cluster.results import HostResult
from runtime.jobs import fanout

from helpers.program import REPO


def checks(*rows):
    return {"checks": [dict(zip(("name", "status", "value", "reason", "fix"), r)) for r in rows]}


def result(host, payload=None, exit_code=0, error=None, stdout=None):
    text = stdout if stdout is not None else (json.dumps(payload) if payload is not None else "")
    return HostResult(host=host, exit_code=None if error else exit_code, stdout=text, error=error,
                      payload=results.parse_json_output(text))


def test_merge_marks_differences_and_splits_hosts():
    results = [
        result("n1", checks(("gpu.count", "PASS", 8, "8 GPUs", ""), ("torch", "PASS", "2.5.1", "", ""))),
        result("n2", checks(("gpu.count", "FAIL", 7, "7 of 8 GPUs", "reseat GPU 3"), ("torch", "PASS", "2.5.1", "", ""))),
        result("n3", checks(("gpu.count", "WARN", 8, "hot", "check fans"), ("torch", "PASS", "2.5.1", "", ""))),
        result("n4", error="unreachable: [Errno 111] Connection refused"),
    ]
    report = fanout.merge(results)
    assert [c["name"] for c in report.checks] == ["gpu.count", "torch"]
    assert [c["differs"] for c in report.checks] == [True, False]
    assert report.passing == ["n1", "n3"] and report.failing == ["n2", "n4"]
    text = fanout.render(report)
    assert "≠ 7" in text and "≠ 8" in text and "2.5.1" in text and "≠ 2.5.1" not in text
    assert "fix: reseat GPU 3" in text
    assert "passing hosts: n1,n3" in text and "failing hosts: n2,n4" in text
    assert "srun --exclude=n2,n4" in text
    assert "UNREACHABLE" in text and "Connection refused" in text
    data = report.to_json()
    assert data["hosts"]["n2"]["failed_checks"] == ["gpu.count"] and data["hosts"]["n4"]["ok"] is False
    assert data["checks"][0]["hosts"]["n4"] is None


def test_a_long_fix_is_wrapped_whole_and_said_once_for_hosts_that_share_it():
    fix = "raise the limit in /etc/security/limits.d/99-rdma.conf: '* soft memlock unlimited', then log in again"
    same = ("host.memlock", "WARN", "64 KiB", "locked memory is limited and RDMA devices are present", fix)
    report = fanout.merge([result("n1", checks(same)), result("n2", checks(same))])
    text = fanout.render(report)
    assert " ".join(text.split()).count("log in again") == 1 and "…" not in text
    assert all(len(line) <= 140 for line in text.splitlines())
    (n2_row,) = [line for line in text.splitlines() if " n2 " in line and "64 KiB" in line]
    assert n2_row.rstrip().endswith("(as above)")


def test_nonzero_exit_fails_a_host_even_when_checks_pass():
    report = fanout.merge([result("a", checks(("x", "PASS", 1, "", ""))),
                           result("b", checks(("x", "PASS", 1, "", "")), exit_code=2)])
    assert report.failing == ["b"] and fanout.host_status(report.results["b"]) == "FAIL (exit 2)"


def test_plain_output_is_shown_per_host():
    report = fanout.merge([result("a", stdout="hello from a\n"), result("b", stdout="", exit_code=1)])
    text = fanout.render(report)
    assert "=== a (exit 0) ===\nhello from a" in text and "=== b (exit 1) ===" in text
    assert report.passing == ["a"] and report.failing == ["b"]


def test_json_is_found_after_log_lines():
    assert results.parse_json_output('note: warming up\n{"checks": []}\n') == {"checks": []}
    assert results.parse_json_output("no json here") is None


def test_hosts_parsing():
    assert ssh.parse_hosts("n1, n2,n1") == ["n1", "n2"]
    assert ssh.parse_hosts("@", ["a", "b"]) == ["a", "b"]
    with pytest.raises(ssh.HostsError):
        ssh.parse_hosts("@", [])
    with pytest.raises(ssh.HostsError):
        ssh.parse_hosts("n1,-oProxyCommand=x")
    assert fanout.slurm_name("root@node3:2222") == "node3" and fanout.slurm_name("[fe80::1]:22") == "fe80::1"


def test_the_ssh_transport_orders_hosts_from_the_master_and_leaves_the_excluded_out():
    from runtime.cluster import Options, Runtime

    def hosts(**options):
        return Runtime("ssh").open(Options(**options)).hosts()

    assert hosts(hosts=["a", "b", "c"]) == ["a", "b", "c"]
    assert hosts(hosts=["a", "b", "c"], master="c") == ["c", "a", "b"]
    assert hosts(hosts=["root@a:22", "b"], exclude=["a"]) == ["b"]       # fail.json names hosts in Slurm form
    with pytest.raises(ssh.HostsError, match="runtime ssh needs hosts"):
        hosts()
    from runtime.launch import LaunchError
    with pytest.raises(LaunchError, match="--master d: not one of the hosts"):
        hosts(hosts=["a", "b"], master="d")
    with pytest.raises(LaunchError, match="every host is excluded"):
        hosts(hosts=["a"], exclude=["a"])


def test_remote_line_quotes_everything_and_carries_no_values():
    """Each host runs the far end of the session on the command; its environment goes over stdin."""
    from runtime.cluster.ssh.session import Control, remote_line
    from runtime.cluster.transport import node_env

    options = SshOptions(remote_path="/shared/my repo", remote_inv=".venv/bin/inv")
    command = [".venv/bin/inv", "-f", "/x/a b.yaml", "demo.hello", "--say", "$(rm -rf ~); echo", "--json"]
    line = remote_line(options, command, timeout=5)
    assert line.startswith("cd '/shared/my repo' && exec ")
    assert shlex.split(line.split("&& ", 1)[1]) == [
        "exec", ".venv/bin/python", "-m", "runtime.cluster.ssh.remote", "--timeout", "5", "--", *command]
    env = node_env({"ANVIL_NODE_RUNTIME": "direct", "HF_TOKEN": "hf-secret"}, "root@n1:22", 1, 2, "/r/run 1/hosts")
    assert "hf-secret" not in line
    control = Control(env)
    sent = json.loads(control.read())
    assert sent == {"ANVIL_NODE_RUNTIME": "direct", "HF_TOKEN": "hf-secret", "ANVIL_HOST": "root@n1:22",
                    "ANVIL_NODE_RANK": "1", "ANVIL_NNODES": "2", "ANVIL_NODE_RUNS_DIR": "/r/run 1/hosts/root@n1:22"}
    assert control.read() is None                      # nothing more yet: the session waits
    import signal
    control.send(signal.SIGUSR2)
    assert control.read() == "SIGUSR2\n"
    control.close()
    assert control.read() == ""                        # its end: the remote command stops as at a Ctrl-C


def test_a_signal_passed_on_to_a_command_that_has_just_ended_is_dropped():
    """The launcher stops the other nodes as one of them ends by itself: Invoke's stdin thread then writes
    the signal's name to a closed channel, which must not become the host's result."""
    from runtime.cluster.ssh.session import fabric_config

    class Channel:
        def __init__(self, closed):
            self.closed, self.sent = closed, []

        def exit_status_ready(self):
            return self.closed

        def sendall(self, data):
            if self.closed:
                raise OSError("Socket is closed")
            self.sent.append(data)

    runner = fabric_config().runners.remote.__new__(fabric_config().runners.remote)
    runner.channel = Channel(closed=False)
    runner._write_proc_stdin(b"SIGTERM\n")
    assert runner.channel.sent == [b"SIGTERM\n"]
    runner.channel = Channel(closed=True)
    assert runner._write_proc_stdin(b"SIGTERM\n") is None


def test_node_overrides_win_over_every_configuration_level(monkeypatch, tmp_path):
    from runtime import settings as settings_mod
    from runtime.cluster import BadRuntime, Runtime

    class Holder:
        config = {"anvil": {"runs_dir": "/from/-f", "runtime": "slurm"}}
    monkeypatch.setenv("ANVIL_NODE_RUNS_DIR", str(tmp_path / "node"))
    monkeypatch.setenv("ANVIL_NODE_RUNTIME", "direct")
    loaded = settings_mod.load(Holder())
    assert (loaded.runs_dir, loaded.runtime) == (tmp_path / "node", Runtime("direct"))
    monkeypatch.setenv("ANVIL_NODE_RUNTIME", "nonsense")
    with pytest.raises(BadRuntime):
        settings_mod.load(Holder())


REMOTE_CHILD = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append("USR2"))
print("ready", os.environ["FANOUT_PROBE"], os.environ.get("ANVIL_LAUNCHER_PID") == str(os.getppid()), flush=True)
try:
    while True:
        time.sleep(0.05)
        if got:
            print("got", got.pop(), flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
    raise SystemExit(130)
"""


def _remote(*options, sigint_ignored=False):
    import signal
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "runtime.cluster.ssh.remote", *options, "--", sys.executable,
                             "-c", REMOTE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True,     # its own group, as sshd gives a session
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored
                            else None,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["plain", "started-with-sigint-ignored"])
def test_the_far_end_of_a_session_takes_its_environment_and_signals_over_stdin(sigint_ignored):
    """What inv writes to a session's stdin: the environment, then signals to pass on; its end (Ctrl-C
    in inv, inv gone, the connection dropped) is SIGINT, as a terminal's Ctrl-C. It reaches the command
    also where the far end itself started with SIGINT ignored (from a script, with `&`)."""
    proc = _remote("--launcher", sigint_ignored=sigint_ignored)
    proc.stdin.write(json.dumps({"FANOUT_PROBE": "from-inv"}) + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "ready from-inv True\n"     # the agent would end with this process
    proc.stdin.write("SIGUSR2\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "got USR2\n"
    proc.stdin.close()
    assert proc.wait(timeout=30) == 130 and proc.stdout.read() == "stopped\n"


def test_the_far_end_ends_a_command_past_its_timeout():
    import time

    proc = _remote("--timeout", "1")
    proc.stdin.write(json.dumps({"FANOUT_PROBE": "x"}) + "\n")
    proc.stdin.flush()
    started = time.monotonic()
    assert proc.stdout.readline() == "ready x False\n"
    assert proc.wait(timeout=30) == 124 and time.monotonic() - started < 15
    proc.stdin.close()


def test_task_argv_rebuilds_given_options_only():
    @task(iterable=["env", "set_"])
    def work(c, name="", count=1, verbose=False, hooks=True, env=None, json=False, set_=None, exclude_from="",
             dry_run=False):
        pass

    parser = Parser(contexts=Collection(work).to_contexts())
    contexts = parser.parse_argv(["work", "--name", "a b", "--verbose", "--no-hooks", "--env", "X=1",
                                  "--env", "Y=2", "--count", "3", "--set", "a.b=1", "--exclude-from", "runs/x",
                                  "--dry-run"])
    assert fanout.task_argv(contexts[0]) == ["work", "--name", "a b", "--count", "3", "--verbose",
                                             "--no-hooks", "--env", "X=1", "--env", "Y=2", "--set", "a.b=1",
                                             "--exclude-from", "runs/x", "--dry-run"]


def test_failed_host_detail_is_the_error_not_the_run_directory():
    from runtime.jobs.fanout import error_line

    stderr = ("WARNING: something harmless\n"
              "train.pretrain failed: the trainer exited with status 1\n"
              "run directory: runs/2026-11-22T10-00-00_train.pretrain\n")
    assert error_line(stderr, "train.pretrain") == "train.pretrain failed: the trainer exited with status 1"
    assert error_line("boom\n", "train.pretrain") == "boom"
    assert error_line("", "x") == ""


def test_ssh_errors_read_as_what_the_user_fixes():
    import socket

    from runtime.cluster.ssh.session import describe

    assert describe(socket.gaierror(-2, "Name or service not known")) == \
        "unreachable: no such host name (Name or service not known)"
    assert describe(TimeoutError("timed out")).startswith("unreachable: ")
    assert describe(ValueError("odd")) == "ValueError: odd"

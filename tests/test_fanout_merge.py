"""Fan-out merging and command building on synthetic per-host results (runtime/program/fanout.py).

Real SSH fan-out is tested in test_fanout_netns.py (namespace hosts) and
test_cli.py (unreachable host through the installed inv).
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from invoke import Collection, task
from invoke.parser import Parser

from runtime.cluster import results, ssh
from runtime.jobs import fanout
from runtime.cluster.results import HostResult
from runtime.cluster.ssh import FanoutOptions

REPO = Path(__file__).resolve().parents[1]


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
    with pytest.raises(ssh.FanoutError):
        ssh.parse_hosts("@", [])
    with pytest.raises(ssh.FanoutError):
        ssh.parse_hosts("n1,-oProxyCommand=x")
    assert fanout.slurm_name("root@node3:2222") == "node3" and fanout.slurm_name("[fe80::1]:22") == "fe80::1"


def test_remote_command_quotes_everything():
    options = FanoutOptions(remote_path="/shared/my repo", remote_inv=".venv/bin/inv", runtime_config="/x/a b.yaml")
    line = ssh.remote_command("n1", ["demo.hello", "--say", "$(rm -rf ~); echo", "--json"], options)
    assert line.startswith("cd '/shared/my repo' && ANVIL_HOST=n1 ")
    assert shlex.split(line.split("&& ", 1)[1]) == [
        "ANVIL_HOST=n1", "ANVIL_STOP_AT_EOF=1", ".venv/bin/inv", "-f", "/x/a b.yaml", "demo.hello", "--say",
        "$(rm -rf ~); echo", "--json"]
    # the host's own runs go under the fan-out's run; a shared `runtime: slurm` is for this machine
    line = ssh.remote_command("root@n1:22", ["x"], options, runs_dir="/r/run 1/hosts", runtime="direct")
    assert " ANVIL_NODE_RUNS_DIR='/r/run 1/hosts/root@n1:22' " in line     # an assignment, not a command name
    assert shlex.split(line.split("&& ", 1)[1])[:4] == [
        "ANVIL_HOST=root@n1:22", "ANVIL_STOP_AT_EOF=1", "ANVIL_NODE_RUNS_DIR=/r/run 1/hosts/root@n1:22",
        "ANVIL_NODE_RUNTIME=direct"]


def test_node_overrides_win_over_every_configuration_level(monkeypatch, tmp_path):
    from runtime import settings as settings_mod

    class Holder:
        config = {"anvil": {"runs_dir": "/from/-f", "runtime": "slurm"}}
    monkeypatch.setenv("ANVIL_NODE_RUNS_DIR", str(tmp_path / "node"))
    monkeypatch.setenv("ANVIL_NODE_RUNTIME", "direct")
    loaded = settings_mod.load(Holder())
    assert (loaded.runs_dir, loaded.runtime) == (tmp_path / "node", "direct")
    monkeypatch.setenv("ANVIL_NODE_RUNTIME", "nonsense")
    with pytest.raises(settings_mod.SettingsError):
        settings_mod.load(Holder())


def test_the_remote_inv_stops_as_at_a_ctrl_c_when_its_stdin_ends():
    """The far end of Ctrl-C under -H: stdin closed (by the fan-out, or a dropped connection) is SIGINT
    to the task's process group."""
    import subprocess
    import sys

    from runtime.cluster import remote_stop

    assert remote_stop.watch_stdin({}) is False
    code = ("import time\nfrom runtime.cluster import remote_stop\nassert remote_stop.watch_stdin()\n"
            "import os\nassert 'ANVIL_STOP_AT_EOF' not in os.environ\nprint('ready', flush=True)\n"
            "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('stopped', flush=True)\n"
            "    raise SystemExit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True,     # its own group, as sshd gives a session
                            env={**os.environ, "ANVIL_STOP_AT_EOF": "1", "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "ready\n"
    proc.stdin.close()
    assert proc.wait(timeout=30) == 130 and proc.stdout.read() == "stopped\n"


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

    from runtime.cluster.ssh import _describe

    assert _describe(socket.gaierror(-2, "Name or service not known")) == \
        "unreachable: no such host name (Name or service not known)"
    assert _describe(TimeoutError("timed out")).startswith("unreachable: ")
    assert _describe(ValueError("odd")) == "ValueError: odd"

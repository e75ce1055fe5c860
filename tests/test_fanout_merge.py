"""Fan-out merging and command building on synthetic per-host results (runtime/program/fanout.py).

Real SSH fan-out is tested in test_fanout_netns.py (namespace hosts) and
test_cli.py (unreachable host through the installed inv).
"""
from __future__ import annotations

import json
import shlex

import pytest
from invoke import Collection, task
from invoke.parser import Parser

from runtime.program import fanout, results, ssh
from runtime.program.results import HostResult
from runtime.program.ssh import FanoutOptions


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
        "ANVIL_HOST=n1", ".venv/bin/inv", "-f", "/x/a b.yaml", "demo.hello", "--say", "$(rm -rf ~); echo", "--json"]


def test_task_argv_rebuilds_given_options_only():
    @task(iterable=["env"])
    def work(c, name="", count=1, verbose=False, hooks=True, env=None, json=False):
        pass

    parser = Parser(contexts=Collection(work).to_contexts())
    contexts = parser.parse_argv(["work", "--name", "a b", "--verbose", "--no-hooks", "--env", "X=1",
                                  "--env", "Y=2", "--count", "3"])
    assert fanout.task_argv(contexts[0]) == ["work", "--name", "a b", "--count", "3", "--verbose",
                                             "--no-hooks", "--env", "X=1", "--env", "Y=2"]


def test_failed_host_detail_is_the_error_not_the_run_directory():
    from runtime.program.fanout import error_line

    stderr = ("WARNING: something harmless\n"
              "train.pretrain failed: the trainer exited with status 1\n"
              "run directory: runs/2026-11-22T10-00-00_train.pretrain\n")
    assert error_line(stderr, "train.pretrain") == "train.pretrain failed: the trainer exited with status 1"
    assert error_line("boom\n", "train.pretrain") == "boom"
    assert error_line("", "x") == ""


def test_ssh_errors_read_as_what_the_user_fixes():
    import socket

    from runtime.program.ssh import _describe

    assert _describe(socket.gaierror(-2, "Name or service not known")) == \
        "unreachable: no such host name (Name or service not known)"
    assert _describe(TimeoutError("timed out")).startswith("unreachable: ")
    assert _describe(ValueError("odd")) == "ValueError: odd"

"""Every exit tells the truth, through the installed inv: `inv` alone, Invoke's options that would do
nothing, -H '' and a port out of range, settings of the wrong type from -f / INVOKE_ANVIL_*, and YAML
that would expand without bound (runtime/program/cli.py, runtime/settings.py, cluster/ssh parse_hosts)."""
from __future__ import annotations

import json
import time

import pytest

from helpers.hostile import alias_bomb
from helpers.program import explain, inv, one_line_error, runs
from helpers.project import in_project


def test_inv_alone_lists_the_tasks(project):
    listed = in_project(project)
    assert listed.returncode == 0, explain(listed)
    assert "Available tasks" in listed.stdout and "demo.hello" in listed.stdout, explain(listed)
    assert "Core options" not in listed.stdout and "inv --help TASK" in listed.stdout


@pytest.mark.parametrize("flag", ["--dry", "-R", "-e", "--echo", "-p", "--hide=both", "-w", "-T", "--command-timeout",
                                  "--prompt-for-sudo-password"])
def test_invokes_options_that_would_do_nothing_are_refused_before_anything_runs(project, flag):
    args = [flag, "5", "demo.hello"] if flag in ("-T", "--command-timeout") else [flag, "demo.hello"]
    refused = in_project(project, *args)
    one_line_error(refused, "Invoke's option", "would do nothing")
    assert runs(project) == []
    helped = in_project(project, "--help")
    for hidden in ("--dry", "--echo", "--pty", "--hide", "--warn-only", "--command-timeout",
                   "--prompt-for-sudo-password"):
        assert hidden not in helped.stdout, helped.stdout
    assert "--list" in helped.stdout and "--hosts" in helped.stdout


def test_an_inert_option_after_the_task_name_is_refused_too(project):
    one_line_error(in_project(project, "demo.hello", "--dry"), "-R/--dry", "would do nothing")
    assert runs(project) == []


def test_an_empty_host_list_is_refused_not_run_here(project):
    for value in ("", " "):
        refused = in_project(project, "-H", value, "demo.checks")
        one_line_error(refused, "-H is empty")
    refused = in_project(project, "-H", ",", "demo.hello")
    one_line_error(refused, "no hosts given")
    assert runs(project) == []


@pytest.mark.parametrize("host, said", [("node1:99999", "'99999'"), ("u@node1:0", "'0'"), ("node1:ssh", "'ssh'"),
                                        ("node1:", "''")])
def test_a_port_ssh_cannot_use_is_refused(project, host, said):
    refused = in_project(project, "-H", host, "demo.checks")
    one_line_error(refused, host, "port must be a number from 1 to 65535", said)
    assert runs(project) == []


def test_a_host_with_a_control_character_is_refused(project):
    refused = in_project(project, "-H", "node1\x1b[2J", "demo.checks")
    one_line_error(refused, "not a host name")


SETTINGS_OF_THE_WRONG_TYPE = [
    ("hosts: {a: 1}", "anvil.hosts must be a comma-separated string or a list of names, got a mapping"),
    ("runs_dir: [x]", "anvil.runs_dir must be a string, got a list (['x'])"),
    ("runs_dir: {x: 1}", "anvil.runs_dir must be a string, got a mapping"),
    ("user: yes", "anvil.user must be a string, got true/false"),
    ("slurm_time: 2:00:00", "quote it"),
    ("slurm_extra: [--qos=high, 3]", "anvil.slurm_extra must be a string of options or a list of strings"),
    ("hook_timeout: soon", "anvil.hook_timeout must be a number of seconds, got 'soon'"),
    ("connect_timeout: [1]", "anvil.connect_timeout must be a number of seconds, got a list"),
    ("container_extra: \"--pull='never\"", "No closing quotation"),
]


@pytest.mark.parametrize("line, said", SETTINGS_OF_THE_WRONG_TYPE)
def test_f_settings_of_the_wrong_type_are_one_line(project, tmp_path, line, said):
    settings = tmp_path / "s.yaml"
    settings.write_text(f"anvil:\n  {line}\n")
    refused = in_project(project, "-f", str(settings), "demo.hello")
    one_line_error(refused, f"-f {settings}", said)
    assert runs(project) == [] and not any("[" in p.name for p in project.iterdir())


def test_a_project_setting_of_the_wrong_type_is_one_line(project):
    (project / "invoke.yaml").write_text("anvil:\n  runs_dir: [x]\n")
    one_line_error(in_project(project, "demo.hello"), "anvil.runs_dir must be a string")
    assert not any("[" in p.name for p in project.iterdir())


def test_a_number_setting_from_the_environment_that_is_a_word_is_one_line(project):
    refused = in_project(project, "demo.hello", env={"INVOKE_ANVIL_CONNECT_TIMEOUT": "abc"})
    one_line_error(refused, "INVOKE_ANVIL_CONNECT_TIMEOUT='abc'", "expected a whole number")
    bad_mode = in_project(project, "demo.hello", env={"INVOKE_ANVIL_SLURM_MODE": "sometimes"})
    one_line_error(bad_mode, "INVOKE_ANVIL_", "anvil.slurm_mode must be one of auto | srun | sbatch")
    assert runs(project) == []


def test_settings_of_the_right_type_still_work(project, tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text("anvil:\n  hosts: [n1, n2]\n  slurm_time: '2:00:00'\n  slurm_account: 1234\n"
                        "  slurm_extra: [--qos=high]\n  hook_timeout: 30\n")
    shown = in_project(project, "-f", str(settings), "demo.settings")
    assert shown.returncode == 0, explain(shown)
    got = json.loads(shown.stdout.strip().splitlines()[-1])
    assert (got["hosts"], got["slurm_time"], got["slurm_account"], got["slurm_extra"], got["hook_timeout"]) == \
        (["n1", "n2"], "2:00:00", "1234", ["--qos=high"], 30.0)


def test_an_alias_bomb_in_a_settings_file_is_refused_at_once(project, tmp_path):
    text = alias_bomb(8, 10)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(text)
    assert len(text) < 1024
    started = time.monotonic()
    refused = in_project(project, "-f", str(bomb), "demo.hello")
    one_line_error(refused, f"-f {bomb}", "an alias bomb")
    (project / "invoke.yaml").write_text(text)
    refused = in_project(project, "demo.hello")
    one_line_error(refused, "an alias bomb")
    assert time.monotonic() - started < 20
    assert runs(project) == []


def test_train_pretrain_hosts_given_empty_is_refused(tmp_path):
    for argv in (["--hosts", ""], ["--hosts", "  "]):
        refused = inv(tmp_path, "train.pretrain", "--set", "data.path=synthetic", *argv, "--dry-run")
        one_line_error(refused, "train.pretrain", "--hosts is empty")
    refused = inv(tmp_path, "-H", "", "train.pretrain", "--set", "data.path=synthetic")
    one_line_error(refused, "-H is empty")
    assert not (tmp_path / "runs").exists()

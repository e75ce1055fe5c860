"""Input that reaches a shell or a scheduler, through the installed inv: a value bound for job.sbatch, an
srun line, an SSH command or a container line is checked where that line is built (runtime/cluster/
values.py, used by slurm/srun.py, slurm/batch.py, ssh/session.py, container.py). A refusal is one line,
exit 2, before any run directory and before any Slurm command is asked anything."""
from __future__ import annotations

import json

import pytest

from helpers.program import inv, one_line_error, runs

TRAIN = ("train.pretrain", "--set", "data.path=synthetic", "--set", "train.steps=2")


@pytest.mark.parametrize("flag, value, said", [
    ("--partition", "gpu\necho pwned", "Slurm partition (--partition, anvil.slurm_partition) 'gpu\\necho pwned': "
                                       "has a control character (\\n)"),
    ("--partition", "gpu debug", "has whitespace; expected one word"),
    ("--partition", "--wrap=id", "starts with '-'"),
    ("--account", "acct\r\n#SBATCH --wrap=id", "Slurm account"),
    ("--time", "2h", "expected minutes, H:MM:SS or D-HH:MM:SS"),
    ("--time", "1:00:00\nid", "control character"),
])
@pytest.mark.parametrize("dry", [True, False])
def test_a_slurm_value_from_the_command_line_that_would_break_the_batch_script(tmp_path, flag, value, said, dry):
    proc = inv(tmp_path, *TRAIN, "--runtime", "slurm", flag, value, *(["--dry-run"] if dry else []))
    one_line_error(proc, "train.pretrain", said)
    assert "#SBATCH" not in proc.stdout and runs(tmp_path) == []


@pytest.mark.parametrize("variable, value, said", [
    ("INVOKE_ANVIL_SLURM_PARTITION", "gpu\necho pwned", "Slurm partition"),
    ("INVOKE_ANVIL_SLURM_ACCOUNT", "a b", "Slurm account"),
    ("INVOKE_ANVIL_SLURM_TIME", "soon", "Slurm time limit"),
    ("INVOKE_ANVIL_SLURM_EXTRA", "--qos high", "'high' is not an option"),
    ("INVOKE_ANVIL_SLURM_EXTRA", "--qos=high\nrm -rf ~", "'rm' is not an option"),
    ("INVOKE_ANVIL_SLURM_EXTRA", "'--comment=a\nb'", "control character"),
])
def test_a_slurm_value_from_the_settings(tmp_path, variable, value, said):
    proc = inv(tmp_path, *TRAIN, "--runtime", "slurm", "--dry-run", env={variable: value})
    one_line_error(proc, "train.pretrain", said)
    assert runs(tmp_path) == []


def test_slurm_extra_from_invoke_yaml_and_a_valid_line_still_written(tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text('anvil:\n  slurm_extra: "--qos=high\\necho pwned"\n')
    proc = inv(tmp_path, "-f", settings, *TRAIN, "--runtime", "slurm", "--dry-run")
    one_line_error(proc, "'echo' is not an option")
    settings.write_text('anvil:\n  slurm_extra: "--qos=high --constraint=h100"\n  slurm_time: "1-00:00:00"\n')
    ok = inv(tmp_path, "-f", settings, *TRAIN, "--runtime", "slurm", "--partition", "gpu", "--dry-run")
    assert ok.returncode == 0, ok.stderr[-3000:]
    directives = [line for line in ok.stdout.splitlines() if line.startswith("#SBATCH")]
    for wanted in ("--partition=gpu", "--time=1-00:00:00", "--qos=high", "--constraint=h100"):
        assert f"#SBATCH {wanted}" in directives, ok.stdout
    script = ok.stdout[ok.stdout.index("#!/bin/bash"):]
    body = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert body[0].startswith("cd "), body      # the first line bash runs is the script's own


def test_a_node_list_entry_that_would_be_a_directive_is_refused(tmp_path):
    preflight = tmp_path / "pre"
    (preflight / "nodes").mkdir(parents=True)
    (preflight / "nodes" / "fail.json").write_text(json.dumps({"node7\n#SBATCH --wrap=id": ["gpu: FAIL"]}))
    proc = inv(tmp_path, *TRAIN, "--runtime", "slurm", "--exclude-from", preflight, "--dry-run")
    one_line_error(proc, "Slurm node (--exclude, --exclude-from, a node list)", "control character")
    proc = inv(tmp_path, *TRAIN, "--runtime", "slurm", "--exclude", "-n7", "--dry-run")
    one_line_error(proc, "Slurm node", "starts with '-'")


def test_a_per_node_fan_out_refuses_before_asking_slurm(tmp_path):
    proc = inv(tmp_path, "preflight.host", "--runtime", "slurm", env={"INVOKE_ANVIL_SLURM_PARTITION": "a\nb",
                                                                        "PATH": "/usr/bin:/bin"})
    one_line_error(proc, "preflight.host", "Slurm partition", "control character")
    assert "scontrol" not in proc.stderr and runs(tmp_path) == []


@pytest.mark.parametrize("variable, value, said", [
    ("INVOKE_ANVIL_CONTAINER_IMAGE", "img --privileged", "container image (anvil.container_image)"),
    ("INVOKE_ANVIL_CONTAINER_IMAGE", "--privileged", "starts with '-'"),
    ("INVOKE_ANVIL_CONTAINER_PYTHON", "python3\nid", "control character"),
    ("INVOKE_ANVIL_CONTAINER_MOUNTS", "--privileged", "container mount"),
])
def test_a_container_value_that_would_change_the_container_line(tmp_path, variable, value, said):
    env = {"INVOKE_ANVIL_CONTAINER_ENGINE": "podman", "INVOKE_ANVIL_CONTAINER_IMAGE": "localhost/x:1", variable: value}
    proc = inv(tmp_path, *TRAIN, "--runtime", "container", "--dry-run", env=env)
    one_line_error(proc, "train.pretrain", said)


def test_an_ssh_line_with_a_control_character_is_refused_before_a_run(tmp_path):
    env = {"INVOKE_ANVIL_REMOTE_PATH": "/srv/anvil\nid"}
    fanned = inv(tmp_path, "-H", "n1.invalid,n2.invalid", "env.detect", env=env)
    one_line_error(fanned, "anvil.remote_path", "control character")
    trained = inv(tmp_path, "-H", "n1.invalid,n2.invalid", *TRAIN, "--dry-run", env=env)
    one_line_error(trained, "anvil.remote_path", "control character")
    assert runs(tmp_path) == []


def test_exclude_from_with_the_direct_runtime_says_it_is_ignored(tmp_path):
    preflight = tmp_path / "pre"
    from runtime.runs import nodes
    nodes.write(preflight, ["n1"], {"n7": ["gpu: FAIL"]})
    here = inv(tmp_path, *TRAIN, "--exclude-from", preflight, "--dry-run")
    assert here.returncode == 0, here.stderr[-3000:]
    notes = [line for line in here.stderr.splitlines() if line.startswith("note: ")]
    assert notes == ["note: --exclude-from ignored: runtime direct runs on this machine only (it leaves nodes "
                     "out of an ssh or slurm launch)"], here.stderr
    both = inv(tmp_path, *TRAIN, "--exclude-from", preflight, "--exclude", "n8", "--runtime", "container",
               "--dry-run", env={"INVOKE_ANVIL_CONTAINER_IMAGE": "localhost/x:1"})
    assert "note: --exclude-from and --exclude ignored: runtime container runs on this machine only" in both.stderr
    slurm = inv(tmp_path, *TRAIN, "--exclude-from", preflight, "--runtime", "slurm", "--dry-run")
    assert "ignored" not in slurm.stderr and "#SBATCH --exclude=n7" in slurm.stdout, slurm.stderr[-2000:]

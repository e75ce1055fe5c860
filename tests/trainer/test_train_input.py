"""train.pretrain's input through the installed `inv`, as a user types it: a config that is not a YAML
text, a directory, empty; inf and nan in float fields, a learning rate out of (0, 1]; options that cannot
work on this machine, said before anything starts; and input made to stall it does not (YAML that
expands or nests without bound is refused in one line, a value of megabytes is read). Each is one line
saying what was wrong and what is expected, exit 2, no traceback, no run directory.

Every command runs with its working directory in a fresh temporary folder.
"""
from __future__ import annotations

import json
import re

import pytest

from core import safe_yaml
from helpers.hostile import alias_bomb
from helpers.program import REPO, inv, one_line_error, runs


# ---------------------------------------------------------------- 1. a config that is not a YAML text
# (through inv for the main cases; the loader in-process for the variants: each inv train.pretrain
# costs seconds of imports before the config is read)

@pytest.mark.parametrize("content,where", [(b"name: x\n\xff\xfe junk\n", "invalid UTF-8 at byte 8"),
                                           (b"name: x\x00\n", "NUL byte at byte 7")])
def test_binary_config_is_refused(tmp_path, content, where):
    (tmp_path / "model.bin").write_bytes(content)
    proc = inv(tmp_path, "train.pretrain", "--config", "model.bin", timeout=120)
    line = one_line_error(proc, "train.pretrain: model.bin: not a text YAML file", where)
    assert line.endswith("; expected a YAML config such as configs/tiny.yaml")
    assert runs(tmp_path) == []


def test_binary_config_variants(tmp_path):
    from trainer.config import ConfigError, load

    (tmp_path / "all.bin").write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=r"all.bin: not a text YAML file \(NUL byte at byte 0\)"):
        load(tmp_path / "all.bin")
    (tmp_path / "late.bin").write_bytes(b"a: 1\n\xe9\x00")
    with pytest.raises(ConfigError, match=r"late.bin: not a text YAML file \(invalid UTF-8 at byte 5\)"):
        load(tmp_path / "late.bin")


def test_directory_as_config_is_refused(tmp_path):
    (tmp_path / "configs").mkdir()
    proc = inv(tmp_path, "train.pretrain", "--config", "configs", timeout=120)
    one_line_error(proc, "train.pretrain: configs: is a directory; expected a YAML config file")
    assert runs(tmp_path) == []


# ---------------------------------------------------------------- 2. an empty config

EMPTY = "config is empty; expected a mapping of sections (model:, data:, optim:, train:, ...)"


@pytest.mark.parametrize("text", ["", "# only a comment\n# and another\n"])
def test_empty_config_is_refused(tmp_path, text):
    (tmp_path / "empty.yaml").write_text(text)
    proc = inv(tmp_path, "train.pretrain", "--config", "empty.yaml", timeout=120)
    one_line_error(proc, f"train.pretrain: empty.yaml: {EMPTY}")
    assert runs(tmp_path) == []


@pytest.mark.parametrize("text", ["\n\n", "---\n", "   \n# x\n"])
def test_empty_config_variants(tmp_path, text):
    from trainer.config import ConfigError, load

    (tmp_path / "empty.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "empty.yaml")
    assert str(info.value) == f"{tmp_path / 'empty.yaml'}: {EMPTY}"


# ---------------------------------------------------------------- 3. inf / nan in float fields; the lr range

@pytest.mark.parametrize("item,key,got", [("optim.lr=.inf", "optim.lr", "inf"),
                                          ("optim.betas=[0.9, .nan]", "optim.betas[1]", "nan")])
def test_inf_and_nan_are_refused(tmp_path, item, key, got):
    proc = inv(tmp_path, "train.pretrain", "--set", item, timeout=120)
    one_line_error(proc, f"tiny.yaml with --set {item}: {key}: expected a finite number, got {got}")
    assert runs(tmp_path) == []


@pytest.mark.parametrize("item,key,got", [
    ("optim.lr=nan", "optim.lr", "'nan'"), ("optim.lr=1e999", "optim.lr", "'1e999'"),
    ("model.norm_eps=inf", "model.norm_eps", "'inf'"), ("optim.grad_clip=-.inf", "optim.grad_clip", "-inf"),
    ("schedule.min_lr_ratio=.nan", "schedule.min_lr_ratio", "nan"),
    ("model.rope_scaling={factor: .inf}", "model.rope_scaling.factor", "inf"),
    ("optim.betas=[.inf, 0.9]", "optim.betas[0]", "inf"),
])
def test_inf_and_nan_in_every_float_field(item, key, got):
    from trainer.config import ConfigError, load

    with pytest.raises(ConfigError, match=re.escape(f"tiny.yaml with --set {item}: {key}: expected a finite number, got {got}")):
        load(None, [item])


def test_learning_rate_must_be_in_zero_one(tmp_path):
    from trainer.config import ConfigError, load

    proc = inv(tmp_path, "train.pretrain", "--set", "optim.lr=2", timeout=120)
    one_line_error(proc, "tiny.yaml with --set optim.lr=2: optim.lr: expected a learning rate in (0, 1], e.g. 3e-4, "
                         "got 2.0")
    assert runs(tmp_path) == []
    for lr in ("0", "-1e-3", "1.0000001"):
        with pytest.raises(ConfigError, match=re.escape("optim.lr: expected a learning rate in (0, 1], e.g. 3e-4")):
            load(None, [f"optim.lr={lr}"])
    assert load(None, ["optim.lr=1"]).optim.lr == 1.0


# ---------------------------------------------------------------- 4. options checked before anything starts

def test_an_empty_config_option_and_a_missing_resume_are_exit_2(tmp_path):
    for argv, expected in ((["train.pretrain", "--config", ""], "--config is empty; expected a YAML config"),
                           (["train.pretrain", "--resume", str(tmp_path / "nosuch"), "--dry-run",
                             "--set", "data.path=synthetic"],
                            "no such file or directory")):
        proc = inv(tmp_path, *argv)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_kernels_on_a_cpu_and_a_warmup_longer_than_the_run_are_said_before_starting(tmp_path):
    no_gpu = inv(tmp_path, "train.pretrain", "--kernels", "--set", "data.path=synthetic",
                 env={"TRITON_INTERPRET": "0"})
    assert no_gpu.returncode == 2 and "--kernels needs a GPU (CUDA or ROCm)" in no_gpu.stderr, no_gpu.stderr
    fp8 = inv(tmp_path, "train.pretrain", "--set", "data.path=synthetic", "--set", "precision.fp8=tensorwise")
    assert fp8.returncode == 2 and fp8.stderr.strip() == ("train.pretrain: precision.fp8 needs a GPU with FP8 support "
                                                          "(sm_89+ / MI300+); this machine has none. Set "
                                                          "precision.fp8=off"), fp8.stderr   # not a failed rank
    assert not (tmp_path / "runs").exists()
    # Through Slurm the GPUs are the nodes', not this (login) machine's: nothing to refuse here.
    on_nodes = inv(tmp_path, "train.pretrain", "--kernels", "--set", "precision.fp8=tensorwise", "--runtime", "slurm",
                   "--dry-run", "--set", "data.path=synthetic", env={"TRITON_INTERPRET": "0"})
    assert on_nodes.returncode == 0 and "sbatch --parsable" in on_nodes.stdout, on_nodes.stderr
    warm = inv(tmp_path, "train.pretrain", "--dry-run", "--set", "data.path=synthetic", "--set", "train.steps=5",
               "--set", "schedule.warmup_steps=5")
    assert warm.returncode == 0, warm.stderr
    assert "WARNING: schedule.warmup_steps=5 >= train.steps=5: the learning rate never leaves warmup" in warm.stderr
    # Warnings go to stderr, so --json's stdout is the result alone.
    as_json = inv(tmp_path, "train.pretrain", "--json", "--set", "data.path=synthetic", "--set", "train.steps=2",
                  "--set", "schedule.warmup_steps=5", "--set", "train.val_batches=0")
    assert as_json.returncode == 0 and "never leaves warmup" in as_json.stderr, as_json.stderr[-2000:]
    assert json.loads(as_json.stdout)["steps"] == 2


# ---------------------------------------------------------------- 5. input made to stall it

def test_a_config_with_a_value_of_megabytes_starts(tmp_path):
    config = tmp_path / "big.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text() + f"\nname: {'n' * 10_000_000}\n")
    done = inv(tmp_path, "train.pretrain", "--config", config, "--set", "data.path=synthetic", "--dry-run",
               timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


def test_safe_yaml_refuses_an_alias_bomb_and_deep_nesting_but_reads_aliases():
    with pytest.raises(safe_yaml.YAMLTooLarge, match="aliases expand to more than 1,000,000 values"):
        safe_yaml.load(alias_bomb(9, 9))
    with pytest.raises(safe_yaml.YAMLTooLarge, match="nested too deeply"):
        safe_yaml.load("[" * 50_000 + "]" * 50_000)
    assert safe_yaml.load("base: &b {lr: 0.1}\nrun: *b\n") == {"base": {"lr": 0.1}, "run": {"lr": 0.1}}


@pytest.mark.parametrize("task", ["train.pretrain", "train.plan"])
def test_an_alias_bomb_config_is_one_line_and_nothing_runs(tmp_path, task):
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb(9, 9))
    line = one_line_error(inv(tmp_path, task, "--config", config, timeout=120), "bomb.yaml", "invalid YAML")
    assert "alias bomb" in line and not runs(tmp_path)

"""The resume hint a stopped training run prints continues it where it ran.

`inv -H a,b train.pretrain ...` or `inv train.pretrain --runtime slurm --nodes 2` stopped on a signal
said "continue with `inv train.pretrain --resume RUN` (same config)": typed as said, that trained on
this machine alone, with the default config. The hint is the command line as typed (hosts, SSH and
settings flags, runtime, nodes, config, overrides) with --resume RUN, and the runtime and node count the
run had where the settings chose them (runtime.runs.replay.resume_command). The launches themselves
are in test_train_signals (this machine), test_ssh_train (SSH hosts) and test_slurm_train (a Slurm allocation).
"""
from __future__ import annotations

import shlex

import pytest

from runtime.runs.replay import resume_command

RUN = "/work/runs/2026-12-07T10-00-00_train.pretrain_tiny"


def run_metadata(*argv: str, runtime: str = "direct", nodes: int = 1, task: str = "train.pretrain") -> dict:
    return {"task": task, "argv": ["/home/me/anvil/.venv/bin/inv", *argv], "runtime": runtime, "nodes": nodes}


@pytest.mark.parametrize("argv, runtime, nodes, said", [
    # -H and inv's SSH flags come before the task: kept, as the hosts were the run's input
    (["-f", "hosts.yaml", "-i", "/keys/id", "-H", "n1,n2", "train.pretrain", "--nproc", "2", "--set", "train.steps=9"],
     "ssh", 2, "inv -f hosts.yaml -i /keys/id -H n1,n2 train.pretrain --nproc 2 --set train.steps=9 --resume RUN"),
    # what chose where it ran, after the task: kept as typed; --resume auto gives way to the run
    (["train.pretrain", "--runtime", "slurm", "--nodes", "2", "--partition", "gpu", "--time", "02:00:00",
      "--resume", "auto", "--config", "configs/llama3_1b.yaml"], "slurm", 2,
     "inv train.pretrain --runtime slurm --nodes 2 --partition gpu --time 02:00:00 --config configs/llama3_1b.yaml "
     "--resume RUN"),
    (["train.pretrain", "--hosts=n1,n2", "--master", "n2", "--exclude", "n3", "--resume=old/run"], "ssh", 2,
     "inv train.pretrain --hosts=n1,n2 --master n2 --exclude n3 --resume RUN"),
    # the settings chose the runtime (anvil.runtime, INVOKE_ANVIL_RUNTIME): said, with a scheduler's nodes
    (["train.pretrain", "--set", "optim.lr=3e-4"], "slurm", 2,
     "inv train.pretrain --set optim.lr=3e-4 --resume RUN --runtime slurm --nodes 2"),
    (["train.pretrain"], "ssh+container", 2, "inv train.pretrain --resume RUN --runtime ssh+container"),
    # here, as the default has it: nothing added
    (["train.pretrain", "--set", "train.steps=50"], "direct", 1, "inv train.pretrain --set train.steps=50 --resume RUN"),
])
def test_the_resume_hint_is_the_command_as_typed_where_it_ran(argv, runtime, nodes, said):
    assert resume_command(run_metadata(*argv, runtime=runtime, nodes=nodes), RUN) == said.replace("RUN", RUN)


def test_the_resume_hint_quotes_what_the_shell_would_split():
    said = resume_command(run_metadata("train.pretrain", "--set", "data.path=my data"), "runs/a b")
    assert shlex.split(said) == ["inv", "train.pretrain", "--set", "data.path=my data", "--resume", "runs/a b"]


def test_profile_train_has_no_resume_of_its_own_and_is_continued_by_train_pretrain():
    said = resume_command(run_metadata("profile.train", "--steps", "3:6", task="profile.train"), RUN)
    assert said == f"inv train.pretrain --resume {RUN}"

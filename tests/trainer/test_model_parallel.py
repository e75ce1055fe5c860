"""Tensor and context parallelism on the CPU (gloo, real torchrun), with documents masked and positions
restarting in them: tp=2, cp=2 and data 2 x tp 2 give the one-process loss curve for 20 steps, a checkpoint
of data 2 x tp 2 resumes at cp 2 x tp 2 on the same curve, and layouts that cannot run are one line."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from core import names
from helpers.program import REPO
from helpers.training import same_curve, trainer_losses
from trainer.config import ConfigError, check_world, load

CONFIG = REPO / "configs" / "tiny.yaml"
SETS = ["data.seq_len=64", "data.position_reset=true", "train.steps=20", "train.log_interval=1",
        "train.val_batches=0", "schedule.warmup_steps=5", "checkpoint.save_final=false", "logging.progress=false"]
# The same sums in another order (reduce-scatters and gathers regroup them): 1e-4 relative, as expert
# parallelism's test; measured differences are below 1e-6 at these sizes
TOLERANCE = 1e-4


def train_tiny(run_dir: Path, data: Path, nproc: int, *sets: str, resume: str | None = None) -> dict[int, float]:
    return trainer_losses(CONFIG, run_dir, nproc, [f"data.path={data}", *SETS, *sets], resume)


def close_to(a: dict[int, float], b: dict[int, float]) -> bool:
    return same_curve(a, b, TOLERANCE)


@pytest.fixture(scope="module")
def one_process_curve(tmp_path_factory, short_documents):
    run = tmp_path_factory.mktemp("one") / "run"
    return train_tiny(run, short_documents, 1, "data.batch_size=8")


@pytest.mark.parametrize("layout", [["parallel.strategy=fsdp", "parallel.tp=2"], ["parallel.cp=2"]],
                         ids=["tp2", "cp2"])
def test_two_ranks_sharing_each_row_give_the_one_process_curve(one_process_curve, short_documents, tmp_path, layout):
    losses = train_tiny(tmp_path / "run", short_documents, 2, "data.batch_size=8", *layout)
    assert close_to(losses, one_process_curve), (losses, one_process_curve)
    assert losses[20] < losses[1] - 1.0


def test_data2_tp2_and_its_checkpoint_resumed_at_cp2_tp2(one_process_curve, short_documents, tmp_path):
    run = tmp_path / "dp2tp2"
    # two data ranks of 4 rows each: the global batch of the one process's 8
    losses = train_tiny(run, short_documents, 4, "data.batch_size=4", "parallel.strategy=fsdp", "parallel.tp=2",
                   "checkpoint.interval=10")
    assert close_to(losses, one_process_curve), (losses, one_process_curve)
    # the weights split over tp, sharded over data, now whole over tp and split over cp
    resumed = train_tiny(tmp_path / "cp2tp2", short_documents, 4, "data.batch_size=8", "parallel.strategy=fsdp",
                    "parallel.tp=2", "parallel.cp=2", resume=str(run / "checkpoints" / "step_10"))
    assert close_to(resumed, {s: one_process_curve[s] for s in range(11, 21)}), (resumed, one_process_curve)
    logs = "".join(p.read_text() for p in (tmp_path / "cp2tp2" / names.LOGS_DIR).glob("*.log"))
    assert "over data 1 x cp 2 x tp 2" in logs


@pytest.mark.parametrize("sets, world, says", [
    (["parallel.strategy=fsdp", "parallel.tp=4"], 4, "parallel.tp: expected a divisor of model.n_kv_heads (2)"),
    (["parallel.tp=2"], 2, "parallel.tp: expected 1 unless parallel.strategy is fsdp"),
    (["parallel.cp=2", "data.seq_len=66"], 2, "data.seq_len: expected a multiple of 4 (2 x parallel.cp x "
                                               "parallel.tp: each rank holds two chunks of every row)"),
    (["parallel.strategy=fsdp", "parallel.tp=2", "precision.fp8=tensorwise"], 2, "parallel.tp: expected 1 with "
                                                                                  "precision.fp8"),
    (["parallel.cp=4"], 2, "parallel.tp x parallel.cp: expected a divisor of the 2 process(es)"),
    (["parallel.strategy=fsdp", "parallel.tp=2", "parallel.async_tp=true"], 2,
     "parallel.async_tp: expected false unless parallel.tp is above 1 and train.compile is on"),
    (["parallel.cp=2", "parallel.tp=2", "parallel.strategy=fsdp"], 6,
     "parallel.tp x parallel.cp: expected a divisor of the 6 process(es)"),
])
def test_a_layout_that_cannot_run_says_why(sets, world, says):
    with pytest.raises(ConfigError) as err:
        check_world(load(CONFIG, sets), world)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_async_tp_on_a_machine_without_gpus_is_one_line(short_documents, tmp_path):
    import sys
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
            "--config", str(CONFIG), "--run-dir", str(tmp_path / "run")]
    for item in [f"data.path={short_documents}", "parallel.strategy=fsdp", "parallel.tp=2", "parallel.async_tp=true",
                 "train.compile=true", "train.device=cpu"]:
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", names.LOG_RANK: "0"})
    assert proc.returncode != 0
    assert "parallel.async_tp needs GPUs (symmetric memory over the tp group)" in proc.stderr
    assert "trainer/train.py\", line" not in proc.stderr   # the ranks' one line (torchrun adds its own report)


def test_a_layout_that_does_not_fit_the_processes_is_refused_before_launch(inv_bin, dataset, tmp_path):
    argv = [str(inv_bin), "train.pretrain", "--config", str(CONFIG), "--nproc", "2", "--dry-run",
            "--set", f"data.path={dataset}", "--set", "parallel.cp=4"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, names.setting_variable("runs_dir"): str(tmp_path / "runs")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "parallel.tp x parallel.cp: expected a divisor of the 2 process(es)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists(), proc.stderr

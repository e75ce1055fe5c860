"""DDP and FSDP2 with 2 gloo processes through real torchrun give the single-process losses:
rank r reads its half of the same global batch, gradients are averaged, so the curves match."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.program import REPO

STEPS = 4
DISTRIBUTED_RUN = ["data.seq_len=64", f"train.steps={STEPS}", "train.log_interval=1", "train.val_batches=2",
                   "train.val_interval=0", "schedule.warmup_steps=2", "checkpoint.save_final=false",
                   "checkpoint.interval=0", "logging.progress=false", "model.n_layers=2"]


def train_records(run_dir: Path, dataset: Path, nproc: int, *sets: str) -> dict:
    """Train on `nproc` processes (1: plain, else torchrun with gloo): its train losses, gradient norms and
    validation losses."""
    trainer = ["-m", "trainer", "--run-dir", str(run_dir)]
    for item in [f"data.path={dataset}", *DISTRIBUTED_RUN, *sets]:
        trainer += ["--set", item]
    if nproc == 1:
        argv = [sys.executable, *trainer]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", *trainer]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ANVIL_LOG_RANK": "0"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in lines if r["kind"] == "train"],
            "grad_norm": [r["grad_norm"] for r in lines if r["kind"] == "train"],
            "val": [r["val_loss"] for r in lines if r["kind"] == "val"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory, dataset):
    return train_records(tmp_path_factory.mktemp("single") / "run", dataset, 1, "data.batch_size=8")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gloo_ranks_match_one_process(tmp_path, dataset, single, strategy):
    two = train_records(tmp_path / strategy, dataset, 2, "data.batch_size=4", f"parallel.strategy={strategy}")
    assert len(two["loss"]) == len(single["loss"]) == STEPS
    assert two["loss"] == pytest.approx(single["loss"], rel=1e-4)
    assert two["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-3)
    assert two["val"] == pytest.approx(single["val"], rel=1e-4)
    assert single["loss"][-1] < single["loss"][0]  # it trained, not just ran
    logs = sorted(p.name for p in (tmp_path / strategy / "logs").iterdir())
    assert logs == ["rank0.log", "rank1.log"]
    assert f"{strategy}, compute torch.float32" in (tmp_path / strategy / "logs" / "rank1.log").read_text()

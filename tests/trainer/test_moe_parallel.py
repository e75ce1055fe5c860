"""Expert parallelism on the CPU (gloo, real torchrun): 2 processes at parallel.ep=2 give the losses of one
process holding every expert (each rank reads half of the same global batch), a checkpoint written at
ep=2 resumes at ep=1 and one written at ep=1 resumes at ep=2 on the same curve, and a router that sends
every token to one expert runs its all-to-all with one rank receiving nothing. Bad layouts are one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core import names, runfiles
from helpers.program import REPO
from helpers.training import SEED_CONFIG as CONFIG, same_curve, trainer_losses

SETS = ["data.seq_len=64", "train.steps=4", "train.log_interval=1", "train.val_batches=0",
        "schedule.warmup_steps=2", "checkpoint.save_final=false", "logging.progress=false",
        "model.moe.aux_loss_alpha=0.01"]
# Same losses up to the order of floating-point sums (the all-to-all regroups the rows)
TOLERANCE = 1e-4


def train_moe(run_dir: Path, dataset: Path, nproc: int, *sets: str, resume: str | None = None) -> dict[int, float]:
    return trainer_losses(CONFIG, run_dir, nproc, [f"data.path={dataset}", *SETS, *sets], resume)


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return same_curve(a, b, TOLERANCE)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, dataset):
    run = tmp_path_factory.mktemp("ep1") / "run"
    return run, train_moe(run, dataset, 1, "data.batch_size=8", "checkpoint.interval=2")


def test_two_processes_at_ep2_give_the_one_process_losses(one_process, dataset, tmp_path):
    _, single = one_process
    run = tmp_path / "ep2"
    losses = train_moe(run, dataset, 2, "data.batch_size=4", "parallel.ep=2", "checkpoint.interval=2")
    assert close(losses, single), (losses, single)
    assert losses[4] < losses[1]
    moe = [r for r in runfiles.metrics_records(run) if r["kind"] == "moe"]
    assert [r["step"] for r in moe] == [1, 2, 3, 4] and len(moe[0]["load"]) == 3   # the 3 MoE layers
    # every rank's tokens, every top-2 choice: 8 x 64 tokens x 2 a layer, over both ranks
    assert all(sum(row) == 8 * 64 * 2 for r in moe for row in r["load"])

    # A checkpoint of ep=2 resumes in one process, and one of one process at ep=2: the same curve.
    resumed = train_moe(tmp_path / "ep2to1", dataset, 1, "data.batch_size=8", resume=str(run / "checkpoints" / "step_2"))
    assert close(resumed, {3: single[3], 4: single[4]}), (resumed, single)
    first, _ = one_process
    back = train_moe(tmp_path / "ep1to2", dataset, 2, "data.batch_size=4", "parallel.ep=2",
                 resume=str(first / "checkpoints" / "step_2"))
    assert close(back, {3: single[3], 4: single[4]}), (back, single)


def test_latent_attention_and_experts_with_the_row_split_over_cp_give_the_one_process_losses(one_process, dataset,
                                                                                          tmp_path):
    # every rank holds half of each row: its keys and values gathered, its tokens routed on their own
    _, single = one_process
    losses = train_moe(tmp_path / "cp2", dataset, 2, "data.batch_size=8", "parallel.cp=2")
    assert close(losses, single), (losses, single)


WORKER = """
import json, sys, torch, torch.distributed as dist
from trainer import config, distributed
from trainer.models import Transformer, moe
cfg = config.load(sys.argv[1], ["model.moe.n_shared_experts=0", "parallel.ep=2", "parallel.strategy=fsdp"])
info = distributed.init(cfg)
torch.manual_seed(0)
model = Transformer(cfg.model)
def to_rank_0(logits, spec, bias):          # every token picks experts 0 and 1, both held by rank 0
    weights, _, scores = moe.route(logits, spec, bias)
    return weights, torch.tensor([0, 1]).expand(logits.shape[0], 2), scores
for _, layer in moe.moe_layers(model):
    layer.gate.route_fn = to_rank_0
distributed.wrap(model, cfg, info)
x = torch.randint(0, 300, (2, 32))
loss = model(x, x)
loss.backward()
load = moe.read_load(model, moe.collect_load(model).tolist())
if info.rank == 0:
    print(json.dumps({"loss": loss.item(), "load": load["load"]}))
distributed.shutdown(info)
"""


def test_a_router_sending_every_token_to_one_rank_runs(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(CONFIG)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loss"] == result["loss"]   # finite
    for row in result["load"]:                # 2 ranks x 64 tokens to each of experts 0 and 1, none elsewhere
        assert row[:2] == [128.0, 128.0] and not any(row[2:]), row


@pytest.mark.parametrize("sets, says", [
    (["parallel.ep=3"], "parallel.ep: expected a divisor of model.moe.n_routed_experts (8)"),
    (["parallel.ep=4"], "parallel.ep: expected a divisor of the 2 process(es)"),
    (["parallel.ep=2", "parallel.strategy=ddp"], "parallel.ep: expected 1 unless parallel.strategy is fsdp"),
    (["model.moe.top_k=9"], "model.moe.top_k: expected a number of experts from 1 to model.moe.n_routed_experts (8)"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor: expected null (dropless) or a positive number"),
    (["model.mla.kv_lora_rank=5000"], "model.mla.kv_lora_rank: expected a rank below the key/value heads' size"),
    (["model.family=llama"], "model.moe: expected null for model.family 'llama'"),
])
def test_a_layout_that_cannot_run_is_one_line_before_launch(inv_bin, dataset, tmp_path, sets, says):
    # (the test's own dataset: the world is checked after the data, which a fresh checkout has not prepared)
    argv = [str(inv_bin), "train.pretrain", "--config", str(CONFIG), "--nproc", "2", "--dry-run",
            "--set", f"data.path={dataset}"]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, names.setting_variable("runs_dir"): str(tmp_path / "runs")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "runs").exists()


def _inv(inv_bin, runs: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(inv_bin), *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL,
                          env={**os.environ, names.setting_variable("runs_dir"): str(runs), "OMP_NUM_THREADS": "1"})


def test_the_seed_scenario_trains_resumes_and_replays_on_the_cpu(inv_bin, dataset, tmp_path):
    """`inv train.pretrain --config configs/deepseek_v2_debug.yaml` as the seed's first step: the loss
    falls, checkpoints are written, a resume from the middle continues the same curve, and a replay of
    the run's snapshot trains it again to the same curve."""
    runs = tmp_path / "runs"
    sets = [f"data.path={dataset}", "data.seq_len=64", "data.batch_size=4", "train.steps=8", "train.log_interval=1",
            "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=2", "checkpoint.interval=4"]
    args = ["train.pretrain", "--config", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
    first = _inv(inv_bin, runs, *args, "--name", "first")
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = runs.glob("*_first")
    losses = {r["step"]: r["loss"] for r in runfiles.metrics_records(run) if r["kind"] == "train"}
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.5, losses
    assert {p.name for p in (run / "checkpoints").iterdir()} >= {"step_4", "step_8"}
    assert "experts' load" in first.stderr and runfiles.read_summary(run)["experts"]["most"]["share"] > 0

    resumed = _inv(inv_bin, runs, *args, "--name", "resumed", "--resume", str(run / "checkpoints" / "step_4"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (again,) = runs.glob("*_resumed")
    tail = {r["step"]: r["loss"] for r in runfiles.metrics_records(again) if r["kind"] == "train"}
    assert close(tail, {s: losses[s] for s in (5, 6, 7, 8)}), (tail, losses)

    replay = _inv(inv_bin, runs, "snapshot.replay", str(run))
    assert replay.returncode == 0, replay.stderr[-3000:]
    (replayed,) = [p for p in runs.iterdir() if p not in (run, again)]
    assert {r["step"]: r["loss"] for r in runfiles.metrics_records(replayed) if r["kind"] == "train"} == losses

"""A small training run for the multi-node tests (Slurm, SSH): the arguments that make it quick and
the same on any layout, and the losses it logged."""
from __future__ import annotations

import json
from pathlib import Path

SETS = ["data.seq_len=32", "data.batch_size=4", "train.steps=16", "train.log_interval=1",
        "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=2", "checkpoint.interval=0",
        "parallel.timeout_minutes=1"]


def train_args(dataset, *extra, steps=None) -> list[str]:
    """train.pretrain's arguments: SETS, the dataset, `steps` if given, one thread per rank, `extra`."""
    out = []
    for item in SETS + [f"data.path={dataset}"] + ([f"train.steps={steps}"] if steps else []):
        out += ["--set", item]
    return [*out, "--env", "OMP_NUM_THREADS=1", *extra]


def train_losses(run: Path) -> dict[int, float]:
    """{step: train loss} from a run's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and rec.get("kind", "train") == "train":
            out[int(rec["step"])] = float(rec["loss"])
    return out

"""Small training runs: the --set items that make them quick on a CPU, and the losses they logged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A model small enough to build and train in seconds on a CPU.
TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=160"]
# Nothing shown or kept but what the tests read: no progress bar, no TensorBoard, no GPU readings.
QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.gpu_stats=false"]
# The tiny model on 4 x 64 tokens a step, two warm-up steps, no validation and no checkpoint but the last.
TINY_RUN = [*TINY_MODEL, "data.seq_len=64", "data.batch_size=4", "train.val_batches=0", "checkpoint.interval=0",
            "schedule.warmup_steps=2", *QUIET]
# The multi-node runs (Slurm, SSH): quick, and the same on any layout; a rank that lost the others gives up
# within a minute.
MULTI_NODE_RUN = ["data.seq_len=32", "data.batch_size=4", "train.steps=16", "train.log_interval=1",
                  "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=2", "checkpoint.interval=0",
                  "parallel.timeout_minutes=1"]


#: The seed's model in miniature (DeepSeek-V2: latent attention, shared + routed experts).
SEED_CONFIG = REPO / "configs" / "deepseek_v2_debug.yaml"
#: ... split over 2 ranks by expert parallelism: what the multi-node tests train where they check the
#: experts' path.
MOE_ARGS = ["--config", str(SEED_CONFIG), "--set", "parallel.ep=2"]


def train_args(dataset, *extra, steps=None) -> list[str]:
    """train.pretrain's arguments: MULTI_NODE_RUN, the dataset, `steps` if given, one thread per rank, `extra`."""
    out = []
    for item in MULTI_NODE_RUN + [f"data.path={dataset}"] + ([f"train.steps={steps}"] if steps else []):
        out += ["--set", item]
    return [*out, "--env", "OMP_NUM_THREADS=1", *extra]


def train_losses(run: Path) -> dict[int, float]:
    """{step: train loss} from a run's metrics.jsonl; a step logged twice (before a kill and after the
    resume) keeps its last value, and a line cut short by a kill is left out."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec and rec.get("kind", "train") == "train":
            out[int(rec["step"])] = float(rec["loss"])
    return out


def last_step(run: Path) -> int:
    """The last training step `run` logged, 0 before its first (or before it has a metrics.jsonl)."""
    try:
        return max(train_losses(run), default=0)
    except FileNotFoundError:
        return 0


def records(run: Path, kind: str = "train") -> list[dict]:
    """A run's metrics.jsonl records of one kind, in order (a line cut short by a kill is left out)."""
    out = []
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind", "train") == kind:
            out.append(record)
    return out


def steps_after_restart(runs: Path, pattern: str, restarts: int) -> int:
    """The last step the run matching runs/`pattern` logged after its `restarts`-th in-job restart (0 before
    it, or before the run exists)."""
    found = sorted(Path(runs).glob(f"{pattern}/metrics.jsonl"))
    if not found:
        return 0
    seen, last = 0, 0
    for line in found[0].read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "restart":
            seen, last = seen + 1, 0
        elif record.get("kind", "train") == "train" and seen == restarts:
            last = max(last, int(record.get("step", 0)))
    return last


def assert_same_curve(losses: dict[int, float], reference: dict[int, float]) -> None:
    """The same steps, each loss within 1e-4 (relative) of the reference's: the same training, however laid out."""
    assert sorted(losses) == sorted(reference), (sorted(losses), sorted(reference))
    for step, loss in reference.items():
        assert abs(losses[step] - loss) < 1e-4 * max(1.0, abs(loss)), (step, losses[step], loss)


def trainer_losses(config: Path, run_dir: Path, nproc: int, sets: list[str], resume: str | None = None) -> dict[int, float]:
    """`python -m trainer` on `config` with `sets`, in one process or under torchrun with `nproc` (gloo, one
    thread each, rank 0's log); asserts it finished and returns its {step: train loss}."""
    from core import names
    trainer = ["-m", "trainer", "--config", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        trainer += ["--set", item]
    if resume:
        trainer += ["--resume", resume]
    argv = [sys.executable, *trainer] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *trainer]
    env = {**os.environ, "OMP_NUM_THREADS": "1", names.LOG_RANK: "0"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return train_losses(run_dir)


def same_curve(a: dict[int, float], b: dict[int, float], tolerance: float) -> bool:
    """The same steps, each loss within `tolerance` (relative) of the other's."""
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= tolerance * abs(b[s]) for s in a)

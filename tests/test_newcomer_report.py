"""`inv snapshot.report` as a newcomer reads it.

The resume mark sits at the checkpoint step a segment went on from (it sat at the first step the
resumed run logged, a log interval late): from the trainer's "resume" record, else the step_N its
--resume named (runs from before the record).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from core.files import seal
from runtime.runs import metrics

REPO = Path(__file__).resolve().parents[1]
INV = REPO / ".venv" / "bin" / "inv"


def train(step: int) -> dict:
    return {"kind": "train", "step": step, "time": 1.0e9 + step, "loss": 6.0 - step / 10, "tokens_per_s": 1000.0}


def write_run(path: Path, records: list[dict], resume: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps(seal({"task": "train.pretrain", "status": "ok", "resume": resume})))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_resumed_run_is_marked_at_its_checkpoint_step_not_a_log_interval_later(tmp_path):
    """Log interval 5, stopped at step 7 (a signal: its checkpoint is step_7, between two log lines);
    --resume RUN went on from step 7 and logged steps 10, 15, 20."""
    first = write_run(tmp_path / "a_train.pretrain_x", [train(5)])
    second = write_run(tmp_path / "b_train.pretrain_x",
                       [{"kind": "resume", "step": 7, "time": 0, "checkpoint": f"{first}/checkpoints/step_7"},
                        train(10), train(15), train(20)], resume=str(first))
    curves = metrics.read(second)
    assert curves.resumes == [7]
    assert sorted(curves.train) == [5, 10, 15, 20]


def test_the_resume_record_decides_where_the_earlier_segment_ends(tmp_path):
    """The earlier segment logged steps past the checkpoint the later one went on from (it was killed):
    those steps are not the curve's; the later segment's are."""
    first = write_run(tmp_path / "a_train.pretrain_x", [train(s) for s in (2, 4, 6, 8)])
    second = write_run(tmp_path / "b_train.pretrain_x",
                       [{"kind": "resume", "step": 5, "time": 0}, train(6), train(8), train(10)], resume=str(first))
    curves = metrics.read(second)
    assert curves.resumes == [5]
    assert sorted(curves.train) == [2, 4, 6, 8, 10]
    assert curves.train[6]["time"] == train(6)["time"] and curves.segments == [first, second]


def test_a_requeued_job_resuming_in_its_own_directory_is_marked_at_its_checkpoint(tmp_path):
    run = write_run(tmp_path / "a_train.pretrain_x",
                    [train(s) for s in (2, 4, 6, 8)] + [{"kind": "resume", "step": 6, "time": 0}]
                    + [train(s) for s in (8, 10)])
    assert metrics.read(run).resumes == [6]


def test_a_run_from_before_the_resume_record_is_marked_at_the_step_its_resume_named(tmp_path):
    first = write_run(tmp_path / "a_train.pretrain_x", [train(s) for s in (2, 4, 6)])
    second = write_run(tmp_path / "b_train.pretrain_x", [train(s) for s in (8, 10)],
                       resume=f"{first}/checkpoints/step_6")
    assert metrics.read(second).resumes == [6]


def test_a_real_run_resumed_from_its_directory_is_marked_where_the_trainer_went_on(tmp_path, dataset):
    """--resume RUN names no step: the trainer's resume record says it went on from step 7 (its last
    checkpoint), where the first step it logged is 10 (log interval 5)."""
    sets = [f"data.path={dataset}", "data.seq_len=32", "data.batch_size=2", "train.log_interval=5",
            "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=2", "checkpoint.interval=0"]
    env = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}

    def train(*args: str) -> Path:
        before = set((tmp_path / "runs").glob("*")) if (tmp_path / "runs").is_dir() else set()
        done = subprocess.run([str(INV), "train.pretrain", "--name", "mark", *args,
                               *[a for s in sets for a in ("--set", s)]], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (made,) = set((tmp_path / "runs").glob("*")) - before
        return made
    first = train("--set", "train.steps=7")
    second = train("--set", "train.steps=12", "--resume", str(first))
    records = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "resume" and records[0]["step"] == 7, records[0]
    assert records[0]["checkpoint"] == str(first / "checkpoints" / "step_7")
    curves = metrics.read(second)
    assert curves.resumes == [7] and sorted(curves.train) == [5, 7, 10, 12]   # the last step is logged too

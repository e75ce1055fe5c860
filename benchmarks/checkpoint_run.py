"""What the checkpoints of one training run cost it, read from its run directory; with --dd, beside
a dd-style write of the same bytes to the same disk.

    python -m benchmarks.checkpoint_run RUN_DIR [--every 100] [--dd] [--remove] [--out FILE]

For runs of any size and any number of ranks (benchmarks.checkpoint_bench measures one GPU in one
process; a two-GPU llama3_8b state is 96 GB, which only a real run holds). Per checkpoint, from its
meta.json: the pause (stall_s: training stopped to stage it), the write (save_s: from the save's
start to its commit, in the background when asynchronous) and its bytes (checksums.json). From
metrics.jsonl (log every step for a clean figure: --set train.log_interval=1): the step time
before the first save (the median after --warmup steps), the steps logged while a save was
writing, and the seconds those steps took beyond that pace; the seconds a save adds, over --every
steps at that pace, is the overhead of saving every --every steps.

--remove deletes the run's checkpoints once read (a 96 GB state and a dd of the same size do not
both fit a 128 GiB disk); --dd then writes that many bytes beside them (64 MiB blocks, one
fdatasync: dd bs=64M conv=fdatasync) and gives the saves' GB/s as a share of it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from core import names, runfiles
from benchmarks.checkpoint_bench import checkpoint_bytes, disk, rate
from trainer.checkpoint import list_checkpoints, read_meta


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="the run directory (runs/<time>_train.pretrain_<name>)")
    p.add_argument("--every", type=int, default=100, help="steps between saves, for the projected overhead")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the pace (compilation, staging)")
    p.add_argument("--dd", action="store_true", help="also time a dd-style write of the checkpoint's size")
    p.add_argument("--remove", action="store_true", help="delete the run's checkpoints once read")
    p.add_argument("--out", default="", help="also write the JSON here")
    return p.parse_args(argv)


def train_records(run: Path) -> list[dict]:
    if not (run / names.METRICS).is_file():
        raise SystemExit(f"{run}: no metrics.jsonl (not a training run directory?)")
    return [r for r in runfiles.metrics_records(run) if r.get("kind") == "train" and r.get("step_time_s")]


def saves(run: Path) -> list[dict]:
    """The run's committed checkpoints, oldest first."""
    found = []
    for path in list_checkpoints(run / names.CHECKPOINTS_DIR):
        meta = read_meta(path)
        nbytes = checkpoint_bytes(path)
        found.append({"path": str(path), "step": meta["step"], "async": meta.get("async"), "bytes": nbytes,
                      "start": meta["time"], "stall_s": meta.get("stall_s"), "write_s": meta["save_s"],
                      "gb_per_s": rate(nbytes, meta["save_s"])})
    return found


def cost(records: list[dict], save: dict, pace: float) -> dict:
    """The steps logged while `save` was writing (each record covers the steps since the one before
    it), and what they took beyond `pace`. The pause itself is not in them: the loop restarts its
    step clock after a save. Also says whether training went on until the write committed."""
    end = save["start"] + save["write_s"]
    steps, seconds = 0, 0.0
    for previous, record in zip(records, records[1:]):
        if record["step"] > save["step"] and previous["time"] < end:
            span = record["step"] - previous["step"]
            steps += span
            seconds += span * record["step_time_s"]
    return {"steps_while_writing": steps, "their_s": round(seconds, 3),
            "added_s": round(seconds - steps * pace, 3),
            "trained_past_commit": bool(records) and records[-1]["time"] >= end}


def summarise(run: Path, every: int, warmup: int) -> dict:
    records, found = train_records(run), saves(run)
    if not found:
        raise SystemExit(f"{run}: no committed checkpoint (checkpoints/step_*/COMPLETE)")
    first = found[0]["step"]
    before = [r["step_time_s"] for r in records if warmup < r["step"] <= first]
    if not before:
        raise SystemExit(f"{run}: no logged step between step {warmup} and the first save at {first}")
    pace = statistics.median(before)
    rows = []
    for save in found:
        row = {**save, **cost(records, save, pace)}
        # A save costs its pause plus what the steps beside its write lost.
        row["overhead"] = round((row["added_s"] + (row["stall_s"] or 0)) / (every * pace), 4)
        rows.append(row)
    return {"run": str(run), "step_s": round(pace, 4), "steps_in_pace": len(before), "every": every,
            "saves": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Path(args.run)
    result = summarise(run, args.every, args.warmup)
    if args.remove:
        shutil.rmtree(run / names.CHECKPOINTS_DIR, ignore_errors=True)
    if args.dd:
        nbytes = result["saves"][-1]["bytes"]
        result["disk"] = disk(run, nbytes)
        for row in result["saves"]:
            row["of_disk"] = round(row["gb_per_s"] / result["disk"]["gb_per_s"], 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

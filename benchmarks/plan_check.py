"""Check `inv train.plan` against a GPU: real training steps, measured peak memory next to the plan.

    python -m benchmarks.plan_check [--config configs/llama3_1b.yaml] [--batch 4] [--seq 4096]
        [--ac none,selective,selective_lean,full] [--fp8 off,tensorwise,rowwise] [--nproc 1] [--steps 4]
        [--set KEY=VALUE]... [--kernels] [--compile] [--out DIR] [--timeout 600]

For each FP8 recipe (precision.fp8) and activation-checkpointing mode, a fresh process runs the real trainer
(`python -m trainer`, or torch.distributed.run with --nproc > 1) on synthetic tokens for
--steps steps with log interval 1, and its metrics.jsonl gives the peak of
torch.cuda.max_memory_allocated and max_memory_reserved over the steps (rank 0). The plan is
trainer.plan for the same config, overrides and GPU count, on this GPU (torch's name and total
memory). Printed: one JSON object with a row per mode: measured allocated and reserved, the
planned peak allocated (over the training moments: model building is not measured), planned
reserved (with the fragmentation reserve), the moment of the peak, the error, and whether the
plan said it fits and the run went out of memory.

Like `inv train.pretrain` on CUDA (envs/profiles/cuda.py), the runs get
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the environment sets an allocator
configuration already. Without a GPU it prints the plan's figures, says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core import checkout, names, runfiles

REPO = checkout.ROOT
GIB = 1024 ** 3
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_check", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / names.CONFIGS_DIR / "llama3_1b.yaml"))
    p.add_argument("--batch", type=int, default=None, help="data.batch_size (default: the config's)")
    p.add_argument("--seq", type=int, default=None, help="data.seq_len (default: the config's)")
    p.add_argument("--ac", default="", help="checkpointing modes to run, comma-separated "
                                            "(none,selective,selective_lean,full; default: the config's)")
    p.add_argument("--fp8", default="", help="precision.fp8 recipes to run, comma-separated "
                                             "(off,tensorwise,rowwise; default: the config's)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (processes) on this node")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable)")
    p.add_argument("--kernels", action="store_true", help="the fused Triton kernels (train.kernels)")
    p.add_argument("--compile", action="store_true", help="torch.compile (train.compile)")
    p.add_argument("--out", default="", help="directory for the run directories and plan_check.log")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    return p.parse_args(argv)


def overrides(args) -> list[str]:
    sets = list(args.sets)
    if args.batch is not None:
        sets.append(f"data.batch_size={args.batch}")
    if args.seq is not None:
        sets.append(f"data.seq_len={args.seq}")
    if args.kernels:
        sets.append("train.kernels=true")
    if args.compile:
        sets.append("train.compile=true")
    return sets


def run_sets(args, mode: str, fp8: str = "") -> list[str]:
    """What the training run gets on top of overrides(): synthetic data, every step logged, no I/O."""
    return overrides(args) + ([f"precision.fp8={fp8}"] if fp8 else []) + [
        "data.path=synthetic", f"train.activation_checkpoint={mode}", f"train.steps={args.steps}",
        "train.log_interval=1", "train.val_batches=0", "checkpoint.interval=0", "checkpoint.save_final=false",
        "logging.progress=false", "logging.tensorboard=false"]


def this_device():
    """trainer.plan.Device of GPU 0 as torch sees it; None without a GPU."""
    import torch

    from trainer.plan import Device

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    hip = bool(torch.version.hip)
    alloc = next((os.environ[v] for v in ALLOC_VARS if os.environ.get(v)), "expandable_segments:True")
    return Device(props.name, round(props.total_memory / GIB, 2), "amd" if hip else "nvidia",
                  "expandable_segments:true" in alloc.replace(" ", "").lower(), "torch.cuda")


def planned(cfg, nproc: int, device, mode: str) -> dict:
    from trainer.plan import GIB as PGIB
    from trainer.plan import Device, memory

    mem = memory(cfg, nproc, device or Device(), mode=mode)
    training = [mo for mo in mem.moments if mo.key != "init"]
    peak = max(training, key=lambda mo: mo.bytes)
    frag = (device or Device()).fragmentation
    return {"plan_peak_allocated_gib": round(peak.bytes / PGIB, 3), "plan_peak_moment": peak.key,
            "plan_reserved_gib": round(peak.bytes * (1 + frag) / PGIB, 3),
            "plan_needed_gib": round(mem.needed_bytes(nproc) / PGIB, 3),
            "plan_fits": mem.fits(nproc)}


def measure(args, mode: str, fp8: str, out: Path, env: dict) -> dict:
    run_dir = out / (f"run_{mode}_fp8_{fp8}" if fp8 else f"run_{mode}")
    trainer = ["-m", "trainer", "--config", args.config, "--run-dir", str(run_dir)]
    for item in run_sets(args, mode, fp8):
        trainer += ["--set", item]
    if args.nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.nproc}"] + trainer
    else:
        argv = [sys.executable] + trainer
    log_path = out / "plan_check.log"
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n===== {mode}{' fp8 ' + fp8 if fp8 else ''}: {' '.join(argv)}\n")
        log.flush()
        start = log.tell()
        try:
            code = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    text = log_path.read_text(encoding="utf-8", errors="replace")[start:]
    records = runfiles.metrics_records(run_dir) if (run_dir / names.METRICS).is_file() else []
    train = [r for r in records if r.get("kind") == "train"]
    alloc = [r["gpu_mem_gib"] for r in train if r.get("gpu_mem_gib") is not None]
    reserved = [r["gpu_mem_reserved_gib"] for r in train if r.get("gpu_mem_reserved_gib") is not None]
    return {"exit_code": code, "oom": "out of memory" in text.lower(), "steps_measured": len(alloc),
            "max_allocated_gib": round(max(alloc), 3) if alloc else None,
            "max_reserved_gib": round(max(reserved), 3) if reserved else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from trainer.config import ConfigError, load

    try:
        cfg = load(args.config, overrides(args))
        modes = [m.strip() for m in (args.ac or cfg.train.activation_checkpoint).split(",") if m.strip()]
        recipes = [r.strip() for r in args.fp8.split(",") if r.strip()] or [""]
        configs = {(fp8, mode): load(args.config, run_sets(args, mode, fp8)) for fp8 in recipes for mode in modes}
    except ConfigError as exc:
        print(f"plan_check: {exc}", file=sys.stderr)
        return 2
    if args.nproc <= 0 or args.steps <= 0:
        print("plan_check: --nproc and --steps: expected positive integers", file=sys.stderr)
        return 2
    device = this_device()
    report = {"config": args.config, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
              "nproc": args.nproc, "steps": args.steps, "kernels": cfg.train.kernels,
              "compile": cfg.train.compile, "params": cfg.precision.params,
              "device": device.name if device else None,
              "device_memory_gib": device.memory_gib if device else None,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "runs": []}
    if device is None:
        report["runs"] = [{"ac": mode, "fp8": cfg.precision.fp8, **planned(cfg, args.nproc, None, mode)}
                          for (_, mode), cfg in configs.items()]
        report["error"] = f"no GPU visible to torch ({torch.__version__}): nothing measured"
        print(json.dumps(report, indent=2))
        print(f"plan_check: {report['error']}; run it on a GPU machine", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < args.nproc:
        print(f"plan_check: --nproc {args.nproc} but {torch.cuda.device_count()} GPU(s) visible", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="plan_check_"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if not torch.version.hip and not any(env.get(v) for v in ALLOC_VARS):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    report["alloc_conf"] = next((f"{v}={env[v]}" for v in ALLOC_VARS if env.get(v)), None)
    report["out"] = str(out)
    for (fp8, mode), run_cfg in configs.items():
        row = {"ac": mode, "fp8": run_cfg.precision.fp8, **planned(run_cfg, args.nproc, device, mode)}
        row.update(measure(args, mode, fp8, out, env))
        if row["max_allocated_gib"]:
            row["error_allocated_pct"] = round(100 * (row["plan_peak_allocated_gib"] / row["max_allocated_gib"] - 1), 1)
        if row["max_reserved_gib"]:
            row["error_reserved_pct"] = round(100 * (row["plan_reserved_gib"] / row["max_reserved_gib"] - 1), 1)
        report["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    (out / "plan_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if all(r["exit_code"] == 0 or (r["oom"] and r["plan_fits"] is False)
                    for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Predicted against measured tokens/s: the speed prediction's check (the table in BENCHMARKS.md).

    python -m benchmarks.speed_check OUT [--peak-tflops 989] [--json]

OUT is what benchmarks/speed_gpu.sh brought back: rates_<case>.json (benchmarks.rates at the case's
shapes) and <case>_<mode>.json (benchmarks.train_throughput's results). Each measured variant's config
is rebuilt from the same overrides the benchmark gave the trainer (train_throughput.anvil_argv) and
predicted by trainer.speed with that case's rates; the ratio is predicted / measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def variant_config(results: dict, variant: str):
    """The TrainConfig the benchmark ran for `variant` (its --set list and flags, read back from its argv)."""
    from benchmarks.train_throughput import anvil_argv
    from trainer import flags
    from trainer.hf import load_config

    args = SimpleNamespace(batch=results["batch"], seq=results["seq"], steps=12, profile_steps=0,
                           sets=results.get("sets") or [], config=results["config"], nproc=results.get("nproc", 1))
    argv = anvil_argv(args, variant, Path("run"))
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    config = Path(results["config"])
    config = str(config if config.is_file() else Path("configs") / config.name)
    return load_config(config, flags.overrides(sets, compile="--compile" in argv, kernels="--kernels" in argv))


def check(out: Path, peak_tflops: float) -> list[dict]:
    from trainer import speed

    rows = []
    for path in sorted(out.glob("*.json")):
        if path.name.startswith("rates_"):
            continue
        case = path.stem.rsplit("_", 1)[0]
        rates_path = out / f"rates_{case}.json"
        if not rates_path.is_file():
            continue
        rates = speed.Rates.from_dict({**json.loads(rates_path.read_text()), "gpu": "measured", "measured": True,
                                       "source": rates_path.name, "peak_tflops": peak_tflops})
        results = json.loads(path.read_text())
        for r in results["results"]:
            if r.get("error") or not r.get("tokens_per_s_per_gpu", r.get("tokens_per_s")):
                continue
            cfg = variant_config(results, r["variant"])
            p = speed.predict(cfg, rates, gpus=results.get("nproc", 1))
            measured = r.get("tokens_per_s_per_gpu") or r["tokens_per_s"]
            rows.append({"case": case, "mode": cfg.train.activation_checkpoint, "variant": r["variant"],
                         "precision": "fp8" if cfg.precision.fp8 != "off" else "bf16",
                         "measured": measured, "predicted": p.tokens_per_s_per_gpu,
                         "ratio": p.tokens_per_s_per_gpu / measured,
                         "parts_ms": {k: round(v * 1e3, 2) for k, v in p.parts.items()},
                         "measured_step_ms": round(r.get("step_time_s", 0) * 1e3, 2)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed_check", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = check(Path(args.out), args.peak_tflops)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from tabulate import tabulate
    print(tabulate([[r["case"], r["precision"], r["mode"], f"{r['measured']:,.0f}", f"{r['predicted']:,.0f}",
                     f"{r['ratio']:.3f}"] for r in rows],
                   headers=["case", "precision", "checkpointing", "measured tokens/s", "predicted", "predicted / measured"]))
    worst = max((abs(r["ratio"] - 1) for r in rows), default=0)
    print(f"\nlargest miss: {worst:.1%} over {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

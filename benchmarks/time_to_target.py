"""The README's time-to-target table: predicted days to train a token target, per config, GPU count and
GPU model, each cell one `inv train.plan --json` (measured figures where Anvil has them, else the model's
datasheet at its node-screen floors; the table says which).

    python -m benchmarks.time_to_target [--tokens 1T] [--configs llama3_8b,llama3_70b] [--gpus 64,512]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("A100", "H100", "H200", "B200", "MI250X", "MI300X", "MI325X", "MI355X")


def cell(config: str, gpu: str, gpus: int, tokens: str) -> dict:
    inv = Path(sys.executable).with_name("inv")
    done = subprocess.run([str(inv), "train.plan", "--config", str(REPO / "configs" / f"{config}.yaml"), "--gpu", gpu,
                           "--gpus", str(gpus), "--tokens", tokens, "--json"], capture_output=True, text=True,
                          cwd=REPO)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_target", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1T")
    p.add_argument("--configs", default="llama3_8b,llama3_70b")
    p.add_argument("--gpus", default="64,512")
    args = p.parse_args(argv)
    counts = [int(g) for g in args.gpus.split(",")]
    print(f"| config | GPU | " + " | ".join(f"{n} GPUs: days to {args.tokens} (tokens/s/GPU, MFU)" for n in counts)
          + " | figures |")
    print("|---|---|" + "---|" * len(counts) + "---|")
    for config in args.configs.split(","):
        for gpu in MODELS:
            cells, source = [], ""
            for n in counts:
                plan = cell(config, gpu, n, args.tokens)
                pred = plan["prediction"]
                fits = "" if plan["fits"] else " (does not fit)"
                cells.append(f"{pred['time_to_tokens_s'] / 86400:,.1f} ({pred['tokens_per_s_per_gpu']:,.0f}, "
                             f"{pred['mfu']:.0%}){fits}")
                source = "measured" if pred["measured_rates"] else "datasheet"
            print(f"| {config} | {gpu} | " + " | ".join(cells) + f" | {source} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

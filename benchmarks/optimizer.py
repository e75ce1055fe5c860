"""AdamW step time: torch's fused AdamW against Anvil's TritonAdamW, on one GPU's share of a model.

    python -m benchmarks.optimizer [--config configs/llama3_8b.yaml] [--shards 2] [--dtype fp32]
        [--iters 10] [--json]

The parameters are the model's own shapes (trainer.model on the meta device), each cut to its
dim-0 shard of --shards ranks as FSDP2 holds them, with gradients, in --dtype. Each optimizer
runs --iters steps after 2 warm-up steps, with the clip factor handed in the way the trainer
does it (torch: a foreach multiply over the gradients when they are DTensors, which FSDP2's
are; here plain tensors, so both rows also show the grad_scale path). Printed: ms per step and
the bandwidth the step moves (read p, g, m, v; write p, m, v) against the time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shard_shapes(config: str, shards: int) -> list[tuple[int, ...]]:
    import torch

    from trainer.config import load
    from trainer.model import Transformer
    with torch.device("meta"):
        model = Transformer(load(config).model)
    return [(-(-p.shape[0] // shards), *p.shape[1:]) for p in model.parameters()]


def time_steps(opt, iters: int, grad_scale=None) -> float:
    """Seconds per step; grad_scale goes where clip_grad_norm puts it (both optimizers read it)."""
    import torch
    opt.grad_scale = grad_scale
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "llama3_8b.yaml"))
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from trainer.optim import TritonAdamW
    if not torch.cuda.is_available():
        print("benchmarks.optimizer: needs a GPU", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    shapes = shard_shapes(args.config, args.shards)
    n = sum(torch.Size(s).numel() for s in shapes)
    traffic = n * (4 * dtype.itemsize + 3 * dtype.itemsize)
    rows = []
    scale = torch.tensor(1.5, device="cuda")
    makers = (("torch fused AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
              ("TritonAdamW", lambda ps: TritonAdamW(ps, lr=1e-4)))
    for (label, make), scaled in ((m, scaled) for m in makers for scaled in (False, True)):
        name = label + (", grad_scale" if scaled else "")
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in shapes]
        for q in params:
            q.grad = torch.randn_like(q) * 1e-3
        opt = make(params)
        seconds = time_steps(opt, args.iters, scale if scaled else None)
        rows.append({"optimizer": name, "ms": round(seconds * 1e3, 2),
                     "tb_per_s": round(traffic / seconds / 1e12, 2)})
        del opt, params
        torch.cuda.empty_cache()
    report = {"config": args.config, "shards": args.shards, "dtype": args.dtype, "parameters": n,
              "gb_moved": round(traffic / 1e9, 1), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['device']}, torch {report['torch']}: {n:,} {args.dtype} parameters "
              f"({args.shards} shards of {Path(args.config).name}), {report['gb_moved']} GB a step")
        for r in rows:
            print(f"  {r['optimizer']:32s} {r['ms']:8.2f} ms  {r['tb_per_s']:5.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

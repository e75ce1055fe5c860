"""AdamW step time: torch's fused AdamW against Anvil's TritonAdamW, on one GPU's share of a model.

    python -m benchmarks.optimizer [--config configs/llama3_8b.yaml] [--shards 2] [--dtype fp32]
        [--iters 10] [--dtensor | --float8] [--json]

The parameters are the model's own shapes (trainer.models on the meta device), each cut to its
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

from core import checkout


REPO = checkout.ROOT


def shard_shapes(config: str, shards: int) -> list[tuple[int, ...]]:
    import torch

    from trainer.config import load
    from trainer.models import Transformer
    with torch.device("meta"):
        model = Transformer(load(config).model)
    return [(-(-p.shape[0] // shards), *p.shape[1:]) for p in model.parameters()]


def time_steps(opt, iters: int, grad_scale=None) -> tuple[float, float]:
    """(GPU, host) seconds per step: to the end of the work, and to the return of step(), which is what
    the host spends launching it (over the GPU's time, the GPU waits for the host). grad_scale goes
    where clip_grad_norm puts it (both optimizers read it)."""
    import torch
    opt.grad_scale = grad_scale
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    host = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        opt.step()
        host += time.perf_counter() - t0
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters, host / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "llama3_8b.yaml"))
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtensor", action="store_true",
                   help="parameters as DTensors on a one-GPU mesh, the way FSDP2 hands them to the optimizer")
    p.add_argument("--float8", action="store_true",
                   help="--dtensor, each shard in torchao's float8 all-gather weight with its precomputed scale, "
                        "as FSDP2 with precision.fp8=tensorwise hands them over (TritonAdamW only)")
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
    wrap = _dtensor_wrapper(args.float8) if args.dtensor or args.float8 else (lambda t: t)
    for (label, make), scaled in ((m, scaled) for m in makers for scaled in (False, True)):
        if label.startswith("torch") and (args.float8 or (args.dtensor and scaled)):
            continue    # torch's fused AdamW takes no grad_scale with DTensors (the trainer multiplies instead)
        name = label + (", grad_scale" if scaled else "")
        params = [torch.nn.Parameter(wrap(torch.randn(s, device="cuda", dtype=dtype) * 0.02)) for s in shapes]
        for q in params:
            q.grad = torch.randn_like(q) * 1e-3
        opt = make(params)
        seconds, host = time_steps(opt, args.iters, scale if scaled else None)
        rows.append({"optimizer": name, "ms": round(seconds * 1e3, 2), "host_ms": round(host * 1e3, 2),
                     "tb_per_s": round(traffic / seconds / 1e12, 2)})
        del opt, params
        torch.cuda.empty_cache()
    report = {"config": args.config, "shards": args.shards, "dtype": args.dtype, "dtensor": args.dtensor,
              "float8": args.float8,
              "tensors": len(shapes), "parameters": n,
              "gb_moved": round(traffic / 1e9, 1), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['device']}, torch {report['torch']}: {n:,} {args.dtype} parameters "
              f"({args.shards} shards of {Path(args.config).name}{', float8 DTensors' if args.float8 else ', DTensors' if args.dtensor else ''}), "
              f"{report['gb_moved']} GB a step")
        for r in rows:
            print(f"  {r['optimizer']:32s} {r['ms']:8.2f} ms  {r['tb_per_s']:5.2f} TB/s  host {r['host_ms']:6.2f} ms")
    return 0


def _dtensor_wrapper(float8: bool = False):
    """t -> a DTensor of t on a one-GPU mesh (a process group of one); float8: t inside torchao's float8
    all-gather weight first."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    if not float8:
        return lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
    import torch
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def wrap(t):
        inner = WeightWithDynamicFloat8CastTensor(t, LinearMMConfig(), torch.float8_e4m3fn,
                                                  precomputed_scale=torch.ones((), device=t.device))
        return DTensor.from_local(inner, mesh, [Shard(0)], run_check=False)
    return wrap


if __name__ == "__main__":
    sys.exit(main())

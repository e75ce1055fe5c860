"""The tests' own torchrun-style program for `inv train.launch --backend command` (not a test module).

    python launch_program.py [--steps N] [--sleep S] [--save-every K] [--fail-rank R --fail-at STEP]
                             [--kill-rank R --kill-at STEP] [--hang-at STEP] [--garbage] [--plain]

Every rank says the torchrun variables it got on stderr, reads them (env:// over gloo) and trains the same tiny linear model on data drawn from the step number, so any number of ranks and any
resume gives the same curve. Rank 0 prints a JSON metric line a step ({"step", "loss", "tokens_per_s",
"lr", "mem_gib"}; --plain: "it N loss=X", for --metrics-regex) and saves checkpoints into
ANVIL_CHECKPOINT_DIR/step_N (written beside, then renamed). SIGUSR2 or SIGTERM on any rank: every rank
finishes its step, rank 0 saves, all exit 3. With ANVIL_RESUME=1 it loads ANVIL_RESUME_FROM and goes on
from that step. --fail-rank raises ValueError on that rank at that step; --kill-rank kills it with SIGKILL;
--hang-at makes every rank stop printing and wait for ever after that step; --garbage prints metric lines
it cannot have meant (a loss that is no number, a line cut short).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

STOP = []


def _on_stop(signum, _frame):
    STOP.append(signum)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x @ torch.linspace(-1.0, 1.0, 8).unsqueeze(1)


def _save(model, step: int, folder: str) -> None:
    temporary = os.path.join(folder, f".tmp_step_{step}")
    os.makedirs(temporary, exist_ok=True)
    torch.save({"model": model.state_dict(), "step": step}, os.path.join(temporary, "state.pt"))
    os.replace(temporary, os.path.join(folder, f"step_{step}"))


def run_launch_program(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=2)
    p.add_argument("--hang-at", type=int, default=0)
    p.add_argument("--garbage", action="store_true")
    p.add_argument("--plain", action="store_true")
    args = p.parse_args(argv)
    signal.signal(signal.SIGUSR2, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)
    seen = " ".join(f"{k}={os.environ.get(k)}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    print(f"launch_program: {seen} MASTER={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
          file=sys.stderr, flush=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    folder = os.environ.get("ANVIL_CHECKPOINT_DIR", "checkpoints")
    if os.environ.get("ANVIL_RESUME") == "1":
        state = torch.load(os.path.join(os.environ["ANVIL_RESUME_FROM"], "state.pt"))
        model.load_state_dict(state["model"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {os.environ['ANVIL_RESUME_FROM']} at step {start}", file=sys.stderr, flush=True)
    for step in range(start + 1, args.steps + 1):
        started = time.perf_counter()
        if rank == args.fail_rank and step == args.fail_at:
            raise ValueError(f"launch_program: rank {rank} fails at step {step} as asked")
        if rank == args.kill_rank and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step)
        shard = x.chunk(dist.get_world_size())[rank], y.chunk(dist.get_world_size())[rank]
        loss = torch.nn.functional.mse_loss(model(shard[0]), shard[1])
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if args.sleep:
            time.sleep(args.sleep)
        if rank == 0:
            mean = total.item() / dist.get_world_size()
            if args.plain:
                print(f"it {step} loss={mean:.6f}", flush=True)
            else:
                print(json.dumps({"step": step, "loss": mean, "lr": 0.1, "mem_gib": 0.001 * step,
                                  "tokens_per_s": 16 / (time.perf_counter() - started)}), flush=True)
            if args.garbage and step == 2:
                print(json.dumps({"step": step, "loss": "not a number"}), flush=True)
                print('{"step": 2, "loss": 1.2', flush=True)
            print(f"launch_program: step {step} done", file=sys.stderr, flush=True)
        if args.hang_at and step == args.hang_at:
            while True:
                time.sleep(1)
        if args.save_every and step % args.save_every == 0 and rank == 0:
            _save(model, step, folder)
        stop = torch.tensor([1 if STOP else 0])
        dist.all_reduce(stop)
        if stop.item():
            if rank == 0:
                _save(model, step, folder)
                print(f"launch_program: stopped on a signal at step {step}, saved", file=sys.stderr, flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return 3
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_launch_program())

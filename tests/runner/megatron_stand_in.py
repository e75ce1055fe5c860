"""A stand-in for Megatron-LM's pretrain_gpt.py in a checkout the tests make (not a test module): what
train.launch --backend megatron relies on, with no GPU and no Megatron-LM.

    python pretrain_gpt.py --train-iters N --seq-length S [--save DIR] [--load DIR [--ckpt-step K]]
                           [--exit-signal-handler] [--exit-signal SIGTERM] [--sleep S] [--fail "message"]

As Megatron-LM does: --load DIR reads DIR/latest_checkpointed_iteration.txt (or --ckpt-step) and goes on
after that iteration, and without a checkpoint there says so and starts from scratch; the last rank prints
training_log's iteration line, rank 0 a memory report after the first; with --exit-signal-handler the exit
signal is caught, rank 0 saves SAVE/iter_%07d and the tracker at the iteration's end, and every rank exits 0;
an uncaught SIGTERM kills it; --fail raises at start as a refused argument would.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

RECEIVED = []


def megatron_stand_in(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--exit-signal-handler", action="store_true")
    p.add_argument("--exit-signal", default="SIGTERM")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--fail", default="")
    args, _ = p.parse_known_args(argv)
    if args.fail:
        raise AssertionError(args.fail)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.exit_signal_handler:
        signal.signal(getattr(signal, args.exit_signal), lambda signum, frame: RECEIVED.append(signum))
    start = 0
    if args.load:
        tracker = os.path.join(args.load, "latest_checkpointed_iteration.txt")
        if args.ckpt_step is not None:
            start = args.ckpt_step
        elif os.path.isfile(tracker):
            start = int(open(tracker).read())
        else:
            print(f"WARNING: could not find the metadata file {tracker}", flush=True)
            print("    will not load any checkpoints and will start from random", flush=True)
        if start:
            print(f"  successfully loaded checkpoint from {args.load} [ t 1/1, p 1/1 ] at iteration {start}",
                  flush=True)
    for iteration in range(start + 1, args.train_iters + 1):
        time.sleep(args.sleep)
        if rank == world - 1:
            now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
            print(f" [{now}] iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: "
                  f"{iteration * args.global_batch_size:12d} | elapsed time per iteration (ms): 500.0 | learning "
                  f"rate: {1e-4:.6E} | global batch size: {args.global_batch_size:5d} | lm loss: {10.0 / iteration:.6E} "
                  f"| loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | number of nan "
                  "iterations:   0 |", flush=True)
        if rank == 0 and iteration == start + 1:
            print(f"[Rank 0] (after {iteration} iterations) memory (MB) | allocated: 100.00 | max allocated: 512.00 "
                  "| reserved: 600.00 | max reserved: 600.00", flush=True)
        if RECEIVED:
            if args.save and rank == 0:
                os.makedirs(os.path.join(args.save, f"iter_{iteration:07d}"), exist_ok=True)
                with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as handle:
                    handle.write(str(iteration))
            print(f"[{datetime.datetime.now()}] exiting program after receiving SIGTERM.", flush=True)
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(megatron_stand_in())

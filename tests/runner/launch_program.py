"""The tests' own torchrun-style program for `inv train.launch --backend command` (not a test module).

    python launch_program.py [--steps N] [--sleep S] [--save-every K] [--fail-rank R --fail-at STEP]
                             [--kill-rank R --kill-at STEP] [--hang-at STEP] [--garbage] [--plain] [--gloo]

Every rank says the torchrun variables it got on stderr and meets the others with them, as torch's env://
does: rank 0 listens on MASTER_PORT, every other rank connects to MASTER_ADDR:MASTER_PORT and says its
RANK, WORLD_SIZE of them in all. --gloo meets through torch.distributed itself (init_process_group("gloo"),
env://) instead: real, and about 3 s of CPU a rank to import torch, so the tests take it where the meeting
is what they check (across hosts) and the plain sockets elsewhere. Either way the ranks train the same tiny
linear model (8 weights, pure Python floats) on data drawn from the step number, their gradients summed in
rank order, so any number of ranks and any resume gives the same curve.

Rank 0 prints a JSON metric line a step ({"step", "loss", "tokens_per_s", "lr", "mem_gib"}; --plain: "it N
loss=X", for --metrics-regex) and saves checkpoints into ANVIL_CHECKPOINT_DIR/step_N (written beside, then
renamed). SIGUSR2 or SIGTERM on any rank: every rank finishes its step, rank 0 saves, all exit 3. With
ANVIL_RESUME=1 it loads ANVIL_RESUME_FROM and goes on from that step (--sleep, seconds after each step,
only until then: a requeued attempt, with the same arguments, goes at once). --fail-rank raises
ValueError on that rank at that step; --kill-rank kills it with SIGKILL in a run that did not resume
(the others then fail: their peer is gone); --hang-at makes every rank stop printing and wait for ever after that step; --garbage prints
metric lines it cannot have meant (a loss that is no number, a line cut short).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import sys
import time

STOP = []
FEATURES, ROWS, LR = 8, 16, 0.1


def _on_stop(signum, _frame):
    STOP.append(signum)


class Sockets:
    """The ranks met over TCP at MASTER_ADDR:MASTER_PORT; all_reduce sums at rank 0, in rank order."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout: float = 120.0):
        self.rank, self.world, self.peers = rank, world, []
        if rank == 0:
            server = socket.create_server(("", port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
            server.settimeout(timeout)
            joined = {}
            while len(joined) < world - 1:
                conn, _ = server.accept()
                conn.settimeout(None)
                stream = conn.makefile("rw")
                joined[int(stream.readline())] = stream
            server.close()
            self.peers = [joined[r] for r in sorted(joined)]
        elif world > 1:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    conn = socket.create_connection((addr, port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            conn.settimeout(None)
            self.peers = [conn.makefile("rw")]
            self._send(self.peers[0], rank)

    @staticmethod
    def _send(stream, value) -> None:
        stream.write(json.dumps(value) + "\n")
        stream.flush()

    @staticmethod
    def _receive(stream):
        line = stream.readline()
        if not line:
            raise ConnectionError("launch_program: a peer rank is gone (its connection closed)")
        return json.loads(line)

    def all_reduce(self, values: list[float]) -> list[float]:
        if self.rank == 0:
            total = list(values)
            for stream in self.peers:
                total = [a + b for a, b in zip(total, self._receive(stream))]
            for stream in self.peers:
                self._send(stream, total)
            return total
        if not self.peers:
            return list(values)
        self._send(self.peers[0], values)
        return self._receive(self.peers[0])

    def close(self) -> None:
        self.all_reduce([0.0])          # a barrier
        for stream in self.peers:
            stream.close()


class Gloo:
    """The ranks met through torch.distributed (env://, gloo)."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")

    def all_reduce(self, values: list[float]) -> list[float]:
        tensor = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(tensor)
        return tensor.tolist()

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


def _batch(step: int) -> tuple[list[list[float]], list[float]]:
    draw = random.Random(1000 + step)
    target = [-1.0 + 2.0 * i / (FEATURES - 1) for i in range(FEATURES)]
    x = [[draw.gauss(0.0, 1.0) for _ in range(FEATURES)] for _ in range(ROWS)]
    return x, [sum(a * t for a, t in zip(row, target)) for row in x]


def _loss_and_grad(w: list[float], x, y) -> tuple[float, list[float]]:
    """The mean squared error of x @ w against y, and its gradient in w."""
    errors = [sum(a * b for a, b in zip(row, w)) - t for row, t in zip(x, y)]
    grad = [2.0 * sum(e * row[i] for e, row in zip(errors, x)) / len(x) for i in range(FEATURES)]
    return sum(e * e for e in errors) / len(x), grad


def _save(w: list[float], step: int, folder: str) -> None:
    temporary = os.path.join(folder, f".tmp_step_{step}")
    os.makedirs(temporary, exist_ok=True)
    with open(os.path.join(temporary, "state.json"), "w") as f:
        json.dump({"w": w, "step": step}, f)
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
    p.add_argument("--gloo", action="store_true")
    args = p.parse_args(argv)
    signal.signal(signal.SIGUSR2, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)
    seen = " ".join(f"{k}={os.environ.get(k)}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    print(f"launch_program: {seen} MASTER={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
          file=sys.stderr, flush=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = Gloo() if args.gloo else Sockets(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    init = random.Random(0)
    w = [init.uniform(-1.0, 1.0) / math.sqrt(FEATURES) for _ in range(FEATURES)]
    start = 0
    folder = os.environ.get("ANVIL_CHECKPOINT_DIR", "checkpoints")
    if os.environ.get("ANVIL_RESUME") == "1":
        with open(os.path.join(os.environ["ANVIL_RESUME_FROM"], "state.json")) as f:
            state = json.load(f)
        w, start = state["w"], state["step"]
        if rank == 0:
            print(f"resumed from {os.environ['ANVIL_RESUME_FROM']} at step {start}", file=sys.stderr, flush=True)
    for step in range(start + 1, args.steps + 1):
        started = time.perf_counter()
        if rank == args.fail_rank and step == args.fail_at:
            raise ValueError(f"launch_program: rank {rank} fails at step {step} as asked")
        if rank == args.kill_rank and step == args.kill_at and not start:   # (not again once resumed)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step)
        size = -(-ROWS // world)                       # torch.chunk's shards
        loss, grad = _loss_and_grad(w, x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size])
        *summed, total = group.all_reduce([*grad, loss])
        w = [a - LR * g / world for a, g in zip(w, summed)]
        if args.sleep and not start:     # slow until a stop signal's checkpoint; a resumed run goes at once
            time.sleep(args.sleep)
        if rank == 0:
            mean = total / world
            if args.plain:
                print(f"it {step} loss={mean:.6f}", flush=True)
            else:
                print(json.dumps({"step": step, "loss": mean, "lr": LR, "mem_gib": 0.001 * step,
                                  "tokens_per_s": ROWS / (time.perf_counter() - started)}), flush=True)
            if args.garbage and step == 2:
                print(json.dumps({"step": step, "loss": "not a number"}), flush=True)
                print('{"step": 2, "loss": 1.2', flush=True)
            print(f"launch_program: step {step} done", file=sys.stderr, flush=True)
        if args.hang_at and step == args.hang_at:
            while True:
                time.sleep(1)
        if args.save_every and step % args.save_every == 0 and rank == 0:
            _save(w, step, folder)
        (stop,) = group.all_reduce([1.0 if STOP else 0.0])
        if stop:
            if rank == 0:
                _save(w, step, folder)
                print(f"launch_program: stopped on a signal at step {step}, saved", file=sys.stderr, flush=True)
            group.close()
            return 3
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_launch_program())

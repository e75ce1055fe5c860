"""Checkpoint saves on one GPU: how long training pauses, how fast the write goes, and what a save
every 100 steps costs, beside the disk's own write speed, in one call.

    python -m benchmarks.checkpoint_bench [--config configs/llama3_1b.yaml] [--dir DIR]
        [--batch 4] [--seq 2048] [--every 100] [--repeats 2] [--skip dcp,titan,train] [--out FILE]

Everything runs in this process, one GPU, on one disk (--dir, default runs/.checkpoint_bench
under the current directory), with the config's model in its training precision (fp32 weights
and AdamW state unless precision.params says bf16) after one optimizer step:

  disk         a dd-style write of the state's size: 64 MiB blocks of random bytes, then one
               fdatasync (dd bs=64M conv=fdatasync)
  anvil_sync   trainer.checkpoint.Checkpointer(async_save=False): training waits for all of it
  anvil_async  Checkpointer(async_save=True): reserve_s (its staging memory faulted in, which the
               trainer does on a thread after its first step), the first save (page-locks that
               memory), then --repeats more: the pause (save() returning) and the background
               write (meta.json save_s: from the save's start to its commit), with checksums
  dcp_save     torch.distributed.checkpoint.save as it comes (no checksums)
  dcp_async    dcp.async_save with its defaults (a thread); its pause and its total
  titan_pinned torchtitan's async_with_pinned_mem recipe (torchtitan/components/checkpoint.py):
               dcp.async_save into DefaultStager(StagingOptions(pinned, shared, async staging,
               non-blocking)) in process mode on a gloo group; its pause is async_save plus
               the staging it waits for before the next optimizer step. Needs
               torch.distributed.checkpoint.staging (torch 2.11 has it): skipped with a note
               otherwise. Last, since it starts a (one-rank) process group
  train        steps without saves (their pace), then a window holding one asynchronous save,
               and one holding a synchronous one: the seconds a save adds to training, and that
               as a share of --every steps (the goal: within 2% for a save every 100 steps)

GB/s are the checkpoint's bytes (its checksums.json) over the seconds; of_disk is that over the
dd-style figure. The JSON goes to stdout (and --out). Sized to take under 5 minutes for
llama3_1b on one H200 (about 15 GB written eight times); --skip drops parts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from core import checkout


REPO = checkout.ROOT
BLOCK = 64 << 20
PARTS = ("disk", "anvil_sync", "anvil_async", "dcp", "train", "titan")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "llama3_1b.yaml"))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--dir", default="runs/.checkpoint_bench",
                   help="a folder of the disk to measure; a fresh folder inside it is written and removed")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run of this program with a small --config (no GPU figures)")
    p.add_argument("--batch", type=int, default=4, help="micro batch of the training steps")
    p.add_argument("--seq", type=int, default=2048, help="sequence length of the training steps")
    p.add_argument("--every", type=int, default=100, help="steps between saves, for the projected overhead")
    p.add_argument("--repeats", type=int, default=1, help="asynchronous saves measured after the first")
    p.add_argument("--baseline-steps", type=int, default=20)
    p.add_argument("--skip", default="", help=f"comma-separated parts to leave out: {', '.join(PARTS)}")
    p.add_argument("--out", default="", help="also write the JSON here")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the state

class Bench:
    def __init__(self, args):
        import torch

        from trainer import optim
        from trainer.config import load
        from trainer.models import Transformer

        self.args = args
        self.cfg = load(args.config, list(args.sets))
        self.device = torch.device(args.device)
        torch.manual_seed(0)
        with self.device:
            self.model = Transformer(self.cfg.model)
        if self.cfg.precision.params == "bf16":
            self.model.to(torch.bfloat16)
        self.optimizer = optim.build_optimizer(self.model, self.cfg.optim, self.device)
        self.step()     # AdamW's moments exist from the first step on
        self.sync()

    def sync(self) -> None:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        import torch

        vocab = self.cfg.model.vocab_size
        x = torch.randint(0, vocab, (self.args.batch, self.args.seq), device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(x, x.roll(-1, 1))
        (loss / x.numel()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        from trainer.checkpoint.state import local_bytes, model_optim_state
        return local_bytes(model_optim_state(self.model, self.optimizer))


def checkpoint_bytes(path: Path) -> int:
    manifest = json.loads((path / "checksums.json").read_text())
    return sum(record["size"] for record in manifest["files"].values())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e9 / max(seconds, 1e-9), 3)


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    gc.collect()
    os.sync()


def release_host_memory() -> None:
    import torch
    gc.collect()
    if not torch.cuda.is_available():
        return
    empty = getattr(torch._C, "_host_emptyCache", None)   # pinned blocks torch's allocator keeps
    if empty is not None:
        empty()


# --------------------------------------------------------------------------- parts

def disk(root: Path, nbytes: int) -> dict:
    """dd if=random of=FILE bs=64M count=N conv=fdatasync, in Python."""
    path = root / "dd.bin"
    block = os.urandom(BLOCK)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: min(BLOCK, nbytes - written)])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return {"bytes": written, "seconds": round(seconds, 3), "gb_per_s": rate(written, seconds)}


def anvil_sync(bench: Bench, root: Path) -> dict:
    from trainer.checkpoint import Checkpointer

    saver = Checkpointer(root / "anvil_sync", async_save=False, keep_last=1)
    started = time.perf_counter()
    path = saver.save(1, model=bench.model, optimizer=bench.optimizer)
    seconds = time.perf_counter() - started
    saver.close()
    nbytes = checkpoint_bytes(path)
    clean(root / "anvil_sync")
    return {"bytes": nbytes, "stall_s": round(seconds, 3), "write_s": round(seconds, 3), "gb_per_s": rate(nbytes, seconds)}


def anvil_async(bench: Bench, root: Path) -> dict:
    from trainer.checkpoint import Checkpointer, read_meta

    saver = Checkpointer(root / "anvil_async", async_save=True, keep_last=1)
    started = time.perf_counter()
    saver.prepare(bench.model, bench.optimizer, wait=True)   # the trainer does it after its first step
    reserve_s = time.perf_counter() - started
    rows = []
    for step in range(1, bench.args.repeats + 2):
        bench.sync()
        started = time.perf_counter()
        saver.save(step, model=bench.model, optimizer=bench.optimizer)
        stall = time.perf_counter() - started
        path = saver.wait()
        meta = read_meta(path)
        nbytes = checkpoint_bytes(path)
        rows.append({"stall_s": round(stall, 3), "write_s": meta["save_s"], "gb_per_s": rate(nbytes, meta["save_s"]),
                     "bytes": nbytes})
    bench.saver = saver       # its page-locked buffers serve the training window too
    clean(root / "anvil_async")
    steady = rows[1:]
    return {"reserve_s": round(reserve_s, 3), "first": rows[0], "saves": steady, "bytes": rows[0]["bytes"],
            "stall_s": statistics.median(r["stall_s"] for r in steady),
            "write_s": statistics.median(r["write_s"] for r in steady),
            "gb_per_s": statistics.median(r["gb_per_s"] for r in steady)}


def dcp_plain(bench: Bench, root: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.state import model_optim_state

    out = {}
    bench.sync()
    started = time.perf_counter()
    dcp.save(model_optim_state(bench.model, bench.optimizer), checkpoint_id=str(root / "dcp_save"), no_dist=True)
    seconds = time.perf_counter() - started
    nbytes = folder_bytes(root / "dcp_save")
    out["dcp_save"] = {"bytes": nbytes, "stall_s": round(seconds, 3), "write_s": round(seconds, 3),
                       "gb_per_s": rate(nbytes, seconds)}
    clean(root / "dcp_save")

    bench.sync()
    started = time.perf_counter()
    future = dcp.async_save(model_optim_state(bench.model, bench.optimizer), checkpoint_id=str(root / "dcp_async"),
                            no_dist=True)
    stall = time.perf_counter() - started
    future.result()
    seconds = time.perf_counter() - started
    nbytes = folder_bytes(root / "dcp_async")
    out["dcp_async"] = {"bytes": nbytes, "stall_s": round(stall, 3), "write_s": round(seconds, 3),
                        "gb_per_s": rate(nbytes, seconds)}
    clean(root / "dcp_async")
    release_host_memory()
    return out


def titan_pinned(bench: Bench, root: Path) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.state import model_optim_state

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as exc:
        return {"skipped": f"torch {torch.__version__} has no DCP DefaultStager ({exc})"}
    if bench.device.type != "cuda":
        return {"skipped": "pinned staging needs a GPU"}
    try:
        import torchtitan
        note = f"torchtitan {getattr(torchtitan, '__version__', '?')} importable; its recipe run through DCP here"
    except ImportError:
        note = "torchtitan not installed; its recipe (components/checkpoint.py) run through DCP here"
    if not dist.is_initialized():   # process mode and its gloo group need a process group (one rank)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(True, True, True, True))
    rows = []
    try:
        for i in range(2):    # the first allocates the shared, pinned buffers (a second fails on torch 2.11:
            #                   its stager's deepcopy meets a class object; the first's figures stand then)
            bench.sync()
            started = time.perf_counter()
            response = dcp.async_save(model_optim_state(bench.model, bench.optimizer),
                                      checkpoint_id=str(root / f"titan_{i}"), process_group=group,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
            try:
                staging = getattr(response, "staging_completion", None)
                if staging is not None:
                    staging.result()      # torchtitan waits for it before the next optimizer step
                stall = time.perf_counter() - started
                (getattr(response, "upload_completion", None) or response).result()
            except Exception as exc:
                if not rows:
                    raise
                rows[0]["second_save"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                break
            seconds = time.perf_counter() - started
            nbytes = folder_bytes(root / f"titan_{i}")
            rows.append({"stall_s": round(stall, 3), "write_s": round(seconds, 3), "gb_per_s": rate(nbytes, seconds),
                         "bytes": nbytes})
            clean(root / f"titan_{i}")
    finally:
        stager.close()
        release_host_memory()
    return {**rows[-1], "first": rows[0], "note": note} if len(rows) > 1 else {**rows[0], "note": note}


def train(bench: Bench, root: Path) -> dict:
    """Steps without saves; a window holding one asynchronous save (until its write is done and
    two steps more); one holding a synchronous save (and as many steps). The extra seconds of a
    window over its steps at the baseline pace are what one save costs training."""
    from trainer.checkpoint import Checkpointer

    def timed_steps(n: int) -> float:
        bench.sync()
        started = time.perf_counter()
        for _ in range(n):
            bench.step()
        bench.sync()
        return time.perf_counter() - started

    timed_steps(3)
    step_s = timed_steps(bench.args.baseline_steps) / bench.args.baseline_steps
    out = {"step_s": round(step_s, 4), "every": bench.args.every}
    for mode, asynchronous in (("async", True), ("sync", False)):
        saver = getattr(bench, "saver", None) if asynchronous else None
        if saver is None:
            saver = Checkpointer(root / f"train_{mode}", async_save=asynchronous, keep_last=1)
        if asynchronous and saver.last_saved is None:   # staging buffers made by an earlier save, as in a long run
            saver.prepare(bench.model, bench.optimizer, wait=True)
            saver.save(0, model=bench.model, optimizer=bench.optimizer, wait=True)
        bench.sync()
        started = time.perf_counter()
        saver.save(1000, model=bench.model, optimizer=bench.optimizer)
        steps = 0
        while saver.writing or steps < 2:
            bench.step()
            steps += 1
        saver.wait()
        bench.sync()
        window = time.perf_counter() - started
        extra = window - steps * step_s
        saver.close()
        clean(saver.dir)
        out[mode] = {"window_s": round(window, 3), "steps": steps, "extra_s": round(extra, 3),
                     "overhead_pct": round(100 * extra / (bench.args.every * step_s), 2)}
    bench.saver = None
    release_host_memory()
    return out


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(PARTS)
    if unknown:
        print(f"--skip {','.join(sorted(unknown))}: expected some of {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("checkpoint_bench needs a GPU (--device cpu: a smoke run of the program itself)", file=sys.stderr)
        return 2
    root = Path(args.dir).resolve() / f"run-{os.getpid()}"   # ours alone: removed at the end
    root.mkdir(parents=True)
    wall = time.perf_counter()
    bench = Bench(args)
    nbytes = bench.state_bytes()
    result = {"config": args.config, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "dir": str(root), "state_bytes": nbytes, "state_gb": round(nbytes / 1e9, 2)}
    parts = [("disk", lambda: disk(root, nbytes)), ("anvil_sync", lambda: anvil_sync(bench, root)),
             ("anvil_async", lambda: anvil_async(bench, root)), ("dcp", lambda: dcp_plain(bench, root)),
             ("train", lambda: train(bench, root)),
             ("titan", lambda: titan_pinned(bench, root))]   # last: it starts a process group, the others run without one
    bench.saver = None
    try:
        for name, run in parts:
            if name in skip:
                continue
            started = time.perf_counter()
            try:
                value = run()
            except Exception as exc:   # one part failing (a peer's recipe on this torch) keeps the others' figures
                value = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
            print(f"[checkpoint_bench] {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            if name == "dcp" and "failed" not in value:
                result.update(value)
            else:
                result["titan_pinned" if name == "titan" else name] = value
            if args.out:   # what is measured so far, should a later part take the process down
                from core.files import write_atomic
                write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    finally:
        if bench.saver is not None:
            bench.saver.close()
        bench.saver = None
        shutil.rmtree(root, ignore_errors=True)
    if "disk" in result:
        for key in ("anvil_sync", "anvil_async", "dcp_save", "dcp_async", "titan_pinned"):
            if isinstance(result.get(key), dict) and "gb_per_s" in result[key]:
                result[key]["of_disk"] = round(result[key]["gb_per_s"] / result["disk"]["gb_per_s"], 3)
    result["bench_s"] = round(time.perf_counter() - wall, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        from core.files import write_atomic
        write_atomic(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

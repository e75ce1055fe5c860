"""Check --init-from on a GPU: a random Hugging Face checkpoint of a real shape, loaded through
Anvil, gives transformers' step-0 loss on the same batch.

    python -m benchmarks.hf_init_check [--shape llama3_1b] [--batch 2] [--seq 2048] [--dtype bfloat16]
        [--set KEY=VALUE]... [--out DIR] [--keep]

1. transformers writes a random LlamaForCausalLM of the shape of configs/<shape>.yaml (config.json
   from trainer.hf.to_hf) in --dtype, sharded like Hub checkpoints (an index and 1 GB files).
2. Anvil builds the run's model as the trainer does (trainer.hf.load_config with
   checkpoint.init_from, trainer.train.build_model on this device), checks the headers
   (check_before_launch) and streams the weights in (load_weights).
3. On one batch of random tokens: Anvil's loss in fp32 against transformers' in fp32 (the same
   math: a tight tolerance), and the trainer's step-0 loss (its autocast: bf16 on a GPU) against
   transformers' in --dtype (the weights as saved).

Prints one JSON object: shape, parameters, seconds to write, check and load, the losses, their
relative differences, and ok. Exit 0 when both differences are within tolerance, 1 otherwise.
Runs on the CPU too (slowly: use a small --shape such as tiny there).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from core import checkout


REPO = checkout.ROOT
TOLERANCE = {"float32": 1e-4, "low": 2e-2}   # relative difference of the mean token loss


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_init_check", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3_1b", help="configs/<shape>.yaml, or a config path")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the checkpoint's dtype (Hub Llama checkpoints are bfloat16)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for Anvil's run, e.g. train.kernels=true (repeatable)")
    p.add_argument("--out", default="", help="where to write the checkpoint, kept (default: a temporary "
                                             "directory, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temporary checkpoint")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def config_path(shape: str) -> Path:
    path = Path(shape)
    return path if path.suffix in (".yaml", ".yml") else REPO / "configs" / f"{shape}.yaml"


def write_checkpoint(model_cfg, out: Path, dtype, device, seed: int) -> None:
    import torch
    import transformers

    from trainer.hf import to_hf

    raw = {k: v for k, v in to_hf(model_cfg).items() if k not in ("torch_dtype", "architectures", "model_type")}
    torch.manual_seed(seed)
    with torch.device(device):   # random init on the GPU: seconds, not minutes, for 1 B parameters
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**raw))
    model.to(device="cpu", dtype=dtype).save_pretrained(out, max_shard_size="1GB")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def mean_loss(logits, labels) -> float:
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="mean").item()


def main(argv=None) -> int:
    args = parse_args(argv)
    import logging

    import torch
    import transformers

    from trainer import distributed, hf
    from trainer.config import load
    from core.errors import UserError
    from trainer.train import autocast_context, build_model

    dtype = getattr(torch, args.dtype)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hf_init_check."))
    remove = not (args.out or args.keep)   # a directory of one's own (--out) is kept
    log = logging.getLogger("hf_init_check")
    try:
        sets = [f"checkpoint.init_from={json.dumps(str(out.resolve()))}", "data.path=synthetic",
                f"data.seq_len={args.seq}", f"data.batch_size={args.batch}", *args.sets]
        base = load(config_path(args.shape), ["data.path=synthetic", f"data.seq_len={args.seq}", *args.sets])
        info = distributed.init(base)
        started = time.perf_counter()
        write_checkpoint(base.model, out, dtype, info.device, args.seed)
        write_s = time.perf_counter() - started

        cfg = hf.load_config(config_path(args.shape), sets)   # the run's config: shape checked against config.json
        started = time.perf_counter()
        hf.check_before_launch(cfg)
        check_s = time.perf_counter() - started
        model, _ = build_model(cfg, info, log)
        started = time.perf_counter()
        provenance = hf.load_weights(model, out, log)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        load_s = time.perf_counter() - started

        gen = torch.Generator().manual_seed(args.seed + 1)
        tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1), generator=gen).to(info.device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        n = y.numel()
        model.eval()
        with torch.no_grad():
            anvil_fp32 = (model(x, y) / n).item()
            with autocast_context(cfg, info)():
                anvil_step0 = (model(x, y).float() / n).item()   # what the trainer logs at step 1
        step0_dtype = distributed.compute_dtype(cfg, info.device)
        del model
        if info.device.type == "cuda":
            torch.cuda.empty_cache()

        theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).to(info.device).eval()
        with torch.no_grad():
            hf_fp32 = mean_loss(theirs(x).logits, y)
            if step0_dtype != torch.float32:   # the checkpoint's own weights in the compute dtype
                theirs.to(dtype if dtype != torch.float32 else step0_dtype)
            hf_step0 = mean_loss(theirs(x).logits, y)
        rel_fp32 = abs(anvil_fp32 - hf_fp32) / abs(hf_fp32)
        rel_step0 = abs(anvil_step0 - hf_step0) / abs(hf_step0)
        tolerance_step0 = TOLERANCE["float32"] if step0_dtype == torch.float32 else TOLERANCE["low"]
        ok = rel_fp32 <= TOLERANCE["float32"] and rel_step0 <= tolerance_step0
        print(json.dumps({
            "shape": args.shape, "device": torch.cuda.get_device_name(info.device)
            if info.device.type == "cuda" else "cpu", "checkpoint_dtype": args.dtype,
            "parameters": provenance["parameters"], "tensors": provenance["tensors"], "files": provenance["files"],
            "batch": [args.batch, args.seq], "write_s": round(write_s, 1), "check_s": round(check_s, 3),
            "load_s": round(load_s, 1),
            "loss_fp32": {"anvil": anvil_fp32, "transformers": hf_fp32, "rel_diff": rel_fp32,
                          "tolerance": TOLERANCE["float32"]},
            "loss_step0": {"compute": str(step0_dtype).removeprefix("torch."), "anvil": anvil_step0,
                           "transformers": hf_step0, "rel_diff": rel_step0, "tolerance": tolerance_step0},
            "ok": ok}, indent=2))
        return 0 if ok else 1
    except UserError as exc:   # a bad --shape or --set
        print(f"hf_init_check: {exc}", file=sys.stderr)
        return 2
    finally:
        if remove:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

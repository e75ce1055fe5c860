"""python -m trainer --config CONFIG.yaml --run-dir RUN_DIR [--set k=v ...] [--resume auto|PATH]
                    [--compile] [--kernels] [--init-from HF_DIR]

What torchrun, srun or a container starts on every rank. Exit status: 0 ok,
1 failure, 3 stopped on SIGTERM/SIGUSR2 after checkpointing (requeue).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=None, help="training config YAML (default: tiny)")
    p.add_argument("--run-dir", type=Path, required=True, help="where logs, metrics, checkpoints go")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, e.g. optim.lr=3e-4 (repeatable)")
    p.add_argument("--resume", default=None, help="auto (newest checkpoint in the run dir) or a path")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder blocks")
    p.add_argument("--kernels", action="store_true", help="patch in the fused Triton kernels")
    p.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="start from a Hugging Face directory (checkpoint.init_from)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from core import checkout
    checkout.put_first_on_path()   # Anvil's kernels/, not a same-named package in site-packages
    args = parse_args(argv)
    from core.signals import ctrl_c_once
    ctrl_c_once()   # before the loop's own handler: the launcher passes on the group's Ctrl-C again
    try:
        from trainer import ranklog
        from trainer import flags, hf, train
    except KeyboardInterrupt:   # a terminal's Ctrl-C while torch is imported, before the log exists
        print("interrupted (Ctrl-C) before training started; nothing to checkpoint", file=sys.stderr, flush=True)
        return 130

    overrides = flags.overrides(args.overrides, compile=args.compile, kernels=args.kernels, init_from=args.init_from)
    log = ranklog.setup(args.run_dir, name="anvil.trainer")
    try:
        cfg = hf.load_config(args.config, overrides)   # the model shape from init_from's config.json
        _keep_config(cfg, args.config, args.run_dir)
        return train.run(cfg, args.run_dir, resume=args.resume, log=log)
    except KeyboardInterrupt:   # before the loop's own handler is installed
        log.warning("interrupted (Ctrl-C) before training started; nothing to checkpoint")
        return 130
    except train.user_errors() as exc:
        log.error(f"error: {exc}")
        return getattr(exc, "exit_code", train.EXIT_FAILED)   # a UserError (bad config, data): 2
    except Exception as exc:
        import torch
        if isinstance(exc, torch.OutOfMemoryError):
            log.error(f"out of memory: {str(exc).splitlines()[0]} -- lower data.batch_size (raise "
                      "data.grad_accum to keep the global batch), or set "
                      "train.activation_checkpoint=selective|selective_lean|full, or parallel.strategy=fsdp")
        else:
            log.exception(f"training failed: {exc}")
        return train.EXIT_FAILED


def _keep_config(cfg, given: Path | None, run_dir: Path) -> None:
    """Rank 0 keeps the config as used in RUN_DIR/config.yaml, unless it came from the run directory
    itself (inv's runs hold theirs once, in configs/train.yaml, and start the ranks with it)."""
    import os

    from trainer import config
    from core.files import write_atomic

    inside = given is not None and Path(given).resolve().is_relative_to(Path(run_dir).resolve())
    if not inside and os.environ.get("RANK", "0") == "0":
        write_atomic(Path(run_dir) / "config.yaml", config.dump(cfg))


if __name__ == "__main__":
    sys.exit(main())

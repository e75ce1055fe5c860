"""What the command-line flags of `inv train.pretrain` and `python -m trainer` mean: config overrides,
after the --set ones. The one place where a flag becomes a key of the config; both command lines
hand their flags here (runtime.jobs.training.TrainingJob.overrides, trainer/__main__.py).

    overrides(["optim.lr=3e-4"], compile=True, init_from="hf/llama")
    -> ["optim.lr=3e-4", "train.compile=true", 'checkpoint.init_from="/abs/hf/llama"']
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable


def overrides(sets: Iterable[str] = (), *, compile: bool = False, kernels: bool = False,
              init_from: str | Path | None = None) -> list[str]:
    out = [*sets, *["train.compile=true"] * compile, *["train.kernels=true"] * kernels]
    if init_from is not None:
        from trainer.hf import init_from_override   # checkpoint.init_from, as an absolute path
        out.append(init_from_override(init_from))
    return out

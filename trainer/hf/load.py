"""A Hugging Face directory's weights into Anvil's model: checked before launch, streamed by the ranks.

    check_before_launch(cfg) -> dict | None    the runner: the weights' names and shapes from their
                                               headers against cfg.model (no weight is read); the
                                               provenance, None without checkpoint.init_from
    tokenizer_warning(cfg) -> str | None       the dataset was tokenized with another tokenizer than
                                               the directory's tokenizer.json
    load_weights(model, directory, log) -> dict  every rank, after the model is built, wrapped and
                                               materialised: each tensor read once, straight into
                                               the parameter (its provenance returned)

Under FSDP2 a parameter is a DTensor sharded on dim 0: each rank reads only its own rows of each
tensor (safetensors' get_slice on the memory-mapped file), so no rank holds a full copy of the
model. DDP and a single process read one whole tensor at a time. bf16 or fp16 weights are cast
into the parameters' dtype (fp32 master weights by default). RoPE's frequencies are no weights:
they come from config.json's rope_theta and rope_scaling through the model config.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from torch import nn

from .weights import HFWeights

TIED = ("lm_head.weight",)   # a tied head is the embedding: a copy in the file is not loaded


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """name -> full shape of each parameter (a tied weight once; a DTensor's global shape)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_before_launch(cfg) -> dict | None:
    directory = cfg.checkpoint.init_from
    if not directory:
        return None
    from trainer.models import Transformer

    with torch.device("meta"):
        shapes = parameter_shapes(Transformer(cfg.model))
    weights = HFWeights.open(directory)
    weights.check(shapes, TIED if cfg.model.tie_embeddings else ())
    return weights.provenance()


def tokenizer_warning(cfg) -> str | None:
    """One line when the directory has a tokenizer.json and the dataset was not made with it."""
    directory = cfg.checkpoint.init_from
    theirs = Path(directory or "") / "tokenizer.json"
    datasets = cfg.data.datasets()   # a blend's datasets share one tokenizer (checked before launch)
    if not directory or not datasets or not theirs.is_file():
        return None
    from trainer.data import load_tokenizer

    ours = load_tokenizer(datasets[0])
    if getattr(ours, "sha256", None) == hashlib.sha256(theirs.read_bytes()).hexdigest():
        return None
    return (f"dataset {datasets[0]} was tokenized with a {ours.kind} tokenizer (vocab {ours.vocab_size:,}), "
            f"not with {theirs}, which the checkpoint was trained with: its token ids mean other things to the "
            f"model. Tokenize the corpus with it: inv data.prepare --input CORPUS --tokenizer {directory} "
            f"--out DATASET")


@torch.no_grad()
def load_weights(model: nn.Module, directory: str | Path, log=None) -> dict:
    """Copy the directory's weights into `model` (plain, DDP-wrapped's module, or FSDP2-sharded);
    InitError when the checkpoint does not fit it. Returns the provenance."""
    started = time.perf_counter()
    weights = HFWeights.open(directory)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    weights.check(parameter_shapes(model), TIED if tied else ())
    params = dict(model.named_parameters())
    from safetensors import safe_open

    for file, names in weights.by_file().items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                _copy(params[name], f, name)
    provenance = weights.provenance()
    if log is not None:
        log.info(f"initialised from {provenance['path']}: {provenance['tensors']} tensors, "
                 f"{provenance['parameters']:,} parameters ({', '.join(provenance['dtypes'])}) in "
                 f"{time.perf_counter() - started:.1f} s; the optimizer and the step count start fresh")
    return provenance


def _copy(param: torch.Tensor, f, name: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()   # this rank's rows (FSDP2: Shard(0)), sharing the parameter's storage
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)}, expected {tuple(shape)} at {offset}")
        if local.numel() == 0:    # more ranks than rows: nothing here
            return
        local.copy_(f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    else:
        param.copy_(f.get_tensor(name))

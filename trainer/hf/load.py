"""A Hugging Face directory's weights into Anvil's model: checked before launch, streamed by the ranks.

    check_before_launch(cfg) -> dict | None    the runner: the weights' names and shapes from their
                                               headers against cfg.model (no weight is read); the
                                               provenance, None without checkpoint.init_from
    tokenizer_warning(cfg) -> str | None       the dataset was tokenized with another tokenizer than
                                               the directory's tokenizer.json
    load_weights(model, directory, log) -> dict  every rank, after the model is built, wrapped and
                                               materialised: each tensor read once, straight into
                                               the parameter (its provenance returned)

Each of our tensors (parameters and persistent buffers: DeepSeek-V3's balancing bias) is read
through its family's mapping (trainer/hf/mapping.py): most are the Hub's tensor of the same name;
the stacked experts gather one tensor per expert, DeepSeek's RoPE rows are permuted.
Under FSDP2 a parameter is a DTensor sharded on dim 0: each rank reads only its own rows of each
tensor (safetensors' get_slice on the memory-mapped file; its own experts of a stacked tensor), so
no rank holds a full copy of the model. DDP and a single process read one whole tensor at a time.
bf16 or fp16 weights are cast
into the parameters' dtype (fp32 master weights by default). RoPE's frequencies are no weights:
they come from config.json's rope_theta and rope_scaling through the model config.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

from .config import mapping_for
from .mapping import TIED_HEAD, HubReader, Source, hub_shapes, sources
from .weights import HFWeights


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> each parameter (a tied weight once) and persistent buffer: what a checkpoint holds."""
    out = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            out[name] = buffer
    return out


def _open_checked(directory, cfg, tensors: dict[str, torch.Tensor]) -> tuple[HFWeights, dict[str, Source], list[int]]:
    """The directory's weights, checked against the Hub's names and shapes of the model's tensors
    (a DTensor's global shape), and the multi-token prediction layers the checkpoint has none of: they keep
    their fresh initialisation (transformers saves DeepSeek-V3 without them, its config saying it has one)."""
    found = sources(mapping_for(cfg.family), cfg, {name: tuple(t.shape) for name, t in tensors.items()})
    weights = HFWeights.open(directory)
    prefixes = {layer: f"model.layers.{layer}." for layer in range(cfg.n_layers, cfg.decoder_layers)}
    fresh = [layer for layer, prefix in prefixes.items()
             if not any(name.startswith(prefix) for name in weights.tensors)]
    unread = tuple(prefixes[layer] for layer in fresh)
    found = {name: source for name, source in found.items() if not name.startswith(unread)}
    weights.check(hub_shapes(found), (TIED_HEAD,) if cfg.tie_embeddings else (), mapping_for(cfg.family).skipped(cfg))
    return weights, found, fresh


def check_before_launch(cfg) -> dict | None:
    directory = cfg.checkpoint.init_from
    if not directory:
        return None
    import torch

    from trainer.models import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
    weights, _, _ = _open_checked(directory, cfg.model, model_tensors(model))
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


def load_weights(model: nn.Module, directory: str | Path, log=None) -> dict:
    """Copy the directory's weights into `model` (plain, DDP-wrapped's module, or FSDP2-sharded);
    InitError when the checkpoint does not fit it. Returns the provenance."""
    import torch

    with torch.no_grad():
        return _load_weights(model, directory, log)


def _load_weights(model: nn.Module, directory: str | Path, log=None) -> dict:
    started = time.perf_counter()
    tensors = model_tensors(model)
    weights, found, fresh = _open_checked(directory, model.cfg, tensors)
    hub = HubReader({name: weights.tensors[name].file for name in weights.loaded})
    first_file = {name: min(str(hub.files[n]) for n in source.hub_shapes()) for name, source in found.items()}
    for name in sorted(found, key=lambda name: first_file[name]):   # file by file, as they lie on disk
        _copy(tensors[name], found[name], hub, name)
    provenance = weights.provenance()
    if log is not None:
        log.info(f"initialised from {provenance['path']}: {provenance['tensors']} tensors, "
                 f"{provenance['parameters']:,} parameters ({', '.join(provenance['dtypes'])}) in "
                 f"{time.perf_counter() - started:.1f} s; the optimizer and the step count start fresh"
                 + (f"; multi-token prediction layer(s) {', '.join(map(str, fresh))} are not in the checkpoint: "
                    "they start from their own initialisation" if fresh else ""))
    return provenance


def _copy(param: torch.Tensor, source: Source, hub: HubReader, name: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()   # this rank's rows (FSDP2: Shard(0)), sharing the parameter's storage
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)}, expected {tuple(shape)} at {offset}")
        if local.numel() == 0:    # more ranks than rows: nothing here
            return
        local.copy_(source.read(hub, tuple(slice(o, o + n) for o, n in zip(offset, shape))))
    else:
        param.copy_(source.read(hub, tuple(slice(0, n) for n in param.shape)))

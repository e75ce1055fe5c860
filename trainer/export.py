"""Checkpoint -> Hugging Face directory that transformers loads: LlamaForCausalLM,
DeepseekV2ForCausalLM, DeepseekV3ForCausalLM or Qwen3MoeForCausalLM, after model.family.

    export_hf(run_or_checkpoint, out_dir=None, dtype="bfloat16") -> Path    (bf16 by default)
    exported(out, dtype) -> str          the line that says where, and in which dtype

writes config.json (trainer.hf.config.to_hf, the mapping --init-from reads back), model.safetensors
(tied lm_head kept once, as transformers expects), generation_config.json, anvil_export.json
(which checkpoint, which training config, whether the tokenizer was written), and the dataset's
tokenizer as transformers' AutoTokenizer loads it (tokenizer.json, tokenizer_config.json,
special_tokens_map.json; the byte tokenizer is rebuilt as a tokenizers Tokenizer with the same
ids). The directory appears atomically: it is built under a temporary name next to out_dir and
renamed into place.

The weights go over through the family's mapping (trainer/hf/mapping.py): most unchanged, the
stacked experts as one linear per expert (the Hub's keys), DeepSeek's RoPE rows back in its
interleaved order (docs/trainer-hooks.md, export). A config the transformers class cannot hold (a
Qwen3-MoE with shared experts) is refused before any weight is read.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from trainer import checkpoint as ck
from core.errors import UserError
from core.files import file_in_the_way, make_parent, make_temp_dir, share

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_DTYPE = "bfloat16"   # half the bytes of fp32 weights, the dtype Llama checkpoints are published in
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}


class ExportError(UserError):
    """No checkpoint, no config to rebuild the model shape, or an existing output dir."""


def _training_config(checkpoint: Path):
    """The TrainConfig the checkpoint was made with: meta.json's copy, else RUN/config.yaml."""
    from trainer import config as config_mod

    raw = ck.read_meta(checkpoint).get("config")
    if raw:
        try:
            return config_mod.from_dict(raw, source=f"{checkpoint}/meta.json")
        except config_mod.ConfigError as exc:
            raise ExportError(str(exc)) from None
    run_dir = checkpoint.parent.parent
    yaml_path = run_dir / "config.yaml"
    if yaml_path.is_file():
        try:
            return config_mod.load(yaml_path)
        except config_mod.ConfigError as exc:
            raise ExportError(str(exc)) from None
    raise ExportError(f"{checkpoint}: no training config (neither meta.json's 'config' nor "
                      f"{yaml_path}); cannot tell the model shape")


def _dataset_dir(cfg, checkpoint: Path) -> Path | None:
    datasets = cfg.data.datasets()   # a blend's share one tokenizer (trainer.data.check)
    if not datasets:
        return None
    path = Path(datasets[0])
    if not path.is_absolute():  # relative to the directory training ran in
        path = Path(ck.read_meta(checkpoint).get("cwd") or os.getcwd()) / path
    return path if (path / "manifest.json").is_file() else None


def _tokenizer_files(dataset: Path | None, staging: Path, max_seq_len: int) -> tuple[dict, dict]:
    """Write the dataset's tokenizer as transformers loads it (tokenizer.json,
    tokenizer_config.json, special_tokens_map.json); return (bos/eos/pad ids for
    config.json, what anvil_export.json records about it).

    The exported tokenizer gives Anvil's ids: `tok(text, add_special_tokens=False)` is
    Anvil's encode(text), and `tok(text)` puts BOS first, as every document Anvil trains
    on begins (documents end with EOS; generation stops there)."""
    if dataset is None:
        return {}, {"written": False, "why": "no dataset (synthetic data, or the dataset was not found)"}
    from trainer.data import ByteTokenizer, DataError, load_tokenizer

    try:
        tok = load_tokenizer(dataset)
    except DataError as exc:
        return {}, {"written": False, "why": str(exc)}
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    byte = isinstance(tok, ByteTokenizer)
    hf = _byte_hf_tokenizer() if byte else _json_hf_tokenizer(tok.path)
    if tok.bos_id is not None and hf.post_processor is None:  # ours: add BOS as Llama's does
        bos = tok.decode([tok.bos_id])
        from tokenizers import processors
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.bos_id)])
        (staging / "tokenizer.json").write_text(hf.to_str(pretty=True))
    else:  # one that has its own post-processor (Llama 3's) goes over byte for byte
        shutil.copyfile(tok.path, staging / "tokenizer.json")
    names = {role: tok.decode([token_id]) for role, token_id in
             (("bos_token", tok.bos_id), ("eos_token", tok.eos_id), ("pad_token", tok.pad_id))
             if token_id is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_len, **names}
    if byte:
        # Anvil's byte tokenizer reads "<|end_of_text|>" in a text as its 15 bytes, never as
        # the special token: so must transformers
        config["split_special_tokens"] = True
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (staging / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    return ids, {"written": True, "kind": tok.kind, "source": str(dataset), **ids}


def _byte_hf_tokenizer():
    """Anvil's byte tokenizer as a `tokenizers` Tokenizer: a BPE without merges over the
    byte-level alphabet, so UTF-8 byte b is id b, and the specials at 256, 257, 258."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from trainer.data.tokenizers import SPECIAL_TOKENS, ByteTokenizer

    chars = _bytes_to_unicode()
    hf = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    byte = ByteTokenizer()
    assert [hf.token_to_id(t) for t in SPECIAL_TOKENS] == [byte.bos_id, byte.eos_id, byte.pad_id]
    return hf


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which tokenizers' ByteLevel uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _json_hf_tokenizer(path: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def dtype_name(dtype: str) -> str:
    """The dtype an export writes for --dtype `dtype` (an alias such as bf16 named in full); ExportError for
    one it cannot write."""
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return name


def exported(out: str | os.PathLike, dtype: str) -> str:
    """train.export's last line: where, and the dtype its weights were written in (and that bf16 is the
    default, whichever was written)."""
    name = dtype_name(dtype)
    other = ", ".join(d for d in DTYPES if d != DEFAULT_DTYPE)
    return (f"exported to {out}: weights in {name}"
            + (f" (the default; --dtype {other} for another)" if name == DEFAULT_DTYPE
               else f" (--dtype; the default is {DEFAULT_DTYPE})"))


def export_hf(run_or_checkpoint: str | os.PathLike, out_dir: str | os.PathLike | None = None,
              dtype: str = DEFAULT_DTYPE, overwrite: bool = False) -> Path:
    """Export the newest complete checkpoint of a run dir (or the named step_N) to out_dir
    (default RUN_DIR/export/hf-step_N). Returns out_dir."""
    from safetensors.torch import save_file

    from trainer.hf.config import to_hf
    from trainer.hf.config import mapping_for
    from trainer.hf.mapping import KEPT_FP32, hub_tensors

    if not str(run_or_checkpoint).strip():
        raise ExportError("the run is empty; expected a run directory or a checkpoint (step_N)")
    source = Path(run_or_checkpoint).expanduser()
    if not source.exists():
        raise ExportError(f"{source}: no such run or checkpoint directory")
    if not source.is_dir():
        raise ExportError(f"{source}: not a directory; expected a run directory or a checkpoint (step_N)")
    dtype = dtype_name(dtype)
    try:
        checkpoint = ck.resolve(str(source), source, what="the run")
    except ck.CheckpointError as exc:
        raise ExportError(str(exc)) from None
    cfg = _training_config(checkpoint)
    config = to_hf(cfg.model, torch_dtype=dtype)   # InexpressibleModel (exit 2) before anything is read
    out = Path(out_dir) if out_dir else checkpoint.parent.parent / "export" / f"hf-{checkpoint.name}"
    staging = _staging_dir(out, overwrite)   # before the weights are read: a bad --out fails fast
    try:
        try:
            weights = ck.load_model_state(checkpoint)
        except ck.CheckpointError as exc:
            raise ExportError(str(exc)) from None
        except (Exception, _dcp_exception()) as exc:  # a damaged checkpoint: a file missing or cut short
            raise ExportError(f"{checkpoint}: cannot read its weights ({_first_cause(exc)}); the "
                              f"checkpoint is damaged; export another step_N") from None
        # a tied head is one tensor on disk (transformers re-ties lm_head to the embedding on load)
        tensors = {name: t.to(torch.float32 if name.endswith(KEPT_FP32) else DTYPES[dtype]).contiguous()
                   for name, t in sorted(hub_tensors(mapping_for(cfg.model.family), cfg.model, weights).items())}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        share(staging / "model.safetensors")  # safetensors writes 0600; the team loads exports too
        token_ids, tokenizer = _tokenizer_files(_dataset_dir(cfg, checkpoint), staging,
                                                cfg.model.max_seq_len)
        config.update(token_ids)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        provenance = {"checkpoint": str(checkpoint.resolve()), "step": ck.read_meta(checkpoint)["step"],
                      "config": cfg.to_dict(), "dtype": dtype, "tokenizer": tokenizer}
        (staging / "anvil_export.json").write_text(json.dumps(provenance, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if config.get(k) is not None}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        ck.replace_dir(staging, out)  # overwrite: swapped, so a failure never leaves half of each
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ExportError(f"cannot write the export at {out} ({exc.strerror or exc}); "
                          f"the partial export was removed") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _dcp_exception() -> type[BaseException]:
    """torch.distributed.checkpoint's CheckpointException (a BaseException: `except Exception`
    misses it), which wraps each rank's failure."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return Exception
    return CheckpointException


def _first_cause(exc: BaseException) -> str:
    """The innermost reason: DCP's CheckpointException carries the per-rank failures."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, traceback summary)
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            exc = inner
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _staging_dir(out: Path, overwrite: bool) -> Path:
    """An empty folder beside `out` to build the export in; ExportError when `out` cannot
    be written there (exists, a file in the way, no permission, no such device...)."""
    blocker = file_in_the_way(out)
    if blocker is not None:
        raise ExportError(f"--out {out}: a file is in the way where a directory is needed ({blocker})")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; expected a new directory for the export")
    if out.exists() and not overwrite:
        raise ExportError(f"--out {out} exists; expected a new directory (an export is never "
                          f"written over an existing one)")
    make_parent(out, ExportError)
    try:
        return make_temp_dir(out.parent, prefix=f".{out.name}.tmp")  # mkdir's mode, not mkdtemp's 0700
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write in {out.parent} ({exc.strerror or exc})") from None

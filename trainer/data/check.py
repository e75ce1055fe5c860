"""Is a run's data there and usable? Checked before any process starts (by the runner, and by the
trainer itself): data.path or every dataset of data.blend is prepared, its tokenizer fits the model,
its splits hold a sequence, a blend's datasets share one tokenizer. Imports no torch: the runner's
launch checks it on a login node."""
from __future__ import annotations

from pathlib import Path

from trainer.config import SYNTHETIC, TrainConfig


def check_data(cfg: TrainConfig) -> str:
    """Fail early (before any process starts) when data.path or a dataset of data.blend is not
    usable (a blend's must also share one tokenizer); returns a label."""
    if cfg.data.path == SYNTHETIC:
        return f"SYNTHETIC random tokens (vocab {cfg.model.vocab_size})"
    if not cfg.data.blend:
        tok = _check_dataset(cfg, "data.path", Path(cfg.data.path))
        return f"{Path(cfg.data.path)} ({_tokenizer_label(tok)})"
    from trainer.data import read_manifest
    from trainer.data.blend import check_same_tokenizer, folded, shares
    sources = [(f"data.blend[{i}].path", Path(source.path)) for i, source in enumerate(cfg.data.blend)]
    for key, path in sources:   # every one there before their tokenizers are compared
        _require_dataset(cfg, key, path)
    check_same_tokenizer([(f"{key} {str(path)!r}", read_manifest(path)) for key, path in sources])
    tok = [_check_dataset(cfg, key, path) for key, path in sources][0]
    parts = folded([f"{source.name} {share:.1%} ({source.path})"
                    for source, share in zip(cfg.data.blend, shares([s.weight for s in cfg.data.blend]))])
    return f"blend of {', '.join(parts)} ({_tokenizer_label(tok)})"


def _tokenizer_label(tok) -> str:
    return f"{getattr(tok, 'kind', type(tok).__name__)} tokenizer, vocab {tok.vocab_size}"


def _require_dataset(cfg: TrainConfig, key: str, path: Path) -> None:
    """DataError saying how to make it when `path` (from config key `key`) holds no prepared dataset."""
    from trainer.data import DataError
    if (path / "manifest.json").is_file():
        return
    if cfg.model.vocab_size > 65536:
        hint = (f"prepare it with Llama 3's tokenizer (vocab {cfg.model.vocab_size}): "
                f"`inv data.prepare --input TEXT_FILES --tokenizer PATH/TO/tokenizer.json --out {path}`"
                + ("; for throughput runs use --set data.path=synthetic" if key == "data.path" else ""))
    else:
        hint = f"prepare it with `inv data.prepare --out {path}`"
    raise DataError(f"{key} {str(path)!r}: no prepared dataset there (manifest.json missing); {hint}")


def _check_dataset(cfg: TrainConfig, key: str, path: Path):
    """The dataset at `path` (config key `key`) exists, its tokenizer fits the model and its splits
    hold a sequence; returns its tokenizer."""
    from trainer.data import DataError, load_tokenizer
    _require_dataset(cfg, key, path)
    tok = load_tokenizer(path)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(f"{key} {str(path)!r}: its tokenizer has {tok.vocab_size} tokens but "
                        f"model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size >= "
                        f"{tok.vocab_size}")
    _check_split_sizes(cfg, key, path)
    if cfg.data.document_mask:
        from trainer.data import read_manifest
        from trainer.data.loader import document_tokens
        document_tokens(read_manifest(path), f"{key} {str(path)!r}")
    return tok


def _split_tokens(manifest: dict, name: str) -> int | None:
    """Tokens of a split as the manifest counts them (no shard is opened); None if it has none."""
    split = manifest["splits"].get(name)
    return None if split is None else sum(int(shard["tokens"]) for shard in split["shards"])


def _check_split_sizes(cfg: TrainConfig, key: str, path: Path) -> None:
    """Each split the run reads must hold one sequence of seq_len+1 tokens, as TokenLoader needs:
    found here, before launch, not by the rank (the val split: at the end, after the training)."""
    from trainer.data import DataError, read_manifest
    manifest = read_manifest(path)
    need = cfg.data.seq_len + 1
    fixes = {"train": "prepare it from more data, or lower data.seq_len",
             # validation runs whenever val_batches > 0 (val_interval=0: at the end only)
             "val": "train without validation with --set train.val_batches=0, or prepare the dataset "
                    "again with a larger --val-fraction or more data"}
    for name in ("train", "val") if cfg.train.val_batches else ("train",):
        tokens = _split_tokens(manifest, name)
        if tokens is None:
            raise DataError(f"{key} {str(path)!r}: the dataset has no {name!r} split; {fixes[name]}")
        if tokens < need:
            raise DataError(f"{key} {str(path)!r}: its {name!r} split has {tokens:,} tokens, too few "
                            f"for one sequence of data.seq_len={cfg.data.seq_len} + 1; {fixes[name]}")

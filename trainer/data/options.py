"""The options of data.prepare and data.tokenizer, checked before anything is read or written:
a DataError names the option, the value and what it expects."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import DataError
from .formats import Limits
from .tokenizers import SPECIAL_TOKENS

EXPECTED_TOKENIZER = "expected byte, bpe or the path of a Hugging Face tokenizer.json"
# The fewest tokens a shard may hold. Each shard is a file (an inode, an fsync when written), a memory map
# in every process that reads the dataset (Linux allows 65,530 per process by default: vm.max_map_count)
# and a manifest entry of about 130 bytes; at 1,000 tokens (2 KB of uint16) the data is still most of
# what a shard costs, below it the bookkeeping takes over (--shard-tokens 1 wrote 391k files for the stdlib).
MIN_SHARD_TOKENS = 1000
DEFAULT_SHARD_TOKENS = 1 << 27


def check_options(*, val_fraction: float = 0.01, shard_tokens: int | None = None, max_docs: int | None = None,
                  max_tokens: int | None = None, workers: int | None = None, text_field: str = "text",
                  pattern: str | None = None, max_doc_bytes: int = Limits.max_doc_bytes,
                  max_ratio: int = Limits.max_ratio) -> None:
    """DataError naming the first option whose value cannot work, and what it expects."""
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):  # nan fails too
        raise DataError(f"--val-fraction: expected a number in [0, 1), got {val_fraction!r}")
    if shard_tokens is not None and shard_tokens < 1:
        raise DataError(f"--shard-tokens: expected a positive number of tokens per shard, got {shard_tokens}")
    if shard_tokens is not None and shard_tokens < MIN_SHARD_TOKENS:
        raise DataError(f"--shard-tokens {shard_tokens}: expected at least {MIN_SHARD_TOKENS:,} tokens per shard "
                        f"(default {DEFAULT_SHARD_TOKENS:,}); each shard is a file, a memory map in every reader "
                        f"and a manifest entry, and smaller ones cost more than the tokens they hold")
    for name, value in (("--max-docs", max_docs), ("--max-tokens", max_tokens)):
        if value is not None and value < 1:
            raise DataError(f"{name}: expected a positive number (0 or left out: no limit), got {value}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers: expected a positive number of processes (0 or left out: "
                        f"all cores), got {workers}")
    if not text_field.strip():
        raise DataError("--text-field is empty; expected the JSONL field or Parquet/Arrow column holding the text, e.g. text")
    if pattern is not None and not pattern.strip():
        raise DataError("--pattern is empty; expected a file-name glob such as '*.txt' "
                        "(left out: every file)")
    if isinstance(max_doc_bytes, bool) or not isinstance(max_doc_bytes, int) or max_doc_bytes < 1:
        raise DataError(f"--max-doc-bytes: expected a positive size in bytes (default "
                        f"{Limits.max_doc_bytes >> 20}M), got {max_doc_bytes!r}")
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, int) or max_ratio < 0:
        raise DataError(f"--max-ratio: expected 0 (off) or a whole number of at least 1 (default "
                        f"{Limits.max_ratio}), got {max_ratio!r}")


_SIZE = re.compile(r"(\d+)\s*([kmg]?)(?:i?b)?", re.IGNORECASE)


def limit_options(max_doc_bytes: str = "", max_ratio: str = "") -> dict:
    """--max-doc-bytes (67108864, 64M, 1G) and --max-ratio as typed ('' = the default) -> keyword
    arguments of prepare() and train_tokenizer()."""
    out = {}
    if str(max_doc_bytes).strip():
        size = _SIZE.fullmatch(str(max_doc_bytes).strip())
        if size is None:
            raise DataError(f"--max-doc-bytes {max_doc_bytes}: expected a size in bytes such as 67108864, 64M or 1G")
        out["max_doc_bytes"] = int(size[1]) << {"": 0, "k": 10, "m": 20, "g": 30}[size[2].lower()]
    if str(max_ratio).strip():
        try:
            out["max_ratio"] = int(str(max_ratio).strip())
        except ValueError:
            raise DataError(f"--max-ratio {max_ratio}: expected 0 (off) or a whole number such as "
                            f"{Limits.max_ratio}") from None
    return out


def check_bpe_vocab(vocab_size: int) -> None:
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{minimum} (256 bytes + {len(SPECIAL_TOKENS)} specials)")


def tokenizer_path(tokenizer: str) -> Path:
    """The tokenizer.json that --tokenizer names (a file, or a directory holding one)."""
    if not str(tokenizer).strip():
        raise DataError(f"--tokenizer is empty; {EXPECTED_TOKENIZER}")
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(f"--tokenizer {tokenizer}: a directory without a tokenizer.json; "
                            f"{EXPECTED_TOKENIZER}")
        return path / "tokenizer.json"
    if not path.exists():
        raise DataError(f"--tokenizer {tokenizer}: no such file; {EXPECTED_TOKENIZER}")
    return path



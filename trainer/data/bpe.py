"""Training a byte-level BPE tokenizer on a corpus: `inv data.tokenizer` (and --tokenizer bpe).

The corpus is streamed document by document (any format data.prepare reads) into Hugging Face
`tokenizers`' trainer; the tokenizer.json is written atomically.
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from core.files import make_parent
from core.signals import interrupted_by

from . import sources
from .errors import DataError, Interrupted
from .formats import Limits, Tally
from .options import check_bpe_vocab, check_options
from .tokenizers import train_bpe

DEFAULT_BPE_VOCAB = 8192


def train_tokenizer(inputs: list[Path] | None, out: Path, vocab_size: int = DEFAULT_BPE_VOCAB, *,
                    text_field: str = "text", max_docs: int | None = None,
                    pattern: str | None = None, max_doc_bytes: int = Limits.max_doc_bytes,
                    max_ratio: int = Limits.max_ratio) -> dict:
    """Train a byte-level BPE tokenizer on a corpus (default: the stdlib) and save it; the corpus is
    read within the limits data.prepare reads it (formats.Limits)."""
    started = time.monotonic()
    check_options(text_field=text_field, pattern=pattern, max_docs=max_docs, max_doc_bytes=max_doc_bytes,
                  max_ratio=max_ratio)
    check_bpe_vocab(vocab_size)
    files, input_names, _ = sources.resolve_inputs(inputs, pattern)
    out = _check_tokenizer_out(out, input_names)
    tally = Tally()
    texts = sources.documents(files, text_field, tally, max_docs, Limits(max_doc_bytes, max_ratio))
    first = next(texts, None)  # a corpus with nothing usable must not give an alphabet-only BPE
    if first is None:
        raise sources.nothing_usable(input_names, files, tally.skipped, text_field, next(iter(tally.notes), None))
    documents = 0

    def counted(texts):   # the documents the trainer read, for the result line
        nonlocal documents
        for text in texts:
            documents += 1
            yield text
    try:
        tok = train_bpe(counted(itertools.chain([first], texts)), vocab_size, out)
    except OSError as exc:
        raise DataError(f"--out {out}: cannot write it ({exc.strerror or exc}); it is as it was") from None
    except KeyboardInterrupt as exc:   # Ctrl-C, or a stop signal inv turned into one (core.signals)
        what, code = interrupted_by(exc)
        raise Interrupted(f"interrupted ({what}) while training the tokenizer; nothing was written "
                          f"and {out} is as it was", code) from None
    return {"path": str(out), "vocab_size": tok.vocab_size, "inputs": input_names,
            "files": len(files), "documents": documents, "max_docs": max_docs, "sha256": tok.sha256,
            "seconds": time.monotonic() - started, "skipped": tally.skipped, "changed": tally.changed,
            "notes": tally.notes}


def _is_tokenizer_json(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model" in data and "added_tokens" in data


def _check_tokenizer_out(out, inputs: list[str]) -> Path:
    """The absolute path data.tokenizer may write, or DataError: not '', not a directory, not
    a file in the corpus, and an existing file only when it is a tokenizer.json itself."""
    given = str(out)
    example = "expected a file path such as data/bpe8192.json"
    if not given.strip():
        raise DataError(f"--out is empty; {example}")
    path = Path(given).expanduser().absolute()
    if path.is_dir():
        raise DataError(f"--out {given} is a directory; {example} (or {given}/tokenizer.json)")
    for name in inputs:
        source = Path(name).resolve()
        if path.resolve() == source or source in path.resolve().parents:
            raise DataError(f"--out {given} is {'' if path.resolve() == source else 'inside '}the input "
                            f"{source}; {example} outside the corpus")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"--out {given}: a file is in the way where a directory is needed ({parent})")
            break
    if path.exists() and not _is_tokenizer_json(path):
        raise DataError(f"--out {given} exists and is not a tokenizer.json; expected a new file, or a "
                        f"tokenizer.json to replace")
    make_parent(path, DataError, given)
    return path

"""Reading a prepared dataset directory: its manifest and its token shards as memmaps.

Layout (written by prepare.py):
    manifest.json            what is here and how it was made
    train/000000.bin ...     the token stream of the split, cut into shards (raw uint16/uint32)
    train/documents.bin      uint64 start offset of every document in that stream
    val/...                  the same for the held-out documents
    tokenizer.json           when a BPE or tokenizer.json tokenizer was used
A document is BOS, its tokens, EOS; documents follow each other without padding.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from core.files import leaves_folder, seal_problem

from .errors import DataError

FORMAT = "anvil-tokens/1"
MANIFEST = "manifest.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (ids 0..65535), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def bad_token_error(root: Path, file: Path, token_id: int, position: int, vocab_size: int) -> DataError:
    """The one message for a shard holding an id the tokenizer cannot have made."""
    return DataError(f"dataset {root} is damaged: {file} holds token id {token_id} at token {position}, "
                     f"outside the tokenizer's vocabulary of {vocab_size} (ids 0..{vocab_size - 1}); "
                     f"prepare it again with --force")


def read_manifest(path: Path) -> dict:
    """The manifest of the dataset at `path`, checked for the keys readers use; DataError
    saying what is wrong (no dataset, not a directory, a damaged manifest) otherwise."""
    if not str(path).strip():
        raise DataError("the dataset path is empty; expected a dataset directory made by inv data.prepare")
    path = Path(path)
    manifest_path = path / MANIFEST
    if path.exists() and not path.is_dir():
        raise DataError(f"{path} is a file, not a directory; expected a dataset directory made by "
                        f"inv data.prepare")
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        if not path.exists():
            hint = "run `inv data.prepare` to build it"
        elif (path / "train").is_dir() or (path / "val").is_dir():     # shards, no manifest: cut short
            hint = "it is not a finished dataset; run `inv data.prepare` again"
        else:
            hint = "this folder is not a dataset; give one made by `inv data.prepare --out DIR`"
        raise DataError(f"no prepared dataset at {path} (no {MANIFEST}); {hint}") from None
    except OSError as exc:
        raise DataError(f"cannot read {manifest_path} ({exc.strerror or exc})") from None
    damaged = "the dataset is damaged; prepare it again with --force"
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{manifest_path} is not text (invalid UTF-8 at byte {exc.start}); {damaged}") from None
    except ValueError as exc:
        raise DataError(f"{manifest_path} is not valid JSON ({exc}); {damaged}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{manifest_path} is not an Anvil dataset manifest (format {FORMAT!r} expected)")
    problem = seal_problem(manifest) or _manifest_problem(manifest)
    if problem:
        raise DataError(f"{manifest_path} {problem}; {damaged}")
    return manifest


def _manifest_problem(m: dict) -> str:
    """What is missing or mistyped in a manifest's keys that readers rely on ("" if nothing)."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if m.get("dtype") not in ("uint16", "uint32"):
        return f"has dtype {m.get('dtype')!r} (expected uint16 or uint32)"
    tok = m.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("kind"), str) or not count(tok.get("vocab_size")):
        return "has no tokenizer kind and vocab_size"
    for key in ("documents", "tokens"):
        if not count(m.get(key)):
            return f"has no {key} count"
    splits = m.get("splits")
    if not isinstance(splits, dict):
        return "has no splits"
    for name, split in splits.items():
        if not isinstance(split, dict) or not count(split.get("documents")) or not isinstance(
                split.get("shards"), list):
            return f"has no documents count or shard list for split {name!r}"
        for shard in split["shards"]:
            if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) or not count(
                    shard.get("tokens")):
                return f"has a shard of split {name!r} without a file name and token count"
        index = split.get("doc_index")
        if index is not None and not (isinstance(index, dict) and isinstance(index.get("file"), str)):
            return f"has a document index of split {name!r} without a file name"
        # (checked whether the manifest is sealed or not: a seal anyone can recompute vouches for nothing)
        for file in [shard["file"] for shard in split["shards"]] + ([index["file"]] if index else []):
            problem = leaves_folder(file)
            if problem:
                return f"names {file!r} as a file of split {name!r}, which {problem}"
    return ""


class SplitStream:
    """One split's token stream, seen as a single array across its shard files."""

    def __init__(self, root: Path, name: str, info: dict, dtype: np.dtype):
        self.name = name
        self.info = info
        self.documents = int(info["documents"])
        self.root = root
        self._shards, self._files, starts = [], [], [0]
        for shard in info["shards"]:
            file = root / shard["file"]
            expected = int(shard["tokens"]) * dtype.itemsize
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise DataError(f"dataset {root} is incomplete: {file} is missing; "
                                f"prepare it again with --force") from None
            if size != expected:
                raise DataError(f"dataset {root} is damaged: {file} has {size} bytes, "
                                f"the manifest says {expected}; prepare it again with --force")
            if expected:
                self._shards.append(np.memmap(file, dtype=dtype, mode="r"))
                self._files.append(file)
                starts.append(starts[-1] + int(shard["tokens"]))
        self._starts = np.asarray(starts, dtype=np.int64)
        self.tokens = int(self._starts[-1])
        self._index_file = root / info["doc_index"]["file"] if info.get("doc_index") else None

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split, copied out of the shards."""
        if start < 0 or start + length > self.tokens:
            raise IndexError(f"{self.name}: tokens [{start}, {start + length}) outside [0, {self.tokens})")
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        offset = start - int(self._starts[shard])
        first = self._shards[shard][offset:offset + length]
        if len(first) == length:
            return np.array(first)
        parts, need = [first], length - len(first)
        while need:
            shard += 1
            part = self._shards[shard][:need]
            parts.append(part)
            need -= len(part)
        return np.concatenate(parts)

    def locate(self, position: int) -> tuple[Path, int]:
        """(shard file, token index inside it) of token `position` of the split."""
        shard = int(np.searchsorted(self._starts, position, side="right")) - 1
        return self._files[shard], position - int(self._starts[shard])

    def check_ids(self, vocab_size: int, chunk: int = 1 << 24) -> None:
        """Scan every shard (a max() per chunk of `chunk` tokens); DataError naming the
        file and the position of the first id outside 0..vocab_size-1."""
        for file, tokens in zip(self._files, self._shards):
            for start in range(0, len(tokens), chunk):
                part = tokens[start:start + chunk]
                if int(part.max()) >= vocab_size:
                    at = int(np.argmax(part >= vocab_size))
                    raise bad_token_error(self.root, file, int(part[at]), start + at, vocab_size)

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """Start offset of every document (uint64), from documents.bin."""
        if self._index_file is None:
            return np.zeros(0, dtype=np.uint64)
        return np.fromfile(self._index_file, dtype=np.uint64)

    def doc_lengths(self) -> np.ndarray:
        starts = self.doc_starts.astype(np.int64)
        return np.diff(np.append(starts, self.tokens))

    def document(self, i: int) -> np.ndarray:
        starts = self.doc_starts
        end = int(starts[i + 1]) if i + 1 < len(starts) else self.tokens
        return self.read(int(starts[i]), end - int(starts[i]))


class Dataset:
    """A prepared dataset directory (manifest.json + shards)."""

    def __init__(self, path: str | Path):
        if not str(path).strip():  # Path("") would be the current directory
            read_manifest("")
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])

    def split(self, name: str) -> SplitStream:
        splits = self.manifest["splits"]
        if name not in splits:
            raise DataError(f"dataset {self.path} has no split {name!r}; expected one of: "
                            f"{', '.join(splits) or '(none)'}")
        return SplitStream(self.path, name, splits[name], self.dtype)

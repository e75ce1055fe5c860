"""Assembling finished parts into the dataset: train/val token streams cut into shards.

Parts are read in unit order and their documents in reading order, so the dataset is the
same whichever worker or node made which part. Each document goes to train or val by a
hash of its name (`path#record`): stable across runs, orders, workers and the way files were
cut. The last document is held back until the end, so neither split is left empty when
there are documents for both. --max-docs / --max-tokens end the assembly there.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from pathlib import Path

import numpy as np

from .formats import Tally
from .parts import WorkFolder


class ShardWriter:
    """Appends documents to one split's stream: fixed-size shard files, sha256 and a doc index."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        (root / split).mkdir()
        self.tokens = 0
        self.doc_starts = array("Q")
        self.shards: list[dict] = []
        self._file = None

    def add(self, doc: np.ndarray) -> None:
        self.doc_starts.append(self.tokens)
        while len(doc):
            if self._file is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, doc = doc[:room], doc[room:]
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self.shards[-1]["tokens"] += len(part)
            self.tokens += len(part)

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.split}/{len(self.shards):06d}.bin"
        self._file = open(self.root / name, "wb")
        self._hash = hashlib.sha256()
        self.shards.append({"file": name, "tokens": 0, "sha256": None})

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            self.shards[-1]["sha256"] = self._hash.hexdigest()

    def close(self) -> dict:
        self._close_current()
        index = f"{self.split}/documents.bin"
        data = self.doc_starts.tobytes()
        with open(self.root / index, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return {"documents": len(self.doc_starts), "tokens": self.tokens, "shards": self.shards,
                "doc_index": {"file": index, "sha256": hashlib.sha256(data).hexdigest()}}

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def is_val(key: str, seed: int, val_fraction: float) -> bool:
    """Held out by a hash of the document's name: stable across runs, orders, workers."""
    h = int.from_bytes(hashlib.sha1(f"{seed}:{key}".encode()).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def _rows(table: np.ndarray, block: int = 1 << 16):
    """The rows of a document table as Python ints, a block at a time (bounded memory)."""
    for start in range(0, len(table), block):
        yield from table[start:start + block].tolist()


def assemble(units: list, parts: dict[int, dict], folder: WorkFolder, out: Path, dtype: np.dtype,
             settings: dict) -> dict:
    """Write the splits of `out` from the parts of `units` (all finished); returns the counts
    the manifest records: splits, documents, tokens, skipped, changed, examples, files used, truncated."""
    max_docs, max_tokens = settings["max_docs"], settings["max_tokens"]
    seed, val_fraction = settings["seed"], settings["val_fraction"]
    writers = {s: ShardWriter(out, s, dtype, settings["shard_tokens"]) for s in ("train", "val")}
    records: dict[Path, int] = {}       # records of each file read so far: numbers in the whole file
    used: set[Path] = set()
    tally = Tally()     # skips and changes by reason; the first notes (the manifest's examples)
    docs = total_tokens = done_bytes = 0
    pending = None   # the latest document, held back so val or train can be made non-empty
    truncated = False
    try:
        for unit in units:
            info = parts[unit.index]
            done_bytes += unit.size
            table = folder.documents(unit.index)
            tokens = folder.tokens(unit.index, dtype)
            bases = []
            for span, reading in zip(unit.spans, info["spans"]):
                base = records.get(span.source.path, 0)
                bases.append(base)
                records[span.source.path] = base + reading["records"]
                tally.add(span.source.path, reading, base)
            position = 0
            for span_number, record, length in _rows(table):
                span = unit.spans[span_number]
                key = span.source.key if span.format == "text" else f"{span.source.key}#{bases[span_number] + record}"
                if pending is not None:
                    writers[pending[0]].add(pending[1])
                pending = ("val" if is_val(key, seed, val_fraction) else "train",
                           np.asarray(tokens[position:position + length]))
                used.add(span.source.path)
                position += length
                docs += 1
                total_tokens += length
                if (max_docs and docs >= max_docs) or (max_tokens and total_tokens >= max_tokens):
                    truncated = True
                    break
            if truncated:
                break
        if pending is not None:
            split = pending[0]
            if val_fraction > 0 and not writers["val"].doc_starts and writers["train"].doc_starts:
                split = "val"
            elif not writers["train"].doc_starts:
                split = "train"
            writers[split].add(pending[1])
        splits = {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return {"splits": splits, "documents": docs, "tokens": total_tokens, "skipped": tally.skipped,
            "changed": tally.changed, "examples": tally.notes, "files_used": len(used), "bytes_read": done_bytes,
            "truncated": truncated}

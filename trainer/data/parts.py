"""The work folder of a prepare: each finished unit's tokens on disk, so a killed or stopped
prepare continues where it was on the next run instead of starting over.

    .OUT.parts-<fingerprint>/      beside the dataset; removed once the dataset is in place
        plan.json                  the settings and the units; parts belong to this plan only
        tokenizer.json             the BPE trained for this build (--tokenizer bpe), reused on resume
        000012.tokens              unit 12's documents, each BOS ids EOS (the dataset's dtype)
        000012.docs                per document: span number in the unit, record number in the
                                   span, token count (int64, three a row)
        000012.json                written last: the counts, what reading each span gave, and the
                                   sha256 of the two files; a unit without it is done again

A part's files are written under temporary names and renamed into place, the .json last, so
a worker killed halfway leaves nothing that counts. Two processes making the same part (a
worker of a killed run that had not noticed yet) write the same bytes: the output of a unit
depends on nothing but its input.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from array import array
from pathlib import Path

import numpy as np

from core.files import make_temp_dir, sha256_file, write_atomic, write_json_atomic

PLAN = "plan.json"
LAYOUT = 1   # bump when a part's files change meaning: older work folders are then not reused


def folder_for(out: Path, fingerprint: str) -> Path:
    return out.parent / f".{out.name}.parts-{fingerprint[:16]}"


def stale_folders(out: Path, fingerprint: str | None) -> list[Path]:
    """Work folders beside `out` of other inputs or settings (a changed corpus, another --seed)."""
    keep = folder_for(out, fingerprint).name if fingerprint else None
    return sorted(p for p in out.parent.glob(f".{out.name}.parts-*") if p.name != keep)


class WorkFolder:
    """The parts of one plan: which are finished (and intact), and where a worker writes one."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def open(cls, out: Path, fingerprint: str, plan: dict) -> tuple["WorkFolder", bool]:
        """(the folder, whether it already held this plan's parts). A folder of the same
        fingerprint but another plan (another Anvil, another layout) is emptied first."""
        path = folder_for(out, fingerprint)
        plan = {"layout": LAYOUT, "fingerprint": fingerprint, **plan}
        try:
            existing = json.loads((path / PLAN).read_text())
        except (OSError, ValueError):
            existing = None
        if existing == json.loads(json.dumps(plan)):
            return cls(path), True
        if path.exists():
            shutil.rmtree(path)
        tmp = make_temp_dir(out.parent, prefix=f"{path.name}.new-")
        write_json_atomic(tmp / PLAN, plan)
        os.replace(tmp, path)
        return cls(path), False

    def files(self, index: int) -> dict[str, Path]:
        stem = self.path / f"{index:06d}"
        return {"tokens": stem.with_suffix(".tokens"), "docs": stem.with_suffix(".docs"),
                "info": stem.with_suffix(".json")}

    def finished(self, index: int, check: bool = True) -> dict | None:
        """The record of a finished part, or None (not finished, or its files do not match it)."""
        files = self.files(index)
        try:
            info = json.loads(files["info"].read_text())
            for name in ("tokens", "docs"):
                if files[name].stat().st_size != info["bytes"][name]:
                    return None
                if check and sha256_file(files[name]) != info["sha256"][name]:
                    return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return info

    def tokens(self, index: int, dtype) -> np.ndarray:
        return np.memmap(self.files(index)["tokens"], dtype=dtype, mode="r") \
            if self.files(index)["tokens"].stat().st_size else np.empty(0, dtype=dtype)

    def documents(self, index: int) -> np.ndarray:
        """[span, record, tokens] per document of a finished part."""
        return np.fromfile(self.files(index)["docs"], dtype=np.int64).reshape(-1, 3)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class PartWriter:
    """Writes one unit's documents: tokens as they come, the document table and record at the end.

    Whole documents come in batches (`add`); a long document comes in pieces (`begin`,
    `extend`..., `end`), and `drop` takes back the one begun (a problem found in its middle);
    `rollback(mark())` takes back everything written since the mark (a file found to be a bomb)."""

    def __init__(self, folder: WorkFolder, index: int, dtype, bos: int, eos: int):
        self.folder, self.index, self.dtype = folder, index, np.dtype(dtype)
        self.bos, self.eos = bos, eos
        self.final = folder.files(index)
        suffix = f".{os.getpid()}.tmp"
        self.paths = {name: path.with_name(path.name + suffix) for name, path in self.final.items()}
        self._file = open(self.paths["tokens"], "wb")
        self._hash = hashlib.sha256()
        self.docs = array("q")
        self.tokens = 0
        self._open: tuple | None = None   # a long document begun: (span, record, the mark at its start)

    @property
    def in_document(self) -> bool:
        """A long document was begun and not ended yet."""
        return self._open is not None

    def _write(self, data: np.ndarray) -> None:
        raw = data.astype(self.dtype, copy=False).tobytes()
        self._file.write(raw)
        self._hash.update(raw)
        self.tokens += len(data)

    def add(self, span: int, records: list[int], ids: list) -> None:
        """Whole documents: BOS + ids + EOS each, in order."""
        if not records:
            return
        lengths = np.fromiter((len(i) + 2 for i in ids), dtype=np.int64, count=len(ids))
        ends = np.cumsum(lengths)
        out = np.empty(int(ends[-1]), dtype=self.dtype)
        bounds = np.zeros(len(out), dtype=bool)
        bounds[ends - lengths] = True
        bounds[ends - 1] = True
        out[ends - lengths] = self.bos
        out[ends - 1] = self.eos
        out[~bounds] = _flat(ids, self.dtype, len(out) - 2 * len(ids))
        self._write(out)
        for record, length in zip(records, lengths.tolist()):
            self.docs.extend((span, record, length))

    def mark(self) -> tuple:
        """Where the part is now (tokens, file offset, hash, documents): what rollback returns to."""
        return self.tokens, self._file.tell(), self._hash.copy(), len(self.docs)

    def rollback(self, mark: tuple) -> None:
        """Take back every token and document written since `mark`."""
        tokens, offset, digest, docs = mark
        self._file.seek(offset)
        self._file.truncate()
        self.tokens, self._hash, self._open = tokens, digest.copy(), None
        del self.docs[docs:]

    def begin(self, span: int, record: int) -> None:
        self._open = (span, record, self.mark())
        self._write(np.array([self.bos]))

    def extend(self, ids) -> None:
        self._write(_flat([ids], self.dtype, len(ids)))

    def end(self) -> None:
        self._write(np.array([self.eos]))
        span, record, mark = self._open
        self.docs.extend((span, record, self.tokens - mark[0]))
        self._open = None

    def drop(self) -> None:
        if self._open is not None:
            self.rollback(self._open[2])

    def finish(self, readings: list[dict], size: int) -> dict:
        """Close the part: files renamed into place, the record (.json) last; returns the record."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        docs = self.docs.tobytes()
        write_atomic(self.paths["docs"], docs)
        info = {"unit": self.index, "documents": len(self.docs) // 3, "tokens": self.tokens,
                "size": size, "spans": readings,
                "bytes": {"tokens": self.tokens * self.dtype.itemsize, "docs": len(docs)},
                "sha256": {"tokens": self._hash.hexdigest(), "docs": hashlib.sha256(docs).hexdigest()}}
        os.replace(self.paths["tokens"], self.final["tokens"])
        os.replace(self.paths["docs"], self.final["docs"])
        write_json_atomic(self.final["info"], info)
        return info

    def abandon(self) -> None:
        """Stopped halfway: remove what was written; nothing of this part counts."""
        if not self._file.closed:
            self._file.close()
        for path in self.paths.values():
            try:
                path.unlink()
            except OSError:
                pass


def _flat(ids: list, dtype, count: int) -> np.ndarray:
    """The token ids of several documents as one array (lists from tokenizers, arrays from bytes)."""
    if ids and isinstance(ids[0], np.ndarray):
        return np.concatenate(ids).astype(dtype, copy=False) if len(ids) > 1 else ids[0].astype(dtype, copy=False)
    from itertools import chain
    return np.fromiter(chain.from_iterable(ids), dtype=dtype, count=count)

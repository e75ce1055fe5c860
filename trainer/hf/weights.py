"""The weights of a Hugging Face directory: model.safetensors or a sharded index
(model.safetensors.index.json, whose weight_map names each tensor's file).

    weights = HFWeights.open(directory)   headers only: names, dtypes, shapes (no weight is read)
    weights.check(shapes, optional, skipped)   each tensor the model needs, of its shape, and no other
    weights.provenance()                  where a run started, for metadata.json and the summary
    weights.loaded                        after check: the tensors that go into the model (each
                                          tensor's file: weights.tensors[name].file)

Every problem is an InitError of one line naming the file: no weights, a header that is not
safetensors, a file cut short, an index naming a missing file or a tensor its file lacks, tensors
missing, unexpected or of the wrong shape or dtype.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import InitError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Bytes per element of the safetensors dtypes whose size is whole (F4, F6 pack theirs: their layout
# is still checked)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_HEADER = 100 * 2**20   # safetensors' own limit on the JSON header
# Buffers that older transformers wrote into checkpoints and that it skips on load
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


class HFWeights:
    def __init__(self, directory: Path, tensors: dict[str, TensorInfo], headers: dict[Path, bytes],
                 index: bytes | None):
        self.directory = directory
        self.tensors = tensors            # every tensor the checkpoint names (IGNORED ones left out)
        self.headers = headers            # file -> its raw JSON header, in file-name order
        self.index = index                # the index file's bytes, None for a single file
        self.loaded: list[str] = []       # set by check: the tensors that go into the model

    @property
    def source(self) -> Path:
        """The file that lists the weights: the index, or the one safetensors file."""
        return self.directory / (INDEX if self.index is not None else SINGLE)

    @classmethod
    def open(cls, directory: str | Path) -> "HFWeights":
        directory = Path(directory).expanduser()
        if (directory / SINGLE).is_file():   # transformers' order: the single file first
            header, entries = read_header(directory / SINGLE)
            tensors = {name: info for name, info in entries.items() if not IGNORED.match(name)}
            return cls(directory, tensors, {directory / SINGLE: header}, None)
        if not (directory / INDEX).is_file():
            raise InitError(f"--init-from {directory}: no {SINGLE} or {INDEX} there (PyTorch .bin "
                            f"weights are not read: save them with transformers' save_pretrained, which "
                            f"writes safetensors)")
        index_bytes, weight_map = _read_index(directory / INDEX)
        headers, tensors = {}, {}
        for file_name in sorted(set(weight_map.values())):
            path = directory / file_name
            if not path.is_file():
                raise InitError(f"{directory / INDEX} names {file_name}, which is missing from {directory}")
            headers[path], entries = read_header(path)
            for name in (n for n, f in weight_map.items() if f == file_name and not IGNORED.match(n)):
                if name not in entries:
                    raise InitError(f"{directory / INDEX} puts {name} in {file_name}, which has no such tensor")
                tensors[name] = entries[name]
        return cls(directory, tensors, headers, index_bytes)

    def check(self, shapes: dict[str, tuple[int, ...]], optional: tuple[str, ...] = (),
              skipped: Callable[[str], bool] | None = None) -> None:
        """The checkpoint holds exactly the tensors of `shapes` (name -> shape), floating point;
        names in `optional` may be there too and are not loaded (a tied lm_head.weight), nor are
        those `skipped` says (modules the model does not build: DeepSeek-V3's multi-token prediction)."""
        names = {name for name in self.tensors if name in shapes or skipped is None or not skipped(name)}
        missing = sorted(set(shapes) - names, key=_natural)
        extra = sorted(names - set(shapes) - set(optional), key=_natural)
        wrong = [f"{n} {list(self.tensors[n].shape)} (the model's is {list(shapes[n])})"
                 for n in sorted(names & set(shapes), key=_natural) if self.tensors[n].shape != tuple(shapes[n])]
        dtypes = [f"{n} {self.tensors[n].dtype}" for n in sorted(names & set(shapes), key=_natural)
                  if self.tensors[n].dtype not in FLOAT_DTYPES]
        problems = [_listed(len(missing), "missing", missing), _listed(len(extra), "unexpected", extra),
                    _listed(len(wrong), "of the wrong shape", wrong),
                    _listed(len(dtypes), f"not floating point ({', '.join(FLOAT_DTYPES)})", dtypes)]
        problems = [p for p in problems if p]
        if problems:
            raise InitError(f"{self.source}: {'; '.join(problems)}, for the model of "
                            f"{self.directory / 'config.json'}")
        self.loaded = sorted(names & set(shapes), key=_natural)

    def provenance(self) -> dict:
        """Where a run started: the directory, sha256 of its config.json and of its index (or of
        the safetensors headers, which hold every name, dtype, shape and offset), tensors loaded."""
        headers = hashlib.sha256()
        for header in self.headers.values():
            headers.update(header)
        config = self.directory / "config.json"
        return {"path": str(self.directory.resolve()),
                "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
                "weights": self.source.name,
                "index_sha256": hashlib.sha256(self.index).hexdigest() if self.index is not None else None,
                "headers_sha256": headers.hexdigest(),
                "files": len(self.headers),
                "tensors": len(self.loaded),
                "parameters": sum(_numel(self.tensors[n].shape) for n in self.loaded),
                "dtypes": sorted({self.tensors[n].dtype for n in self.loaded})}


def read_header(path: Path) -> tuple[bytes, dict[str, TensorInfo]]:
    """(the raw JSON header, name -> TensorInfo) of a safetensors file; no weight is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < length <= min(MAX_HEADER, size - 8):
                raise InitError(f"{path}: not a safetensors file (no header of a plausible size)")
            header = f.read(length)
    except OSError as exc:
        raise InitError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        raw = json.loads(header)
    except ValueError:
        raise InitError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(raw, dict):
        raise InitError(f"{path}: not a safetensors file (its header is not a JSON object)")
    entries, spans = {}, []
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not (isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
                    and isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise InitError(f"{path}: damaged header (the entry of {name!r} is not dtype, shape, "
                            f"data_offsets)") from None
        entries[name] = TensorInfo(path, dtype, shape)
        spans.append((start, stop, name))
        need = _numel(shape) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else stop - start
        if stop - start != need:   # safetensors would read another tensor's bytes, or past its own
            raise InitError(f"{path}: damaged header ({name} is {dtype} {list(shape)}, {need:,} bytes, but its "
                            f"data_offsets [{start}, {stop}] hold {stop - start:,})")
    end = 0
    for start, stop, name in sorted(spans):   # one after the other from 0, as safetensors writes them
        if start != end:
            raise InitError(f"{path}: damaged header ({name}'s data_offsets [{start}, {stop}] "
                            + ("overlap the tensor before it" if start < end else f"leave a gap after byte {end}")
                            + ")")
        end = stop
    if 8 + length + end > size:
        raise InitError(f"{path}: cut short ({size:,} bytes; its header describes {8 + length + end:,})")
    return header, entries


def _read_index(path: Path) -> tuple[bytes, dict[str, str]]:
    try:
        data = path.read_bytes()
        raw = json.loads(data)
    except OSError as exc:
        raise InitError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise InitError(f"{path}: not valid JSON ({exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
        raise InitError(f"{path}: expected a weight_map of tensor name -> file name in this directory")
    return data, weight_map


def _listed(count: int, what: str, items: list[str], show: int = 3) -> str:
    if not count:
        return ""
    more = f", and {count - show} more" if count > show else ""
    return f"{count} tensor{'s' * (count != 1)} {what} ({', '.join(items[:show])}{more})"


def _natural(name: str) -> list:
    """model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

"""Reading a DCP checkpoint as data, never code: its `.metadata` and its non-tensor values.

torch.distributed.checkpoint reads `.metadata` with pickle.load, and each non-tensor value of a shard
(the optimizer's param_groups: lr, betas, ...) with torch.load(weights_only=False): a checkpoint from
elsewhere whose pickle names os.system runs it, and checksums.json recomputed to match says nothing.
Here `.metadata` goes through an unpickler that resolves only the globals DCP metadata is made of
(METADATA_GLOBALS: found by pickling the metadata of FSDP2 and DDP checkpoints of torch 2.13 and
walking their opcodes), and each value through torch.load(weights_only=True) first. Any other global
is a CheckpointError naming the file and the global, raised when the unpickler meets its name: before
it is imported, let alone called. Every file `.metadata` points into must lie inside the checkpoint.

    metadata = safe_dcp.read_metadata(step_dir)            # CheckpointError: one line
    dcp.load(state, storage_reader=safe_dcp.reader(step_dir), planner=safe_dcp.planner())
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from core.files import leaves_folder
from trainer.checkpoint.layout import DCP_METADATA, CheckpointError

_DCP = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset(
    {(_DCP, name) for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                               "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
       ("torch", "Size"),
       ("torch.serialization", "_get_layout"),   # a layout by its name ("torch.strided"): a dict lookup
       ("collections", "OrderedDict"),           # (not in torch 2.13's: a plain container, should another have it)
       # StorageMeta.checkpoint_id, the folder it was saved to (pathlib._local: Python 3.13's module)
       *((module, cls) for module in ("pathlib", "pathlib._local")
         for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
REFUSED = "which no DCP checkpoint holds: refused before it is read (a checkpoint is data, never code)"


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise CheckpointError(f"{self.path} names the global {module}.{name}, {REFUSED}")
        return super().find_class(module, name)


def read_metadata(checkpoint: Path, file: str = DCP_METADATA) -> Metadata:
    """A checkpoint's DCP metadata, read as data; CheckpointError naming the file and what is wrong:
    not readable, a global of another kind, not DCP metadata, a shard outside the folder."""
    path = Path(checkpoint) / file
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled pickle: whatever pickle makes of it
        raise CheckpointError(f"{path} is not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        problem = leaves_folder(name)
        if problem:
            raise CheckpointError(f"{path} puts a shard in {name!r}, which {problem}: refused")
    return metadata


class _Reader(FileSystemReader):
    """DCP's FileSystemReader with read_metadata through read_metadata above."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(Path(self.path), DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id     # as DCP's own read_metadata does
        return metadata


class _Planner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor values pass torch.load(weights_only=True) first."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:
            metadata = getattr(self, "metadata", None)
            info = metadata.storage_data.get(read_item.storage_index) if metadata is not None else None
            where = getattr(info, "relative_path", "a shard")
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))   # (torch words it in more than one way)
            what = f"the global {found.group(1)}" if found else "something other than plain values"
            raise CheckpointError(f"{where}: the value of {read_item.dest_index.fqn} holds {what}, {REFUSED}") \
                from None
        # The same bytes again through DCP's own load_bytes (which puts them where they go): they were
        # just read with weights_only, so this reading calls nothing else.
        super().load_bytes(read_item, io.BytesIO(data))


def reader(checkpoint: Path) -> FileSystemReader:
    return _Reader(str(checkpoint))


def planner() -> DefaultLoadPlanner:
    return _Planner()

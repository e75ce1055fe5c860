"""Which files a corpus is: the inputs named, folders walked in a fixed order, and the default.

Inputs are files or folders, in the order given; a folder is walked in sorted order, hidden
entries left out. A folder written by Hugging Face `datasets.save_to_disk` (its state.json
names the data files) contributes those Arrow files in its own order; a DatasetDict folder
(dataset_dict.json) its `train` split, or every split when it has none. What each file holds
is the formats' business (formats/): here a file is a path, a stable key and its size.
"""
from __future__ import annotations

import fnmatch
import json
import os
import sysconfig
from pathlib import Path

from .errors import DataError
from .formats import Limits, Reading, SourceFile, Tally, read, spans

# The default corpus: the standard library's own modules. Test suites are left out:
# they hold deliberately broken sources and large data tables, not library code.
STDLIB_EXCLUDE_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests",
                       "idle_test", "lib2to3_tests"}

__all__ = ["SourceFile", "default_inputs", "documents", "expand_inputs", "resolve_inputs", "stdlib_dir"]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_inputs() -> tuple[list[Path], str, set[str]]:
    """(inputs, pattern, excluded dir names) of the embedded default corpus."""
    return [stdlib_dir()], "*.py", STDLIB_EXCLUDE_DIRS


def resolve_inputs(inputs: list[Path] | None, pattern: str | None = None
                   ) -> tuple[list[SourceFile], list[str], bool]:
    """(files, input names, is the default corpus) for what the user named (None: stdlib)."""
    if inputs:
        files = expand_inputs([Path(p) for p in inputs], pattern or "*")
        names = list(dict.fromkeys(str(Path(p).absolute()) for p in inputs))
    else:
        roots, default_pattern, exclude = default_inputs()
        files = expand_inputs(roots, pattern or default_pattern, exclude)
        names = [str(r) for r in roots]
    if not files:
        raise DataError(f"no input files found in {', '.join(names)}"
                        + (f" matching {pattern!r}" if pattern else "")
                        + "; expected text or JSONL files (.gz, .zst too), Parquet or Arrow "
                          "files, or a save_to_disk folder" + (" or another --pattern" if pattern else ""))
    return files, names, not inputs


def nothing_usable(names: list[str], files: list[SourceFile], skipped: dict, text_field: str,
                   first_note: str | None = None) -> DataError:
    """The one error for a corpus none of whose documents can be used, with what was skipped
    (and the first skip's note: it often names the columns the files do have)."""
    detail = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "nothing readable"
    return DataError(f"no usable documents in {', '.join(names)} ({len(files)} "
                     f"file{'' if len(files) == 1 else 's'}; skipped: {detail}"
                     + (f"; first: {first_note}" if first_note else "")
                     + f"); expected UTF-8 text files, or JSONL lines / Parquet or Arrow rows with a "
                       f"text field {text_field!r} (--text-field)")


def hf_data_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a `save_to_disk` folder in their order (a DatasetDict: its train
    split, else every split), or None when `folder` is not one."""
    try:
        if (folder / "dataset_dict.json").is_file():
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits") or []
            chosen = ["train"] if "train" in splits else list(splits)
            files = [f for split in chosen for f in (hf_data_files(folder / split) or [])]
            return files
        if (folder / "state.json").is_file():
            entries = json.loads((folder / "state.json").read_text()).get("_data_files")
            if isinstance(entries, list):
                return [folder / str(e["filename"]) for e in entries if isinstance(e, dict) and "filename" in e]
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{folder}: looks like a Hugging Face save_to_disk folder but its "
                        f"state.json or dataset_dict.json cannot be read ({exc})") from None
    return None


def expand_inputs(inputs: list[Path], pattern: str = "*", exclude_dirs: set[str] = frozenset()
                  ) -> list[SourceFile]:
    """Every file named or found under a named directory, in a deterministic order:
    the inputs in the order given, each directory walked in sorted order."""
    missing = [str(p) for p in inputs if not Path(p).exists()]
    if missing:
        raise DataError(f"input not found: {', '.join(missing)}; expected existing files or directories")
    files: list[SourceFile] = []
    for given in map(Path, inputs):
        if given.is_file():
            files.append(_source(given, given.name))
            continue
        for root, dirs, names in os.walk(given):
            root = Path(root)
            arrow_files = hf_data_files(root)
            if arrow_files is not None:   # a save_to_disk folder: its own files, in its order
                dirs[:] = []
                files.extend(_source(p, f"{given.name}/{p.relative_to(given).as_posix()}")
                             for p in arrow_files if p.is_file())
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in exclude_dirs)
            for name in sorted(names):
                if name.startswith(".") or not fnmatch.fnmatch(name, pattern):
                    continue
                path = root / name
                if path.is_file():
                    files.append(_source(path, f"{given.name}/{path.relative_to(given).as_posix()}"))
    # A file named twice (--input a --input a, or a folder and a file in it) is read once: its first place.
    seen: set[Path] = set()
    unique = [f for f in files if not (f.path.resolve() in seen or seen.add(f.path.resolve()))]
    return unique


def _source(path: Path, key: str) -> SourceFile:
    st = path.stat()
    return SourceFile(path=path, key=key, size=st.st_size, mtime_ns=st.st_mtime_ns)


def documents(files: list[SourceFile], text_field: str = "text", tally: Tally | None = None,
              max_docs: int | None = None, limits: Limits = Limits()):
    """The corpus's document texts in order, streamed (for training a tokenizer); skips and changes
    are added up into `tally`. A document split into pieces comes back whole. (A file found to be a
    bomb is left out from there on; the documents it gave before, at most 16 MiB, were given.)"""
    count = 0
    for source in files:
        for span in spans(source, text_field, target=1 << 62):
            reading = Reading()
            pending: list[str] = []
            for piece in read(span, text_field, reading, limits):
                if piece.text is None:
                    pending = []
                    continue
                pending.append(piece.text)
                if piece.last:
                    if max_docs is not None and count >= max_docs:
                        return
                    count += 1
                    yield "".join(pending)
                    pending = []
            if tally is not None:
                tally.add(source.path, reading.to_dict())

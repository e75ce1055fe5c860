"""Reading a corpus: which files, and the documents in each, with counted reasons for skips.

A plain text file is one document. A JSONL file (.jsonl / .ndjson) holds one document
per line in a text field. Either may be gzip-compressed (recognised by its magic bytes).
Files that cannot be used are skipped and counted by reason, never fatal: empty,
invalid UTF-8, binary (NUL bytes), corrupt gzip, unreadable; in JSONL also malformed
lines and lines without the text field (with line numbers in the notes).
"""
from __future__ import annotations

import fnmatch
import gzip
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
GZIP_MAGIC = b"\x1f\x8b"
MAX_NOTES_PER_FILE = 5

# The default corpus: the standard library's own modules. Test suites are left out:
# they hold deliberately broken sources and large data tables, not library code.
STDLIB_EXCLUDE_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests",
                       "idle_test", "lib2to3_tests"}


@dataclass(frozen=True)
class SourceFile:
    path: Path
    key: str  # stable name for split assignment: relative to the input it came from
    size: int
    mtime_ns: int


@dataclass
class FileDocuments:
    """What reading one file gave: its documents (keys and texts) and what was skipped."""

    documents: list[tuple[str, str]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    bytes_read: int = 0

    def skip(self, reason: str, note: str | None = None) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if note and len(self.notes) < MAX_NOTES_PER_FILE:
            self.notes.append(note)


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
                        + "; expected text or JSONL files (.gz too)"
                        + (" or another --pattern" if pattern else ""))
    return files, names, not inputs


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
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in exclude_dirs)
            for name in sorted(names):
                if name.startswith(".") or not fnmatch.fnmatch(name, pattern):
                    continue
                path = Path(root) / name
                if path.is_file():
                    rel = path.relative_to(given)
                    files.append(_source(path, f"{given.name}/{rel.as_posix()}"))
    # A file named twice (--input a --input a, or a folder and a file in it) is read once: its first place.
    seen: set[Path] = set()
    unique = [f for f in files if not (f.path.resolve() in seen or seen.add(f.path.resolve()))]
    return unique


def _source(path: Path, key: str) -> SourceFile:
    st = path.stat()
    return SourceFile(path=path, key=key, size=st.st_size, mtime_ns=st.st_mtime_ns)


def is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith(JSONL_SUFFIXES)


def read_documents(source: SourceFile, text_field: str = "text") -> FileDocuments:
    """The documents in one file; problems become counted skips, never exceptions."""
    result = FileDocuments()
    name = str(source.path)
    try:
        with open(source.path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        result.skip("unreadable", f"{name}: {exc.strerror or exc}")
        return result
    result.bytes_read = len(raw)
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            result.skip("bad_gzip", f"{name}: corrupt gzip ({exc})")
            return result
    if is_jsonl(source.path):
        _read_jsonl(raw, source, text_field, result)
        return result
    if not raw.strip():
        result.skip("empty", f"{name}: empty")
        return result
    nul = raw.find(b"\x00")
    if nul >= 0:
        result.skip("binary", f"{name}: binary (NUL byte at offset {nul})")
        return result
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        result.skip("invalid_utf8", f"{name}: invalid UTF-8 at byte {exc.start}")
        return result
    result.documents.append((source.key, text))
    return result


def _read_jsonl(raw: bytes, source: SourceFile, text_field: str, result: FileDocuments) -> None:
    name = str(source.path)
    if not raw.strip():
        result.skip("empty", f"{name}: empty")
        return
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            result.skip("invalid_utf8", f"{name}:{number}: invalid UTF-8")
            continue
        except ValueError as exc:
            result.skip("bad_json_line", f"{name}:{number}: invalid JSON ({exc.msg})")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            result.skip("missing_text_field", f"{name}:{number}: no string field {text_field!r}")
            continue
        if not text.strip():
            result.skip("empty", f"{name}:{number}: empty text")
            continue
        result.documents.append((f"{source.key}#{number}", text))


def iter_texts(files: list[SourceFile], text_field: str = "text", max_docs: int | None = None):
    """Just the texts, in order (for tokenizer training)."""
    count = 0
    for source in files:
        for _key, text in read_documents(source, text_field).documents:
            if max_docs is not None and count >= max_docs:
                return
            count += 1
            yield text

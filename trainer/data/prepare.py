"""Corpus -> prepared dataset directory (token shards + manifest), built atomically.

The dataset is built in OUT.tmp-XXXX next to OUT and renamed into place only when it
is complete, so an existing dataset is never damaged by a failed or killed run. A lock
file (.OUT.lock, flock, removed before it is released) keeps two runs apart; while holding
it, leftovers of killed runs are stale and are removed. Files are read and tokenized by a pool of worker processes
with ordered results, so the output is the same for any worker count.

Why one module of this size: the output guard, the lock, the worker pool, the shard writer and the
atomic swap are the one promise "an existing dataset is never damaged"; each step depends on the
state the one before left, and they read best in order.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from array import array
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from trainer.files import make_parent, make_temp_dir

from . import sources
from .dataset import FORMAT, MANIFEST, dtype_for_vocab, read_manifest
from .errors import DataError, Interrupted
from .tokenizers import SPECIAL_TOKENS, ByteTokenizer, get_tokenizer, train_bpe

DEFAULT_OUT = Path("data/stdlib")
DEFAULT_SHARD_TOKENS = 1 << 27
DEFAULT_BPE_VOCAB = 8192
PROGRESS_ENV = "ANVIL_PROGRESS_INTERVAL"  # seconds between plain progress lines (default 5)
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def anvil_version() -> str:
    try:
        from importlib.metadata import version

        return version("anvil")
    except Exception:  # not installed as a distribution: report it, do not fail
        return "unknown"


# ---------------------------------------------------------------- worker side

_worker_tokenizer = None
_worker_stop = None     # set by the main process: skip the jobs left (see _stop_pool)


def _init_pool_worker(tokenizer_name: str, stop=None) -> None:
    # Ctrl-C reaches the whole process group: the main process stops the pool and cleans up;
    # the workers leave that to it instead of each printing a KeyboardInterrupt traceback.
    # They start with SIGINT ignored already (see _results); this keeps it so either way.
    global _worker_stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_stop = stop
    _init_worker(tokenizer_name)


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _worker_tokenizer = get_tokenizer(tokenizer_name)


def _tokenize_file(job) -> dict:
    """Read one file and tokenize its documents: BOS + tokens + EOS each, concatenated."""
    source, text_field, dtype, seed, val_fraction = job
    if _worker_stop is not None and _worker_stop.is_set():
        return _SKIPPED_JOB
    tok = _worker_tokenizer
    read = sources.read_documents(source, text_field)
    texts = [text for _, text in read.documents]
    if isinstance(tok, ByteTokenizer):
        encoded = [tok.encode_array(t) for t in texts]
    else:
        encoded = tok.encode_batch(texts) if texts else []
    lengths = np.fromiter((len(e) + 2 for e in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for e in encoded:
        tokens[pos] = tok.bos_id
        tokens[pos + 1:pos + 1 + len(e)] = e
        tokens[pos + 1 + len(e)] = tok.eos_id
        pos += len(e) + 2
    to_val = np.array([_is_val(key, seed, val_fraction) for key, _ in read.documents], dtype=bool)
    return {"tokens": tokens, "lengths": lengths, "to_val": to_val, "skipped": read.skipped,
            "notes": read.notes, "bytes": read.bytes_read}


_SKIPPED_JOB = {"tokens": np.empty(0, dtype=np.uint8), "lengths": np.empty(0, dtype=np.int64),
                "to_val": np.empty(0, dtype=bool), "skipped": {}, "notes": [], "bytes": 0}


def _is_val(key: str, seed: int, val_fraction: float) -> bool:
    """Held-out by a hash of the document's name: stable across runs, orders, workers."""
    h = int.from_bytes(hashlib.sha1(f"{seed}:{key}".encode()).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


# ---------------------------------------------------------------- main side

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


class Progress:
    """A live line on a terminal; a plain line every `interval` seconds otherwise."""

    def __init__(self, total_bytes: int, enabled: bool = True, stream=None, interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.total = max(total_bytes, 1)
        self.interval = 0.1 if self.tty else float(os.environ.get(PROGRESS_ENV, interval))
        self.start = self.last = time.monotonic()

    def update(self, files: int, docs: int, tokens: int, done_bytes: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < self.interval):
            return
        self.last = now
        elapsed = now - self.start
        frac = min(done_bytes / self.total, 1.0)
        rate = done_bytes / elapsed / 1e6 if elapsed > 0 else 0.0
        eta = f"eta {elapsed / frac - elapsed:4.0f}s" if 0 < frac < 1 else f"{elapsed:.1f}s"
        text = (f"prepare {frac:6.1%} | {files:,} files | {docs:,} docs | {tokens:,} tokens "
                f"| {rate:.1f} MB/s | {eta}")
        if self.tty:
            bar = "#" * int(frac * 20)
            self.stream.write(f"\r[{bar:<20}] {text}\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


@contextmanager
def _locked(out: Path):
    """Hold the lock of `out` (flock on .OUT.lock beside it) while building it.

    The lock file is removed while still locked, so none is left beside the dataset (one
    killed with SIGKILL stays, empty, and the next run takes it over and removes it). That is
    race-free because the lock counts only on the file that is at the path: a run that
    opened the file just before its holder removed it gets a lock on a file nobody sees any
    more, notices (its inode is not the path's), and opens the path again."""
    lock_path = out.parent / f".{out.name}.lock"
    for _ in range(100):  # each retry needs another run to have finished meanwhile
        try:
            fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise DataError(f"cannot write in {out.parent}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except BlockingIOError:  # held: another run is writing `out`
            os.close(fd)
            held = False
            break
        except FileNotFoundError:  # removed by the run that held it: take the path's new file
            held = False
        except BaseException:
            os.close(fd)
            raise
        if held:
            break
        os.close(fd)
    else:
        held = False
    if not held:
        raise DataError(f"another data.prepare is writing {out} right now "
                        f"(lock {lock_path}); wait for it to finish")
    try:
        yield
    finally:
        try:
            os.unlink(lock_path)  # before the lock goes: see above
        except OSError:
            pass
        os.close(fd)


def _recover(out: Path) -> list[str]:
    """Under the lock: finish or undo what a killed run left next to `out`."""
    actions = []
    olds = sorted(out.parent.glob(f"{out.name}.old-*"))
    if not out.exists():
        for old in olds:
            if (old / MANIFEST).is_file():  # killed between the two renames of a swap
                old.rename(out)
                actions.append(f"restored {out} from {old.name}")
                break
    for leftover in [*out.parent.glob(f"{out.name}.tmp-*"), *out.parent.glob(f"{out.name}.old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
        actions.append(f"removed stale {leftover.name}")
    return actions


def _fingerprint(files, settings: dict, tokenizer_id: str) -> str:
    digest = hashlib.sha256(json.dumps({"settings": settings, "tokenizer": tokenizer_id},
                                       sort_keys=True).encode())
    for f in files:
        digest.update(f"{f.path}\0{f.key}\0{f.size}\0{f.mtime_ns}\n".encode())
    return digest.hexdigest()


def _is_intact(out: Path, manifest: dict) -> bool:
    """Cheap check (sizes, not hashes) that the files a manifest names are all there."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            f = out / shard["file"]
            if not f.is_file() or f.stat().st_size != shard["tokens"] * itemsize:
                return False
    return True


EXPECTED_OUT = "expected a new or empty directory, or an existing Anvil dataset to rebuild"
EXPECTED_TOKENIZER = "expected byte, bpe or the path of a Hugging Face tokenizer.json"


def check_options(*, val_fraction: float = 0.01, shard_tokens: int = 1, max_docs: int | None = None,
                  max_tokens: int | None = None, workers: int | None = None, text_field: str = "text",
                  pattern: str | None = None) -> None:
    """DataError naming the first option whose value cannot work, and what it expects."""
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):  # nan fails too
        raise DataError(f"--val-fraction: expected a number in [0, 1), got {val_fraction!r}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens: expected a positive number of tokens per shard, got {shard_tokens}")
    for name, value in (("--max-docs", max_docs), ("--max-tokens", max_tokens)):
        if value is not None and value < 1:
            raise DataError(f"{name}: expected a positive number (0 or left out: no limit), got {value}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers: expected a positive number of processes (0 or left out: "
                        f"all cores), got {workers}")
    if not text_field.strip():
        raise DataError("--text-field is empty; expected the JSONL field holding the text, e.g. text")
    if pattern is not None and not pattern.strip():
        raise DataError("--pattern is empty; expected a file-name glob such as '*.txt' "
                        "(left out: every file)")


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


def is_dataset_dir(path: Path) -> bool:
    """Whether `path` holds an Anvil dataset: its manifest.json carries the format marker
    (a manifest too damaged to parse still counts when the marker is in its text)."""
    manifest = Path(path) / MANIFEST
    try:
        with open(manifest, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    try:
        data = json.loads(head)
    except ValueError:
        return f'"{FORMAT}"'.encode() in head
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_out(out, inputs: list[str]) -> Path:
    """The absolute --out, or DataError before anything is touched: --out must be missing,
    an empty directory or an Anvil dataset, and neither the filesystem root, the current
    directory or one of its parents, nor inside an input or holding one (the swap that
    puts a new dataset in place removes what was at --out)."""
    given = str(out)
    if not given.strip():
        raise DataError("--out is empty; expected a dataset directory such as data/mine")
    out = Path(given).expanduser().absolute()
    real = out.resolve()
    if real == Path(real.anchor):
        raise DataError(f"--out {given} is the filesystem root; expected a dataset directory "
                        f"such as data/mine")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        where = "the current directory" if real == cwd else "a parent of the current directory"
        raise DataError(f"--out {given} is {where} ({real}); expected a dataset directory of its "
                        f"own such as data/mine")
    for name in inputs:
        source = Path(name).resolve()
        if real == source or source in real.parents:
            raise DataError(f"--out {given} is {'' if real == source else 'inside '}the input "
                            f"{source}; expected a directory outside the corpus")
        if real in source.parents:
            raise DataError(f"--out {given} holds the input {source}; expected a directory "
                            f"outside the corpus")
    for parent in out.parents:  # the nearest thing that exists above --out must be a directory
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"--out {given}: a file is in the way where a directory is needed "
                                f"({parent})")
            break
    if out.is_symlink() and not out.exists():
        raise DataError(f"--out {given} is a broken symbolic link; {EXPECTED_OUT}")
    if out.exists():
        if not out.is_dir():
            raise DataError(f"--out {given} is a file, not a directory; {EXPECTED_OUT}")
        try:
            entries = sorted(os.listdir(out))
        except OSError as exc:
            raise DataError(f"--out {given}: cannot read it ({exc.strerror or exc}); "
                            f"{EXPECTED_OUT}") from None
        if entries and not is_dataset_dir(out):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise DataError(f"--out {given} is a directory holding other things ({len(entries)} "
                            f"{'entry' if len(entries) == 1 else 'entries'}: {shown}) and not an Anvil dataset (no {MANIFEST} with "
                            f"format {FORMAT!r}); {EXPECTED_OUT}")
    return out


def prepare(inputs: list[Path] | None = None, out: Path = DEFAULT_OUT, tokenizer: str = "byte", *,
            val_fraction: float = 0.01, text_field: str = "text", workers: int | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, max_docs: int | None = None,
            max_tokens: int | None = None, vocab_size: int = DEFAULT_BPE_VOCAB, seed: int = 0,
            pattern: str | None = None, force: bool = False, progress: bool = True) -> dict:
    """Build (or find up to date) the dataset at `out`. Returns a summary dict with
    "status" ("built" | "up-to-date"), "path", "seconds", "manifest", "notes".
    Ctrl-C becomes Interrupted (exit 130) once the partial output is removed."""
    state = {"out": None, "had_dataset": False, "tmp": None, "done": False}
    try:
        return _prepare(inputs, out, tokenizer, state, val_fraction=val_fraction, text_field=text_field,
                        workers=workers, shard_tokens=shard_tokens, max_docs=max_docs,
                        max_tokens=max_tokens, vocab_size=vocab_size, seed=seed, pattern=pattern,
                        force=force, progress=progress)
    except KeyboardInterrupt:
        target = state["out"]
        if target is None:
            raise Interrupted("interrupted (Ctrl-C) before anything was written") from None
        if state["tmp"] is None:
            intact = f"; the dataset already at {target} is intact" if state["had_dataset"] else ""
            raise Interrupted(f"interrupted (Ctrl-C) before anything was written at {target}{intact}") from None
        if state["done"]:
            raise Interrupted(f"interrupted (Ctrl-C) as the new dataset was put in place: {target} "
                              f"holds it, complete") from None
        if state["had_dataset"]:
            raise Interrupted(f"interrupted (Ctrl-C): stopped before the new dataset was complete; "
                              f"the dataset already at {target} is intact and the partial one "
                              f"was removed") from None
        raise Interrupted(f"interrupted (Ctrl-C): stopped before the dataset was complete; the "
                          f"partial one was removed and nothing was put at {target}") from None


def _prepare(inputs, out, tokenizer: str, state: dict, *, val_fraction: float, text_field: str,
             workers: int | None, shard_tokens: int, max_docs: int | None, max_tokens: int | None,
             vocab_size: int, seed: int, pattern: str | None, force: bool, progress: bool) -> dict:
    started = time.monotonic()
    out_given = str(out)
    check_options(val_fraction=val_fraction, shard_tokens=shard_tokens, max_docs=max_docs,
                  max_tokens=max_tokens, workers=workers, text_field=text_field, pattern=pattern)
    tok = None
    if tokenizer == "bpe":
        check_bpe_vocab(vocab_size)
    elif tokenizer != "byte":
        tok = get_tokenizer(tokenizer_path(tokenizer))  # a bad file fails here, before any writing
    files, input_names, is_default = sources.resolve_inputs(inputs, pattern)

    settings = {"val_fraction": val_fraction, "text_field": text_field, "shard_tokens": shard_tokens,
                "max_docs": max_docs, "max_tokens": max_tokens, "seed": seed, "pattern": pattern}
    if tokenizer == "bpe":
        tokenizer_id = f"bpe:{vocab_size}"
        settings["vocab_size"] = vocab_size
    elif tokenizer == "byte":
        tokenizer_id = "byte"
    else:
        tokenizer_id = "json:" + tok.sha256
    fingerprint = _fingerprint(files, settings, tokenizer_id)

    out = check_out(out_given, input_names)
    state["out"] = out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--out {out_given}: cannot create {out.parent} "
                        f"({exc.strerror or exc}); expected a writable location") from None
    with _locked(out):
        notes = _recover(out)
        state["had_dataset"] = is_dataset_dir(out)
        if not force and (out / MANIFEST).is_file():
            try:
                existing = read_manifest(out)
            except DataError:
                existing = None
            if existing and existing.get("fingerprint") == fingerprint and _is_intact(out, existing):
                return {"status": "up-to-date", "path": str(out), "manifest": existing,
                        "seconds": time.monotonic() - started, "notes": notes}
        try:  # shared like any folder mkdir makes: mkdtemp's 0700 would keep the team out
            tmp = state["tmp"] = make_temp_dir(out.parent, prefix=f"{out.name}.tmp-")
        except OSError as exc:
            raise DataError(f"--out {out_given}: cannot create a folder in {out.parent} "
                            f"({exc.strerror or exc}); nothing was written") from None
        try:
            manifest = _build(files, tmp, tokenizer, settings, workers, progress, input_names,
                              is_default, vocab_size, tok)
            manifest["fingerprint"] = fingerprint
            _write_json(tmp / MANIFEST, manifest)
            with _ctrl_c_deferred():  # the two renames of the swap happen both or neither
                _swap_into_place(tmp, out)
                state["done"] = True
        except OSError as exc:
            _remove(tmp)
            if exc.errno in _DISK_FULL:
                raise DataError(f"disk full while writing the dataset next to {out} "
                                f"({os.strerror(exc.errno)}); the partial output was removed and "
                                f"any earlier dataset at {out} is unchanged") from None
            raise DataError(f"cannot write the dataset at {out}: {exc}") from None
        except BaseException:
            _remove(tmp)
            raise
    return {"status": "built", "path": str(out), "manifest": manifest,
            "seconds": time.monotonic() - started, "notes": notes + manifest["source"]["skipped_examples"]}


@contextmanager
def _ctrl_c_deferred():
    """Hold a Ctrl-C (SIGINT) back until the block is over, then raise KeyboardInterrupt.
    Only the main thread can set handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _remove(path: Path) -> None:
    """rmtree that a second Ctrl-C cannot cut short (it is raised once the folder is gone)."""
    with _ctrl_c_deferred():
        shutil.rmtree(path, ignore_errors=True)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _swap_into_place(tmp: Path, out: Path) -> None:
    """tmp -> out. With an existing out: out -> out.old-X, tmp -> out, drop old; a kill
    between the renames is repaired by _recover on the next run."""
    if not out.exists():
        tmp.rename(out)
        return
    if os.listdir(out) and not is_dataset_dir(out):  # filled since check_out looked: keep it
        raise DataError(f"--out {out} was filled with other things while the dataset was being "
                        f"built; it was left as it is; {EXPECTED_OUT}")
    old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _build(files, tmp: Path, tokenizer: str, settings: dict, workers, progress: bool,
           input_names: list[str], is_default: bool, vocab_size: int, tok=None) -> dict:
    max_docs, max_tokens = settings["max_docs"], settings["max_tokens"]
    if tokenizer == "bpe":
        texts = sources.iter_texts(files, settings["text_field"], max_docs)
        tok = train_bpe(texts, vocab_size, tmp / "tokenizer.json")
    else:
        tok = tok or get_tokenizer(tokenizer)
        if tok.kind != "byte":
            shutil.copyfile(tok.path, tmp / "tokenizer.json")
    tok_name = "byte" if tok.kind == "byte" else str(tmp / "tokenizer.json")
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(tmp, s, dtype, settings["shard_tokens"]) for s in ("train", "val")}
    skipped: dict[str, int] = {}
    examples: list[str] = []
    docs = files_used = total_tokens = done_bytes = 0
    pending = None  # the latest document, held back so val or train can be made non-empty
    truncated = False
    meter = Progress(sum(f.size for f in files), enabled=progress)
    jobs = ((f, settings["text_field"], dtype, settings["seed"], settings["val_fraction"]) for f in files)
    workers = max(1, min(workers or _auto_workers(files, tok), len(files)))
    try:
        with _results(jobs, tok_name, workers) as results:
            for count, res in enumerate(results, start=1):
                done_bytes += res["bytes"]
                for reason, n in res["skipped"].items():
                    skipped[reason] = skipped.get(reason, 0) + n
                examples.extend(res["notes"][: max(0, 50 - len(examples))])
                files_used += bool(len(res["lengths"]))
                pos = 0
                for length, to_val in zip(res["lengths"].tolist(), res["to_val"].tolist()):
                    if pending is not None:
                        writers[pending[0]].add(pending[1])
                    pending = ("val" if to_val else "train", res["tokens"][pos:pos + length])
                    pos += length
                    docs += 1
                    total_tokens += length
                    if (max_docs and docs >= max_docs) or (max_tokens and total_tokens >= max_tokens):
                        truncated = True
                        break
                meter.update(count, docs, total_tokens, done_bytes)
                if truncated:
                    break
        if pending is not None:
            split = pending[0]
            if settings["val_fraction"] > 0 and not writers["val"].doc_starts and writers["train"].doc_starts:
                split = "val"
            elif not writers["train"].doc_starts:
                split = "train"
            writers[split].add(pending[1])
        meter.update(count if files else 0, docs, total_tokens, done_bytes, final=True)
        splits = {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if not docs:
        detail = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "nothing readable"
        raise DataError(f"no usable documents in {', '.join(input_names)} ({len(files)} "
                        f"file{'' if len(files) == 1 else 's'}; skipped: {detail}); expected UTF-8 "
                        f"text files or JSONL lines with a string field {settings['text_field']!r}")
    return {
        "format": FORMAT,
        "anvil_version": anvil_version(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "documents": docs,
        "tokens": total_tokens,
        "dtype": dtype.name,
        "tokenizer": tok.spec() | ({"source": "trained on these inputs by data.prepare"}
                                   if tokenizer == "bpe" else {}),
        "source": {"inputs": input_names, "default_corpus": is_default, "files": len(files),
                   "files_used": files_used, "bytes_read": done_bytes, "skipped": skipped,
                   "skipped_examples": examples, "truncated": truncated},
        "settings": settings,
        "splits": splits,
    }


def _auto_workers(files, tok) -> int:
    """All cores when the work pays for starting them (about a second per spawned worker):
    byte tokenizing runs at ~100 MB/s in one process, HF BPE at ~1 MB/s."""
    per_second = 100e6 if tok.kind == "byte" else 1e6
    seconds = sum(f.size for f in files) / per_second
    return len(os.sched_getaffinity(0)) if seconds > 5 else 1


@contextmanager
def _results(jobs, tok_name: str, workers: int):
    """Ordered per-file results, from a process pool when workers > 1."""
    if workers == 1:
        _init_worker(tok_name)
        yield map(_tokenize_file, jobs)
        return
    # spawn: a fork after tokenizers' thread pool has run (e.g. BPE just trained) can deadlock
    ctx = multiprocessing.get_context("spawn")
    # An ignored SIGINT survives exec and Python keeps it ignored at start-up: the workers are
    # started with it ignored, so a Ctrl-C halfway through their imports cannot make each print
    # a traceback. (The main process ignores it only for the few milliseconds of the spawns.)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    stop = ctx.Event()
    try:
        pool = ctx.Pool(workers, initializer=_init_pool_worker, initargs=(tok_name, stop))
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    try:
        yield pool.imap(_tokenize_file, jobs, chunksize=4)
    finally:
        _stop_pool(pool, stop)


def _stop_pool(pool, stop, grace: float = 20.0) -> None:
    """End the pool early (Ctrl-C, --max-tokens reached) or at the end, without killing a worker.

    Pool.terminate() kills the workers, and one killed halfway through sending a result (a file's
    tokens: megabytes) leaves a part of the message in the pipe; the pool's result thread then
    waits for the rest for ever and so does terminate(). So the workers are asked instead: with
    `stop` set each job left returns at once, empty, and close() + join() lets them finish. Only
    a worker still busy after `grace` seconds (one huge file) is killed, by a terminate() that is
    not waited for beyond another `grace`."""
    stop.set()
    pool.close()
    for end in (pool.join, pool.terminate):
        waiter = threading.Thread(target=end, daemon=True, name=f"prepare-pool-{end.__name__}")
        waiter.start()
        try:
            waiter.join(grace)
        except KeyboardInterrupt:   # a second Ctrl-C: stop waiting for the workers
            pass
        if not waiter.is_alive():
            return


def train_tokenizer(inputs: list[Path] | None, out: Path, vocab_size: int = DEFAULT_BPE_VOCAB, *,
                    text_field: str = "text", max_docs: int | None = None,
                    pattern: str | None = None) -> dict:
    """Train a byte-level BPE tokenizer on a corpus (default: the stdlib) and save it."""
    started = time.monotonic()
    check_options(text_field=text_field, pattern=pattern, max_docs=max_docs)
    check_bpe_vocab(vocab_size)
    files, input_names, _ = sources.resolve_inputs(inputs, pattern)
    out = _check_tokenizer_out(out, input_names)
    skipped: dict[str, int] = {}
    texts = _counted_texts(files, text_field, max_docs, skipped)
    first = next(texts, None)  # a corpus with nothing usable must not give an alphabet-only BPE
    if first is None:
        detail = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "nothing readable"
        raise DataError(f"no usable documents in {', '.join(input_names)} ({len(files)} "
                        f"file{'' if len(files) == 1 else 's'}; skipped: {detail}); expected UTF-8 "
                        f"text files or JSONL lines with a string field {text_field!r}")
    texts = itertools.chain([first], texts)
    try:
        tok = train_bpe(texts, vocab_size, out)
    except OSError as exc:
        raise DataError(f"--out {out}: cannot write it ({exc.strerror or exc}); it is as it was") from None
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted (Ctrl-C) while training the tokenizer; nothing was written "
                          f"and {out} is as it was") from None
    return {"path": str(out), "vocab_size": tok.vocab_size, "inputs": input_names,
            "files": len(files), "sha256": tok.sha256, "seconds": time.monotonic() - started}


def _counted_texts(files, text_field: str, max_docs: int | None, skipped: dict):
    """The texts of the files in order (at most max_docs), adding skips by reason to `skipped`."""
    count = 0
    for source in files:
        read = sources.read_documents(source, text_field)
        for reason, n in read.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
        for _key, text in read.documents:
            if max_docs is not None and count >= max_docs:
                return
            count += 1
            yield text


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

"""The tokenizing workers: each takes a unit, reads its spans, tokenizes the documents in
batches on the tokenizer's fast path and writes the unit's part (parts.py) itself.

Only a part's small record travels back to the main process, never tokens: memory is a
batch of text per worker (BATCH_BYTES) whatever the size of a file. The pool is spawned (a
fork after tokenizers' thread pool has run can deadlock), each worker tokenizing on one
thread (the pool is the parallelism). Units go out one at a time to whichever worker is
free; their parts are put in order afterwards, so the result does not depend on which
worker did what.

Stopping: `stop` (an Event) makes every worker drop the unit it is in at its next batch and
return None; a worker whose parent died stops too. Ctrl-C (or SIGTERM, SIGHUP, SIGUSR2) reaches
the whole process group: the workers ignore it and leave the stopping to the main process.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path

from . import formats
from .errors import DataError
from .parts import PartWriter, WorkFolder
from .progress import Progress
from .tokenizers import get_tokenizer, splits_at_newlines

BATCH_BYTES = 1 << 20   # text tokenized in one call: large enough to amortise, small in memory


class _Stopped(Exception):
    pass


class Worker:
    """What one process needs to turn units into parts."""

    def __init__(self, tokenizer: str, folder: Path, dtype: str, text_field: str, limits: formats.Limits,
                 stop=None, in_pool: bool = False):
        if in_pool:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.tok = get_tokenizer(tokenizer)
        self.pieces = splits_at_newlines(self.tok)
        self.folder = WorkFolder(Path(folder))
        self.dtype, self.text_field, self.limits, self.stop = dtype, text_field, limits, stop
        self.parent = os.getppid() if in_pool else None   # a pool worker outliving its parent stops

    def _check(self) -> None:
        if (self.stop is not None and self.stop.is_set()) or (
                self.parent is not None and os.getppid() != self.parent):
            raise _Stopped

    def run(self, unit) -> dict | None:
        """Make the unit's part; None when stopped before it was finished."""
        try:
            self._check()
        except _Stopped:
            return None
        writer = PartWriter(self.folder, unit.index, self.dtype, self.tok.bos_id, self.tok.eos_id)
        try:
            readings = [self._span(writer, number, span) for number, span in enumerate(unit.spans)]
            return writer.finish(readings, unit.size)
        except _Stopped:
            writer.abandon()
            return None
        except BaseException:
            writer.abandon()
            raise

    def _span(self, writer: PartWriter, number: int, span) -> dict:
        reading = formats.Reading()
        texts, records, size = [], [], 0
        long_doc: list[str] | None = None   # pieces of a long document (tokenizers that cannot take them apart)

        def flush():
            nonlocal texts, records, size
            if texts:
                self._check()
                writer.add(number, records, self.tok.encode_many(texts))
            texts, records, size = [], [], 0

        start = writer.mark()
        for piece in formats.read(span, self.text_field, reading, self.limits):
            if piece.text is None:      # the document begun is dropped
                writer.drop()
                long_doc = None
                continue
            if piece.last and long_doc is None and not writer.in_document:
                texts.append(piece.text)
                records.append(piece.record)
                size += len(piece.text)
                if size >= BATCH_BYTES:
                    flush()
                continue
            flush()                      # documents stay in reading order
            self._check()
            if not self.pieces:
                long_doc = (long_doc or []) + [piece.text]
                if piece.last:
                    writer.add(number, [piece.record], self.tok.encode_many(["".join(long_doc)]))
                    long_doc = None
                continue
            if not writer.in_document:
                writer.begin(number, piece.record)
            writer.extend(self.tok.encode_many([piece.text])[0])
            if piece.last:
                writer.end()
        if reading.void:   # (a bomb, found after its first documents were written)
            writer.rollback(start)
        else:
            flush()
        return reading.to_dict()


# ---------------------------------------------------------------- driving the pool

def make_parts(plan: list, parts: dict, folder: WorkFolder, tok, tok_name: str, dtype, settings: dict,
               n_workers, progress: bool, state: dict, mine: list | None = None) -> None:
    """Tokenize the units that have no finished part yet (of `mine`, when this is one node of
    several), into `parts` (index -> record); stop early once the finished units from the first
    on already hold --max-docs / --max-tokens (other nodes' parts counted from the folder)."""
    todo = [u for u in (plan if mine is None else mine) if u.index not in parts]
    meter = Progress(sum(u.size for u in plan), enabled=progress)
    done_bytes = sum(u.size for u in plan if u.index in parts)
    docs = sum(p["documents"] for p in parts.values())
    tokens = sum(p["tokens"] for p in parts.values())
    if enough(plan, parts, settings, folder if mine is not None else None) or not todo:
        meter.update(len(parts), len(plan), docs, tokens, done_bytes, final=True)
        return
    n = max(1, min(n_workers or auto_workers(todo, tok), len(todo)))
    with results(todo, tok_name, folder.path, dtype.name, settings["text_field"], formats.Limits.of(settings),
                 n) as (finished, stop):
        for index, info in finished:
            if info is None:
                continue
            parts[index] = info
            state["parts"] = len(parts)
            done_bytes += plan[index].size
            docs += info["documents"]
            tokens += info["tokens"]
            meter.update(len(parts), len(plan), docs, tokens, done_bytes)
            if enough(plan, parts, settings, folder if mine is not None else None):
                stop.set()
                break
    meter.update(len(parts), len(plan), docs, tokens, done_bytes, final=True)
    missing = [u.index for u in todo if u.index not in parts]
    if missing and not enough(plan, parts, settings, folder if mine is not None else None):
        raise DataError(f"{len(missing)} of {len(plan)} parts were not made (first: unit {missing[0]}); "
                        f"run the same command again to continue")


def enough(plan: list, parts: dict, settings: dict, folder: WorkFolder | None = None) -> bool:
    """Whether the finished parts from the first unit on already reach --max-docs / --max-tokens
    (with `folder`, parts other nodes finished count too: read from their records)."""
    max_docs, max_tokens = settings["max_docs"], settings["max_tokens"]
    if not (max_docs or max_tokens):
        return False
    docs = tokens = 0
    for unit in plan:
        info = parts.get(unit.index)
        if info is None and folder is not None:
            info = folder.finished(unit.index, check=False)
        if info is None:
            return False
        docs += info["documents"]
        tokens += info["tokens"]
        if (max_docs and docs >= max_docs) or (max_tokens and tokens >= max_tokens):
            return True
    return False


def auto_workers(todo, tok) -> int:
    """All cores when the work pays for starting them (about a second per spawned worker):
    byte tokenizing runs at ~100 MB/s in one process, HF BPE at ~1 MB/s."""
    per_second = 100e6 if tok.kind == "byte" else 1e6
    seconds = sum(u.size for u in todo) / per_second
    return len(os.sched_getaffinity(0)) if seconds > 5 else 1


# ---------------------------------------------------------------- the pool

_worker: Worker | None = None


def _init(tokenizer: str, folder: str, dtype: str, text_field: str, limits, stop) -> None:
    global _worker
    # A terminal's Ctrl-C and a scheduler's SIGTERM reach the whole process group: the main
    # process stops the pool (`stop`) and the workers finish or drop their unit, never die mid-part.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    _worker = Worker(tokenizer, Path(folder), dtype, text_field, limits, stop, in_pool=True)


def _run(unit):
    return unit.index, _worker.run(unit)


@contextmanager
def results(units: list, tokenizer: str, folder: Path, dtype: str, text_field: str, limits, workers: int):
    """(index, part record or None) of every unit, as they finish; `.stop()` on the iterator's
    holder ends the rest early. Yields (iterator, stop event)."""
    if workers <= 1 or len(units) <= 1:
        stop = threading.Event()
        worker = Worker(tokenizer, folder, dtype, text_field, limits, stop)
        yield ((u.index, worker.run(u)) for u in units), stop
        return
    ctx = multiprocessing.get_context("spawn")
    # A blocked signal stays blocked across fork and exec: the workers (and multiprocessing's
    # resource tracker, which blocks only SIGINT and SIGTERM itself) start with the stop signals
    # blocked, so one sent to the whole group halfway through their imports cannot kill them or
    # make each print a traceback. This process blocks them only for the milliseconds of the
    # spawns; one that came meanwhile is delivered when they are unblocked.
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        resource_tracker.ensure_running()                  # (it unblocks SIGINT and SIGTERM when it returns)
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        stop = ctx.Event()
        pool = ctx.Pool(min(workers, len(units)), initializer=_init,
                        initargs=(tokenizer, str(folder), dtype, text_field, limits, stop))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        yield pool.imap_unordered(_run, units, chunksize=1), stop
    finally:
        _stop_pool(pool, stop)


def _stop_pool(pool, stop, grace: float = 20.0) -> None:
    """End the pool early (Ctrl-C, --max-tokens reached) or at the end, without killing a worker
    that may be writing: with `stop` set each worker drops its unit at its next batch and the
    units left return at once, so close() + join() ends them. Only a worker still busy after
    `grace` seconds is killed, by a terminate() not waited for beyond another `grace`."""
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

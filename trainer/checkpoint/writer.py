"""Saving: every rank writes its DCP shards and its own state into .tmp_step_N/, hashing the
bytes as they go; rank 0 then writes trainer.pt, meta.json, checksums.json and COMPLETE, renames
the folder to step_N and prunes. A checkpoint counts only once it is complete and checksummed.

Asynchronous saves (checkpoint.async_save; `Checkpointer.save`):
  - the training loop waits only while the state is copied into host buffers (staging.py);
  - the write runs on a background thread, at most one in flight: the next save, the end of
    the run and a stop on a signal first wait for it;
  - its collectives (DCP's plan and metadata exchange, the commit) run on a gloo group of
    their own, never on the one training uses, so the two cannot interleave (torchtitan does
    the same);
  - a failed write (a full disk) is agreed on by all ranks inside the write; the loop learns
    of it at the next step boundary (signals.Stopper) and stops with one line.
A thread rather than a process: the staged buffers are already in this process (a writer
process needs them in shared memory, which containers and Slurm often keep small); the
writer's Python work is a little per tensor, while write() and xxhash run with the GIL
released (a thread hashing at full speed does not slow the main thread's Python); and a
SIGKILL takes the writer with the trainer, leaving no orphan writing into a checkpoint.

Test-only: names.TEST_CHECKPOINT_DELAY_S makes a save wait that many seconds after its files
are written and before its commit, so that tests can kill or signal a run mid-write. Nothing
else sets it.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core import names
from core.host import this_host
from trainer.checkpoint import checksums
from trainer.checkpoint.layout import (COMPLETE_MARKER, META_FILE, RANKS_DIR, TMP_PREFIX, TRAINER_FILE,
                                       CheckpointError, CheckpointWriteError, fsync_dir, prune, remove_stale,
                                       replace_dir)
from trainer.checkpoint.reader import dcp_first_error
from trainer.checkpoint.resume import find_latest
from trainer.checkpoint.staging import Stager
from trainer.checkpoint.state import (all_gather, broadcast_from_first, dist_on, gather_to_first, jsonable,
                                      local_bytes, model_optim_state, rank, rng_state, to_bytes, versions, world)
from core.files import write_atomic

TEST_DELAY_ENV = names.TEST_CHECKPOINT_DELAY_S


def _failures() -> tuple[type[BaseException], ...]:
    """What a write can raise: DCP's CheckpointException (all ranks' errors) is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)
_HOST_MEMORY_SHARE = 0.8     # async_save auto: staging may take this share of the available memory


@dataclass
class _Job:
    """One save on its way: what was captured at its step, and how it ended."""
    step: int
    tmp: Path
    final: Path
    state: Any                      # the model/optimizer state dict (staged, when async)
    rank_file: bytes                # ranks/rank<R>.pt: RNG and loader states
    trainer_file: bytes | None      # trainer.pt (rank 0)
    meta: dict | None               # meta.json (rank 0)
    started: float
    ready: Any = None               # CUDA event the staging copies complete at
    stall_s: float | None = None    # how long training waited to stage it (None: synchronous, all of it)
    thread: threading.Thread | None = None
    path: Path | None = None
    error: CheckpointError | None = None


class Checkpointer:
    """Saves of one run. Collective: every rank makes one, at the same point, and calls save()
    at the same steps. async_save: True, False, or None (on where the staging copy fits in the
    host's memory; the ranks agree at the first save)."""

    def __init__(self, checkpoint_dir: Path, *, keep_last: int = 3, config: dict | None = None,
                 async_save: bool | None = None, log: logging.Logger | None = None, timeout=None,
                 write_threads: int = 4):
        self.dir = Path(checkpoint_dir)
        self.write_threads = max(1, int(write_threads))
        self.keep_last = keep_last
        self.config = config
        self.requested = async_save
        self.asynchronous: bool | None = False if async_save is False else None   # decided at the first save
        self.log = log or logging.getLogger("anvil.trainer")
        self.last_saved: Path | None = None
        self._pending: _Job | None = None
        self._stager = Stager()
        self._group = None
        if async_save is not False and dist_on():
            kwargs = {"timeout": timeout} if timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)   # collective: every rank, here

    # ------------------------------------------------------------------ the loop's side
    def save(self, step: int, *, model, optimizer, scheduler=None, loader=None, extra: dict | None = None,
             wait: bool = False) -> Path | None:
        """Save the state at `step`. Synchronous saves return the checkpoint; asynchronous ones
        return None once the state is staged (the path with wait=True, after the write)."""
        self.wait()
        started, clock = time.time(), time.perf_counter()
        state = model_optim_state(model, optimizer)
        if self.asynchronous is None:
            self.asynchronous = self._decide(local_bytes(state))
        job = _Job(step=int(step), tmp=self.dir / f"{TMP_PREFIX}{step}", final=self.dir / f"step_{step}",
                   state=state, started=started, trainer_file=None, meta=None,
                   rank_file=to_bytes({"rng": rng_state(), "loader": loader.state_dict() if loader is not None else None,
                                       "rank": rank(), "world_size": world()}))
        if rank() == 0:
            job.trainer_file = to_bytes({"step": int(step), "extra": dict(extra or {}),
                                         "scheduler": scheduler.state_dict() if scheduler is not None else None})
            job.meta = {"step": int(step), "world_size": world(), "time": started, "host": this_host(),
                        "save_s": None, "stall_s": None, "async": self.asynchronous, "versions": versions(),
                        "extra": jsonable(extra or {}), "config": jsonable(self.config), "cwd": os.getcwd()}
        if not self.asynchronous:
            self._write(job)
            return self._settle(job)
        job.state, job.ready = self._stager.stage(state)
        job.stall_s = time.perf_counter() - clock
        job.thread = threading.Thread(target=self._write, args=(job,), name=f"checkpoint-step-{step}", daemon=True)
        self._pending = job
        job.thread.start()
        self.log.info(f"checkpoint step {step}: training paused {job.stall_s:.2f} s to stage it; "
                      "writing it in the background")
        return self.wait() if wait else None

    def prepare(self, model, optimizer, wait: bool = False) -> None:
        """Once the optimizer holds its state (after the first step; asking for it earlier makes
        torch take a step of its own): decide on background saves now (collective, as the first
        save would) and, if on, fault in the staging memory on a thread ahead of the first save
        (wait: until that is done)."""
        if not optimizer.state:
            return
        state = model_optim_state(model, optimizer)
        if self.asynchronous is None:
            self.asynchronous = self._decide(local_bytes(state))
        if self.asynchronous:
            self._stager.reserve(state, wait=wait)

    def wait(self) -> Path | None:
        """Wait for the save in flight; raise its error. Returns the newest saved checkpoint."""
        job, self._pending = self._pending, None
        if job is None:
            return self.last_saved
        job.thread.join()
        return self._settle(job)

    @property
    def writing(self) -> bool:
        """A save is being written in the background."""
        return self._pending is not None and self._pending.thread.is_alive()

    def failed(self) -> bool:
        """The save in flight ended with an error (every rank's ends alike; the loop agrees on
        when to stop through signals.Stopper, then wait() raises it)."""
        job = self._pending
        return job is not None and not job.thread.is_alive() and job.error is not None

    def close(self) -> None:
        """At the end, also after an error: let a write in flight finish (its checkpoint is good)
        and log, not raise, its own failure over the error that got us here."""
        try:
            self.wait()
        except CheckpointError as exc:
            self.log.error(f"error: {exc}")
        finally:
            self._stager.close()

    def _settle(self, job: _Job) -> Path:
        if job.error is not None:
            raise job.error
        self.last_saved = job.path
        return job.path

    def _decide(self, nbytes: int) -> bool:
        """Asynchronous where the staging copy fits: this rank's state times the ranks on this
        host, within a share of the memory available now."""
        import psutil

        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        need, available = nbytes * ranks_here, psutil.virtual_memory().available
        fits = need <= _HOST_MEMORY_SHARE * available
        if self.requested is None and dist_on():
            flag = torch.tensor([int(fits)], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
            fits = bool(flag.item())
        if not fits:
            what = ("checkpoint.async_save=true: staging may not fit" if self.requested
                    else "checkpoint.async_save: off, since staging would not fit")
            self.log.warning(f"{what}: it takes {need / 2**30:.1f} GiB of host memory on this host "
                             f"({ranks_here} rank(s)), {available / 2**30:.1f} GiB are available"
                             + ("" if self.requested else "; each save pauses training for the whole write"))
        return True if self.requested else fits

    # ------------------------------------------------------------------ the write (a thread, when async)
    def _write(self, job: _Job) -> None:
        """Every rank: write, report to rank 0, which commits or cleans up, and hear how it ended.
        The collectives run in the same order on every rank whatever fails on one of them."""
        clock = time.perf_counter()
        group = self._group
        try:
            error = self._prepare(job)
            errors = [e for e in all_gather(error, group) if e]
            records: dict = {}
            error = errors[0] if errors else None
            if error is None:
                try:
                    records = self._write_files(job, group)
                except _failures() as exc:   # reported to rank 0 and agreed on
                    error = describe(exc)
            _test_delay()
            reports = gather_to_first({"error": error, "records": records}, group)
            outcome = self._commit(job, reports, clock) if rank() == 0 else None
            outcome = broadcast_from_first(outcome, group)
        except _failures() as exc:   # a collective failed: a peer is gone
            outcome = {"error": f"checkpoint step_{job.step} not saved: {describe(exc)}", "path": None}
        finally:
            job.state = None       # the staged buffers stay with the stager; the live state is not ours
        if outcome["error"]:
            job.error = CheckpointWriteError(outcome["error"])
            return
        job.path = Path(outcome["path"])
        seconds = time.perf_counter() - clock
        written = outcome["bytes"]
        self.log.info(f"checkpoint saved: {job.path} ({written / 1e9:.2f} GB in {seconds:.1f} s, "
                      f"{written / 1e9 / max(seconds, 1e-9):.2f} GB/s)")

    def _prepare(self, job: _Job) -> str | None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            if rank() == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                remove_stale(self.dir)   # leftovers of a crashed save, this step's among them
                (job.tmp / RANKS_DIR).mkdir(parents=True)
        except _failures() as exc:   # agreed on before anyone writes
            return describe(exc)
        return None

    def _write_files(self, job: _Job, group) -> dict:
        import torch.distributed.checkpoint as dcp

        writer = checksums.dcp_writer(job.tmp, thread_count=self.write_threads)
        lost: list[BaseException] = []
        try:
            with _no_zip_crc32(), _writer_thread_errors(lost):
                dcp.save(job.state, storage_writer=writer, process_group=group, no_dist=not dist_on())
        except _failures():
            if writer.fs.error is not None:   # the file and the system's reason, not DCP's account of it
                raise writer.fs.error from None
            raise
        if writer.fs.error is not None or lost:   # a DCP writer thread failed and DCP went on without it
            raise writer.fs.error or lost[0]
        records = checksums.relative_records(writer.fs.records, job.tmp)
        name = f"{RANKS_DIR}/rank{rank()}.pt"
        records[name] = checksums.write_file(job.tmp / name, job.rank_file)
        return records

    def _commit(self, job: _Job, reports: list[dict], clock: float) -> dict:
        """Rank 0: the last files, COMPLETE, the rename and pruning; or, when any rank failed,
        remove the partial folder and name the newest intact checkpoint."""
        errors = [r["error"] for r in reports if r["error"]]
        records = {name: rec for r in reports for name, rec in r["records"].items()}
        if not errors:
            try:
                records[TRAINER_FILE] = checksums.write_file(job.tmp / TRAINER_FILE, job.trainer_file)
                meta = dict(job.meta, save_s=round(time.time() - job.started, 3),
                            stall_s=None if job.stall_s is None else round(job.stall_s, 3))
                data = (_json(meta)).encode()
                _write_named(job.tmp / META_FILE, data)
                records[META_FILE] = checksums.record_of(data)
                fsync_dir(job.tmp / RANKS_DIR)
                checksums.write_manifest(job.tmp, records)
                _write_named(job.tmp / COMPLETE_MARKER, f"{job.step}\n".encode())
                fsync_dir(job.tmp)
                replace_dir(job.tmp, job.final)   # the same step may be saved again (a final save after a resume)
                fsync_dir(self.dir)
            except _failures() as exc:   # becomes the agreed error
                errors.append(describe(exc))
        if errors:
            shutil.rmtree(job.tmp, ignore_errors=True)
            newest = find_latest(self.dir)
            return {"error": f"checkpoint step_{job.step} not saved: {errors[0]}; removed the partial "
                             f"{job.tmp.name}; the newest intact checkpoint is "
                             f"{newest if newest is not None else 'none (this run has not saved one yet)'}",
                    "path": None}
        try:
            prune(self.dir, self.keep_last, keep=job.final)
        except OSError as exc:
            self.log.warning(f"checkpoint: could not remove an old checkpoint ({exc})")
        return {"error": None, "path": str(job.final), "bytes": sum(size for size, _ in records.values())}


def save(checkpoint_dir: Path, step: int, *, model, optimizer, scheduler=None, loader=None,
         extra: dict | None = None, keep_last: int = 3, config: dict | None = None) -> Path:
    """Write checkpoint_dir/step_{step}/ atomically, now. Collective: every rank calls it.

    model: the plain (possibly fully_shard-ed) module, never the DDP wrapper;
    loader: anything with state_dict() (per rank); config: the training config as a dict
    (stored in meta.json so the checkpoint is self-describing for export);
    keep_last: complete checkpoints kept after this one is in place (<= 0 keeps all).
    """
    checkpointer = Checkpointer(checkpoint_dir, keep_last=keep_last, config=config, async_save=False)
    try:
        return checkpointer.save(step, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                                 extra=extra)
    finally:
        checkpointer.close()


def describe(exc: BaseException) -> str:
    """One line for what stopped a write: the file and the system's reason where there is one."""
    error = dcp_first_error(exc)
    if isinstance(error, OSError) and error.filename is not None:
        return f"cannot write {error.filename}: {error.strerror or error}"
    return f"{type(error).__name__}: {error}"


def _write_named(path: Path, data: bytes) -> None:
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise checksums.named(exc, path) from None


def _json(obj: Any) -> str:
    import json
    return json.dumps(obj, indent=2) + "\n"


@contextmanager
def _no_zip_crc32():
    """DCP torch.saves each tensor as a zip record whose CRC-32 costs one core about 1 GB/s and
    which torch.load never checks; checksums.json covers the same bytes at 10 GB/s."""
    get = getattr(torch.serialization, "get_crc32_options", None)   # torch >= 2.6
    if get is None:
        yield
        return
    before = get()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@contextmanager
def _writer_thread_errors(lost: list):
    """With write_threads > 1, DCP writes files on threads of its own too. One that fails ends with
    Python's traceback on stderr, and DCP neither sees it nor fails: its files would be missing
    from a checkpoint that commits. Their exceptions are kept here instead, for the save to fail
    with them (one line, like any failed save). When DCP's own part fails first, it returns
    without waiting for its threads: they are waited for here."""
    previous = threading.excepthook

    def dcp_writer(thread) -> bool:
        return thread is not None and "_write_files_from_queue" in (thread.name or "")

    def keep(args) -> None:
        if dcp_writer(args.thread):
            lost.append(args.exc_value)
        else:
            previous(args)
    threading.excepthook = keep
    try:
        yield
    finally:
        for thread in threading.enumerate():
            if dcp_writer(thread) and thread is not threading.current_thread():
                thread.join()
        threading.excepthook = previous


def _test_delay() -> None:
    seconds = float(os.environ.get(TEST_DELAY_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)

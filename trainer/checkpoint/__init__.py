"""Sharded, atomic, checksummed, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint (CHECKPOINT_DIR/step_{N}/):

    .metadata, __*_*.distcp   DCP files: {"model": ..., "optim": ...}, sharded per rank
    ranks/rank{R}.pt          per rank: RNG states (python, numpy, torch CPU, CUDA) and the
                              data loader's state_dict()
    trainer.pt                step, scheduler state_dict, extra (tokens_seen, wall_s, ...)
    meta.json                 human-readable: step, world_size, time, save and stall seconds,
                              versions, config
    checksums.json            size and xxh3_64 of every file above (checksums.py)
    COMPLETE                  written last; a directory without it is never resumed from

Atomicity: every rank writes into CHECKPOINT_DIR/.tmp_step_{N}, hashing what it writes; rank 0
then writes trainer.pt, meta.json, checksums.json and COMPLETE, renames the directory to
step_{N} (one atomic rename) and prunes to the last k. A crash at any point leaves the previous
step_* untouched; a leftover .tmp_step_* is ignored and removed by the next save. A save that
cannot be written (a full disk) removes its .tmp_step_N and names the file and the newest
intact checkpoint (CheckpointWriteError, exit 1).

Loading verifies every file against checksums.json first (reader.py); --resume auto skips,
names and sets aside a damaged checkpoint (damaged_step_N), --resume of one damaged step_N is
an error naming the file (resume.py). Checkpoints saved before checksums load unverified.

Saves are asynchronous where the state fits in host memory (writer.py, staging.py): training
waits only while the state is copied to host memory; the write runs in the background, one at
a time; the end of a run and a stop on a signal wait for it.

Model and optimizer go through torch.distributed.checkpoint.state_dict.get_state_dict /
set_state_dict, whose keys are the plain parameter names whatever the wrapping (FSDP2 DTensor
shards, DDP, or none), so a checkpoint from N ranks loads on M ranks, a single process included.

Modules: layout (names, errors, folders), checksums, resume (which checkpoint), staging,
writer (Checkpointer, save), reader (verify, load), state (RNG, state dicts, collectives).
"""
from trainer.checkpoint.layout import (CHECKSUMS_FILE, COMPLETE_MARKER, FORMAT_VERSION, META_FILE, RANKS_DIR,
                                       TMP_PREFIX, TRAINER_FILE, CheckpointError, CheckpointWriteError,
                                       DamagedCheckpoint, is_complete, list_checkpoints, prune, read_meta,
                                       replace_dir)
from trainer.checkpoint.reader import load, load_first_intact, load_model_state, verify
from trainer.checkpoint.resume import Candidate, candidates, find_latest, resolve
from trainer.checkpoint.state import rng_state, set_rng_state
from trainer.checkpoint.writer import Checkpointer, save

__all__ = [
    "CHECKSUMS_FILE", "COMPLETE_MARKER", "FORMAT_VERSION", "META_FILE", "RANKS_DIR", "TMP_PREFIX", "TRAINER_FILE",
    "Candidate", "CheckpointError", "CheckpointWriteError", "Checkpointer", "DamagedCheckpoint", "candidates",
    "find_latest", "is_complete", "list_checkpoints", "load", "load_first_intact", "load_model_state", "prune",
    "read_meta", "replace_dir", "resolve", "rng_state", "save", "set_rng_state", "verify",
]

"""Corpus -> prepared dataset directory (token shards + manifest): the flow of data.prepare.

    files     sources.py   which files, in which order (formats/: what each holds, by content)
    units     units.py     the corpus cut into units of work, the same for any worker count
    parts     workers.py   a pool of processes tokenizes units into parts (parts.py: kept on
                           disk in a work folder, so a stopped prepare continues there)
    dataset   shards.py    the parts assembled in order into train/val shards and a manifest;
                           output.py checks --out, locks it and swaps the new dataset in

Memory is bounded by the work in flight (a batch of text per worker), never by a file's
size, and the output is the same for any number of workers or nodes.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from core.files import make_temp_dir, seal
from core.signals import interrupted_by

from . import sources, units, workers
from .bpe import DEFAULT_BPE_VOCAB
from .dataset import FORMAT, MANIFEST, dtype_for_vocab, read_manifest
from .errors import DataError, Interrupted
from .formats import Limits
from .options import DEFAULT_SHARD_TOKENS, check_bpe_vocab, check_options, tokenizer_path
from .output import check_out, ctrl_c_deferred, is_dataset_dir, locked, recover, remove, swap_into_place, write_json
from .parts import WorkFolder
from .shards import assemble
from .tokenizers import get_tokenizer, train_bpe

DEFAULT_OUT = Path("data/stdlib")
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}

__all__ = ["DEFAULT_BPE_VOCAB", "DEFAULT_OUT", "DEFAULT_SHARD_TOKENS", "prepare"]


def anvil_version() -> str:
    try:
        from importlib.metadata import version

        return version("anvil")
    except Exception:  # not installed as a distribution: report it, do not fail
        return "unknown"


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
def prepare(inputs: list[Path] | None = None, out: Path = DEFAULT_OUT, tokenizer: str = "byte", *,
            val_fraction: float = 0.01, text_field: str = "text", workers: int | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, max_docs: int | None = None,
            max_tokens: int | None = None, vocab_size: int = DEFAULT_BPE_VOCAB, seed: int = 0,
            pattern: str | None = None, force: bool = False, progress: bool = True,
            on_nodes: Callable[[Path], None] | None = None, max_doc_bytes: int = Limits.max_doc_bytes,
            max_ratio: int = Limits.max_ratio) -> dict:
    """Build (or find up to date) the dataset at `out`. Returns a summary dict with
    "status" ("built" | "up-to-date"), "path", "seconds", "manifest", "notes".
    Ctrl-C becomes Interrupted (exit 130): the finished parts are kept for the next run.

    on_nodes(folder): make the parts elsewhere instead of here, and return when they are made:
    the runner starts `python -m trainer.data.node FOLDER` once on every node (the folder is on
    a file system they share, and its plan.json says everything a node needs); this process
    then checks the parts and assembles the dataset as it would its own.

    max_doc_bytes, max_ratio: what a hostile file may cost (formats.Limits): a longer document is
    skipped or cut, a compressed file past the ratio left out; both counted in the manifest."""
    state = {"out": None, "had_dataset": False, "folder": None, "parts": 0, "units": 0, "done": False}
    try:
        return _prepare(inputs, out, tokenizer, state, val_fraction=val_fraction, text_field=text_field,
                        workers=workers, shard_tokens=shard_tokens, max_docs=max_docs,
                        max_tokens=max_tokens, vocab_size=vocab_size, seed=seed, pattern=pattern,
                        force=force, progress=progress, on_nodes=on_nodes, max_doc_bytes=max_doc_bytes,
                        max_ratio=max_ratio)
    except KeyboardInterrupt as exc:   # Ctrl-C, or a stop signal inv turned into one (core.signals)
        what, code = interrupted_by(exc)
        raise Interrupted(_interrupted(state, what), code) from None


def _interrupted(state: dict, what: str = "Ctrl-C") -> str:
    """What a Ctrl-C (or `what` stopped it: SIGTERM, ...) left: the dataset as it was, and the
    finished parts for the next run."""
    target = state["out"]
    if target is None:
        return f"interrupted ({what}) before anything was written"
    if state["done"]:
        return f"interrupted ({what}) as the new dataset was put in place: {target} holds it, complete"
    intact = f"; the dataset already at {target} is intact" if state["had_dataset"] else \
        f"; nothing was put at {target}"
    if state["folder"] is not None:   # as on disk: a worker may have finished one the pool had not yet handed back
        folder = WorkFolder(Path(state["folder"]))
        state["parts"] = sum(folder.finished(i, check=False) is not None for i in range(state["units"]))
    if state["folder"] is None or not state["parts"]:
        return f"interrupted ({what}) before any part of the new dataset was finished{intact}"
    return (f"interrupted ({what}): {state['parts']} of {state['units']} parts of the new dataset are "
            f"finished and kept in {state['folder']}{intact}; run the same command again to continue "
            f"from there")


def _prepare(inputs, out, tokenizer: str, state: dict, *, val_fraction: float, text_field: str,
             workers: int | None, shard_tokens: int, max_docs: int | None, max_tokens: int | None,
             vocab_size: int, seed: int, pattern: str | None, force: bool, progress: bool, on_nodes=None,
             max_doc_bytes: int, max_ratio: int) -> dict:
    started = time.monotonic()
    out_given = str(out)
    check_options(val_fraction=val_fraction, shard_tokens=shard_tokens, max_docs=max_docs,
                  max_tokens=max_tokens, workers=workers, text_field=text_field, pattern=pattern,
                  max_doc_bytes=max_doc_bytes, max_ratio=max_ratio)
    tok = None
    if tokenizer == "bpe":
        check_bpe_vocab(vocab_size)
    elif tokenizer != "byte":
        tok = get_tokenizer(tokenizer_path(tokenizer))  # a bad file fails here, before any writing
    files, input_names, is_default = sources.resolve_inputs(inputs, pattern)

    settings = {"val_fraction": val_fraction, "text_field": text_field, "shard_tokens": shard_tokens,
                "max_docs": max_docs, "max_tokens": max_tokens, "seed": seed, "pattern": pattern,
                "max_doc_bytes": max_doc_bytes, "max_ratio": max_ratio}
    if tokenizer == "bpe":
        tokenizer_id = f"bpe:{vocab_size}"
        settings["vocab_size"] = vocab_size
    elif tokenizer == "byte":
        tokenizer_id = "byte"
    else:
        tokenizer_id = "json:" + tok.sha256
    fingerprint = _fingerprint(files, settings, tokenizer_id)

    out = check_out(out_given, input_names, force)
    state["out"] = out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--out {out_given}: cannot create {out.parent} "
                        f"({exc.strerror or exc}); expected a writable location") from None
    with locked(out):
        notes = recover(out, fingerprint)
        state["had_dataset"] = is_dataset_dir(out)
        if not force and (out / MANIFEST).is_file():
            try:
                existing = read_manifest(out)
            except DataError:
                existing = None
            if existing and existing.get("fingerprint") == fingerprint and _is_intact(out, existing):
                return {"status": "up-to-date", "path": str(out), "manifest": existing,
                        "seconds": time.monotonic() - started, "notes": notes}
        plan = units.plan(files, text_field)
        try:
            manifest, resumed = _build(out, fingerprint, plan, files, tokenizer, tok, settings, workers,
                                       progress, input_names, is_default, vocab_size, state, on_nodes, force)
        except OSError as exc:
            kept = (f"; the {state['parts']} finished parts are kept in {state['folder']} for the next run "
                    f"(delete it to free its space)") if state["parts"] else ""
            if exc.errno in _DISK_FULL:
                raise DataError(f"disk full while writing the dataset next to {out} "
                                f"({os.strerror(exc.errno)}); any earlier dataset at {out} is unchanged"
                                f"{kept}") from None
            raise DataError(f"cannot write the dataset at {out}: {exc}{kept}") from None
    if resumed:
        notes.append(f"continued a stopped prepare: {resumed} of {len(plan)} parts were already finished")
    return {"status": "built", "path": str(out), "manifest": manifest, "resumed_parts": resumed,
            "seconds": time.monotonic() - started, "notes": notes + manifest["source"]["skipped_examples"]}


def _build(out: Path, fingerprint: str, plan: list, files, tokenizer: str, tok, settings: dict, n_workers,
           progress: bool, input_names: list[str], is_default: bool, vocab_size: int, state: dict, on_nodes=None,
           force: bool = False) -> tuple[dict, int]:
    """Parts (those not finished yet), then the dataset assembled from them and swapped in.
    Returns (manifest, how many parts an earlier run had finished)."""
    folder, _ = WorkFolder.open(out, fingerprint, {
        "units": [u.to_dict() for u in plan], "settings": settings,
        "tokenizer": tokenizer if tokenizer in ("byte", "bpe") else str(tok.path)})
    state["folder"], state["units"] = folder.path, len(plan)
    if tokenizer == "bpe":
        tok = _trained_bpe(folder, files, settings, vocab_size)
    tok = tok or get_tokenizer(tokenizer)
    tok_name = "byte" if tok.kind == "byte" else str(tok.path)
    dtype = dtype_for_vocab(tok.vocab_size)
    parts = {u.index: info for u in plan if (info := folder.finished(u.index)) is not None}
    resumed = state["parts"] = len(parts)
    if on_nodes is None:
        workers.make_parts(plan, parts, folder, tok, tok_name, dtype, settings, n_workers, progress, state)
    elif not workers.enough(plan, parts, settings) and len(parts) < len(plan):
        on_nodes(folder.path)
        parts.update({u.index: info for u in plan if u.index not in parts
                      and (info := folder.finished(u.index)) is not None})
        state["parts"] = len(parts)
        missing = [u.index for u in plan if u.index not in parts]
        if missing and not workers.enough(plan, parts, settings):
            raise DataError(f"the nodes left {len(missing)} of {len(plan)} parts unmade (first: unit {missing[0]}); "
                            f"the {len(parts)} finished ones are kept in {folder.path}: run the same command "
                            f"again to continue")

    tmp = make_temp_dir(out.parent, prefix=f"{out.name}.tmp-")   # shared: mkdtemp's 0700 keeps the team out
    try:
        counts = assemble(plan, parts, folder, tmp, dtype, settings)
        if not counts["documents"]:   # the corpus itself is the problem: its parts are no use either
            folder.remove()
            raise sources.nothing_usable(input_names, files, counts["skipped"], settings["text_field"],
                                         next(iter(counts["examples"]), None))
        if tok.kind != "byte":
            shutil.copyfile(tok.path, tmp / "tokenizer.json")
        manifest = _manifest(counts, plan, files, tok, tokenizer, settings, input_names, is_default)
        manifest["fingerprint"] = fingerprint
        manifest = seal(manifest)   # a later reader notices an edited or damaged manifest
        write_json(tmp / MANIFEST, manifest)
        with ctrl_c_deferred():  # the two renames of the swap happen both or neither
            swap_into_place(tmp, out, force)
            state["done"] = True
    except BaseException:
        remove(tmp)
        raise
    folder.remove()
    return manifest, resumed


def _trained_bpe(folder: WorkFolder, files, settings: dict, vocab_size: int):
    """--tokenizer bpe: trained on the inputs once per work folder (a resumed prepare reuses it)."""
    path = folder.path / "tokenizer.json"
    if path.is_file():
        return get_tokenizer(path)
    texts = sources.documents(files, settings["text_field"], max_docs=settings["max_docs"],
                              limits=Limits.of(settings))
    return train_bpe(texts, vocab_size, path)


def _manifest(counts: dict, plan: list, files, tok, tokenizer: str, settings: dict, input_names: list[str],
              is_default: bool) -> dict:
    formats: dict[str, set] = {}
    for unit in plan:
        for span in unit.spans:
            formats.setdefault(span.format, set()).add(span.source.path)
    return {
        "format": FORMAT,
        "anvil_version": anvil_version(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "dtype": dtype_for_vocab(tok.vocab_size).name,
        "tokenizer": tok.spec() | ({"source": "trained on these inputs by data.prepare"}
                                   if tokenizer == "bpe" else {}),
        "source": {"inputs": input_names, "default_corpus": is_default, "files": len(files),
                   "files_used": counts["files_used"], "bytes_read": counts["bytes_read"],
                   "formats": {name: len(paths) for name, paths in sorted(formats.items())},
                   "skipped": counts["skipped"], "changed": counts["changed"], "skipped_examples": counts["examples"],
                   "truncated": counts["truncated"]},
        "settings": settings,
        "splits": counts["splits"],
    }

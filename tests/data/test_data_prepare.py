"""data.prepare on real files: counts, checksums, exact roundtrip, split, bad inputs,
full disk, a SIGKILL mid-way, reruns."""
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.corpus import STDLIB_FILES, decoded_documents, make_corpus
from helpers.files import tmpfs, tree
from helpers.program import inv
from trainer.data import DataError, Dataset, prepare
from trainer.data.inspect import verify


def test_prepare_counts_checksums_roundtrip(tmp_path):
    corpus, expected = make_corpus(tmp_path)
    out = tmp_path / "ds"
    result = prepare([corpus], out, val_fraction=0.3, shard_tokens=4000, workers=1, progress=False)
    m = result["manifest"]
    assert result["status"] == "built"
    assert m["documents"] == len(expected) == m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"]
    assert m["source"]["skipped"] == {"empty": 3, "invalid_utf8": 1, "binary": 1, "bad_gzip": 1,
                                      "bad_json_line": 1, "missing_text_field": 2}
    notes = "\n".join(m["source"]["skipped_examples"])
    assert "docs.jsonl:2: invalid JSON" in notes and "docs.jsonl:3: no string field 'text'" in notes
    assert m["dtype"] == "uint16" and m["tokenizer"]["kind"] == "byte"
    assert len(m["splits"]["train"]["shards"]) > 1  # shard_tokens forces several
    assert verify(Dataset(out)) == []
    docs = decoded_documents(out)
    assert sorted(docs["train"] + docs["val"]) == sorted(expected)  # byte roundtrip is exact
    assert docs["val"] and not set(docs["val"]) & set(docs["train"])
    assert m["tokens"] == sum(len(t.encode()) + 2 for t in expected)
    assert not list(tmp_path.glob("ds.tmp-*")) and not list(tmp_path.glob("ds.old-*"))


def test_parallel_output_identical_and_rerun_up_to_date(tmp_path):
    corpus, _ = make_corpus(tmp_path)
    serial = prepare([corpus], tmp_path / "a", workers=1, progress=False)
    parallel = prepare([corpus], tmp_path / "b", workers=2, progress=False)
    for split in ("train", "val"):
        assert serial["manifest"]["splits"][split] == parallel["manifest"]["splits"][split]
    again = prepare([corpus], tmp_path / "a", workers=1, progress=False)
    assert again["status"] == "up-to-date"
    (corpus / "py" / "this.py").write_text("changed\n")
    assert prepare([corpus], tmp_path / "a", workers=1, progress=False)["status"] == "built"
    forced = prepare([corpus], tmp_path / "a", workers=1, progress=False, force=True)
    assert forced["status"] == "built"


def test_val_split_never_empty_and_limits(tmp_path):
    corpus, _ = make_corpus(tmp_path)
    m = prepare([corpus / "py"], tmp_path / "ds", val_fraction=0.001, workers=1, progress=False)["manifest"]
    assert m["splits"]["val"]["documents"] == 1 and m["splits"]["train"]["documents"] == len(STDLIB_FILES) - 1
    m = prepare([corpus / "py"], tmp_path / "ds", max_docs=3, workers=1, progress=False)["manifest"]
    assert m["documents"] == 3 and m["source"]["truncated"]
    m = prepare(None, tmp_path / "std", max_docs=5, workers=1, progress=False)["manifest"]
    assert m["source"]["default_corpus"] and m["documents"] == 5


def test_workers_are_asked_to_stop_not_killed_when_the_pool_ends_early(tmp_path, monkeypatch):
    """Pool.terminate() kills workers, and one killed while sending a file's tokens leaves half a
    message in the pipe: the pool then waits for the rest for ever (a Ctrl-C that hung data.prepare).
    Ending early (here --max-tokens; Ctrl-C takes the same way out) must not go through it."""
    import multiprocessing.pool

    terminated = []
    real = multiprocessing.pool.Pool.terminate
    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", lambda pool: (terminated.append(pool), real(pool)))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"d{i:02}.txt").write_text(f"document {i} " * 2000)
    m = prepare([corpus], tmp_path / "ds", max_tokens=30_000, workers=2, progress=False)["manifest"]
    assert m["source"]["truncated"] and 30_000 <= m["tokens"] < 30_000 + 2 * 24_000
    assert terminated == []
    m = prepare([corpus], tmp_path / "all", workers=2, progress=False)["manifest"]   # the jobs still run in full
    assert m["documents"] == 40 and not m["source"]["truncated"] and terminated == []


def test_bad_inputs_are_clear_errors(tmp_path):
    corpus, _ = make_corpus(tmp_path)
    with pytest.raises(DataError, match="input not found: .*nope"):
        prepare([tmp_path / "nope"], tmp_path / "ds", progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("empty.txt", "junk.bin", "latin1.txt", "corrupt.txt.gz"):
        shutil.copy(corpus / name, bad / name)
    good = tmp_path / "ds"
    prepare([corpus / "py"], good, workers=1, progress=False)
    before = tree(good)
    with pytest.raises(DataError, match="no usable documents.*1 bad_gzip, 1 binary, 1 empty, 1 invalid_utf8"):
        prepare([bad], good, workers=1, progress=False)
    assert tree(good) == before
    with pytest.raises(DataError, match="val-fraction"):
        prepare([corpus], good, val_fraction=1.5, progress=False)
    with pytest.raises(DataError, match="gpt2: no such file; expected byte, bpe or the path of a Hugging Face tokenizer.json"):
        prepare([corpus], good, tokenizer="gpt2", progress=False)
    assert not list(tmp_path.glob("ds.tmp-*"))


def _prepare_in_subprocess(args: str, preexec=None, wait=True):
    code = f"from pathlib import Path\nfrom trainer.data import prepare, DataError\n" \
           f"try:\n    prepare({args}, progress=False)\nexcept DataError as e:\n    print('DataError:', e)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=preexec)
    if wait:
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err
    return proc


def test_file_size_limit_is_disk_full_and_keeps_old_dataset(tmp_path):
    """RLIMIT_FSIZE makes writes fail with EFBIG, as a full disk fails them with ENOSPC."""
    import resource

    corpus, _ = make_corpus(tmp_path)
    out = tmp_path / "ds"
    prepare([corpus / "py"], out, workers=1, progress=False)
    before = tree(out)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # noqa: E731
    rc, stdout, stderr = _prepare_in_subprocess(
        f"None, Path({str(out)!r}), max_docs=50, workers=1", preexec=limit)
    assert rc == 0 and "Traceback" not in stderr
    assert "DataError: disk full" in stdout and "unchanged" in stdout
    assert tree(out) == before
    assert not list(tmp_path.glob("ds.tmp-*"))


def test_full_tmpfs_is_clear_error(tmp_path):
    with tmpfs(tmp_path / "disk", "512k") as disk:
        corpus, _ = make_corpus(tmp_path)
        out = disk / "ds"
        prepare([corpus / "py"], out, workers=1, progress=False)
        before = tree(out)
        with pytest.raises(DataError, match="disk full.*No space left.*unchanged"):
            prepare(None, out, max_docs=60, workers=1, progress=False)
        assert tree(out) == before
        assert [p.name for p in disk.iterdir() if not p.name.startswith(".ds.parts-")] == ["ds"]
        # with room again, the same command builds it (from the parts kept) and leaves nothing beside it
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert prepare(None, out, max_docs=60, workers=1, progress=False)["manifest"]["documents"] == 60
        assert sorted(p.name for p in disk.iterdir()) == ["ds"]


def test_sigkill_midway_keeps_dataset_and_rerun_is_clean(tmp_path):
    corpus, _ = make_corpus(tmp_path)
    out = tmp_path / "ds"
    prepare([corpus / "py"], out, workers=1, progress=False)
    before = tree(out)
    # the default corpus (the stdlib) in 20k-token shards, each fsynced: long enough to be caught
    proc = _prepare_in_subprocess(f"None, Path({str(out)!r}), shard_tokens=20_000, "
                                  f"workers=1, force=True", wait=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tmps = list(tmp_path.glob("ds.tmp-*"))
        if tmps and len(list(tmps[0].glob("train/*.bin"))) >= 3:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "prepare finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob("ds.tmp-*")), "the killed run left its temp dir"
    assert tree(out) == before  # the dataset in place is untouched
    result = prepare([corpus / "py"], out, workers=1, progress=False)
    assert result["status"] == "up-to-date" and any("removed stale ds.tmp-" in n for n in result["notes"])
    assert not list(tmp_path.glob("ds.tmp-*"))


def test_interrupted_swap_is_repaired(tmp_path):
    """A kill between 'out -> out.old' and 'tmp -> out' leaves only out.old: restored."""
    corpus, _ = make_corpus(tmp_path)
    out = tmp_path / "ds"
    prepare([corpus / "py"], out, workers=1, progress=False)
    before = tree(out)
    out.rename(tmp_path / "ds.old-abc123")
    (tmp_path / "ds.tmp-xyz").mkdir()
    result = prepare([corpus / "py"], out, workers=1, progress=False)
    assert result["status"] == "up-to-date"
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]


def test_large_vocab_tokenizer_json_gives_uint32(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"tok{i}": len(alphabet) + i for i in range(70_000)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    path = tmp_path / "big.json"
    tok.save(str(path))
    corpus, expected = make_corpus(tmp_path)
    out = tmp_path / "ds"
    m = prepare([corpus], out, tokenizer=str(path), workers=1, progress=False)["manifest"]
    assert m["dtype"] == "uint32" and m["tokenizer"]["vocab_size"] > 65536
    assert m["tokenizer"]["kind"] == "json" and (out / "tokenizer.json").read_bytes() == path.read_bytes()
    docs = decoded_documents(out)
    assert sorted(docs["train"] + docs["val"]) == sorted(expected)
    assert np.fromfile(out / m["splits"]["train"]["shards"][0]["file"], dtype=np.uint32).max() > 65535


def test_concurrent_prepare_is_refused(tmp_path):
    from trainer.data.output import locked as _locked

    corpus, _ = make_corpus(tmp_path)
    out = tmp_path / "ds"
    with _locked(out):  # what a running prepare holds
        assert (tmp_path / ".ds.lock").is_file()
        with pytest.raises(DataError, match="another data.prepare is writing"):
            prepare([corpus], out, workers=1, progress=False)
    assert not (tmp_path / ".ds.lock").exists()  # removed when the lock went
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="not a directory"):
        prepare([corpus], tmp_path / "file", workers=1, progress=False)


def test_inv_data_prepare_leaves_no_lock_file(tmp_path):
    """The lock file beside the dataset goes when the run ends: built, up to date, failed,
    or after a run killed with SIGKILL left one."""
    corpus, _ = make_corpus(tmp_path)

    def prepare_here(*args):
        return inv(tmp_path, "data.prepare", "--input", corpus / "py", "--out", tmp_path / "data" / "ds", "-q",
                   "--workers", "1", *args)

    for args in ((), (), ("--force",)):   # built, up to date, rebuilt
        proc = prepare_here(*args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["ds"]
    (tmp_path / "data" / ".ds.lock").write_bytes(b"")   # what a SIGKILLed run leaves
    assert prepare_here().returncode == 0
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["ds"]
    failed = prepare_here("--val-fraction", "0.5", "--shard-tokens", "0")  # refused before the lock
    assert failed.returncode == 2 and sorted(p.name for p in (tmp_path / "data").iterdir()) == ["ds"]


def test_lock_on_a_lock_file_removed_meanwhile_does_not_count(tmp_path, monkeypatch):
    """Run B opens .ds.lock; run A, which held it, removes it and lets go; run C creates and
    locks a new one. B's flock then succeeds on A's removed file: B must see that and not
    write beside C (the race that removing lock files could open)."""
    import fcntl
    import importlib

    output = importlib.import_module("trainer.data.output")

    out, lock_path = tmp_path / "ds", tmp_path / ".ds.lock"
    real_flock, others = fcntl.flock, []

    def flock_after_a_and_c(fd, operation):
        if not others:
            os.unlink(lock_path)                                      # A is done
            others.append(os.open(lock_path, os.O_WRONLY | os.O_CREAT))
            real_flock(others[0], fcntl.LOCK_EX)                      # C holds the new file
        return real_flock(fd, operation)

    monkeypatch.setattr(output.fcntl, "flock", flock_after_a_and_c)
    lock_path.write_bytes(b"")                                        # A's file, which B opens
    try:
        with pytest.raises(DataError, match="another data.prepare is writing"):
            with output.locked(out):
                pass
        assert lock_path.is_file()                                    # C's, untouched
    finally:
        os.close(others[0])


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_dataset_gets_the_modes_mkdir_and_open_give(tmp_path, umask):
    """Not mkdtemp's 0700: a dataset on a shared cluster is read by the whole team, like runs."""
    corpus, _ = make_corpus(tmp_path)
    old = os.umask(umask)
    try:
        for tokenizer, force in (("byte", False), ("bpe", False), ("bpe", True)):  # new, replaced, rebuilt
            prepare([corpus], tmp_path / "ds", tokenizer, vocab_size=300, force=force, workers=1,
                    progress=False)
            out = tmp_path / "ds"
            paths = [out, *sorted(out.rglob("*"))]
            names = {str(p.relative_to(out)) for p in paths}
            assert {"manifest.json", "train/000000.bin", "val/documents.bin"} <= names
            assert ("tokenizer.json" in names) is (tokenizer == "bpe")
            for path in paths:
                expected = (0o777 if path.is_dir() else 0o666) & ~umask
                assert path.stat().st_mode & 0o777 == expected, (tokenizer, path)
    finally:
        os.umask(old)


def test_a_file_named_twice_is_read_once(tmp_path):
    corpus, expected = make_corpus(tmp_path)
    once = prepare([corpus / "py"], tmp_path / "once", workers=1, progress=False)["manifest"]
    twice = prepare([corpus / "py", corpus / "py", corpus / "py" / "this.py"], tmp_path / "twice", workers=1,
                    progress=False)["manifest"]
    assert twice["documents"] == once["documents"] == len(STDLIB_FILES) and twice["tokens"] == once["tokens"]
    assert twice["source"]["files"] == len(STDLIB_FILES) and len(twice["source"]["inputs"]) == 2

"""Bad input to data.prepare, data.tokenizer and data.inspect through the installed `inv`, as a user types
it: one line saying what was wrong and what is expected, exit 2, no traceback, and nothing that was
already there (datasets, corpora, unrelated files) lost; a dataset damaged on disk is found by
data.inspect and by training before it trains on it; a split too small for one sequence is said
before launch.

Every command runs with its working directory in a fresh temporary folder and every
output path inside it: a wrong guard must never be able to reach the checkout.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers.files import tree
from helpers.program import inv, one_line_error, runs


# ---------------------------------------------------------------- 1. data.prepare's --out guard

def test_prepare_refuses_a_folder_holding_other_things(tmp_path, small_corpus):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine, keep me")
    proc = inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", other, "-q")
    one_line_error(proc, "data.prepare: --out", "holding other things", "notes.txt",
                   "expected a new or empty directory")
    assert tree(other) == {"notes.txt": b"mine, keep me"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "other"]  # no lock, no temp dir


@pytest.mark.parametrize("out,what", [("", "--out is empty"), (".", "is the current directory"),
                                      ("..", "is a parent of the current directory"),
                                      ("/", "is the filesystem root")])
def test_prepare_refuses_the_working_directory_and_above(tmp_path, small_corpus, out, what):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    proc = inv(work, "data.prepare", "--input", small_corpus, "--out", out, "-q")
    one_line_error(proc, "data.prepare:", what, "expected a dataset directory")
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "work"]


@pytest.mark.parametrize("out,what", [("corpus", "is the input"), ("corpus/ds", "is inside the input"),
                                      (".", "is the current directory")])
def test_prepare_refuses_an_output_at_or_around_an_input(tmp_path, small_corpus, out, what):
    before = tree(small_corpus)
    proc = inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", tmp_path / out, "-q")
    one_line_error(proc, "data.prepare: --out", what)
    assert tree(small_corpus) == before


def test_prepare_refuses_an_output_holding_an_input(tmp_path):
    inner = tmp_path / "box" / "corpus"
    inner.mkdir(parents=True)
    (inner / "a.txt").write_text("some text here")
    proc = inv(tmp_path, "data.prepare", "--input", inner, "--out", tmp_path / "box", "-q")
    one_line_error(proc, "data.prepare: --out", "holds the input", "expected a directory outside the corpus")
    assert (inner / "a.txt").read_text() == "some text here"


def test_prepare_writes_into_missing_or_empty_and_rebuilds_a_dataset(tmp_path, small_corpus):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", empty, "-q").returncode == 0
    assert json.loads((empty / "manifest.json").read_text())["format"] == "anvil-tokens/1"
    again = inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", empty, "-q", "--force")
    assert again.returncode == 0, again.stderr
    fresh = inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", tmp_path / "a" / "b", "-q")
    assert fresh.returncode == 0 and (tmp_path / "a" / "b" / "manifest.json").is_file()


# ---------------------------------------------------------------- 2. a shard holding ids outside the vocabulary

@pytest.fixture
def damaged(tmp_path, dataset) -> Path:
    """A copy of the session dataset with ids >= the vocabulary written into its first train
    shard, every 50th token from token 100 on: same size, so only the ids tell."""
    import shutil

    import numpy as np

    copy = tmp_path / "damaged"
    shutil.copytree(dataset, copy)
    shard = copy / "train" / "000000.bin"
    size = shard.stat().st_size
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[100::50] = 1000
    tokens.flush()
    del tokens
    assert shard.stat().st_size == size
    return copy


def damage_line(ds: Path, token_id=1000, at=100) -> str:
    return (f"dataset {ds} is damaged: {ds}/train/000000.bin holds token id {token_id} at token {at}, "
            f"outside the tokenizer's vocabulary of 259 (ids 0..258); prepare it again with --force")


@pytest.mark.parametrize("verify", [False, True])
def test_inspect_finds_ids_outside_the_vocabulary(tmp_path, damaged, verify):
    proc = inv(tmp_path, "data.inspect", "--path", damaged, "--samples", "0", *(["--verify"] if verify else []))
    one_line_error(proc, "data.inspect: " + damage_line(damaged))


def test_inspect_scans_large_datasets_only_with_verify(damaged, monkeypatch):
    from trainer.data import DataError, inspect
    monkeypatch.setattr(inspect, "SCAN_LIMIT_BYTES", 0)  # as if the shards were over 1 GiB
    assert inspect.inspect_dataset(damaged, samples=0)["token_ids_checked"] is False
    with pytest.raises(DataError, match="is damaged: .* holds token id 1000 at token 100"):
        inspect.inspect_dataset(damaged, samples=0, check=True)


def test_training_stops_on_ids_outside_the_vocabulary(tmp_path, damaged):
    sets = [f"data.path={damaged}", "train.steps=3", "data.seq_len=64", "data.batch_size=16",
            "train.val_interval=0", "checkpoint.interval=0"]
    proc = inv(tmp_path, "train.pretrain", "--env", "OMP_NUM_THREADS=1",
               *[arg for item in sets for arg in ("--set", item)], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]   # the rank's UserError
    prefix = damage_line(damaged).split(" holds")[0]
    assert f"error: {prefix} holds token id 1000 at token " in proc.stderr
    assert "outside the tokenizer's vocabulary of 259 (ids 0..258); prepare it again with --force" in proc.stderr


# ---------------------------------------------------------------- 3. data.* options: exit 2, one line, no fallback

@pytest.fixture(scope="module")
def playground(tmp_path_factory) -> Path:
    """A folder with a small corpus, a dataset, damaged copies of it and odd files. Commands
    that run here must be refused: whatever they do, nothing in it may change."""
    import shutil

    from trainer.data import prepare

    root = tmp_path_factory.mktemp("playground")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"d{i}.txt").write_text(f"document {i} " * 50)
    (root / "bin.dat").write_bytes(b"\x00\x01\x02binary")
    (root / "afile").write_text("text")
    (root / "emptydir").mkdir()
    (root / "halfds" / "train").mkdir(parents=True)      # shards begun, no manifest: a cut-short prepare
    (root / "tokdir").mkdir()
    (root / "one.jsonl").write_text('{"text": "x"}\n')
    prepare([root / "corpus"], root / "ds", progress=False, workers=1)

    def damaged(name, edit):
        shutil.copytree(root / "ds", root / name)
        edit(root / name)

    def manifest(edit, unsealed=True):
        """An edited manifest; unsealed: without its own checksum, as one written before manifests had it."""
        def apply(path):
            m = json.loads((path / "manifest.json").read_text())
            edit(m)
            if unsealed:
                m.pop("record_sha256")
            (path / "manifest.json").write_text(json.dumps(m))
        return apply

    damaged("cut", lambda p: (p / "manifest.json").write_text('{"format": "anvil-tokens/1", '))
    damaged("nokeys", lambda p: (p / "manifest.json").write_text('{"format": "anvil-tokens/1"}'))
    damaged("binman", lambda p: (p / "manifest.json").write_bytes(b"\xff\xfe\x00"))
    damaged("noshard", lambda p: (p / "train" / "000000.bin").unlink())
    damaged("short", lambda p: os.truncate(p / "train" / "000000.bin", 10))
    damaged("notok", manifest(lambda m: m["tokenizer"].update(kind="bpe")))
    damaged("nosplits", manifest(lambda m: m.update(splits={})))
    damaged("edited", manifest(lambda m: m.update(tokens=m["tokens"] + 1), unsealed=False))
    damaged("badsum", lambda p: (p / "train" / "000000.bin").write_bytes(
        b"A\x00" + (p / "train" / "000000.bin").read_bytes()[2:]))
    return root


DATA_CASES = [
    # data.prepare
    ("data.prepare --input {w}/corpus --out {w}/o --shard-tokens -5",
     "--shard-tokens: expected a positive number of tokens per shard, got -5"),
    ("data.prepare --input {w}/corpus --out {w}/o --shard-tokens 0",
     "--shard-tokens: expected a positive number of tokens per shard, got 0"),
    ("data.prepare --input {w}/corpus --out {w}/o --max-docs -1",
     "--max-docs: expected a positive number (0 or left out: no limit), got -1"),
    ("data.prepare --input {w}/corpus --out {w}/o --max-tokens -1",
     "--max-tokens: expected a positive number (0 or left out: no limit), got -1"),
    ("data.prepare --input {w}/corpus --out {w}/o --val-fraction 1.5", "--val-fraction: expected a number in [0, 1), got 1.5"),
    ("data.prepare --input {w}/corpus --out {w}/o --val-fraction -0.1", "--val-fraction: expected a number in [0, 1), got -0.1"),
    ("data.prepare --input {w}/corpus --out {w}/o --val-fraction nan", "--val-fraction: expected a number in [0, 1), got nan"),
    ("data.prepare --input {w}/corpus --out {w}/o --val-fraction abc", "--val-fraction: expected a number in [0, 1), got 'abc'"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer bpe --vocab-size -5",
     "--vocab-size -5 is too small: a byte-level BPE needs at least 259"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer bpe --vocab-size 100",
     "--vocab-size 100 is too small: a byte-level BPE needs at least 259"),
    ("data.prepare --input {w}/corpus --out {w}/o --vocab-size 5000",
     "--vocab-size applies to --tokenizer bpe only"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer nosuch",
     "--tokenizer nosuch: no such file; expected byte, bpe or the path of a Hugging Face tokenizer.json"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer {w}/tokdir",
     "tokdir: a directory without a tokenizer.json; expected byte, bpe or the path"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer {w}/bin.dat",
     "bin.dat is not a text file (NUL byte at byte 0); expected a Hugging Face tokenizer.json"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer {w}/afile",
     "afile is not JSON (Expecting value: line 1 column 1 (char 0)); expected a Hugging Face tokenizer.json"),
    ("data.prepare --input {w}/corpus --out {w}/o --tokenizer ''", "--tokenizer is empty; expected byte, bpe"),
    ("data.prepare --input {w}/corpus --out {w}/o --pattern '*.nothing'",
     "no input files found in {w}/corpus matching '*.nothing'; expected text or JSONL files (.gz, .zst too), Parquet"),
    ("data.prepare --input {w}/corpus --out {w}/o --pattern ''", "--pattern is empty; expected a file-name glob"),
    ("data.prepare --input {w}/nosuch --out {w}/o", "input not found: {w}/nosuch; expected existing files"),
    ("data.prepare --input {w}/bin.dat --out {w}/o",
     "no usable documents in {w}/bin.dat (1 file; skipped: 1 binary; first: {w}/bin.dat: binary (NUL byte at offset 0)); expected UTF-8 text files"),
    ("data.prepare --input '' --out {w}/o", "--input is empty; expected a file or directory"),
    ("data.prepare --input , --out {w}/o", "--input is empty; expected a file or directory"),
    ("data.prepare --input {w}/corpus --out {w}/afile", "--out {w}/afile is a file, not a directory"),
    ("data.prepare --input {w}/corpus --out {w}/afile/ds",
     "a file is in the way where a directory is needed ({w}/afile)"),
    ("data.prepare --input {w}/corpus --out /proc/forbidden/ds",
     "--out /proc/forbidden/ds: cannot create /proc/forbidden (No such file or directory)"),
    ("data.prepare --input {w}/corpus --out {w}/o --workers -3",
     "--workers: expected a positive number of processes (0 or left out: all cores), got -3"),
    ("data.prepare --input {w}/corpus --out {w}/o --text-field ''", "--text-field is empty; expected the JSONL field"),
    ("data.prepare --input {w}/one.jsonl --out {w}/o --text-field nope",
     "(1 file; skipped: 1 missing_text_field; first: {w}/one.jsonl:1: no string field 'nope'); expected UTF-8 text files, or JSONL lines / Parquet or Arrow rows with a text field 'nope'"),
    # data.tokenizer
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out ''", "--out is empty; expected a file path"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/emptydir", "emptydir is a directory; expected a file path"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/afile",
     "afile exists and is not a tokenizer.json; expected a new file"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/afile/t.json",
     "a file is in the way where a directory is needed ({w}/afile)"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out /proc/forbidden/t.json",
     "--out /proc/forbidden/t.json: cannot create /proc/forbidden (No such file or directory)"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/corpus/d1.txt", "is inside the input {w}/corpus"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/ds/manifest.json", "is not a tokenizer.json"),
    ("data.tokenizer --vocab-size 0 --input {w}/corpus --out {w}/t.json", "--vocab-size 0 is too small"),
    ("data.tokenizer --vocab-size 300 --input '' --out {w}/t.json", "--input is empty"),
    ("data.tokenizer --vocab-size 300 --input {w}/bin.dat --out {w}/t.json", "no usable documents in {w}/bin.dat"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/t.json --max-docs -1", "--max-docs: expected a positive"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/t.json --text-field ''", "--text-field is empty"),
    ("data.tokenizer --vocab-size 300 --input {w}/corpus --out {w}/t.json --pattern ''", "--pattern is empty"),
    # data.inspect
    ("data.inspect --path ''", "the dataset path is empty; expected a dataset directory"),
    ("data.inspect --path {w}/afile", "afile is a file, not a directory; expected a dataset directory"),
    ("data.inspect --path {w}/corpus", "no prepared dataset at {w}/corpus (no manifest.json); this folder is not a "
                                       "dataset; give one made by `inv data.prepare --out DIR`"),
    ("data.inspect --path {w}/halfds", "(no manifest.json); it is not a finished dataset; run `inv data.prepare` "
                                       "again"),
    ("data.inspect --path {w}/ds --split nosuch", "has no split 'nosuch'; expected one of: train, val"),
    ("data.inspect --path {w}/ds --samples -1", "--samples: expected a number of documents >= 0, got -1"),
    ("data.inspect --path {w}/ds --chars -1", "--chars: expected a positive number of characters per sample, got -1"),
    ("data.inspect --path {w}/ds --chars 0", "--chars: expected a positive number of characters per sample, got 0"),
    ("data.inspect --path {w}/cut", "cut/manifest.json is not valid JSON (")
    , ("data.inspect --path {w}/nokeys", "nokeys/manifest.json has dtype None (expected uint16 or uint32); the dataset is damaged"),
    ("data.inspect --path {w}/binman", "binman/manifest.json is not text (invalid UTF-8 at byte 0); the dataset is damaged"),
    ("data.inspect --path {w}/noshard", "is incomplete: {w}/noshard/train/000000.bin is missing; prepare it again"),
    ("data.inspect --path {w}/short", "short/train/000000.bin has 10 bytes, the manifest says"),
    ("data.inspect --path {w}/notok", "was made with a bpe tokenizer but its tokenizer.json is missing"),
    ("data.inspect --path {w}/nosplits", "has no split 'train'; expected one of: (none)"),
    ("data.inspect --path {w}/edited", "edited/manifest.json does not match its own checksum (edited or "
                                       "damaged since it was written); the dataset is damaged; prepare it again"),
    ("data.inspect --path {w}/badsum --verify --samples 0",
     "badsum is damaged: the sha256 of train/000000.bin differs from the manifest; prepare it again with --force"),
]


@pytest.mark.parametrize("command,message", DATA_CASES, ids=[c for c, _ in DATA_CASES])
def test_data_option_is_one_line_and_exit_2(playground, command, message):
    import shlex

    before = tree(playground)
    args = [a.replace("{w}", str(playground)) for a in shlex.split(command)]
    task = args[0]
    proc = inv(playground, *args, "-q" if task == "data.prepare" else "--json", timeout=120)
    one_line_error(proc, f"{task}: ", message.replace("{w}", str(playground)))
    after = tree(playground)
    assert after == before  # nothing written: no temp folder, and data.prepare removes its lock file


# ---------------------------------------------------------------- 4. splits too small, said before launch

def test_a_split_too_small_for_one_sequence_is_said_before_launch(tmp_path, small_corpus):
    """data.prepare --val-fraction 0 is a user's choice; training on it must fail before a run
    directory exists and name the fix, not after the training steps (the final validation)."""
    proc = inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", tmp_path / "vf0", "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = ["train.pretrain", "--env", "OMP_NUM_THREADS=1", "--set", f"data.path={tmp_path / 'vf0'}",
            "--set", "train.steps=2", "--set", "data.seq_len=64"]
    for extra in ([], ["--set", "train.val_interval=0"]):  # 0: validation at the end only, still on
        one_line_error(inv(tmp_path, *base, *extra), "its 'val' split has 0 tokens, too few for one sequence "
                       "of data.seq_len=64 + 1", "--set train.val_batches=0", "larger --val-fraction")
    # 3 documents of 362 tokens, split at 0.5: train holds 1 or 2, under one sequence of 1024+1
    proc = inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", tmp_path / "half", "--val-fraction", "0.5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    one_line_error(inv(tmp_path, *base[:3], "--set", f"data.path={tmp_path / 'half'}", "--set", "data.seq_len=1024"),
                   "its 'train' split has", "too few for one sequence of data.seq_len=1024 + 1",
                   "prepare it from more data, or lower data.seq_len")
    assert runs(tmp_path) == []
    proc = inv(tmp_path, *base, "--set", "train.val_batches=0", "--set", "checkpoint.interval=0")
    assert proc.returncode == 0, proc.stderr[-3000:]                    # the fix it names works
    (run,) = runs(tmp_path)
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file()

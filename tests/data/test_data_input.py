"""Bad input through the installed `inv`, as a user types it: one line saying what was wrong
and what is expected, a non-zero exit (2 for user errors), no traceback, and nothing that
was already there (datasets, run directories, exports, unrelated files) lost.

Every command runs with its working directory in a fresh temporary folder and every
output path inside it: a wrong guard must never be able to reach the checkout.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers.program import INV, inv, one_line_error, runs


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document number {i}\n" * 20)
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, dataset) -> Path:
    """A tiny finished train.pretrain run (2 steps on CPU, a final checkpoint); read-only for tests."""
    work = tmp_path_factory.mktemp("finished")
    sets = [f"data.path={dataset}", "train.steps=2", "data.seq_len=64", "data.batch_size=4",
            "train.val_interval=0", "train.log_interval=1", "checkpoint.interval=0"]
    proc = inv(work, "train.pretrain", "--env", "OMP_NUM_THREADS=1",
               *[arg for item in sets for arg in ("--set", item)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(work)
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file() and (run / "metrics.jsonl").is_file()
    return run


# ---------------------------------------------------------------- 0. data.prepare's --out guard

def test_prepare_refuses_a_folder_holding_other_things(tmp_path, corpus):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine, keep me")
    proc = inv(tmp_path, "data.prepare", "--input", corpus, "--out", other, "-q")
    one_line_error(proc, "data.prepare: --out", "holding other things", "notes.txt",
                   "expected a new or empty directory")
    assert tree(other) == {"notes.txt": b"mine, keep me"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "other"]  # no lock, no temp dir


@pytest.mark.parametrize("out,what", [("", "--out is empty"), (".", "is the current directory"),
                                      ("..", "is a parent of the current directory"),
                                      ("/", "is the filesystem root")])
def test_prepare_refuses_the_working_directory_and_above(tmp_path, corpus, out, what):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    proc = inv(work, "data.prepare", "--input", corpus, "--out", out, "-q")
    one_line_error(proc, "data.prepare:", what, "expected a dataset directory")
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "work"]


@pytest.mark.parametrize("out,what", [("corpus", "is the input"), ("corpus/ds", "is inside the input"),
                                      (".", "is the current directory")])
def test_prepare_refuses_an_output_at_or_around_an_input(tmp_path, corpus, out, what):
    before = tree(corpus)
    proc = inv(tmp_path, "data.prepare", "--input", corpus, "--out", tmp_path / out, "-q")
    one_line_error(proc, "data.prepare: --out", what)
    assert tree(corpus) == before


def test_prepare_refuses_an_output_holding_an_input(tmp_path):
    inner = tmp_path / "box" / "corpus"
    inner.mkdir(parents=True)
    (inner / "a.txt").write_text("some text here")
    proc = inv(tmp_path, "data.prepare", "--input", inner, "--out", tmp_path / "box", "-q")
    one_line_error(proc, "data.prepare: --out", "holds the input", "expected a directory outside the corpus")
    assert (inner / "a.txt").read_text() == "some text here"


def test_prepare_writes_into_missing_or_empty_and_rebuilds_a_dataset(tmp_path, corpus):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert inv(tmp_path, "data.prepare", "--input", corpus, "--out", empty, "-q").returncode == 0
    assert json.loads((empty / "manifest.json").read_text())["format"] == "anvil-tokens/1"
    again = inv(tmp_path, "data.prepare", "--input", corpus, "--out", empty, "-q", "--force")
    assert again.returncode == 0, again.stderr
    fresh = inv(tmp_path, "data.prepare", "--input", corpus, "--out", tmp_path / "a" / "b", "-q")
    assert fresh.returncode == 0 and (tmp_path / "a" / "b" / "manifest.json").is_file()


# ---------------------------------------------------------------- 1. a config that is not a YAML text
# (through inv for the main cases; the loader in-process for the variants: each inv train.pretrain
# costs seconds of imports before the config is read)

@pytest.mark.parametrize("content,where", [(b"name: x\n\xff\xfe junk\n", "invalid UTF-8 at byte 8"),
                                           (b"name: x\x00\n", "NUL byte at byte 7")])
def test_binary_config_is_refused(tmp_path, content, where):
    (tmp_path / "model.bin").write_bytes(content)
    proc = inv(tmp_path, "train.pretrain", "--config", "model.bin", timeout=120)
    line = one_line_error(proc, "train.pretrain: model.bin: not a text YAML file", where)
    assert line.endswith("; expected a YAML config such as configs/tiny.yaml")
    assert runs(tmp_path) == []


def test_binary_config_variants(tmp_path):
    from trainer.config import ConfigError, load

    (tmp_path / "all.bin").write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=r"all.bin: not a text YAML file \(NUL byte at byte 0\)"):
        load(tmp_path / "all.bin")
    (tmp_path / "late.bin").write_bytes(b"a: 1\n\xe9\x00")
    with pytest.raises(ConfigError, match=r"late.bin: not a text YAML file \(invalid UTF-8 at byte 5\)"):
        load(tmp_path / "late.bin")


def test_directory_as_config_is_refused(tmp_path):
    (tmp_path / "configs").mkdir()
    proc = inv(tmp_path, "train.pretrain", "--config", "configs", timeout=120)
    one_line_error(proc, "train.pretrain: configs: is a directory; expected a YAML config file")
    assert runs(tmp_path) == []


# ---------------------------------------------------------------- 2. export / plot outputs that cannot be written

@pytest.mark.parametrize("task,out,fragments", [
    ("train.export", "/proc/forbidden/x", ["--out /proc/forbidden/x: cannot create /proc/forbidden",
                                           "No such file or directory"]),
    ("train.export", "afile/x", ["--out afile/x: a file is in the way where a directory is needed", "afile)"]),
    ("train.export", "afile", ["--out afile is a file; expected a new directory"]),
    ("train.export", "adir", ["--out adir exists; expected a new directory"]),
    ("train.plot", "/proc/forbidden/x.png", ["--out /proc/forbidden/x.png: cannot create /proc/forbidden",
                                             "No such file or directory"]),
    ("train.plot", "afile/x.png", ["--out afile/x.png: a file is in the way where a directory is needed"]),
    ("train.plot", "afile", ["a file is in the way where a directory is needed", "afile)"]),
    ("train.plot", "x.jpg", ["x.jpg: the output must be a .png file or a directory"]),
])
def test_unwritable_output_is_one_line(tmp_path, finished_run, task, out, fragments):
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep").write_text("mine too")
    proc = inv(tmp_path, task, finished_run, "--out", out, timeout=120)
    one_line_error(proc, f"{task}: ", *fragments)
    assert (tmp_path / "afile").read_text() == "mine" and (tmp_path / "adir" / "keep").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]  # no temp left behind


@pytest.mark.parametrize("task,run,fragments", [
    ("train.export", "afile", ["afile: not a directory; expected a run directory or a checkpoint (step_N)"]),
    ("train.export", "RUN/metrics.jsonl", ["not a directory; expected a run directory or a checkpoint"]),
    ("train.export", "", ["the run is empty; expected a run directory or a checkpoint (step_N)"]),
    ("train.plot", "afile", ["afile: not a directory; expected a run directory"]),
    ("train.plot", "", ["the run is empty; expected a run directory"]),
])
def test_export_or_plot_of_something_else_than_a_run(tmp_path, finished_run, task, run, fragments):
    (tmp_path / "afile").write_text("mine")
    proc = inv(tmp_path, task, run.replace("RUN", str(finished_run)), timeout=120)
    one_line_error(proc, f"{task}: ", *fragments)


def test_plot_and_export_still_write(tmp_path, finished_run):
    png = tmp_path / "plots" / "loss.png"
    assert inv(tmp_path, "train.plot", finished_run, "--out", png, timeout=120).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_mode & 0o777 == 0o666 & ~umask  # as before write_atomic: the umask, not 0600
    assert not list(png.parent.glob(".*"))
    proc = inv(tmp_path, "train.export", finished_run, "--out", tmp_path / "hf", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


# ---------------------------------------------------------------- 3. an empty config

EMPTY = "config is empty; expected a mapping of sections (model:, data:, optim:, train:, ...)"


@pytest.mark.parametrize("text", ["", "# only a comment\n# and another\n"])
def test_empty_config_is_refused(tmp_path, text):
    (tmp_path / "empty.yaml").write_text(text)
    proc = inv(tmp_path, "train.pretrain", "--config", "empty.yaml", timeout=120)
    one_line_error(proc, f"train.pretrain: empty.yaml: {EMPTY}")
    assert runs(tmp_path) == []


@pytest.mark.parametrize("text", ["\n\n", "---\n", "   \n# x\n"])
def test_empty_config_variants(tmp_path, text):
    from trainer.config import ConfigError, load

    (tmp_path / "empty.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "empty.yaml")
    assert str(info.value) == f"{tmp_path / 'empty.yaml'}: {EMPTY}"


# ---------------------------------------------------------------- 4. inf / nan in float fields; the lr range

@pytest.mark.parametrize("item,key,got", [("optim.lr=.inf", "optim.lr", "inf"),
                                          ("optim.betas=[0.9, .nan]", "optim.betas[1]", "nan")])
def test_inf_and_nan_are_refused(tmp_path, item, key, got):
    proc = inv(tmp_path, "train.pretrain", "--set", item, timeout=120)
    one_line_error(proc, f"tiny.yaml with --set {item}: {key}: expected a finite number, got {got}")
    assert runs(tmp_path) == []


@pytest.mark.parametrize("item,key,got", [
    ("optim.lr=nan", "optim.lr", "'nan'"), ("optim.lr=1e999", "optim.lr", "'1e999'"),
    ("model.norm_eps=inf", "model.norm_eps", "'inf'"), ("optim.grad_clip=-.inf", "optim.grad_clip", "-inf"),
    ("schedule.min_lr_ratio=.nan", "schedule.min_lr_ratio", "nan"),
    ("model.rope_scaling={factor: .inf}", "model.rope_scaling.factor", "inf"),
    ("optim.betas=[.inf, 0.9]", "optim.betas[0]", "inf"),
])
def test_inf_and_nan_in_every_float_field(item, key, got):
    from trainer.config import ConfigError, load

    with pytest.raises(ConfigError, match=re.escape(f"tiny.yaml with --set {item}: {key}: expected a finite number, got {got}")):
        load(None, [item])


def test_learning_rate_must_be_in_zero_one(tmp_path):
    from trainer.config import ConfigError, load

    proc = inv(tmp_path, "train.pretrain", "--set", "optim.lr=2", timeout=120)
    one_line_error(proc, "tiny.yaml with --set optim.lr=2: optim.lr: expected a learning rate in (0, 1], e.g. 3e-4, "
                         "got 2.0")
    assert runs(tmp_path) == []
    for lr in ("0", "-1e-3", "1.0000001"):
        with pytest.raises(ConfigError, match=re.escape("optim.lr: expected a learning rate in (0, 1], e.g. 3e-4")):
            load(None, [f"optim.lr={lr}"])
    assert load(None, ["optim.lr=1"]).optim.lr == 1.0


# ---------------------------------------------------------------- 5. a shard holding ids outside the vocabulary

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


# ---------------------------------------------------------------- 6. snapshot.list and a broken metadata.json

def test_list_shows_runs_with_unreadable_metadata(tmp_path):
    root = tmp_path / "runs"
    for name, content in [("2026-01-01T00-00-00_good", json.dumps({"task": "env.show", "status": "ok",
                                                                     "start": "2026-01-01T00:00:00"})),
                          ("2026-01-02T00-00-00_cut", '{"task": "train.pretrain", "sta'),
                          ("2026-01-03T00-00-00_binary", b"\xff\xfe\x00"),
                          ("2026-01-04T00-00-00_list", "[1, 2]")]:
        (root / name).mkdir(parents=True)
        target = root / name / "metadata.json"
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    (root / "not-a-run").mkdir()  # no metadata.json at all: not a run, not listed
    proc = inv(tmp_path, "snapshot.list", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    table, _, below = proc.stdout.partition("\n2026-01-02T00-00-00_cut: ")
    lines = {line.split()[-1]: line for line in table.splitlines()[2:]}
    assert sorted(lines) == ["2026-01-01T00-00-00_good", "2026-01-02T00-00-00_cut",
                             "2026-01-03T00-00-00_binary", "2026-01-04T00-00-00_list"]
    assert "env.show" in lines["2026-01-01T00-00-00_good"]
    assert all("(unreadable)" in lines[name] for name in lines if not name.endswith("good"))
    assert below.startswith("metadata.json unreadable: not valid JSON: Unterminated string")   # one reason a line
    assert "\n2026-01-03T00-00-00_binary: metadata.json unreadable: not UTF-8 text at byte 0\n" in below
    assert "\n2026-01-04T00-00-00_list: metadata.json unreadable: not a JSON object (a list)" in below
    assert max(map(len, table.splitlines())) < 150
    rows = json.loads(inv(tmp_path, "snapshot.list", "--json", timeout=60).stdout)
    assert [r["dir"] for r in rows if r.get("problem")] == ["2026-01-02T00-00-00_cut", "2026-01-03T00-00-00_binary",
                                                           "2026-01-04T00-00-00_list"]


# ---------------------------------------------------------------- 7. Ctrl-C during data.prepare

@pytest.mark.parametrize("existing", [True, False])
def test_ctrl_c_during_prepare_keeps_the_old_dataset_and_the_finished_parts(tmp_path, corpus, existing):
    import signal

    from helpers.processes import start_as_from_a_terminal, wait_until

    out = tmp_path / "ds"
    if existing:
        assert inv(tmp_path, "data.prepare", "--input", corpus, "--out", out, "-q").returncode == 0
    before = tree(out) if existing else {}
    # the default corpus (the stdlib, ~12 M tokens) in 1000-token shards: seconds of assembly
    command = [str(INV), "data.prepare", "--out", str(out), "--shard-tokens", "1000", "--force", "--workers", "2"]
    env = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs")}
    proc = start_as_from_a_terminal(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)

    def sharding() -> bool:
        tmps = list(tmp_path.glob("ds.tmp-*"))
        return bool(tmps) and len(list(tmps[0].glob("train/*.bin"))) >= 3
    wait_until(sharding, proc, timeout=120, pause=0.01)
    assert proc.poll() is None, "prepare finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C on a terminal does: the whole process group
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stderr, stderr
    parts = list(tmp_path.glob(".ds.parts-*"))
    assert len(parts) == 1
    finished = len(list(parts[0].glob("*.json"))) - 1   # plan.json is not a part
    assert finished > 0
    intact = f"the dataset already at {out} is intact" if existing else f"nothing was put at {out}"
    assert (f"data.prepare: interrupted (Ctrl-C): {finished} of {finished} parts of the new dataset are finished "
            f"and kept in {parts[0]}; {intact}; run the same command again to continue from there") in stderr
    assert tree(out) == before if existing else not out.exists()
    assert not list(tmp_path.glob("ds.tmp-*")) and not list(tmp_path.glob("ds.old-*"))
    # the same command again continues from the finished parts, and leaves nothing beside the dataset
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"continued a stopped prepare: {finished} of {finished} parts were already finished" in again.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ds", ".ds"))) == ["ds"]


# ---------------------------------------------------------------- 8. data.* options: exit 2, one line, no fallback

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


# ---------------------------------------------------------------- 8. snapshot.* and profile.* options

@pytest.fixture
def recorded(tmp_path, finished_run) -> Path:
    """tmp_path/runs with a copy of the finished run and damaged copies of it."""
    import shutil

    runs_dir = tmp_path / "runs"

    def copy(name, edit=None):
        shutil.copytree(finished_run, runs_dir / name, ignore=shutil.ignore_patterns("checkpoints"))
        if edit:
            edit(runs_dir / name)

    copy("good")
    copy("cut_md", lambda p: (p / "metadata.json").write_text('{"task": '))
    copy("bad_env", lambda p: (p / "env.json").write_text("[1"))
    copy("list_machine", lambda p: (p / "machine.json").write_text("[1, 2]"))
    copy("str_vars", lambda p: (p / "env.json").write_text('{"vars": "x"}'))
    copy("bin_versions", lambda p: (p / "versions.json").write_bytes(b"\xff\xfe"))

    def argv(value):
        def edit(p):
            md = json.loads((p / "metadata.json").read_text())
            md["argv"] = value
            md.pop("record_sha256")   # as a run recorded before records were sealed: its types are checked
            (p / "metadata.json").write_text(json.dumps(md))
        return edit

    copy("no_argv", argv([]))
    copy("str_argv", argv("inv train.pretrain"))
    (tmp_path / "afile").write_text("x")
    return runs_dir


SNAPSHOT_CASES = [
    ("snapshot.list --limit -1", "--limit: expected a number of runs >= 1 (0 or left out: all), got -1"),
    ("snapshot.show ''", "the run is empty; expected a run directory (a path, or a name under {runs})"),
    ("snapshot.show nosuch", "nosuch: no such run directory; expected a run directory (a path, or a name under {runs})"),
    ("snapshot.show afile", "afile: not a directory; expected a run directory"),
    ("snapshot.show .", ".: not a run directory (no metadata.json); expected a run directory"),
    ("snapshot.show cut_md", "cut_md/metadata.json: not valid JSON (Expecting value: line 1 column 10 (char 9)); "
                             "the run directory is damaged"),
    ("snapshot.show bad_env", "bad_env/env.json: not valid JSON ("),
    ("snapshot.show list_machine", "list_machine/machine.json: expected a JSON object, got a list; the run directory is damaged"),
    ("snapshot.show str_vars", "str_vars/env.json: 'vars' is not a JSON object; the run directory is damaged"),
    ("snapshot.show bin_versions", "bin_versions/versions.json: not UTF-8 text (byte 0); the run directory is damaged"),
    ("snapshot.diff -a good -b list_machine", "list_machine/machine.json: expected a JSON object, got a list"),
    ("snapshot.diff -a '' -b good", "the run is empty; expected a run directory"),
    ("snapshot.replay '' --dry-run", "the run is empty; expected a run directory"),
    ("snapshot.replay no_argv --dry-run", "no_argv: no recorded command line"),
    ("snapshot.replay str_argv --dry-run",
     "str_argv: the recorded command line (metadata.json 'argv') is not a list of strings; the run directory is damaged"),
    ("snapshot.replay str_vars --dry-run", "str_vars/env.json: 'vars' is not a JSON object"),
    ("profile.train --steps abc", "--steps 'abc': expected START:END with 1 <= START < END (end exclusive), e.g. 3:6"),
    ("profile.train --steps 0:3", "--steps '0:3': expected START:END with 1 <= START < END"),
    ("profile.train --ranks ''", "--ranks '': expected global ranks >= 0 such as 0 or 0,8, or all"),
    ("profile.train --ranks 0,-2", "--ranks '0,-2': expected global ranks >= 0"),
    ("profile.train --top 0", "--top: expected a positive number of operators, got 0"),
    ("profile.train --nproc -1", "--nproc: expected a positive number of processes per node"),
]


@pytest.mark.parametrize("command,message", SNAPSHOT_CASES, ids=[c for c, _ in SNAPSHOT_CASES])
def test_snapshot_and_profile_option_is_one_line_and_exit_2(tmp_path, recorded, command, message):
    import shlex

    names = sorted(p.name for p in recorded.iterdir())
    args = shlex.split(command)
    proc = inv(tmp_path, *args, timeout=120)
    one_line_error(proc, f"{args[0]}: ", message.replace("{runs}", str(recorded)))
    assert sorted(p.name for p in recorded.iterdir()) == names  # no run directory made


def test_snapshot_show_and_diff_still_work(tmp_path, recorded):
    shown = inv(tmp_path, "snapshot.show", "good", timeout=120)
    assert shown.returncode == 0 and "train.pretrain" in shown.stdout, shown.stderr
    assert inv(tmp_path, "snapshot.diff", "-a", "good", "-b", "good", timeout=120).stdout.strip() == "no differences"
    listed = inv(tmp_path, "snapshot.list", "--limit", "2", "--json", timeout=120)
    assert [row["dir"] for row in json.loads(listed.stdout)] == ["str_argv", "str_vars"]


# ---------------------------------------------------------------- 2 (more). damaged runs given to export / plot

def test_plot_of_binary_metrics_and_export_of_a_damaged_checkpoint(tmp_path, finished_run):
    import shutil

    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\xff\xfe\x00\n")
    proc = inv(tmp_path, "train.plot", "binary", "--out", tmp_path / "p.png", timeout=120)
    one_line_error(proc, "train.plot: binary/metrics.jsonl: no training steps logged yet")
    damaged = tmp_path / "damaged"
    shutil.copytree(finished_run, damaged)
    for shard in (damaged / "checkpoints" / "step_2").glob("*.distcp"):
        shard.unlink()
    proc = inv(tmp_path, "train.export", "damaged", "--out", tmp_path / "hf", timeout=300)
    one_line_error(proc, "train.export: the run damaged: no intact checkpoint in damaged "
                         "(step_2: __0_0.distcp is missing)")   # seen from checksums.json, before reading
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


# ---------------------------------------------------------------- more: options checked before anything starts

def test_empty_config_option_missing_resume_and_missing_argument_are_exit_2(tmp_path):
    for argv, expected in ((["train.pretrain", "--config", ""], "--config is empty; expected a YAML config"),
                           (["train.pretrain", "--resume", str(tmp_path / "nosuch"), "--dry-run",
                             "--set", "data.path=synthetic"],
                            "no such file or directory"),
                           (["snapshot.diff", "-a", "x"], "did not receive required positional arguments")):
        proc = inv(tmp_path, *argv)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_kernels_on_a_cpu_and_a_warmup_longer_than_the_run_are_said_before_starting(tmp_path):
    no_gpu = inv(tmp_path, "train.pretrain", "--kernels", "--set", "data.path=synthetic",
                 env={"TRITON_INTERPRET": "0"})
    assert no_gpu.returncode == 2 and "--kernels needs a GPU (CUDA or ROCm)" in no_gpu.stderr, no_gpu.stderr
    fp8 = inv(tmp_path, "train.pretrain", "--set", "data.path=synthetic", "--set", "precision.fp8=tensorwise")
    assert fp8.returncode == 2 and fp8.stderr.strip() == ("train.pretrain: precision.fp8 needs a GPU with FP8 support "
                                                          "(sm_89+ / MI300+); this machine has none. Set "
                                                          "precision.fp8=off"), fp8.stderr   # not a failed rank
    assert not (tmp_path / "runs").exists()
    # Through Slurm the GPUs are the nodes', not this (login) machine's: nothing to refuse here.
    on_nodes = inv(tmp_path, "train.pretrain", "--kernels", "--set", "precision.fp8=tensorwise", "--runtime", "slurm",
                   "--dry-run", "--set", "data.path=synthetic", env={"TRITON_INTERPRET": "0"})
    assert on_nodes.returncode == 0 and "sbatch --parsable" in on_nodes.stdout, on_nodes.stderr
    warm = inv(tmp_path, "train.pretrain", "--dry-run", "--set", "data.path=synthetic", "--set", "train.steps=5",
               "--set", "schedule.warmup_steps=5")
    assert warm.returncode == 0, warm.stderr
    assert "WARNING: schedule.warmup_steps=5 >= train.steps=5: the learning rate never leaves warmup" in warm.stderr
    # Warnings go to stderr, so --json's stdout is the result alone.
    as_json = inv(tmp_path, "train.pretrain", "--json", "--set", "data.path=synthetic", "--set", "train.steps=2",
                  "--set", "schedule.warmup_steps=5", "--set", "train.val_batches=0")
    assert as_json.returncode == 0 and "never leaves warmup" in as_json.stderr, as_json.stderr[-2000:]
    assert json.loads(as_json.stdout)["steps"] == 2


# ---------------------------------------------------------------- more: splits too small, said before launch

def test_a_split_too_small_for_one_sequence_is_said_before_launch(tmp_path, corpus):
    """data.prepare --val-fraction 0 is a user's choice; training on it must fail before a run
    directory exists and name the fix, not after the training steps (the final validation)."""
    proc = inv(tmp_path, "data.prepare", "--input", corpus, "--out", tmp_path / "vf0", "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = ["train.pretrain", "--env", "OMP_NUM_THREADS=1", "--set", f"data.path={tmp_path / 'vf0'}",
            "--set", "train.steps=2", "--set", "data.seq_len=64"]
    for extra in ([], ["--set", "train.val_interval=0"]):  # 0: validation at the end only, still on
        one_line_error(inv(tmp_path, *base, *extra), "its 'val' split has 0 tokens, too few for one sequence "
                       "of data.seq_len=64 + 1", "--set train.val_batches=0", "larger --val-fraction")
    # 3 documents of 362 tokens, split at 0.5: train holds 1 or 2, under one sequence of 1024+1
    proc = inv(tmp_path, "data.prepare", "--input", corpus, "--out", tmp_path / "half", "--val-fraction", "0.5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    one_line_error(inv(tmp_path, *base[:3], "--set", f"data.path={tmp_path / 'half'}", "--set", "data.seq_len=1024"),
                   "its 'train' split has", "too few for one sequence of data.seq_len=1024 + 1",
                   "prepare it from more data, or lower data.seq_len")
    assert runs(tmp_path) == []
    proc = inv(tmp_path, *base, "--set", "train.val_batches=0", "--set", "checkpoint.interval=0")
    assert proc.returncode == 0, proc.stderr[-3000:]                    # the fix it names works
    (run,) = runs(tmp_path)
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file()

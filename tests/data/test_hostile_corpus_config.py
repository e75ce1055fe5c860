"""Issue 44, the training side of a hostile corpus: `--set data.path=null` alone is refused in one
line (it used to train on data/stdlib without a word), and a blend of a thousand datasets keeps
the console and logs short: each line names the first few sources and "... N more", while the
run's files (summary.json, dataset.json, metrics.jsonl) keep every source."""
from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from trainer import metrics
from trainer.config import DEFAULT_CONFIG, ConfigError, load
from trainer.data import prepare
from helpers.program import inv, one_line_error, runs

SOURCES = 1000


def _tiny_dataset(folder: Path) -> Path:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:2]
    prepare(files, folder, val_fraction=0.3, workers=1, progress=False)
    return folder


# ---------------------------------------------------------------- data.path=null

def test_data_path_null_alone_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load(None, ["data.path=null"])
    text = str(err.value)
    assert text.startswith(f"{DEFAULT_CONFIG} with --set data.path=null: data.path: expected a prepared dataset "
                           f"directory or 'synthetic', got null") and "data.blend" in text and "\n" not in text


def test_data_path_null_in_a_file_is_refused_and_left_out_is_the_default(tmp_path):
    config = tmp_path / "null.yaml"
    config.write_text("data:\n  path: null\n")
    with pytest.raises(ConfigError, match=rf"^{config}: data.path: expected a prepared dataset directory"):
        load(config)
    config.write_text("data:\n  path: null\n  blend: []\n")
    with pytest.raises(ConfigError, match="got null"):
        load(config)
    config.write_text("data:\n  seq_len: 64\n")
    assert load(config).data.path == "data/stdlib"   # a config without data.path: the documented default
    blend = load(None, ["data.path=null", "data.blend=[{path: data/a, weight: 1}]"])   # what null is for
    assert blend.data.path is None and [s.path for s in blend.data.blend] == ["data/a"]


def test_inv_train_pretrain_with_data_path_null_does_not_train_on_the_stdlib(tmp_path):
    """With a data/stdlib there, a null data.path used to resolve to it and train."""
    _tiny_dataset(tmp_path / "data" / "stdlib")
    proc = inv(tmp_path, "train.pretrain", "--set", "data.path=null", "--dry-run", timeout=240)
    line = one_line_error(proc, "--set data.path=null", "data.path: expected a prepared dataset directory")
    assert "got null" in line and not runs(tmp_path)


# ---------------------------------------------------------------- a blend of a thousand datasets

@pytest.fixture(scope="module")
def thousand(tmp_path_factory) -> Path:
    """A folder holding data/s0000 .. data/s0999: copies of one tiny dataset."""
    root = tmp_path_factory.mktemp("thousand")
    one = _tiny_dataset(root / "data" / "s0000")
    for i in range(1, SOURCES):
        shutil.copytree(one, root / "data" / f"s{i:04d}")
    return root


def _blend_sets(root: Path) -> list[str]:
    blend = ", ".join(f"{{path: {root}/data/s{i:04d}, weight: {1 + i % 3}}}" for i in range(SOURCES))
    return ["data.path=null", f"data.blend=[{blend}]"]


def test_the_data_line_and_the_summary_table_fold_a_long_blend(thousand):
    from trainer.train import check_data
    label = check_data(load(None, [*_blend_sets(thousand), "data.seq_len=32"]))
    assert len(label) < 800 and label.startswith("blend of s0000 ") and f"... {SOURCES - 5} more" in label
    sources = {f"s{i:04d}": {"weight": 1 / SOURCES, "tokens": 64, "token_share": 1 / SOURCES, "epochs": 0.01,
                             "val_loss": 5.0} for i in range(SOURCES)}
    summary = {"status": "ok", "steps": 20, "final_loss": 5.0, "val_loss": 5.0, "tokens": 1280, "data": label,
               "wall_s": 1.0, "sources": sources}
    lines = metrics.summary_table(summary).splitlines()
    assert max(map(len, lines)) < 900, max(map(len, lines))   # each row was padded to the whole label
    assert len(lines) < 40 and sum(line.startswith("│ s0") for line in lines) == 5
    assert any(f"... {SOURCES - 5} more" in line and "summary.json" in line for line in lines)
    few = metrics.summary_table({**summary, "sources": dict(list(sources.items())[:6])})   # short: all, as before
    assert all(f"s000{i}" in few for i in range(6)) and "in summary.json" not in few


@pytest.mark.slow   # a real run over 1000 sources (their loaders, a validation batch each): about 45 s
def test_a_thousand_source_blend_run_keeps_its_console_short_and_its_files_whole(thousand):
    sets = [*_blend_sets(thousand), "data.seq_len=32", "data.batch_size=2", "train.steps=2", "train.log_interval=1",
            "train.val_interval=0", "train.val_batches=1", "checkpoint.interval=0", "checkpoint.save_final=false",
            "logging.progress=false", "logging.tensorboard=false", "logging.gpu_stats=false", "model.dim=32",
            "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64", "model.vocab_size=512",
            "schedule.warmup_steps=1"]
    tmp_path = thousand / "work"
    tmp_path.mkdir()
    proc = inv(tmp_path, "train.pretrain", "--env", "OMP_NUM_THREADS=1",
               *[a for s in sets for a in ("--set", s)], timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    (run,) = runs(tmp_path)
    log = (run / "logs" / "rank0.log").read_text()
    for text in (out, log):
        longest = max(text.splitlines(), key=len)
        assert len(longest) < 1000, longest[:300]
        assert len(text) < 200_000, len(text)
        assert f"... {SOURCES - 5} more" in text
    summary = json.loads((run / "summary.json").read_text())
    assert len(summary["sources"]) == SOURCES   # the full list stays in the run's files
    assert len(json.loads((run / "dataset.json").read_text())["blend"]) == SOURCES
    last_val = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"kind": "val"' in line][-1]
    assert sum(key.startswith("val_loss/") for key in last_val) == SOURCES

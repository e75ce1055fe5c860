"""Issue 44, the training side of a hostile corpus: `--set data.path=null` alone is refused in one
line (it used to train on data/stdlib without a word)."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from trainer.config import DEFAULT_CONFIG, ConfigError, load
from trainer.data import prepare
from user_input import inv, one_line_error, runs


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

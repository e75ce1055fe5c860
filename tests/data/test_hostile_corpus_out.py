"""Issue 44, what data.prepare writes: never a file per token (--shard-tokens has a floor), and
nothing of the user's in --out is lost: `data.prepare --out DS --force` over a dataset folder that
also held the user's notes.txt deleted it. A rebuild now replaces only what Anvil wrote there
(the files the manifest lists), a folder that is no dataset takes the dataset beside its things
with --force only, and a kill at any point of the swap loses nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.data import DataError, prepare
from trainer.data.options import MIN_SHARD_TOKENS
from helpers.files import tree
from helpers.program import inv, one_line_error


@pytest.fixture
def three_doc_corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document number {i}\n" * 200)
    return folder


# ---------------------------------------------------------------- --shard-tokens has a floor

@pytest.mark.parametrize("tokens", [1, MIN_SHARD_TOKENS - 1])
def test_shard_tokens_below_the_floor_is_one_line_and_writes_nothing(tmp_path, three_doc_corpus, tokens):
    proc = inv(tmp_path, "data.prepare", "--input", three_doc_corpus, "--out", tmp_path / "ds", "--shard-tokens", tokens, "-q")
    one_line_error(proc, f"--shard-tokens {tokens}: expected at least 1,000 tokens per shard")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_shard_tokens_at_the_floor_is_taken(tmp_path, three_doc_corpus):
    result = prepare([three_doc_corpus], tmp_path / "ds", shard_tokens=MIN_SHARD_TOKENS, workers=1, progress=False)
    shards = result["manifest"]["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["tokens"] == MIN_SHARD_TOKENS for s in shards[:-1])
    with pytest.raises(DataError, match="--shard-tokens 999: expected at least 1,000"):
        prepare([three_doc_corpus], tmp_path / "ds2", shard_tokens=999, workers=1, progress=False)


# ---------------------------------------------------------------- --force replaces only what Anvil wrote

def _users_files(out: Path) -> dict[str, bytes]:
    """The user's things in a dataset folder: a note, a folder of their own, a file among the shards."""
    (out / "notes.txt").write_text("mine, keep me")
    (out / "mine").mkdir()
    (out / "mine" / "plot.png").write_bytes(b"\x89PNG not really")
    (out / "train" / "README.md").write_text("what these shards are")
    return {"notes.txt": b"mine, keep me", "mine/plot.png": b"\x89PNG not really",
            "train/README.md": b"what these shards are"}


def _theirs_kept(out: Path, expected: dict[str, bytes]) -> None:
    files = tree(out)
    assert {name: files.get(name) for name in expected} == expected


def test_force_over_a_dataset_keeps_the_users_files(tmp_path, three_doc_corpus):
    out = tmp_path / "ds"
    prepare([three_doc_corpus], out, workers=1, progress=False)
    mine = _users_files(out)
    before = json.loads((out / "manifest.json").read_text())
    proc = inv(tmp_path, "data.prepare", "--input", three_doc_corpus, "--out", out, "--force", "-q")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    _theirs_kept(out, mine)
    after = json.loads((out / "manifest.json").read_text())
    assert after["created"] >= before["created"] and after["splits"] == before["splits"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]   # no old, tmp, parts or lock left


def test_a_rebuild_for_new_inputs_keeps_them_too_and_drops_only_old_shards(tmp_path, three_doc_corpus):
    out = tmp_path / "ds"
    prepare([three_doc_corpus], out, workers=1, progress=False, shard_tokens=1000)
    mine = _users_files(out)
    (three_doc_corpus / "doc0.txt").write_text("a much shorter corpus now\n")
    result = prepare([three_doc_corpus], out, workers=1, progress=False, shard_tokens=1000 * 1000)
    assert result["status"] == "built"
    _theirs_kept(out, mine)
    listed = {s["file"] for split in result["manifest"]["splits"].values() for s in split["shards"]}
    assert {name for name in tree(out) if name.endswith(".bin") and "documents" not in name} == listed


def test_a_folder_holding_other_things_needs_force_and_then_keeps_them(tmp_path, three_doc_corpus):
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = inv(tmp_path, "data.prepare", "--input", three_doc_corpus, "--out", out, "-q")
    one_line_error(proc, "holding other things", "notes.txt", "--force writes the dataset beside them")
    assert tree(out) == {"notes.txt": b"mine"}
    proc = inv(tmp_path, "data.prepare", "--input", three_doc_corpus, "--out", out, "--force", "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(out)["notes.txt"] == b"mine" and (out / "manifest.json").is_file()
    again = prepare([three_doc_corpus], out, workers=1, progress=False, force=True)   # now a dataset: rebuilt, note kept
    assert again["status"] == "built" and tree(out)["notes.txt"] == b"mine"


def test_force_refuses_a_folder_whose_things_take_the_datasets_names(tmp_path, three_doc_corpus):
    out = tmp_path / "results"
    (out / "train").mkdir(parents=True)
    (out / "train" / "my_model.pt").write_text("weights")
    proc = inv(tmp_path, "data.prepare", "--input", three_doc_corpus, "--out", out, "--force", "-q")
    one_line_error(proc, "is not an Anvil dataset but holds train", "nothing was written")
    assert tree(out) == {"train/my_model.pt": b"weights"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "results"]


def test_a_file_of_the_users_in_the_way_of_a_new_shard_stops_the_swap(tmp_path, three_doc_corpus):
    out = tmp_path / "ds"
    prepare([three_doc_corpus], out, workers=1, progress=False, val_fraction=0)   # val: no shard
    (out / "val" / "000000.bin").write_bytes(b"not a shard of this dataset")
    before = tree(out)
    with pytest.raises(DataError, match=r"holds val/000000.bin, which the dataset there does not list"):
        prepare([three_doc_corpus], out, workers=1, progress=False, val_fraction=0.5)
    assert tree(out) == before


def test_a_kill_before_the_users_files_were_put_back_is_repaired(tmp_path, three_doc_corpus):
    """Killed after the swap's renames: the new dataset is in place, the old one (with the user's
    notes) beside it as ds.old-X. The next run puts the notes back and removes the rest."""
    out = tmp_path / "ds"
    prepare([three_doc_corpus], out, workers=1, progress=False)
    old = tmp_path / "ds.old-abc123"
    shutil.copytree(out, old)
    mine = _users_files(old)
    result = prepare([three_doc_corpus], out, workers=1, progress=False)
    assert result["status"] == "up-to-date" and any("put 3 of your files back" in n for n in result["notes"])
    _theirs_kept(out, mine)
    assert not old.exists()


def test_a_kill_between_the_renames_of_a_folder_that_was_no_dataset_restores_it(tmp_path, three_doc_corpus):
    """--force into a folder of the user's, killed after 'out -> out.old-X': the folder is restored,
    where it used to be removed for holding no manifest."""
    old = tmp_path / "results.old-abc123"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    result = prepare([three_doc_corpus], tmp_path / "results", workers=1, progress=False, force=True)
    assert result["status"] == "built" and tree(tmp_path / "results")["notes.txt"] == b"mine"
    assert any("restored" in n for n in result["notes"]) and not old.exists()

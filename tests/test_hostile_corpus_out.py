"""Issue 44, what data.prepare writes: never a file per token (--shard-tokens has a floor), and
nothing of the user's in --out is lost (--force replaces only what Anvil wrote there)."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainer.data import DataError, prepare
from trainer.data.options import MIN_SHARD_TOKENS
from user_input import inv, one_line_error


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document number {i}\n" * 200)
    return folder


# ---------------------------------------------------------------- --shard-tokens has a floor

@pytest.mark.parametrize("tokens", [1, MIN_SHARD_TOKENS - 1])
def test_shard_tokens_below_the_floor_is_one_line_and_writes_nothing(tmp_path, corpus, tokens):
    proc = inv(tmp_path, "data.prepare", "--input", corpus, "--out", tmp_path / "ds", "--shard-tokens", tokens, "-q")
    one_line_error(proc, f"--shard-tokens {tokens}: expected at least 1,000 tokens per shard")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_shard_tokens_at_the_floor_is_taken(tmp_path, corpus):
    result = prepare([corpus], tmp_path / "ds", shard_tokens=MIN_SHARD_TOKENS, workers=1, progress=False)
    shards = result["manifest"]["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["tokens"] == MIN_SHARD_TOKENS for s in shards[:-1])
    with pytest.raises(DataError, match="--shard-tokens 999: expected at least 1,000"):
        prepare([corpus], tmp_path / "ds2", shard_tokens=999, workers=1, progress=False)

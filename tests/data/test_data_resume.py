"""A prepare killed or stopped halfway continues on the next run from its finished parts,
which are checked first, and gives the same dataset as a run that was never stopped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from trainer.data import prepare
from trainer.data.tokenizers import train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory) -> Path:
    """A small real BPE: tokenizing several MB with it takes seconds, long enough to stop it."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[:40]]
    return train_bpe(texts, 600, tmp_path_factory.mktemp("tok") / "tokenizer.json").path


def corpus_of(tmp_path: Path) -> Path:
    """The standard library's top-level modules as one JSONL file of several MB: several units."""
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for p in sorted(STDLIB.glob("*.py")):
            f.write(json.dumps({"text": p.read_text(encoding="utf-8"), "path": p.name}) + "\n")
    return path


def finished_parts(tmp_path: Path) -> list[Path]:
    return sorted(p for p in tmp_path.glob(".ds.parts-*/*.json") if p.name != "plan.json")


def comparable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in ("created", "record_sha256")}   # (the seal covers created)


def test_a_killed_prepare_continues_from_its_checked_parts(tmp_path, bpe_path):
    corpus = corpus_of(tmp_path)
    reference = prepare([corpus], tmp_path / "ref", tokenizer=str(bpe_path), workers=1, progress=False)
    units = reference["manifest"]
    out = tmp_path / "ds"
    code = (f"from pathlib import Path\nfrom trainer.data import prepare\n"
            f"prepare([Path({str(corpus)!r})], Path({str(out)!r}), tokenizer={str(bpe_path)!r}, workers=1, "
            f"progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(finished_parts(tmp_path)) < 2 and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "prepare finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = finished_parts(tmp_path)
    plan = json.loads((kept[0].parent / "plan.json").read_text())
    assert 2 <= len(kept) < len(plan["units"]) and not out.exists()

    # a finished part damaged on disk since (a flipped byte) is not trusted: it is made again
    damaged = kept[0].with_suffix(".tokens")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    result = prepare([corpus], out, tokenizer=str(bpe_path), workers=2, progress=False)
    assert result["resumed_parts"] == len(kept) - 1
    assert f"continued a stopped prepare: {len(kept) - 1} of {len(plan['units'])} parts were already finished" \
        in result["notes"]
    assert comparable(result["manifest"]) == comparable(units)        # the same shards, sha256 and all
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "ds", "ref"]


def test_parts_of_other_settings_are_not_used_and_are_removed(tmp_path, bpe_path):
    corpus = corpus_of(tmp_path)
    out = tmp_path / "ds"
    stale = tmp_path / ".ds.parts-0123456789abcdef"
    stale.mkdir()
    (stale / "000000.json").write_text("{}")
    result = prepare([corpus], out, workers=1, progress=False, max_docs=5)
    assert any("removed the finished parts of an earlier prepare with other inputs or settings" in n
               for n in result["notes"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "ds"]


def test_max_docs_stops_the_workers_early(tmp_path, bpe_path):
    """Only the units that hold the first --max-docs documents are needed: the rest are not made."""
    corpus = corpus_of(tmp_path)
    result = prepare([corpus], tmp_path / "ds", tokenizer=str(bpe_path), workers=1, progress=False, max_docs=3)
    assert result["manifest"]["documents"] == 3 and result["manifest"]["source"]["truncated"]
    assert result["manifest"]["source"]["bytes_read"] < corpus.stat().st_size / 2


def test_parts_made_by_two_node_processes_give_the_one_node_dataset(tmp_path):
    """prepare(on_nodes=...) leaves the parts to `python -m trainer.data.node` on every node (here two
    processes with their own node rank) and assembles what they made: the same dataset as one node."""
    corpus = corpus_of(tmp_path)
    one = prepare([corpus], tmp_path / "one", workers=1, progress=False)
    ran = []

    def two_nodes(folder):
        procs = [subprocess.Popen([sys.executable, "-m", "trainer.data.node", str(folder), "--workers", "1"],
                                  cwd=REPO, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "ANVIL_NODE_RANK": str(rank), "ANVIL_NNODES": "2"})
                 for rank in range(2)]
        ran.extend(json.loads(p.communicate(timeout=300)[0]) for p in procs)
        assert all(p.returncode == 0 for p in procs)

    two = prepare([corpus], tmp_path / "two", workers=1, progress=False, on_nodes=two_nodes)
    assert sorted(r["node"] for r in ran) == [0, 1] and all(r["made"] > 0 for r in ran)
    assert sum(r["made"] for r in ran) == sum(r["units"] for r in ran)   # every unit made once, by one node
    assert comparable(two["manifest"]) == comparable(one["manifest"])

"""A prepare killed or stopped halfway continues on the next run from its finished parts,
which are checked first, and gives the same dataset as a run that was never stopped; through the
installed inv, a stop signal (SIGTERM, SIGHUP, SIGUSR2, Ctrl-C) while it tokenizes or assembles keeps
the finished parts and the dataset already there, says so in one line, exits 128+N and leaves no
temporary folder, lock or process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.corpus import STDLIB, comparable_manifest
from helpers.files import tree
from helpers.interrupts import SIGNAL_NAME, ended, group_gone, send
from helpers.processes import wait_until
from helpers.program import ONE_THREAD, REPO, assert_no_traceback, inv, start_inv
from trainer.data import prepare
from trainer.data.tokenizers import train_bpe


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
    assert comparable_manifest(result["manifest"]) == comparable_manifest(units)   # the same shards, sha256, all
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
    assert comparable_manifest(two["manifest"]) == comparable_manifest(one["manifest"])


# ---- through the installed inv: a stop signal while it tokenizes or assembles

@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(a corpus of about 6 MB, a BPE tokenizer.json): Hugging Face BPE tokenizes ~1 MB/s a worker,
    seconds of parts to interrupt."""
    import random

    root = tmp_path_factory.mktemp("slow-corpus")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = [f"w{rng.randrange(4000)}x{i % 13}" for i in range(20000)]
    for f in range(12):
        lines = (" ".join(rng.choice(words) for _ in range(40)) for _ in range(1300))
        (corpus / f"doc{f:02d}.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tok = root / "bpe.json"
    proc = inv(root, "data.tokenizer", "--input", corpus / "doc00.jsonl", "--vocab-size", "400", "--out", tok,
               env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr
    return corpus, tok


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2])
def test_a_signal_while_prepare_tokenizes_keeps_the_finished_parts(tmp_path, slow_corpus, signum):
    """It used to kill inv and its workers where they stood: a temporary folder and the lock left
    beside the dataset, no word, exit 143 (SIGUSR2 also killed multiprocessing's resource tracker,
    which then printed tracebacks)."""
    from trainer.data.parts import WorkFolder

    corpus, tok = slow_corpus
    out = tmp_path / "ds"
    command = ["data.prepare", "--input", str(corpus), "--tokenizer", str(tok), "--out", str(out), "--workers", "2"]
    proc = start_inv(tmp_path, *command)

    def a_part_done() -> bool:
        try:   # the work folder is made under a temporary name and renamed: glob can race with it
            return any(p.name != "plan.json" for p in tmp_path.glob(".ds.parts-*/*.json"))
        except FileNotFoundError:
            return False
    assert wait_until(a_part_done, proc, timeout=300, pause=0.02)
    assert proc.poll() is None, "prepare finished before it could be interrupted"
    send(proc, signum)
    code, out_text, err = ended(proc)
    assert_no_traceback(out_text, err)
    assert code == 128 + signum, err[-3000:]
    said = re.search(rf"data\.prepare: interrupted \({SIGNAL_NAME[signum]}\): (\d+) of (\d+) parts of the new dataset "
                     rf"are finished and kept in (\S+); nothing was put at {re.escape(str(out))}; run the same "
                     rf"command again to continue from there", err)
    assert said, err[-3000:]
    assert "resource_tracker" not in err and "leaked" not in err
    assert group_gone(proc.pid), "a worker outlived the interrupted prepare"
    assert not out.exists() and not list(tmp_path.glob("ds.tmp-*")) and not (tmp_path / ".ds.lock").exists()
    (parts,) = tmp_path.glob(".ds.parts-*")
    assert str(parts) == said[3] and not list(parts.glob("*.tmp"))   # the workers dropped their unit halfway
    folder = WorkFolder(parts)
    finished = [int(p.stem) for p in parts.glob("0*.json")]
    assert len(finished) == int(said[1]) > 0 and all(folder.finished(i) is not None for i in finished)

    again = inv(tmp_path, *command, env=ONE_THREAD, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"continued a stopped prepare: {said[1]} of {said[2]} parts were already finished" in again.stdout
    whole = inv(tmp_path, *command[:-4], "--out", tmp_path / "whole", "--workers", "2", env=ONE_THREAD,
                timeout=600)
    assert whole.returncode == 0, whole.stderr
    # the same dataset as an uninterrupted build (but for when its manifest was made)
    assert tree(out, leave_out=("manifest.json",)) == tree(tmp_path / "whole", leave_out=("manifest.json",))


def test_sigterm_while_prepare_assembles_keeps_the_old_dataset(tmp_path):
    """The same as Ctrl-C (above) at the last stage, the shards being written."""
    from trainer.data.dataset import read_manifest

    out = tmp_path / "ds"
    first = inv(tmp_path, "data.prepare", "--out", out, "--max-docs", "50", "-q", env=ONE_THREAD)
    assert first.returncode == 0, first.stderr
    before = read_manifest(out)
    proc = start_inv(tmp_path, "data.prepare", "--out", str(out), "--shard-tokens", "1000", "--force", "--workers", "2")

    def sharding() -> bool:
        tmps = list(tmp_path.glob("ds.tmp-*"))
        return bool(tmps) and len(list(tmps[0].glob("train/*.bin"))) >= 3
    assert wait_until(sharding, proc, timeout=300, pause=0.01)
    assert proc.poll() is None, "prepare finished before it could be interrupted"
    send(proc, signal.SIGTERM)
    code, out_text, err = ended(proc)
    assert_no_traceback(out_text, err)
    assert code == 143 and "data.prepare: interrupted (SIGTERM): " in err, err[-3000:]
    assert f"the dataset already at {out} is intact" in err
    assert read_manifest(out) == before
    assert not list(tmp_path.glob("ds.tmp-*")) and not list(tmp_path.glob("ds.old-*"))
    assert not (tmp_path / ".ds.lock").exists() and group_gone(proc.pid)


@pytest.mark.parametrize("existing", [True, False])
def test_ctrl_c_during_prepare_keeps_the_old_dataset_and_the_finished_parts(tmp_path, small_corpus, existing):
    out = tmp_path / "ds"
    if existing:
        assert inv(tmp_path, "data.prepare", "--input", small_corpus, "--out", out, "-q").returncode == 0
    before = tree(out) if existing else {}
    # the default corpus (the stdlib, ~12 M tokens) in 1000-token shards: seconds of assembly
    command = ["data.prepare", "--out", str(out), "--shard-tokens", "1000", "--force", "--workers", "2"]
    proc = start_inv(tmp_path, *command)

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
    again = inv(tmp_path, *command)
    assert again.returncode == 0, again.stderr
    assert f"continued a stopped prepare: {finished} of {finished} parts were already finished" in again.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ds", ".ds"))) == ["ds"]

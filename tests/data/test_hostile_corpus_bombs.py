"""Issue 44, bounded memory for a hostile corpus: compressed bombs and documents longer than memory.

A 512 KB `.jsonl.zst` of `{"text": "` and 16 GiB of `a` with no newline drove data.prepare past 6 GiB
in 14 s (the line was read whole), a `.txt.zst` of the same in 6.5 s (a text file with no place to
cut grew one piece), and a bomb of many short lines filled the disk. Now:
  - a document longer than --max-doc-bytes is skipped (a JSONL line: read past to its end a block
    at a time, never held) or cut there (a text file: its start kept, the rest not read), counted;
  - a compressed file whose content grows more than --max-ratio times the compressed bytes it came
    from, over any 16 MiB of content, is stopped there and left out whole, with one note naming it.
The bombs are made here, streamed through zstandard (a few KB on disk for 1 GiB of content); the
peak RSS of the data.prepare process (and its workers) is read with getrusage(RUSAGE_CHILDREN) in a
fresh wrapper process, so nothing else the suite ran counts."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path

import pytest
import zstandard

from helpers.corpus import decoded_documents
from trainer.data import DataError, prepare, train_tokenizer
from helpers.program import INV

GIB, MIB = 1 << 30, 1 << 20
LEGIT = [f"a real document number {i}, with some words in it" for i in range(20)]
# What a prepare that holds the bomb's line or text needs at least: the bomb's content; an honest
# one holds the limit (1 MiB here) or one window of content (16 MiB) and stays near its 50 MB baseline.
RSS_LIMIT_MIB = 400


def zst_bomb(path: Path, content: int, start: bytes = b"", unit: bytes = b"a") -> Path:
    """`start`, then `unit` repeated to about `content` bytes, zstd-compressed as it is made."""
    block = unit * max(1, MIB // len(unit))
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f) as writer:
        writer.write(start)
        for _ in range(content // len(block)):
            writer.write(block)
    return path


def legit_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "good.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LEGIT))
    return folder


def prepare_measured(cwd: Path, *args) -> tuple[subprocess.CompletedProcess, int]:
    """inv data.prepare ARGS in a wrapper process: (the finished process, the peak RSS in MiB of
    the largest process it started, the prepare's workers included)."""
    wrapper = ("import resource, subprocess, sys\n"
               "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr)\n"
               "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(done.returncode)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, str(INV), "data.prepare", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    peak = int(proc.stderr.rsplit("PEAK_RSS_KIB ", 1)[1].split()[0]) >> 10
    proc.stderr = proc.stderr.rsplit("PEAK_RSS_KIB ", 1)[0]
    return proc, peak


def built(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    return proc.stdout


def one_line(proc: subprocess.CompletedProcess, *fragments) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert all(f in line for f in fragments), line
    return line


# ---------------------------------------------------------------- the ratio guard

@pytest.mark.parametrize("name,start", [("bomb.jsonl.zst", b'{"text": "'), ("bomb.txt.zst", b"")])
def test_a_one_document_zstd_bomb_is_stopped_in_bounded_memory(tmp_path, name, start):
    corpus = legit_corpus(tmp_path / "corpus")
    zst_bomb(corpus / name, GIB, start)
    proc, peak = prepare_measured(tmp_path, "--input", corpus, "--out", tmp_path / "ds", "--workers", "1", "-q")
    out = built(proc)
    assert peak < RSS_LIMIT_MIB, f"peak RSS {peak} MiB"
    assert "1 decompression_bomb" in out and f"note: {corpus}/{name}: " in out and "--max-ratio" in out, out
    docs = decoded_documents(tmp_path / "ds")
    assert sorted(docs["train"] + docs["val"]) == sorted(LEGIT)   # nothing of the bomb's


def test_a_bomb_alone_is_one_line_naming_it(tmp_path):
    bomb = zst_bomb(tmp_path / "bomb.jsonl.zst", GIB, b'{"text": "')
    proc, peak = prepare_measured(tmp_path, "--input", bomb, "--out", tmp_path / "ds", "-q")
    one_line(proc, "no usable documents", "1 decompression_bomb", "bomb.jsonl.zst")
    assert peak < RSS_LIMIT_MIB and not (tmp_path / "ds").exists()


def test_a_bomb_of_many_short_lines_is_left_out_whole(tmp_path):
    """Every line is a fine document: only the ratio tells the bomb, and none of its lines count
    (those before the guard tripped were given out already: they are taken back)."""
    corpus = legit_corpus(tmp_path / "corpus")
    zst_bomb(corpus / "lines.jsonl.zst", GIB, unit=b'{"text": "' + b"a" * 200 + b'"}\n')
    proc, peak = prepare_measured(tmp_path, "--input", corpus, "--out", tmp_path / "ds", "--workers", "1", "-q")
    out = built(proc)
    assert peak < RSS_LIMIT_MIB and "1 decompression_bomb" in out and "lines.jsonl.zst" in out
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["documents"] == len(LEGIT)
    assert sum(p.stat().st_size for p in (tmp_path / "ds").rglob("*")) < MIB   # the disk is not filled


def test_a_gzip_bomb_is_stopped_too(tmp_path):
    """gzip cannot compress past 1032:1; the default ratio (100) is well below that."""
    corpus = legit_corpus(tmp_path / "corpus")
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)   # level 1: about 230:1, a quick bomb to make
    with open(corpus / "bomb.jsonl.gz", "wb") as f:
        for _ in range(128):
            f.write(packer.compress(b"a" * MIB if _ else b'{"text": "' + b"a" * (MIB - 10)))
        f.write(packer.flush())
    result = prepare([corpus], tmp_path / "ds", workers=1, progress=False)
    assert result["manifest"]["source"]["skipped"] == {"decompression_bomb": 1}
    assert result["manifest"]["documents"] == len(LEGIT)


def test_the_ratio_is_settable_and_ordinary_compressed_files_pass(tmp_path):
    corpus = legit_corpus(tmp_path / "corpus")
    texts = [p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]]
    (corpus / "real.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                                 for t in texts).encode(), 9))
    zst_bomb(corpus / "squeezed.txt.zst", 20 * MIB, unit=b"the same sentence again and again. ")
    result = prepare([corpus], tmp_path / "ds", workers=1, progress=False)
    assert result["manifest"]["source"]["skipped"] == {"decompression_bomb": 1}   # the repeated sentence
    assert result["manifest"]["documents"] == len(LEGIT) + len(texts)
    result = prepare([corpus], tmp_path / "ds", workers=1, progress=False, max_ratio=0)   # 0: off
    assert result["manifest"]["source"]["skipped"] == {} and result["manifest"]["settings"]["max_ratio"] == 0
    with pytest.raises(DataError, match="--max-ratio: expected 0 .off. or a whole number of at least 1"):
        prepare([corpus], tmp_path / "ds", progress=False, max_ratio=-1)


# ---------------------------------------------------------------- --max-doc-bytes

def test_a_jsonl_line_longer_than_the_limit_is_skipped_while_streaming(tmp_path):
    """The guard off: the whole GiB line is read past in blocks, never held."""
    corpus = legit_corpus(tmp_path / "corpus")
    zst_bomb(corpus / "long.jsonl.zst", GIB, b'{"text": "')
    proc, peak = prepare_measured(tmp_path, "--input", corpus, "--out", tmp_path / "ds", "--workers", "1", "-q",
                                  "--max-ratio", "0", "--max-doc-bytes", "1M")
    out = built(proc)
    assert peak < RSS_LIMIT_MIB, f"peak RSS {peak} MiB"
    assert "1 too_long" in out and f"{corpus}/long.jsonl.zst:1: longer than --max-doc-bytes" in out, out
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["documents"] == len(LEGIT)


def test_a_text_file_longer_than_the_limit_is_cut_there(tmp_path):
    corpus = legit_corpus(tmp_path / "corpus")
    zst_bomb(corpus / "long.txt.zst", GIB)
    proc, peak = prepare_measured(tmp_path, "--input", corpus, "--out", tmp_path / "ds", "--workers", "1", "-q",
                                  "--max-ratio", "0", "--max-doc-bytes", "1M")
    out = built(proc)
    assert peak < RSS_LIMIT_MIB, f"peak RSS {peak} MiB"
    assert "changed: 1 cut_too_long" in out and f"{corpus}/long.txt.zst: longer than --max-doc-bytes" in out
    docs = decoded_documents(tmp_path / "ds")
    assert sorted(docs["train"] + docs["val"]) == sorted(LEGIT + ["a" * MIB])


def test_the_default_limit_and_a_bad_one(tmp_path):
    corpus = legit_corpus(tmp_path / "corpus")
    (corpus / "big.jsonl").write_text(json.dumps({"text": "b" * (3 * MIB)}) + "\n"
                                      + json.dumps({"text": "fits"}) + "\n")
    result = prepare([corpus], tmp_path / "ds", workers=1, progress=False)
    assert result["manifest"]["settings"]["max_doc_bytes"] == 64 * MIB and not result["manifest"]["source"]["skipped"]
    result = prepare([corpus], tmp_path / "ds", workers=1, progress=False, max_doc_bytes=2 * MIB)
    assert result["manifest"]["source"]["skipped"] == {"too_long": 1}
    assert result["manifest"]["documents"] == len(LEGIT) + 1
    with pytest.raises(DataError, match="--max-doc-bytes: expected a positive size"):
        prepare([corpus], tmp_path / "ds", progress=False, max_doc_bytes=0)
    proc = subprocess.run([str(INV), "data.prepare", "--input", corpus, "--out", tmp_path / "x", "--max-doc-bytes",
                           "lots"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    one_line(proc, "--max-doc-bytes lots: expected a size in bytes such as 67108864, 64M or 1G")


def test_data_tokenizer_has_the_same_limits(tmp_path):
    corpus = legit_corpus(tmp_path / "corpus")
    zst_bomb(corpus / "bomb.txt.zst", GIB)
    result = train_tokenizer([corpus], tmp_path / "tok.json", 300)
    assert result["skipped"] == {"decompression_bomb": 1} and "bomb.txt.zst" in result["notes"][0]
    (corpus / "bomb.txt.zst").unlink()
    (corpus / "long.jsonl").write_text(json.dumps({"text": "c " * MIB}) + "\n")
    result = train_tokenizer([corpus], tmp_path / "tok.json", 300, max_doc_bytes=MIB)
    assert result["skipped"] == {"too_long": 1} and "long.jsonl:1: longer than --max-doc-bytes" in result["notes"][0]


# ---------------------------------------------------------------- the pieces, in process

def test_reading_a_long_line_reads_past_it_and_keeps_the_next():
    import io
    from trainer.data.formats.jsonl import read_line
    stream = io.BufferedReader(io.BytesIO(b"x" * (5 * MIB) + b"\nnext\n" + b"y" * (3 * MIB)), buffer_size=MIB)
    assert read_line(stream, 4 * MIB) == (None, 5 * MIB + 1)
    assert read_line(stream, 4 * MIB) == (b"next\n", 5)
    assert read_line(stream, 2 * MIB) == (None, 3 * MIB)   # to the end of the file, no newline
    assert read_line(stream, 2 * MIB) == (b"", 0)

"""Issue 44, text no UTF-8 can hold: a JSONL line with a lone surrogate (an escaped "\\ud83d" alone, or
the bytes ED A0 BD that json.loads lets through; common in web crawls where an emoji was cut in two)
ended data.prepare and data.tokenizer with a traceback (UnicodeEncodeError from the byte tokenizer,
TypeError from a tokenizer.json), taking the whole corpus with it. Now the surrogate becomes U+FFFD,
the document is kept, and the count and the line show in the result and the manifest."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from helpers.corpus import decoded_documents
from trainer.data import train_tokenizer
from helpers.program import inv

BAD = [b'{"text": "hello \\ud83d x"}', b'{"text": "tail \\udc00"}', b'{"text": "cesu \xed\xa0\xbd y"}']
GOOD = [b'{"text": "smile \\ud83d\\ude00 (a whole pair)"}', b'{"text": "caf\\u00e9 \xe6\x97\xa5\xe6\x9c\xac"}']
FIXED = ["hello \ufffd x", "tail \ufffd", "cesu \ufffd y"]
KEPT = ["smile \U0001F600 (a whole pair)", "caf\u00e9 \u65e5\u672c"]


@pytest.fixture
def dirty_corpus(tmp_path) -> Path:
    """Real text around the bad lines (lines 3, 6 and 9 of web.jsonl)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = [p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:6]]
    lines = [json.dumps({"text": t}).encode() for t in texts]
    for i, (bad, good) in enumerate(zip(BAD, GOOD + [None])):
        lines.insert(3 * i + 2, bad)
        if good:
            lines.insert(3 * i + 3, good)
    (folder / "web.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return folder


def _check_replaced(proc, dirty_corpus: Path) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert "changed: 3 replaced_unencodable" in proc.stdout, proc.stdout
    for line in (3, 6, 9):
        assert f"note: {dirty_corpus}/web.jsonl:{line}: 1 lone surrogate" in proc.stdout, proc.stdout


@pytest.mark.parametrize("tokenizer", ["byte", "bpe", "tokenizer.json"])
def test_prepare_replaces_lone_surrogates_and_counts_them(tmp_path, dirty_corpus, tokenizer):
    args = {"byte": ["--tokenizer", "byte"], "bpe": ["--tokenizer", "bpe", "--vocab-size", "300"]}.get(tokenizer)
    if args is None:   # a tokenizer.json on disk (trained on clean text): Hugging Face's raised TypeError
        train_tokenizer(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:6], tmp_path / "tok.json", 300)
        args = ["--tokenizer", tmp_path / "tok.json"]
    proc = inv(tmp_path, "data.prepare", "--input", dirty_corpus, "--out", tmp_path / "ds", "-q", *args)
    _check_replaced(proc, dirty_corpus)
    source = json.loads((tmp_path / "ds" / "manifest.json").read_text())["source"]
    assert source["changed"] == {"replaced_unencodable": 3} and source["skipped"] == {}
    docs = decoded_documents(tmp_path / "ds")
    assert set(FIXED + KEPT) <= set(docs["train"] + docs["val"])
    assert len(docs["train"] + docs["val"]) == 11   # every line kept


def test_data_tokenizer_replaces_lone_surrogates_and_says_so(tmp_path, dirty_corpus):
    proc = inv(tmp_path, "data.tokenizer", "--input", dirty_corpus, "--out", tmp_path / "tok.json", "--vocab-size", "300")
    _check_replaced(proc, dirty_corpus)
    assert json.loads((tmp_path / "tok.json").read_text())["model"]["type"] == "BPE"
    result = train_tokenizer([dirty_corpus], tmp_path / "again.json", 300)
    assert result["changed"] == {"replaced_unencodable": 3} and len(result["notes"]) == 3


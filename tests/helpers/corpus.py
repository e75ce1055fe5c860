"""Corpora, datasets and loaders for the data tests: real text from the standard library that every
machine with Python has, a corpus with every kind of bad file, what a prepared dataset decodes back to."""
from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

from trainer.data import Dataset, load_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
STDLIB_FILES = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "abc.py", "fnmatch.py",
                "glob.py", "shlex.py"]
JSONL_TEXTS = ["first JSONL document\nwith two lines", "second: unicode ✓ 日本語", "third"]


def make_corpus(root: Path) -> tuple[Path, set[str]]:
    """A small real corpus with every kind of bad file; returns (dir, expected texts)."""
    corpus = root / "corpus"
    (corpus / "py").mkdir(parents=True)
    expected = set()
    for name in STDLIB_FILES:
        text = (STDLIB / name).read_text(encoding="utf-8")
        (corpus / "py" / name).write_text(text, encoding="utf-8")
        expected.add(text)
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / "blank.txt").write_bytes(b" \n\n")
    (corpus / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (corpus / "junk.bin").write_bytes(bytes(range(256)) * 4)
    (corpus / "corrupt.txt.gz").write_bytes(b"\x1f\x8b\x08\x00garbage, not deflate")
    gz_text = "a gzipped text document\n" * 3
    (corpus / "plain.txt.gz").write_bytes(gzip.compress(gz_text.encode()))
    expected.add(gz_text)
    lines = [json.dumps({"text": JSONL_TEXTS[0], "id": 1}), "{not json", json.dumps({"body": "x"}),
             "", json.dumps({"text": ""}), json.dumps({"text": JSONL_TEXTS[1]}), json.dumps([1, 2])]
    (corpus / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (corpus / "more.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": JSONL_TEXTS[2]}) + "\n").encode()))
    expected.update(JSONL_TEXTS)
    return corpus, expected


def decoded_documents(path: Path) -> dict[str, list[str]]:
    ds, tok = Dataset(path), load_tokenizer(path)
    out = {}
    for name in ds.manifest["splits"]:
        stream = ds.split(name)
        docs = []
        for i in range(stream.documents):
            doc = stream.document(i)
            assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
            docs.append(tok.decode(doc[1:-1].tolist()))
        out[name] = docs
    return out


def comparable_manifest(manifest: dict) -> dict:
    """A dataset's manifest without what differs between two builds of the same dataset: when it was
    made and its own checksum (the seal covers `created`)."""
    return {k: v for k, v in manifest.items() if k not in ("created", "record_sha256")}


def take(loader, n: int) -> list:
    """The next `n` batches of a loader."""
    return [next(loader) for _ in range(n)]

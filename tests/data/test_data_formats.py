"""data.prepare reads every corpus format it claims, by content, streamed, and cut into units
of work without the cut showing in the output. Each test makes its own real files: JSONL
(plain, gzip, zstd), Parquet with several row groups (pyarrow), folders written by Hugging
Face `datasets.save_to_disk`, Arrow IPC files, and damaged copies of them."""
from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from helpers.corpus import STDLIB, decoded_documents
from helpers.program import INV
from trainer.data import DataError, Dataset, load_tokenizer, prepare
from trainer.data import formats, units
from trainer.data.tokenizers import ByteTokenizer, JsonTokenizer, splits_at_newlines, train_bpe


def stdlib_texts(count: int) -> list[str]:
    """Real documents: standard-library sources, in a fixed order."""
    return [p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[:count]]


TEXTS = stdlib_texts(40)


def jsonl_bytes(texts, field="text") -> bytes:
    return "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)).encode()


def write_parquet(path: Path, texts, row_group_size: int = 7, field: str = "text") -> Path:
    table = pa.table({"id": list(range(len(texts))), field: texts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def all_documents(path: Path) -> list[str]:
    docs = decoded_documents(path)
    return sorted(docs["train"] + docs["val"])


def quiet_prepare(inputs, out: Path, **options) -> dict:
    return prepare(inputs, out, progress=False, **options)


# ---------------------------------------------------------------- every format, the same documents

def _as_jsonl(d: Path) -> Path:
    (d / "c.jsonl").write_bytes(jsonl_bytes(TEXTS))
    return d / "c.jsonl"


def _as_gzip(d: Path) -> Path:
    (d / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS)))
    return d / "c.jsonl.gz"


def _as_zstd(d: Path) -> Path:
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS)))
    return d / "c.jsonl.zst"


def _as_parquet(d: Path) -> Path:
    return write_parquet(d / "c.parquet", TEXTS)


def _as_save_to_disk(d: Path) -> Path:
    import datasets
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
        str(d / "hf"), max_shard_size="100KB")
    return d / "hf"


def _as_dataset_dict(d: Path) -> Path:
    """A DatasetDict: its train split is the corpus; the test split is not read."""
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                          "test": datasets.Dataset.from_dict({"text": ["held-out text, not training data"]})}
                         ).save_to_disk(str(d / "hfdict"))
    return d / "hfdict"


def _as_arrow_file(d: Path) -> Path:
    table = pa.table({"text": TEXTS})
    with pa.OSFile(str(d / "c.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=9):
            writer.write_batch(batch)
    return d / "c.arrow"


@pytest.mark.parametrize("make, format_name", [
    (_as_jsonl, "jsonl"), (_as_gzip, "jsonl"), (_as_zstd, "jsonl"), (_as_parquet, "parquet"),
    (_as_save_to_disk, "arrow"), (_as_dataset_dict, "arrow"), (_as_arrow_file, "arrow")],
    ids=["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "save_to_disk", "DatasetDict", "arrow-file"])
def test_each_format_gives_the_corpus_documents(tmp_path, make, format_name):
    source = make(tmp_path)
    result = quiet_prepare([source], tmp_path / "ds", val_fraction=0.2, workers=1)
    m = result["manifest"]
    assert all_documents(tmp_path / "ds") == sorted(TEXTS)
    assert m["documents"] == len(TEXTS) and m["source"]["skipped"] == {}
    assert set(m["source"]["formats"]) == {format_name}


def test_save_to_disk_files_are_read_in_the_folders_order(tmp_path):
    source = _as_save_to_disk(tmp_path)
    files = json.loads((source / "state.json").read_text())["_data_files"]
    assert len(files) > 1, "the test needs a dataset written in several Arrow files"
    m = quiet_prepare([source], tmp_path / "ds", val_fraction=0, workers=1)["manifest"]
    stream = Dataset(tmp_path / "ds").split("train")
    tok = load_tokenizer(tmp_path / "ds")
    first_and_last = [tok.decode(stream.document(i)[1:-1].tolist()) for i in (0, stream.documents - 1)]
    assert first_and_last == [TEXTS[0], TEXTS[-1]] and m["documents"] == len(TEXTS)


# ---------------------------------------------------------------- recognised by content

def test_formats_are_recognised_by_content_where_the_suffix_lies(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_parquet(corpus / "a.jsonl", TEXTS[:5])                                          # Parquet, named JSONL
    (corpus / "b.txt").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS[5:10])))  # zstd JSONL as .txt
    (corpus / "c").write_bytes(gzip.compress(jsonl_bytes(TEXTS[10:15])))                  # gzip JSONL, no suffix
    (corpus / "d.dat").write_bytes(jsonl_bytes(TEXTS[15:20]))                              # JSONL as .dat
    (corpus / "e.json.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS[20:25])))           # Dolma's naming
    (corpus / "f.py").write_text(TEXTS[25])                                                # text stays text
    m = quiet_prepare([corpus], tmp_path / "ds", workers=1)["manifest"]
    assert all_documents(tmp_path / "ds") == sorted(TEXTS[:26])
    assert m["source"]["formats"] == {"jsonl": 4, "parquet": 1, "text": 1}


# ---------------------------------------------------------------- big files: split, and the split does not show

def test_a_large_file_is_cut_into_units_and_the_output_does_not_depend_on_the_cut(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = stdlib_texts(300)
    lines = jsonl_bytes(texts).split(b"\n")
    lines[150] = b"{not json"                                 # line 151: a note with its line number
    (corpus / "big.jsonl").write_bytes(b"\n".join(lines))
    write_parquet(corpus / "big.parquet", texts[:120], row_group_size=10)
    spans = formats.spans(formats.SourceFile(corpus / "big.jsonl", "big.jsonl", (corpus / "big.jsonl").stat().st_size,
                                             0), "text", target=1 << 20)
    assert len(spans) >= 3 and spans[0].start == 0 and spans[-1].end == (corpus / "big.jsonl").stat().st_size

    one = quiet_prepare([corpus], tmp_path / "one", workers=1, val_fraction=0.1)
    two = quiet_prepare([corpus], tmp_path / "two", workers=2, val_fraction=0.1)
    monkeypatch.setattr(units, "MIN_TARGET", 64 << 10)        # many more, smaller units
    small = quiet_prepare([corpus], tmp_path / "small", workers=2, val_fraction=0.1)
    assert len(units.plan(units_files(corpus), "text")) > 2 * len(units.plan(units_files(corpus), "text", 4 << 20))
    for other in (two, small):
        assert other["manifest"]["splits"] == one["manifest"]["splits"]   # shards' sha256 included
        assert other["manifest"]["source"]["skipped_examples"] == one["manifest"]["source"]["skipped_examples"]
    assert f"{corpus / 'big.jsonl'}:151: invalid JSON" in "\n".join(one["manifest"]["source"]["skipped_examples"])
    assert one["manifest"]["documents"] == len(texts) - 1 + 120


def units_files(corpus: Path):
    from trainer.data.sources import expand_inputs
    return expand_inputs([corpus])


def test_a_line_that_straddles_a_cut_is_read_once(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(jsonl_bytes(TEXTS))
    source = formats.SourceFile(path, "c.jsonl", path.stat().st_size, 0)
    whole = [p.text for p in formats.read(formats.spans(source, "text", 1 << 30)[0], "text", formats.Reading())]
    for target in (1000, 4096, 50_000):
        pieces, records = [], 0
        for span in formats.spans(source, "text", target):
            reading = formats.Reading()
            pieces += [p.text for p in formats.read(span, "text", reading)]
            records += reading.records
        assert pieces == whole and records == len(TEXTS)


# ---------------------------------------------------------------- long documents in pieces

@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> JsonTokenizer:
    return train_bpe(stdlib_texts(60), 600, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_a_long_text_file_is_tokenized_in_pieces_as_a_whole(tmp_path, monkeypatch, bpe):
    from trainer.data.formats import text as text_format

    monkeypatch.setattr(text_format, "PIECE_BYTES", 2000)    # pieces of 2 kB: dozens for this file
    whole = "\n".join(stdlib_texts(12))
    (tmp_path / "long.txt").write_text(whole)
    assert splits_at_newlines(bpe)
    for tokenizer, tok in ((str(bpe.path), bpe), ("byte", ByteTokenizer())):
        out = tmp_path / f"ds-{tok.kind}"
        quiet_prepare([tmp_path / "long.txt"], out, tokenizer=tokenizer, workers=1, val_fraction=0)
        doc = Dataset(out).split("train").document(0)
        assert doc[1:-1].tolist() == [int(i) for i in tok.encode(whole)]


def test_a_tokenizer_that_cannot_take_pieces_gets_the_document_whole(tmp_path, monkeypatch):
    """SentencePiece-like tokenizers mark the start of the input: pieces would get that mark each."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trainer.data.formats import text as text_format
    from trainer.data.tokenizers import SPECIAL_TOKENS

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    hf.train_from_iterator(stdlib_texts(20), trainer=trainers.BpeTrainer(vocab_size=400,
                                                                        special_tokens=list(SPECIAL_TOKENS)))
    hf.save(str(tmp_path / "sp.json"))
    tok = JsonTokenizer(tmp_path / "sp.json")
    assert not splits_at_newlines(tok)
    monkeypatch.setattr(text_format, "PIECE_BYTES", 2000)
    whole = "\n".join(stdlib_texts(5))
    (tmp_path / "long.txt").write_text(whole)
    quiet_prepare([tmp_path / "long.txt"], tmp_path / "ds", tokenizer=str(tmp_path / "sp.json"), workers=1,
                  val_fraction=0)
    assert Dataset(tmp_path / "ds").split("train").document(0)[1:-1].tolist() == tok.encode(whole)


# ---------------------------------------------------------------- damaged and unusable files

def test_damaged_files_are_counted_skips_and_the_rest_is_read(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = write_parquet(corpus / "good.parquet", TEXTS[:10])
    (corpus / "cut.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])   # footer gone
    write_parquet(corpus / "other.parquet", TEXTS[10:12], field="content")                # no text column
    raw = jsonl_bytes(TEXTS[12:40])
    frame = zstandard.ZstdCompressor().compress(raw)
    (corpus / "cut.jsonl.zst").write_bytes(frame[: len(frame) * 2 // 3])                  # cut mid-frame
    (corpus / "cut.jsonl.gz").write_bytes(gzip.compress(raw)[:-30])                        # gzip cut short
    m = quiet_prepare([corpus], tmp_path / "ds", workers=1)["manifest"]
    skipped, notes = m["source"]["skipped"], "\n".join(m["source"]["skipped_examples"])
    assert skipped == {"bad_parquet": 1, "missing_text_field": 1, "bad_zstd": 1, "bad_gzip": 1}
    assert "other.parquet: no column 'text' (columns: id, content)" in notes
    assert "cut.parquet: not a readable Parquet file" in notes
    assert "cut.jsonl.zst: corrupt zstd after line" in notes
    docs = all_documents(tmp_path / "ds")
    # the whole good file, and what the cut streams held before their cut (not a document more)
    assert set(TEXTS[:10]) <= set(docs) and set(docs) <= set(TEXTS[:10]) | set(TEXTS[12:40])
    assert len(docs) > 10


def test_a_corpus_without_the_text_column_is_one_line_naming_the_columns(tmp_path):
    write_parquet(tmp_path / "c.parquet", TEXTS[:3], field="content")
    with pytest.raises(DataError, match=r"skipped: 1 missing_text_field; first: .*c\.parquet: no column 'text' "
                                        r"\(columns: id, content\); give the text column with --text-field"):
        quiet_prepare([tmp_path / "c.parquet"], tmp_path / "ds", workers=1)
    assert not list(tmp_path.glob("*ds*")) and not list(tmp_path.glob(".ds*"))
    m = quiet_prepare([tmp_path / "c.parquet"], tmp_path / "ds", workers=1, text_field="content")["manifest"]
    assert m["documents"] == 3


def test_inv_data_prepare_reads_parquet_and_refuses_a_cut_one_in_one_line(tmp_path):
    write_parquet(tmp_path / "c.parquet", TEXTS[:20])
    ok = subprocess.run([str(INV), "data.prepare", "--input", str(tmp_path / "c.parquet"), "--out",
                         str(tmp_path / "ds"), "-q"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert Dataset(tmp_path / "ds").manifest["documents"] == 20
    cut = tmp_path / "only" / "cut.parquet"
    cut.parent.mkdir()
    cut.write_bytes((tmp_path / "c.parquet").read_bytes()[:100])
    bad = subprocess.run([str(INV), "data.prepare", "--input", str(cut.parent), "--out", str(tmp_path / "ds2")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("data.prepare: no usable documents in")
    assert "1 bad_parquet" in bad.stderr and not (tmp_path / "ds2").exists()

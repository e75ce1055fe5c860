"""Tokenizers: byte roundtrip, BPE trained with Hugging Face tokenizers, tokenizer.json checks."""
import json

import pytest

from helpers.corpus import STDLIB, STDLIB_FILES, decoded_documents, make_corpus
from trainer.data import ByteTokenizer, DataError, get_tokenizer, load_tokenizer, prepare, train_tokenizer
from trainer.data.tokenizers import SPECIAL_TOKENS, train_bpe

TEXTS = ["plain ascii", "unicode: é ✓ 日本語 🙂", "tabs\tand\r\nnewlines\n", ""]


def test_byte_tokenizer_roundtrip_and_specials():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert max(ids, default=0) < 256 and tok.decode(ids) == text
    assert tok.decode([256, *b"hi", 257, 258]) == "<|begin_of_text|>hi<|end_of_text|><|pad|>"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a cut multi-byte char does not raise


def test_bpe_train_roundtrip_and_specials(tmp_path):
    texts = [(STDLIB / name).read_text() for name in STDLIB_FILES]
    tok = train_bpe(texts, 500, tmp_path / "tok.json")
    assert tok.kind == "bpe" and tok.vocab_size == 500
    assert [tok._tok.token_to_id(t) for t in SPECIAL_TOKENS] == [tok.bos_id, tok.eos_id, tok.pad_id]
    for text in texts + TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert len(tok.encode(texts[0])) < len(texts[0].encode()) / 2  # it learned merges
    assert get_tokenizer(tmp_path / "tok.json").kind == "bpe"
    with pytest.raises(DataError, match="too small"):
        train_bpe(texts, 100, tmp_path / "small.json")


def test_train_tokenizer_then_prepare_with_it(tmp_path):
    corpus, expected = make_corpus(tmp_path)
    info = train_tokenizer([corpus], tmp_path / "bpe.json", 400)
    assert info["vocab_size"] == 400 and info["files"] > 0
    out = tmp_path / "ds"
    m = prepare([corpus], out, tokenizer=str(tmp_path / "bpe.json"), workers=1, progress=False)["manifest"]
    assert m["tokenizer"]["kind"] == "bpe" and m["tokenizer"]["vocab_size"] == 400
    assert m["tokenizer"]["sha256"] == info["sha256"] and (out / "tokenizer.json").is_file()
    assert m["dtype"] == "uint16"
    tok = load_tokenizer(out)
    assert tok.kind == "bpe" and tok.vocab_size == 400
    docs = decoded_documents(out)
    assert sorted(docs["train"] + docs["val"]) == sorted(expected)
    # "bpe" trains one on the inputs inside the dataset directory
    m2 = prepare([corpus], tmp_path / "ds2", tokenizer="bpe", vocab_size=300, workers=1, progress=False)["manifest"]
    assert m2["tokenizer"]["kind"] == "bpe" and m2["tokenizer"]["vocab_size"] == 300
    assert m2["tokens"] < sum(len(t.encode()) + 2 for t in expected)


def test_tokenizer_json_problems_are_clear(tmp_path):
    with pytest.raises(DataError, match="not found"):
        get_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{ not json")
    with pytest.raises(DataError, match="broken.json is not JSON .*; expected a Hugging Face tokenizer.json"):
        get_tokenizer(tmp_path / "broken.json")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "noeos.json"))
    with pytest.raises(DataError, match="no end-of-text token"):
        get_tokenizer(tmp_path / "noeos.json")
    with pytest.raises(DataError, match="no prepared dataset"):
        load_tokenizer(tmp_path / "nowhere")


def test_load_tokenizer_refuses_a_swapped_tokenizer_json(tmp_path):
    corpus, _ = make_corpus(tmp_path)
    train_tokenizer([corpus], tmp_path / "bpe.json", 300)
    out = tmp_path / "ds"
    prepare([corpus], out, tokenizer=str(tmp_path / "bpe.json"), workers=1, progress=False)
    data = json.loads((out / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    (out / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="does not match the manifest"):
        load_tokenizer(out)

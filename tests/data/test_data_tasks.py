"""The installed `inv data.*` tasks end to end, as a user types them."""
import json

import pytest

from helpers.corpus import make_corpus


def assert_clean_failure(proc, message):
    assert proc.returncode == 2  # a user error (DataError is a UserError)
    assert message in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


def test_prepare_rerun_inspect(checked_inv, tmp_path):
    corpus, expected = make_corpus(tmp_path)
    out = tmp_path / "ds"
    first = checked_inv("data.prepare", "--input", str(corpus), "--out", str(out), "--val-fraction", "0.2")
    assert "train" in first.stdout and "3 empty, 1 invalid_utf8" in first.stdout and f"wrote {out}" in first.stdout
    assert "prepare 100.0%" in first.stderr  # plain progress lines when not on a terminal
    again = checked_inv("data.prepare", "--input", str(corpus), "--out", str(out), "--val-fraction", "0.2")
    assert "is up to date" in again.stdout
    shown = checked_inv("data.inspect", "--path", str(out), "--samples", "2", "--verify")
    assert "document length (train, tokens)" in shown.stdout and "#" in shown.stdout
    assert "<|begin_of_text|>" in shown.stdout and "all shards match" in shown.stdout
    assert "skipped: 1 bad_gzip, 1 bad_json_line, 1 binary, 3 empty, 1 invalid_utf8, 2 missing_text_field)" \
        in shown.stdout, shown.stdout     # counts, not a dict
    report = json.loads(checked_inv("data.inspect", "--path", str(out), "--json").stdout)
    assert report["documents"] == len(expected) and report["tokenizer"]["kind"] == "byte"
    assert sum(s["documents"] for s in report["splits"].values()) == len(expected)


def test_inspect_an_empty_validation_split(checked_inv, tmp_path):
    corpus, _ = make_corpus(tmp_path)
    out = tmp_path / "ds"
    checked_inv("data.prepare", "--input", str(corpus), "--out", str(out), "--val-fraction", "0", "--quiet")
    shown = checked_inv("data.inspect", "--path", str(out), "--samples", "0").stdout
    assert shown.split("document length (val, tokens):\n", 1)[1].strip() == "(no documents)", shown


def test_default_corpus_and_bpe_tokenizer(checked_inv, tmp_path):
    result = json.loads(checked_inv("data.prepare", "--out", str(tmp_path / "std"), "--max-docs", "30", "--json",
                                    "--quiet").stdout)
    assert result["manifest"]["source"]["default_corpus"] and result["manifest"]["documents"] == 30
    tok = tmp_path / "bpe.json"
    trained = checked_inv("data.tokenizer", "--vocab-size", "300", "--max-docs", "30", "--out", str(tok))
    assert tok.is_file() and "vocab 300" in trained.stdout and "WARNING" not in trained.stderr
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "a.txt").write_text("hello world\nhello there\n")
    short = checked_inv("data.tokenizer", "--vocab-size", "1024", "--input", str(tmp_path / "small"),
                        "--out", str(tmp_path / "small.json"))
    assert "of the 1,024 tokens asked for" in short.stderr, short.stderr      # said, not silent
    made = checked_inv("data.prepare", "--max-docs", "30", "--tokenizer", str(tok), "--out", str(tmp_path / "bpe"),
                       "-q")
    assert "tokenizer bpe (vocab 300, uint16)" in made.stdout


@pytest.mark.parametrize("args,message", [
    (["data.prepare", "--input", "/no/such/corpus", "--out", "{tmp}/x"], "input not found: /no/such/corpus"),
    (["data.prepare", "--input", "{tmp}", "--out", "{tmp}/x", "--val-fraction", "lots"], "--val-fraction"),
    (["data.prepare", "--out", "{tmp}/x", "--tokenizer", "{tmp}/none.json"], "no such file; expected byte, bpe or the path of a Hugging Face tokenizer.json"),
    (["data.inspect", "--path", "{tmp}/missing"], "no prepared dataset"),
    (["data.tokenizer", "--vocab-size", "10", "--out", "{tmp}/t.json"], "too small"),
])
def test_bad_input_is_one_clear_message(checked_inv, tmp_path, args, message):
    proc = checked_inv(*[a.format(tmp=tmp_path) for a in args], check=False)
    assert_clean_failure(proc, message)


def test_only_bad_files_fail_cleanly(checked_inv, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "junk").write_bytes(b"\x00\x01" * 100)
    proc = checked_inv("data.prepare", "--input", str(tmp_path / "bin"), "--out", str(tmp_path / "x"), "-q",
                       check=False)
    assert_clean_failure(proc, "no usable documents")
    assert not (tmp_path / "x").exists()

"""What a newcomer is told at the end of a task: what was written, how, and what to type next.

train.export says the dtype it wrote and that bfloat16 is its default (its --help too); data.tokenizer
says how many documents it trained on; the training summary says where --init-from started.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers.program import run_inv





def test_train_export_help_names_bfloat16_as_the_default_dtype():
    shown = run_inv("--help", "train.export")
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "--dtype=STRING dtype of the exported weights: bfloat16 (the default" in text
    assert "weights in bfloat16 unless --dtype says so" in text


def test_train_export_says_which_dtype_it_wrote():
    from trainer.export import ExportError, exported

    assert exported("out/hf", "bfloat16") == ("exported to out/hf: weights in bfloat16 (the default; --dtype "
                                              "float16, float32 for another)")
    assert exported("out/hf", "bf16").startswith("exported to out/hf: weights in bfloat16 (the default")
    assert exported("out/hf", "fp32") == "exported to out/hf: weights in float32 (--dtype; the default is bfloat16)"
    with pytest.raises(ExportError, match="expected one of bfloat16, float16, float32"):
        exported("out/hf", "int8")


def test_data_tokenizer_says_how_many_documents_it_trained_on(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.py").write_text(f"def function_{i}(x):\n    return x * {i}\n" * 5)
    (corpus / "notes.jsonl").write_text("".join(f'{{"text": "note {i} about function_{i}"}}\n' for i in range(3)))
    out = tmp_path / "tok.json"
    made = run_inv("data.tokenizer", "--vocab-size", "300", "--input", str(corpus), "--out", str(out))
    assert made.returncode == 0, made.stderr[-2000:]
    assert "trained BPE (vocab " in made.stdout and ") on 15 documents from 13 files in " in made.stdout, made.stdout
    first = run_inv("data.tokenizer", "--vocab-size", "300", "--input", str(corpus), "--out", str(out), "--max-docs", "5")
    assert ") on 5 documents from 13 files (stopped at --max-docs) in " in first.stdout, first.stdout
    as_json = run_inv("data.tokenizer", "--vocab-size", "300", "--input", str(corpus), "--out", str(out), "--json")
    assert json.loads(as_json.stdout)["documents"] == 15


def test_the_training_summary_says_where_init_from_started():
    from trainer.metrics import summary_table

    text = summary_table({"status": "ok", "steps": 2, "data": "data/stdlib", "wall_s": 1.0,
                          "init_from": {"path": "/models/Llama-3.2-1B", "tensors": 147, "files": 1}})
    assert re.search(r"│ started from +│ /models/Llama-3.2-1B +│", text), text
    assert "started from" not in summary_table({"status": "ok", "steps": 2})

"""trainer.export: checkpoint -> HF dir that transformers' LlamaForCausalLM loads with our logits."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers.program import inv
from trainer import checkpoint as ck
from trainer import config as config_mod
from trainer.export import ExportError, export_hf
from trainer.models import Transformer

transformers = pytest.importorskip("transformers")


# Per export dtype: our fp32 model vs HF run in that dtype (fp32 is the same math up to
# kernel order; bf16 carries the weight rounding and bf16 activations).
# Measured: fp32 0.0, bf16 0.011 on logits of magnitude ~1.
DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.05}


def tiny_config(tmp_path: Path, **model) -> config_mod.TrainConfig:
    raw = config_mod.load(config_mod.DEFAULT_CONFIG).to_dict()
    raw["model"].update(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=320,
                        max_seq_len=128, **model)
    raw["data"].update(path=str(tmp_path / "no-dataset"), seq_len=64)
    return config_mod.from_dict(raw)


def trained_checkpoint(tmp_path: Path, cfg) -> tuple[Transformer, Path]:
    """A model moved off its initialisation by a few AdamW steps, then checkpointed."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    run_dir = tmp_path / "run"
    ck.save(run_dir / "checkpoints", 3, model=model, optimizer=optimizer, config=cfg.to_dict())
    return model, run_dir


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", [
    {},  # untied, plain RoPE
    {"tie_embeddings": True,  # tied lm_head + Llama 3.1 RoPE frequency scaling
     "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}},
], ids=["untied", "tied-llama3rope"])
def test_export_loads_in_transformers_with_same_logits(tmp_path, variant, dtype):
    cfg = tiny_config(tmp_path, **variant)
    model, run_dir = trained_checkpoint(tmp_path, cfg)
    out = export_hf(run_dir, tmp_path / "hf", dtype=dtype)
    assert sorted(p.name for p in out.iterdir()) == [
        "anvil_export.json", "config.json", "generation_config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".hf.tmp*"))  # staging dir renamed, nothing left behind

    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=DTYPE_BY_NAME[dtype], local_files_only=True)
    hf.eval()
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not cfg.model.tie_embeddings
    if cfg.model.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    ids = torch.randint(0, cfg.model.vocab_size, (2, 48))  # > original_max_position_embeddings
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits.float()
    torch.testing.assert_close(theirs, ours, atol=TOLERANCE[dtype], rtol=0)


def test_export_writes_config_and_tokenizer(tmp_path):
    from trainer.data import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 20)
    dataset = tmp_path / "dataset"
    prepare([corpus], dataset, tokenizer="bpe", vocab_size=300, progress=False)
    cfg = tiny_config(tmp_path)
    raw = cfg.to_dict()
    raw["data"]["path"] = str(dataset)
    cfg = config_mod.from_dict(raw)
    _, run_dir = trained_checkpoint(tmp_path, cfg)
    step_dir = ck.find_latest(run_dir)

    out = export_hf(step_dir)  # a named checkpoint; default out dir, bf16
    assert out == run_dir / "export" / "hf-step_3"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (64, 2, 2)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    from trainer.data import load_tokenizer
    ours = load_tokenizer(dataset)
    assert config["eos_token_id"] == ours.eos_id == tok.eos_token_id
    text = "def function_3(x):\n    return x"
    assert tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)

    with pytest.raises(ExportError, match="exists"):  # never silently replaced
        export_hf(run_dir, out)
    (out / "marker").write_text("old")
    assert export_hf(run_dir, out, overwrite=True) == out and not (out / "marker").exists()


TEXTS = ["def function_3(x):\n    return x", "h\u00e9llo w\u00f6rld \u2603 \u65e5\u672c\u8a9e \U0001f999",
         "  two spaces\ttab\r\nCRLF", "", "a literal <|end_of_text|> and <|begin_of_text|> in text"]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_inv_export_writes_a_tokenizer_with_anvils_ids(tmp_path, kind):
    """`inv train.export` puts the dataset's tokenizer beside the model: AutoTokenizer loads
    it and gives Anvil's ids, non-ASCII and special tokens included, BOS first by default."""
    from trainer.data import load_tokenizer, prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 20)
    dataset = tmp_path / "dataset"
    prepare([corpus], dataset, tokenizer=kind, vocab_size=300, progress=False)
    raw = tiny_config(tmp_path).to_dict()
    raw["data"]["path"] = str(dataset)
    _, run_dir = trained_checkpoint(tmp_path, config_mod.from_dict(raw))
    out = tmp_path / "hf"
    proc = inv(tmp_path, "train.export", run_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported to {out}: weights in bfloat16 (the default; --dtype float16, float32 for another)" in proc.stdout
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in out.iterdir()}

    ours = load_tokenizer(dataset)
    assert ours.kind == kind
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    assert len(tok) == ours.vocab_size
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok(text)["input_ids"] == [ours.bos_id, *ids], text  # documents begin with BOS
        assert tok.decode(ids) == text
    if kind == "byte":
        assert ours.encode(TEXTS[1]) == list(TEXTS[1].encode("utf-8"))
    assert tok.decode([ours.bos_id, ours.eos_id]) == ours.decode([ours.bos_id, ours.eos_id])
    provenance = json.loads((out / "anvil_export.json").read_text())["tokenizer"]
    assert provenance["written"] and provenance["kind"] == kind


def test_export_errors(tmp_path):
    with pytest.raises(ExportError, match="no such"):
        export_hf(tmp_path / "missing")
    (tmp_path / "checkpoints" / ".tmp_step_5").mkdir(parents=True)  # only a crashed save
    with pytest.raises(ExportError, match="^the run .*no complete checkpoint"):
        export_hf(tmp_path)
    cfg = tiny_config(tmp_path)
    _, run_dir = trained_checkpoint(tmp_path, cfg)
    with pytest.raises(ExportError, match="dtype"):
        export_hf(run_dir, tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


def modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` ("." ) and of everything under it."""
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *sorted(root.rglob("*"))]}


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_export_dir_and_files_get_the_mode_mkdir_and_open_give(tmp_path, umask):
    """Not mkdtemp's 0700 nor safetensors' 0600: teammates on a shared cluster load exports."""
    from trainer.data import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("def f(x):\n    return x\n" * 20)
    raw = tiny_config(tmp_path).to_dict()
    raw["data"]["path"] = str(prepare([corpus], tmp_path / "dataset", progress=False)["path"])  # tokenizer files
    _, run_dir = trained_checkpoint(tmp_path, config_mod.from_dict(raw))
    old = os.umask(umask)
    try:
        default, given = export_hf(run_dir), export_hf(run_dir, tmp_path / "given" / "hf")
    finally:
        os.umask(old)
    for out in (default, given):
        assert {"model.safetensors", "tokenizer.json", "config.json"} <= {p.name for p in out.iterdir()}
        assert modes(out) == {name: (0o777 if name == "." else 0o666) & ~umask for name in modes(out)}, out
    assert (run_dir / "export").stat().st_mode & 0o777 == 0o777 & ~umask

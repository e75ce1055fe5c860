"""--init-from: training starts from a Hugging Face Llama directory that transformers wrote.

Against transformers itself: a small random LlamaForCausalLM (fp32, GQA, with and without tied
embeddings, with Llama 3.1 RoPE scaling) saved by save_pretrained as one file and sharded with an
index. After loading, Anvil's logits equal transformers'; under FSDP2 with 2 gloo ranks each rank
reads its own rows and the weights are the same; `inv train.pretrain --init-from` records where it
started and its first logged loss is transformers' loss on the same batch; an export gives back
the same tensors; bad directories are one line, exit 2, and nothing is written.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer import checkpoint as ck
from trainer import config as config_mod
from trainer.hf import InitError, from_hf, load_config, load_weights, to_hf
from trainer.hf.weights import INDEX, SINGLE, HFWeights
from trainer.models import Transformer

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (transformers brings it)

from helpers.program import ONE_THREAD, REPO, run_inv  # noqa: E402
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
# intermediate_size 99: odd, so two FSDP ranks get 50 and 49 rows of the MLP weights
SHAPE = dict(hidden_size=64, intermediate_size=99, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5)


def write_hf(out: Path, *, tied=False, rope_scaling=None, sharded=False, dtype=torch.float32, seed=0):
    """A random LlamaForCausalLM saved by transformers; returns the fp32 model in eval mode."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tied,   # (a copy: transformers adds to it)
                                      rope_scaling=dict(rope_scaling) if rope_scaling else None)
    model = transformers.LlamaForCausalLM(config).eval()
    model.to(dtype).save_pretrained(out, **({"max_shard_size": "50KB"} if sharded else {}))
    assert (out / INDEX).is_file() == sharded and (out / SINGLE).is_file() != sharded
    return model.float()


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    return {name: t for f in files for name, t in load_file(f).items()}


def tree_digest(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def hf_mean_loss(model, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(x).logits.float()
    return (F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
            / (y != -100).sum()).item()


def first_batch(run_dir: Path, rank: int = 0, world: int = 1):
    """The first training batch a rank of this run read (the loader is seeded by the config)."""
    from trainer.distributed import DistInfo
    from trainer.train import make_loader

    used = run_dir / "configs" / "train.yaml"     # an inv run's config as used; `python -m trainer` keeps config.yaml
    cfg = config_mod.load(used if used.is_file() else run_dir / "config.yaml")
    return next(make_loader(cfg, "train", DistInfo(rank, rank, world, torch.device("cpu"), None)))


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a failed task printed (library noise such as torch's warnings left out)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.pretrain:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


# --------------------------------------------------------------------------- config.json

@pytest.mark.parametrize("model", [
    {},
    {"tie_embeddings": True, "rope_theta": 500000.0, "norm_eps": 1e-6, "max_seq_len": 4096,
     "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}},
], ids=["plain", "llama3.2-like"])
def test_config_json_both_ways(model):
    """from_hf(to_hf(m)) gives m back: export and --init-from share one mapping."""
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG, [f"model.{k}={json.dumps(v)}" for k, v in model.items()])
    fields = from_hf(to_hf(cfg.model), "config.json")
    for key, value in fields.items():
        ours = getattr(cfg.model, key)
        assert (ours.fields() if key == "rope_scaling" and ours else ours) == value, key


def test_transformers_config_json_is_read_in_both_layouts(tmp_path):
    """transformers 5 writes rope_parameters (with rope_theta), Hub checkpoints rope_theta + rope_scaling."""
    write_hf(tmp_path / "v5", tied=True, rope_scaling=LLAMA31_ROPE)
    written = json.loads((tmp_path / "v5" / "config.json").read_text())
    older = {k: v for k, v in written.items() if k != "rope_parameters"}
    older.update(rope_theta=10000.0, rope_scaling={**{k: v for k, v in LLAMA31_ROPE.items() if k != "rope_type"},
                                                   "type": "llama3"})
    for raw in (written, older):
        fields = from_hf(raw, "config.json")
        assert fields["rope_theta"] == 10000.0 and fields["tie_embeddings"] is True
        assert fields["rope_scaling"] == {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_type"}
        assert (fields["dim"], fields["n_kv_heads"], fields["ffn_dim"]) == (64, 2, 99)


@pytest.mark.parametrize("change, says", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
     "Llama, DeepSeek-V2, DeepSeek-V3 and Qwen3-MoE checkpoints only"),
    ({"attention_bias": True}, "attention_bias True: Anvil's Llama has attention_bias False only"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "type 'yarn'"),
    ({"head_dim": 32}, "head_dim = hidden_size / num_attention_heads"),
    ({"num_key_value_heads": 3}, "does not divide"),
    ({"hidden_size": "64"}, "hidden_size: expected a positive integer"),
])
def test_what_anvils_llama_cannot_compute_is_refused(tmp_path, change, says):
    write_hf(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(InitError, match=says.replace("(", r"\(").replace(")", r"\)")):
        from_hf({**raw, **change}, "config.json")


def test_model_shape_comes_from_config_json_or_is_checked_against_it(tmp_path):
    hf = tmp_path / "Llama-mini"
    write_hf(hf, tied=True, rope_scaling=LLAMA31_ROPE)
    init = f"checkpoint.init_from={hf}"
    # No config file: the model section is config.json's, the run is named after the directory.
    cfg = load_config(None, [init, "data.seq_len=64"])
    assert cfg.name == cfg.model.name == "Llama-mini"
    assert (cfg.model.dim, cfg.model.ffn_dim, cfg.model.vocab_size, cfg.model.max_seq_len) == (64, 99, 320, 128)
    assert cfg.model.tie_embeddings and cfg.model.rope_scaling.factor == 8.0 and cfg.model.norm_eps == 1e-5
    assert cfg.optim.lr == config_mod.load(config_mod.DEFAULT_CONFIG).optim.lr   # the rest is tiny.yaml's
    # A config file naming matching keys keeps them; the keys it leaves out come from config.json;
    # max_seq_len is a limit on data.seq_len, not a shape: a lower one is the user's to choose.
    own = tmp_path / "mine.yaml"
    own.write_text("name: mine\nmodel:\n  dim: 64\n  n_heads: 4\n  max_seq_len: 64\n"
                   f"data:\n  seq_len: 32\ncheckpoint:\n  init_from: {hf}\n")
    cfg = load_config(own)
    assert (cfg.name, cfg.model.name, cfg.model.max_seq_len, cfg.model.n_layers) == ("mine", "Llama-mini", 64, 2)
    # Keys that contradict config.json: one line naming each, where it came from, and the file.
    own.write_text(own.read_text().replace("dim: 64", "dim: 128"))
    with pytest.raises(InitError) as err:
        load_config(own, ["model.n_kv_heads=4", "model.tie_embeddings=true"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{hf / 'config.json'}: the config differs")
    assert f"model.dim 128 ({own}) vs hidden_size 64" in message
    assert "model.n_kv_heads 4 (--set model.n_kv_heads=4) vs num_key_value_heads 2" in message
    assert "tie_embeddings" not in message    # it agrees
    # A value of config.json against the config's data.seq_len says where the limit comes from.
    with pytest.raises(config_mod.ConfigError, match="max_seq_len is max_position_embeddings of .*config.json"):
        load_config(None, [init, "data.seq_len=256"])


# --------------------------------------------------------------------------- the weights

@pytest.mark.parametrize("variant", [dict(), dict(tied=True, rope_scaling=LLAMA31_ROPE, sharded=True)],
                         ids=["untied-one-file", "tied-llama3rope-sharded"])
def test_logits_equal_transformers(tmp_path, variant):
    hf_model = write_hf(tmp_path / "hf", **variant)
    cfg = load_config(None, [f"checkpoint.init_from={tmp_path / 'hf'}", "data.seq_len=64"])
    torch.manual_seed(1)
    model = Transformer(cfg.model).eval()    # initialised at random first, as the trainer does
    provenance = load_weights(model, cfg.checkpoint.init_from)
    assert provenance["tensors"] == len(hf_tensors(tmp_path / "hf")) == 2 * 9 + 2 + (not variant.get("tied"))
    assert provenance["files"] == (len(list((tmp_path / "hf").glob("*.safetensors"))))
    assert (provenance["index_sha256"] is not None) == bool(variant.get("sharded"))
    if variant.get("tied"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 320, (2, 48))     # longer than original_max_position_embeddings (32)
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_bf16_weights_go_into_fp32_master_weights_exactly(tmp_path):
    write_hf(tmp_path, dtype=torch.bfloat16)
    cfg = load_config(None, [f"checkpoint.init_from={tmp_path}", "data.seq_len=64"])
    model = Transformer(cfg.model)
    assert load_weights(model, tmp_path)["dtypes"] == ["BF16"]
    for name, tensor in hf_tensors(tmp_path).items():
        param = model.get_parameter(name)
        assert param.dtype == torch.float32 and torch.equal(param, tensor.float()), name


def test_a_tied_head_saved_anyway_and_old_rope_buffers_are_not_loaded(tmp_path):
    """Some tied checkpoints carry lm_head.weight too, older transformers wrote rotary_emb.inv_freq:
    transformers skips both on load, and so does Anvil."""
    hf_model = write_hf(tmp_path, tied=True)
    tensors = load_file(tmp_path / SINGLE)
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, tmp_path / SINGLE)
    cfg = load_config(None, [f"checkpoint.init_from={tmp_path}", "data.seq_len=64"])
    model = Transformer(cfg.model)
    assert load_weights(model, tmp_path)["tensors"] == 20
    assert torch.equal(model.lm_head.weight, hf_model.model.embed_tokens.weight)


def test_export_of_the_loaded_model_gives_back_the_same_tensors(tmp_path):
    from trainer.export import export_hf

    write_hf(tmp_path / "hf", tied=True, rope_scaling=LLAMA31_ROPE, sharded=True)
    cfg = load_config(None, [f"checkpoint.init_from={tmp_path / 'hf'}", f"data.path={tmp_path / 'none'}",
                             "data.seq_len=64"])
    model = Transformer(cfg.model)
    load_weights(model, tmp_path / "hf")
    ck.save(tmp_path / "run" / "checkpoints", 1, model=model, optimizer=torch.optim.AdamW(model.parameters()),
            config=cfg.to_dict())
    out = export_hf(tmp_path / "run", tmp_path / "back", dtype="float32")
    theirs, back = hf_tensors(tmp_path / "hf"), load_file(out / SINGLE)
    assert back.keys() == theirs.keys()      # a tied head stays one tensor
    assert all(torch.equal(back[name], theirs[name]) for name in theirs)
    assert from_hf(json.loads((out / "config.json").read_text()), "export") == \
        from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()), "hf")


def test_damaged_weights_are_one_line_naming_the_file(tmp_path):
    write_hf(tmp_path / "one")
    path = tmp_path / "one" / SINGLE
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(InitError, match=rf"{SINGLE}: cut short \({len(data) - 100:,} bytes"):
        HFWeights.open(tmp_path / "one")
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(InitError, match="not a safetensors file"):
        HFWeights.open(tmp_path / "one")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(InitError, match="no model.safetensors or model.safetensors.index.json there"):
        HFWeights.open(tmp_path / "bin")
    write_hf(tmp_path / "sharded", sharded=True)
    index = json.loads((tmp_path / "sharded" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = files[0]     # a file that holds other tensors
    (tmp_path / "sharded" / INDEX).write_text(json.dumps(index))
    with pytest.raises(InitError, match=f"puts model.norm.weight in {files[0]}, which has no such tensor"):
        HFWeights.open(tmp_path / "sharded")
    # Integer weights (a quantized checkpoint) are refused before anything is read.
    write_hf(tmp_path / "int8")
    tensors = load_file(tmp_path / "int8" / SINGLE)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, tmp_path / "int8" / SINGLE)
    cfg = load_config(None, [f"checkpoint.init_from={tmp_path / 'int8'}", "data.seq_len=64"])
    with pytest.raises(InitError, match=r"1 tensor not floating point \(F64, F32, F16, BF16\) \(model.norm.weight I8\)"):
        load_weights(Transformer(cfg.model), tmp_path / "int8")


# --------------------------------------------------------------------------- inv and the ranks

def bad_directory(kind: str, good: Path, out: Path) -> tuple[Path, str]:
    """A copy of a good directory broken one way, and what the error line must say."""
    import shutil

    shutil.copytree(good, out)
    if kind == "other-architecture":
        raw = json.loads((out / "config.json").read_text())
        raw.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096)
        (out / "config.json").write_text(json.dumps(raw))
        return out, "model_type 'mistral'"
    if kind == "missing-shard":
        index = json.loads((out / INDEX).read_text())
        lost = index["weight_map"]["model.norm.weight"]
        (out / lost).unlink()
        return out, f"{out / INDEX} names {lost}, which is missing from {out}"
    shards = sorted(out.glob("*.safetensors"))   # one file here, sharded above
    tensors = load_file(shards[0])
    if kind == "missing-tensor":
        del tensors["model.norm.weight"]
        said = "1 tensor missing (model.norm.weight)"
    elif kind == "extra-tensor":
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        said = "1 tensor unexpected (model.layers.0.self_attn.q_proj.bias)"
    else:
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(98, 64)
        said = "1 tensor of the wrong shape (model.layers.1.mlp.up_proj.weight [98, 64] (the model's is [99, 64]))"
    save_file(tensors, shards[0])
    return out, f"{shards[0]}: {said}, for the model of {out / 'config.json'}"


@pytest.mark.parametrize("kind", ["missing-tensor", "extra-tensor", "wrong-shape", "other-architecture",
                                  "missing-shard"])
def test_bad_directory_is_one_line_exit_2_and_nothing_written(tmp_path, dataset, kind):
    sharded = kind == "missing-shard"
    write_hf(tmp_path / "good", sharded=sharded)
    broken, says = bad_directory(kind, tmp_path / "good", tmp_path / "broken")
    before = tree_digest(broken, dataset)
    proc = run_inv("train.pretrain", "--init-from", str(broken), "--set", f"data.path={dataset}", "--set",
                   "data.seq_len=64", runs=tmp_path / "runs", env=ONE_THREAD, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in error_line(proc)
    assert not (tmp_path / "runs").exists()               # no run directory
    assert tree_digest(broken, dataset) == before        # the checkpoint and the dataset untouched


@pytest.mark.slow
def test_inv_pretrain_from_a_directory_with_its_tokenizer(tmp_path):
    """data.prepare --tokenizer DIR takes the directory's tokenizer.json; pretrain --init-from DIR
    trains from its weights, its first loss is transformers' on the same batch, and the run says
    where it started (summary.json, metadata.json, snapshot.show)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"doc{i}.py").write_text(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 20)
    hf = tmp_path / "hf"
    hf_model = write_hf(hf, tied=True, rope_scaling=LLAMA31_ROPE, sharded=True)
    made = run_inv("data.tokenizer", "--vocab-size", "300", "--input", str(corpus), "--out", str(hf / "tokenizer.json"),
                   runs=tmp_path / "runs", env=ONE_THREAD)
    assert made.returncode == 0, made.stderr[-3000:]
    dataset = tmp_path / "dataset"
    prepared = run_inv("data.prepare", "--input", str(corpus), "--tokenizer", str(hf), "--out", str(dataset),
                       runs=tmp_path / "runs", env=ONE_THREAD)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256((hf / "tokenizer.json").read_bytes()).hexdigest()

    # (causal over the packed row, as transformers' loss is: tiny.yaml's attention stays inside documents)
    sets = [f"data.path={dataset}", "data.seq_len=64", "data.batch_size=4", "train.steps=2",
            "train.log_interval=1", "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=1",
            "data.document_mask=false"]
    args = [a for item in sets for a in ("--set", item)]
    before = tree_digest(hf)
    proc = run_inv("train.pretrain", "--init-from", str(hf), "--json", *args, runs=tmp_path / "runs", env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenized with" not in proc.stderr          # the dataset was made with the directory's tokenizer
    summary = json.loads(proc.stdout)
    run = Path(summary["run_dir"])
    assert run.name.endswith("_train.pretrain_hf")      # named after the directory (no --config)
    started = summary["init_from"]
    assert started["path"] == str(hf) and started["tensors"] == 20 and started["files"] > 1
    assert started["config_sha256"] == hashlib.sha256((hf / "config.json").read_bytes()).hexdigest()
    assert started["index_sha256"] == hashlib.sha256((hf / INDEX).read_bytes()).hexdigest()
    assert json.loads((run / "metadata.json").read_text())["init_from"] == started
    assert config_mod.load(run / "configs" / "train.yaml").checkpoint.init_from == str(hf)   # replays and ranks see it
    assert "initialised from" in (run / "logs" / "rank0.log").read_text()
    assert re.search(rf"│ started from +│ {re.escape(str(hf))} +│", (run / "logs" / "rank0.log").read_text())  # summary
    assert f"started from {hf}: its weights" in (run / "logs" / "runner.log").read_text()
    first = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "train")
    x, y = first_batch(run)
    assert first["step"] == 1 and first["loss"] == pytest.approx(hf_mean_loss(hf_model, x, y), rel=1e-5)
    assert tree_digest(hf) == before
    # --resume wins: the run goes on from its checkpoint's weights, and still says where it started.
    resumed = run_inv("train.pretrain", "--init-from", str(hf), "--resume", str(run), "--json", *args, "--set",
                      "train.steps=3", runs=tmp_path / "runs", env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads(resumed.stdout)
    log = (Path(again["run_dir"]) / "logs" / "rank0.log").read_text()
    assert "resumed from" in log and "initialised from" not in log
    assert again["steps"] == 3 and again["init_from"] == started
    shown = run_inv("snapshot.show", str(run), runs=tmp_path / "runs", env=ONE_THREAD, timeout=60)
    assert shown.returncode == 0 and re.search(rf"started from +{re.escape(str(hf))}\n", shown.stdout)

    # A dataset of another tokenizer: one warning line before launch, with the fix.
    byte_tokens = run_inv("data.prepare", "--input", str(corpus), "--out", str(tmp_path / "bytes"),
                          runs=tmp_path / "runs", env=ONE_THREAD)
    assert byte_tokens.returncode == 0
    dry = run_inv("train.pretrain", "--init-from", str(hf), "--dry-run", *args, "--set",
                  f"data.path={tmp_path / 'bytes'}", runs=tmp_path / "runs", env=ONE_THREAD, timeout=120)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"was tokenized with a byte tokenizer (vocab 259), not with {hf / 'tokenizer.json'}" in dry.stderr
    assert f"inv data.prepare --input CORPUS --tokenizer {hf}" in dry.stderr


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks_load_their_rows_and_give_the_same_weights(tmp_path):
    """Under FSDP2 (meta init) each rank reads its rows of every tensor; a step at lr 1e-30 cannot
    move an fp32 weight, so the checkpoint after it holds exactly the loaded weights, which an
    export gives back; the first loss is transformers' over both ranks' batches."""
    from trainer.export import export_hf

    hf = tmp_path / "hf"
    hf_model = write_hf(hf, sharded=True)      # untied: embedding and head are FSDP groups of their own
    import sysconfig

    from trainer.data import prepare
    dataset = tmp_path / "data"
    prepare(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20], dataset, progress=False)
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "trainer", "--run-dir", str(run), "--init-from", str(hf)]
    for item in [f"data.path={dataset}", "data.seq_len=64", "data.batch_size=2", "train.steps=1",
                 "train.log_interval=1", "train.val_batches=0", "parallel.strategy=fsdp", "parallel.meta_init=true",
                 "optim.lr=1e-30", "logging.progress=false", "logging.tensorboard=false",
                 "data.document_mask=false"]:   # causal over the row, as transformers' loss
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "ANVIL_LOG_RANK": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = hf_tensors(hf)
    saved = ck.load_model_state(ck.find_latest(run))
    assert saved.keys() == theirs.keys()
    assert all(torch.equal(saved[name], theirs[name]) for name in theirs)
    back = load_file(export_hf(run, tmp_path / "back", dtype="float32") / SINGLE)
    assert all(torch.equal(back[name], theirs[name]) for name in theirs)
    logged = next(json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines())
    expected = sum(hf_mean_loss(hf_model, *first_batch(run, rank, 2)) for rank in (0, 1)) / 2
    assert logged == pytest.approx(expected, rel=1e-5)
    for rank in (0, 1):
        assert "initialised from" in (run / "logs" / f"rank{rank}.log").read_text()

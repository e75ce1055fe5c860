"""Training config: the shipped configs load; every bad key, type or value is one message
naming the file, the key and what was expected."""
from pathlib import Path

import pytest

from helpers.program import REPO
from trainer.config import DEFAULT_CONFIG, ConfigError, TrainConfig, dump, load

CONFIGS = REPO / "configs"


def config_file(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_8b", "llama3_70b"])
def test_shipped_configs_load(name):
    cfg = load(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, TrainConfig)
    assert cfg.name == name


def test_default_is_tiny_on_stdlib():
    assert DEFAULT_CONFIG == CONFIGS / "tiny.yaml"
    cfg = load()
    assert cfg.data.path == "data/stdlib"
    assert cfg.model.vocab_size >= 259  # the byte tokenizer's vocabulary


def test_llama_shapes():
    one = load(CONFIGS / "llama3_1b.yaml").model
    assert (one.dim, one.n_layers, one.n_heads, one.n_kv_heads, one.ffn_dim) == (2048, 16, 32, 8, 8192)
    assert one.tie_embeddings and one.rope_theta == 500000 and one.rope_scaling.factor == 32
    eight = load(CONFIGS / "llama3_8b.yaml").model
    assert (eight.dim, eight.n_layers, eight.n_kv_heads, eight.ffn_dim) == (4096, 32, 8, 14336)
    seventy = load(CONFIGS / "llama3_70b.yaml").model
    assert (seventy.dim, seventy.n_layers, seventy.n_heads, seventy.ffn_dim) == (8192, 80, 64, 28672)
    for m in (one, eight, seventy):
        assert m.vocab_size == 128256 and m.rope_scaling is not None
    assert eight.rope_scaling.factor == seventy.rope_scaling.factor == 8


def test_overrides_are_typed_and_dotted():
    cfg = load(None, ["optim.lr=3e-4", "train.steps=200", "model.rope_scaling=null",
                      "train.compile=true", "env.NCCL_DEBUG=INFO", "env.OMP_NUM_THREADS=4"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 200 and cfg.train.compile is True
    assert cfg.env == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}


def test_dump_roundtrip(tmp_path):
    cfg = load(CONFIGS / "llama3_8b.yaml", ["optim.lr=1e-4"])
    again = load(config_file(tmp_path, dump(cfg)))
    assert again == cfg


@pytest.mark.parametrize("text, key, expected", [
    ("optim:\n  lrr: 0.1\n", "optim.lrr", "expected one of"),
    ("modle:\n  dim: 64\n", "modle", "expected one of"),
    ("optim:\n  lr: fast\n", "optim.lr", "expected a number"),
    ("train:\n  steps: 1.5\n", "train.steps", "expected an integer"),
    ("train:\n  compile: 'yes'\n", "train.compile", "expected true or false"),
    ("train:\n  activation_checkpoint: some\n", "train.activation_checkpoint", "'selective'"),
    ("optim:\n  lr: -1.0\n", "optim.lr", "expected a learning rate in (0, 1]"),
    ("optim:\n  betas: [0.9]\n", "optim.betas", "two numbers"),
    ("model:\n  n_heads: 8\n  n_kv_heads: 3\n", "model.n_kv_heads", "a divisor of model.n_heads"),
    ("data:\n  seq_len: 4096\nmodel:\n  max_seq_len: 1024\n", "data.seq_len", "at most model.max_seq_len"),
    ("model:\n  rope_scaling: 8\n", "model.rope_scaling", "a mapping with keys type, factor"),
    ("parallel:\n  strategy: zero3\n", "parallel.strategy", "'fsdp'"),
    ("env:\n  1BAD: x\n", "env.1BAD", "environment variable name"),
    ("env:\n  FLAG: true\n", "env.FLAG", "quote it"),
])
def test_bad_values_name_file_key_and_expectation(tmp_path, text, key, expected):
    path = config_file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert key in message and expected in message


def test_bad_override_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"tiny.yaml with --set optim.lrr=1: unknown key 'optim.lrr'"):
        load(DEFAULT_CONFIG, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"tiny.yaml with --set optim.betas=0.9: optim.betas: expected a list of "
                                          r"numbers, got 0.9"):
        load(DEFAULT_CONFIG, ["train.steps=5", "optim.betas=0.9"])
    with pytest.raises(ConfigError, match=r"tiny.yaml with --set model.rope_scaling=\{factor: x\}: "
                                          r"model.rope_scaling.factor: expected a number"):
        load(DEFAULT_CONFIG, ["model.rope_scaling={factor: x}"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load(DEFAULT_CONFIG, ["optim.lr"])


def test_broken_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid YAML \(line \d+, column \d+\)"):
        load(config_file(tmp_path, "model:\n  dim: [1, 2\n"))
    with pytest.raises(ConfigError, match="no such config file"):
        load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load(config_file(tmp_path, "- a\n- b\n"))


def test_a_bare_off_is_the_choice_off_not_yaml_false(tmp_path):
    """YAML 1.1 reads `fp8: off` as false; a choice field that has "off" takes it as that."""
    from trainer.config import ConfigError, load
    assert load(None, ["precision.fp8=off"]).precision.fp8 == "off"
    path = tmp_path / "c.yaml"
    path.write_text("precision:\n  fp8: off\n")
    assert load(path).precision.fp8 == "off"
    path.write_text("precision:\n  compute: off\n")        # no "off" among its choices: still an error
    with pytest.raises(ConfigError):
        load(path)


def test_a_check_across_keys_names_the_set_that_broke_it():
    with pytest.raises(ConfigError, match=r"tiny.yaml with --set model.n_heads=3: model.dim: expected a multiple of "
                                          r"model.n_heads \(3\), got 128"):
        load(None, ["train.steps=5", "model.n_heads=3"])
    with pytest.raises(ConfigError, match=r"tiny.yaml with --set model.dim=130: model.dim: expected a multiple"):
        load(None, ["model.dim=130", "train.steps=5"])     # the key itself, as before

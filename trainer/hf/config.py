"""config.json <-> ModelConfig, both ways, and the training config of a run that starts from one.

    to_hf(model_cfg, torch_dtype) -> dict          what train.export writes as config.json
    from_hf(config_json, source) -> dict           ModelConfig fields, or InitError for what Anvil's
                                                   Llama cannot do (another architecture, biases, ...)
    load_config(path, overrides) -> TrainConfig    trainer.config.load, with the model section from
                                                   checkpoint.init_from's config.json when it is set

A run that starts from a Hugging Face directory takes the model shape from its config.json: keys
the config file or --set give are checked against it (a difference is one line naming each key and
where it came from), the others come from it. With no config file (the embedded tiny default) the
whole model section comes from config.json, and the run is named after the directory.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from trainer.config import DEFAULT_CONFIG, ConfigError, ModelConfig, TrainConfig
from trainer.config import load as load_yaml_config

from .errors import InitError

# ModelConfig field -> config.json key
HF_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size", "vocab_size": "vocab_size",
           "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
           "tie_embeddings": "tie_word_embeddings", "max_seq_len": "max_position_embeddings",
           "init_std": "initializer_range"}
# Checked against config.json when the config gives them: they change the weights or the math.
# max_seq_len (a limit on data.seq_len; RoPE does not depend on it) and init_std (unused once the
# weights are loaded) are taken from config.json only where the config leaves them out.
CHECKED = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "norm_eps", "rope_theta",
           "rope_scaling", "tie_embeddings")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ARCHITECTURE = "LlamaForCausalLM"
EXPECTED = "a Hugging Face Llama directory (config.json + model.safetensors or model.safetensors.index.json)"


def to_hf(m: ModelConfig, torch_dtype: str = "bfloat16") -> dict:
    """config.json for transformers' LlamaForCausalLM with this shape."""
    rs = m.rope_scaling
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": m.dim,
        "intermediate_size": m.ffn_dim,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "num_hidden_layers": m.n_layers,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None if rs is None else {"rope_type": rs.type, **rs.fields()},
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": torch_dtype,
    }


def read_config_json(directory: str | Path) -> tuple[dict, Path]:
    """(config.json as a dict, its path) of a Hugging Face directory; InitError when unreadable."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise InitError(f"--init-from {directory}: {what}; expected {EXPECTED}")
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise InitError(f"--init-from {directory}: no config.json there; expected {EXPECTED}") from None
    except OSError as exc:
        raise InitError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError
        raise InitError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise InitError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw, path


def from_hf(raw: dict, source: str) -> dict[str, Any]:
    """ModelConfig fields (rope_scaling as a dict or None) of a Llama config.json; InitError for
    another architecture or anything Anvil's Llama does not compute the same way."""
    arch = raw.get("architectures")
    if raw.get("model_type") != "llama" or (isinstance(arch, list) and ARCHITECTURE not in arch):
        raise InitError(f"{source}: model_type {raw.get('model_type')!r}, architectures {arch!r}: Anvil "
                        f"starts from Llama checkpoints only (model_type 'llama', {ARCHITECTURE})")

    def need(key: str, kind: type, default: Any = ...) -> Any:
        value = raw.get(key, default)
        if value is ...:
            raise InitError(f"{source}: no {key}; expected a Llama config.json")
        if kind is bool:
            ok, expected = isinstance(value, bool), "true or false"
        elif kind is int:
            ok, expected = isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"
        else:
            return _number(value, f"{source}: {key}")
        if not ok:
            raise InitError(f"{source}: {key}: expected {expected}, got {value!r}")
        return value

    for key, supported in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if raw.get(key, supported) != supported:
            raise InitError(f"{source}: {key} {raw[key]!r}: Anvil's Llama has {key} {supported!r} only")
    dim, heads = need("hidden_size", int), need("num_attention_heads", int)
    kv_heads = need("num_key_value_heads", int, heads)
    head_dim = raw.get("head_dim") or dim / heads
    if dim % heads or head_dim != dim // heads or (dim // heads) % 2:
        raise InitError(f"{source}: head_dim {head_dim!r} with hidden_size {dim} and num_attention_heads "
                        f"{heads}: Anvil's Llama needs head_dim = hidden_size / num_attention_heads, even")
    if heads % kv_heads:
        raise InitError(f"{source}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    # transformers 5 writes rope_parameters (rope_theta inside); earlier ones rope_theta + rope_scaling
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling, rope_theta = params, _number(params["rope_theta"], f"{source}: rope_parameters.rope_theta")
    else:
        scaling, rope_theta = raw.get("rope_scaling"), need("rope_theta", float, 10000.0)
    return {"dim": dim, "n_layers": need("num_hidden_layers", int), "n_heads": heads, "n_kv_heads": kv_heads,
            "ffn_dim": need("intermediate_size", int), "vocab_size": need("vocab_size", int),
            "norm_eps": need("rms_norm_eps", float, 1e-6), "rope_theta": rope_theta,
            "rope_scaling": _rope_scaling(scaling, source),
            "tie_embeddings": need("tie_word_embeddings", bool, False),
            "max_seq_len": need("max_position_embeddings", int, 2048),
            "init_std": need("initializer_range", float, 0.02)}


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InitError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _rope_scaling(scaling: Any, source: str) -> dict | None:
    """Llama 3.1 frequency scaling as ModelConfig.rope_scaling; None for plain RoPE."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise InitError(f"{source}: rope_scaling: expected an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise InitError(f"{source}: RoPE scaling of type {kind!r}: Anvil's Llama does the 'llama3' "
                        f"type only (or none)")
    missing = [key for key in ROPE_SCALING_KEYS if key not in scaling]
    if missing:
        raise InitError(f"{source}: rope_scaling of type llama3 without {', '.join(missing)}")
    out = {key: _number(scaling[key], f"{source}: rope_scaling.{key}") for key in ROPE_SCALING_KEYS}
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out


# --------------------------------------------------------------------------- the run's config

def load_config(path: str | Path | None = None, overrides=()) -> TrainConfig:
    """trainer.config.load(path, overrides), with checkpoint.init_from's config.json giving the
    model section (see the module's docstring). Raises ConfigError or InitError."""
    overrides = list(overrides)
    init_from = _init_from(path, overrides)
    if init_from is None:
        return load_yaml_config(path, overrides)
    if not init_from.strip():
        raise InitError("checkpoint.init_from is empty; expected " + EXPECTED + ", or null")
    raw, config_json = read_config_json(init_from)
    fields = from_hf(raw, str(config_json))
    fields["name"] = Path(init_from).expanduser().resolve().name or "hf"
    given = _given_model_keys(path, overrides)
    sets = {key: f"model.{key}={json.dumps(value)}" for key, value in fields.items() if key not in given}
    named = [] if path is not None or any(item.partition("=")[0].strip() == "name" for item in overrides) else [
        f"name={json.dumps(fields['name'])}"]   # not "tiny": the run is named after the checkpoint
    try:
        cfg = load_yaml_config(path, named + list(sets.values()) + overrides)
    except ConfigError as exc:   # a value of config.json against one of the config (data.seq_len > max_seq_len)
        try:   # a key the config sets and config.json contradicts is the better message
            _check_same(load_yaml_config(path, overrides), given, fields, config_json)
        except ConfigError:
            pass
        message = str(exc)
        for key, item in sets.items():
            message = message.replace(f" with --set {item}", "")   # not the user's --set: say where it is from
        notes = [f"model.{key} is {HF_KEYS[key]} of {config_json}" for key in sets
                 if key in HF_KEYS and re.search(rf"model\.{key}\b", message)]
        raise ConfigError("; ".join([message, *notes])) from None
    _check_same(cfg, given, fields, config_json)
    return cfg


def _check_same(cfg: TrainConfig, given: dict[str, str], fields: dict[str, Any], config_json: Path) -> None:
    """InitError naming each model key the config gives that config.json contradicts."""
    differences = []
    for key, where in given.items():
        if key not in CHECKED:
            continue
        ours = getattr(cfg.model, key)
        ours = ours.fields() if hasattr(ours, "fields") else dataclasses.asdict(ours) if dataclasses.is_dataclass(ours) \
            else ours
        if not _same(ours, fields[key]):
            differences.append(f"model.{key} {_show(ours)} ({where}) vs {HF_KEYS[key]} {_show(fields[key])}")
    if differences:
        raise InitError(f"{config_json}: the config differs from the checkpoint: {'; '.join(differences)}; "
                        f"leave these keys out of the config (they then come from config.json), or start "
                        f"from a checkpoint of this shape")


def _init_from(path: str | Path | None, overrides: list[str]) -> str | None:
    """checkpoint.init_from as --set or the file give it, read loosely: a broken file or value is
    left for trainer.config.load to report."""
    for item in reversed(overrides):
        key, _, value = item.partition("=")
        if key.strip() == "checkpoint.init_from":
            value = _yaml(value) if value.strip() else ""
            return value if isinstance(value, str) else None   # null: not from a directory after all
    section = _file_section(path, "checkpoint")
    value = section.get("init_from")
    return value if isinstance(value, str) else None


def _given_model_keys(path: str | Path | None, overrides: list[str]) -> dict[str, str]:
    """The model keys the user set, each with where: the config file (not the embedded default:
    that one's model section is the tiny model's, replaced whole) or the --set that gave it."""
    given = {key: str(path) for key in _file_section(path, "model")} if path is not None else {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.startswith("model."):
            given[key.split(".")[1]] = f"--set {item}"
        elif key == "model" and isinstance(_yaml(item.partition("=")[2]), dict):
            given.update({k: f"--set {item}" for k in _yaml(item.partition("=")[2])})
    return given


def _file_section(path: str | Path | None, name: str) -> dict:
    try:
        raw = _yaml(Path(path or DEFAULT_CONFIG).read_text())
    except (OSError, UnicodeDecodeError):
        return {}
    section = raw.get(name) if isinstance(raw, dict) else None
    return section if isinstance(section, dict) else {}


def _yaml(text: str) -> Any:
    import yaml

    from core import safe_yaml
    try:
        return safe_yaml.load(text)
    except yaml.YAMLError:
        return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def init_from_override(directory: str | Path) -> str:
    """The --set that --init-from DIR stands for: checkpoint.init_from, as an absolute path (the
    run records exactly which directory; ranks and replays read the same one)."""
    if not str(directory).strip():
        raise InitError(f"--init-from is empty; expected {EXPECTED}")
    return f"checkpoint.init_from={json.dumps(str(Path(directory).expanduser().resolve()))}"

"""config.json <-> ModelConfig, both ways, and the training config of a run that starts from one.

    to_hf(model_cfg, torch_dtype) -> dict          what train.export writes as config.json, for the
                                                   transformers class of model.family
    from_hf(config_json, source) -> dict           ModelConfig fields (dotted for mla and moe keys:
                                                   "moe.top_k"), model.family among them; InitError
                                                   for what Anvil does not compute the same way
    load_config(path, overrides) -> TrainConfig    trainer.config.load, with the model section from
                                                   checkpoint.init_from's config.json when it is set

A run that starts from a Hugging Face directory takes the model shape from its config.json: keys
the config file or --set give are checked against it (a difference is one line naming each key and
where it came from), the others come from it. With no config file (the embedded tiny default) the
whole model section comes from config.json, and the run is named after the directory.

Each family's keys are a table beside its layer recipe (trainer/models/<family>.py HF_MAPPINGS,
applied by mapping.py): Llama, DeepSeek-V2, DeepSeek-V3 and Qwen3-MoE.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from trainer.config import DEFAULT_CONFIG, ConfigError, ModelConfig, TrainConfig
from trainer.config import load as load_yaml_config

from .errors import InitError
from .mapping import SECTIONS, UNCHECKED, HFFamily, ours_value

EXPECTED = "a Hugging Face directory (config.json + model.safetensors or model.safetensors.index.json)"


def tables() -> dict[str, HFFamily]:
    """model.family -> its table, from the families' modules (trainer.models.transformer.FAMILIES)."""
    from trainer.models.transformer import FAMILIES   # (the families import trainer.hf.mapping)

    found: dict[str, HFFamily] = {}
    for module in dict.fromkeys(FAMILIES.values()):
        found.update(module.HF_MAPPINGS)
    return found


def mapping_for(family: str) -> HFFamily:
    return tables()[family]


def family_of(raw: dict, source: str) -> HFFamily:
    """The table of config.json's architecture; InitError naming the ones Anvil starts from."""
    arch, model_type = raw.get("architectures"), raw.get("model_type")
    known = list(tables().values())
    for table in known:
        if model_type == table.model_type and (not isinstance(arch, list) or table.architecture in arch):
            return table
    names = [t.name for t in known]
    raise InitError(f"{source}: model_type {model_type!r}, architectures {arch!r}: Anvil starts from "
                    f"{', '.join(names[:-1])} and {names[-1]} checkpoints only (architectures "
                    f"{', '.join(t.architecture for t in known)})")


def to_hf(m: ModelConfig, torch_dtype: str = "bfloat16") -> dict:
    """config.json for the transformers class of m.family with this shape; InexpressibleModel for
    a config that class cannot hold."""
    return mapping_for(m.family).write_config(m, torch_dtype)


def from_hf(raw: dict, source: str) -> dict[str, Any]:
    """ModelConfig fields of a config.json (rope_scaling as a dict or None, a section's keys dotted);
    InitError for another architecture or anything Anvil does not compute the same way."""
    return family_of(raw, source).read_config(raw, source)


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
    table = family_of(raw, str(config_json))
    fields = table.read_config(raw, str(config_json))
    name = Path(init_from).expanduser().resolve().name or "hf"   # model.name: the directory's, unless given
    given = _given_model_keys(path, overrides)
    sets = {key: f"model.{key}={json.dumps(value)}" for key, value in {**fields, "name": name}.items()
            if key not in given}
    named = [] if path is not None or any(item.partition("=")[0].strip() == "name" for item in overrides) else [
        f"name={json.dumps(name)}"]   # not "tiny": the run is named after the checkpoint
    try:
        cfg = load_yaml_config(path, named + list(sets.values()) + overrides)
    except ConfigError as exc:   # a value of config.json against one of the config (data.seq_len > max_seq_len)
        try:   # a key the config sets and config.json contradicts is the better message
            _check_same(load_yaml_config(path, overrides), given, fields, config_json, table)
        except ConfigError:
            pass
        message = str(exc)
        for key, item in sets.items():
            message = message.replace(f" with --set {item}", "")   # not the user's --set: say where it is from
        notes = [f"model.{key} is {table.hf_key(key)} of {config_json}" for key in sets
                 if key != "name" and re.search(rf"model\.{re.escape(key)}\b", message)]
        raise ConfigError("; ".join([message, *notes])) from None
    _check_same(cfg, given, fields, config_json, table)
    return cfg


def _check_same(cfg: TrainConfig, given: dict[str, str], fields: dict[str, Any], config_json: Path,
                table: HFFamily) -> None:
    """InitError naming each model key the config gives that config.json contradicts: the family
    first (a DeepSeek config against a Llama checkpoint), then each shape key (experts, top-k, ranks)."""
    differences = []
    for key, where in sorted(given.items(), key=lambda item: item[0] != "family"):
        if key not in fields or key in UNCHECKED:
            continue
        ours = ours_value(cfg.model, key)
        if _same(ours, fields[key]):
            continue
        if key == "family":
            differences.append(f"model.family {ours} ({where}) vs {table.family} ({table.architecture} in "
                               f"config.json)")
        elif key in table.implied:
            differences.append(f"model.{key} {_show(ours)} ({where}) vs {_show(fields[key])} (what "
                               f"{table.architecture} always has)")
        else:
            differences.append(f"model.{key} {_show(ours)} ({where}) vs {table.hf_key(key)} {_show(fields[key])}")
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
    given = {key: str(path) for key in _model_keys(_file_section(path, "model"))} if path is not None else {}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if key == "model" or key in (f"model.{section}" for section in SECTIONS):
            value = _yaml(value)
            section = key.partition(".")[2]
            given.update({k: f"--set {item}" for k in _model_keys({section: value} if section else value)})
        elif key.startswith("model."):
            parts = key.split(".")[1:]
            given[".".join(parts[:2] if parts[0] in SECTIONS else parts[:1])] = f"--set {item}"
    return given


def _model_keys(section: Any) -> list[str]:
    """A model section's keys as from_hf names them: an mla or moe mapping's one by one ("moe.top_k")."""
    if not isinstance(section, dict):
        return []
    out = []
    for key, value in section.items():
        out += [f"{key}.{sub}" for sub in value] if key in SECTIONS and isinstance(value, dict) else [key]
    return out


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

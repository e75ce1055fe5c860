"""The env: block of a training config, read through the trainer's own loader.

trainer.config.load is the one definition of the config format (it validates
env: names and turns numbers into strings), so env.show --config agrees with
what train.pretrain will use. Reading the YAML directly is only the fallback
for a checkout without the trainer package.
"""
from __future__ import annotations

from pathlib import Path

from envs.errors import EnvError


def load_config_env(path) -> dict[str, str]:
    try:
        from trainer import config as trainer_config
    except ImportError:
        return _yaml_env(Path(path))
    try:
        return dict(trainer_config.load(path).env)
    except trainer_config.ConfigError as exc:
        raise EnvError(str(exc)) from None


def _yaml_env(path: Path) -> dict[str, str]:
    import yaml

    from core import safe_yaml
    try:
        data = safe_yaml.load(path.read_text())
    except OSError as exc:
        raise EnvError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise EnvError(f"{path}: not valid YAML ({exc})") from None
    env = (data or {}).get("env") if isinstance(data, dict) else None
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise EnvError(f"{path}: env: expected a mapping of VARIABLE: value")
    return {str(k): str(v) for k, v in env.items()}

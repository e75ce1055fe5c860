"""Runner settings: the `anvil:` section of invoke.yaml.

DEFAULTS is the one place their defaults are written. The program's config class
(runtime.program.cli) declares them to Invoke from it, because Invoke only lets environment
variables override keys that already exist: with them declared, ``INVOKE_ANVIL_RUNS_DIR=/x``
and ``-f other.yaml`` both work as Invoke users expect. invoke.yaml shows the same values
with a comment each (a test holds the two together).

Lists travel as comma-separated strings (Invoke cannot cast an env var into a
list), e.g. ``hosts: "node1,node2"``.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from core import names
from runtime.cluster.options import SLURM_MODES, ContainerOptions, Options, SlurmOptions, SshOptions
from runtime.cluster.runtime import Runtime
from runtime.cluster.transport import NODE_RUNS_DIR_VAR
# Checkout root: the folder holding tasks.py (re-exported: where the program finds its tasks).
from runtime.launch.spec import CHECKOUT  # noqa: F401
from core.errors import UserError

DEFAULTS: dict[str, Any] = {
    "runs_dir": "runs",          # run directories go here (relative: to the project root)
    "hosts": "",                 # default host list for `inv -H @ TASK`
    "user": "",                  # SSH user for fan-out ("" = ssh config / current user)
    "key_filename": "",          # SSH private key(s), comma-separated; -i adds to these
    "remote_path": "",           # checkout path on the remote hosts ("" = same as here)
    "remote_inv": "",            # the inv to run there ("" = the same path as this one; relative: to remote_path)
    "runtime": "direct",         # where work runs: direct | ssh | slurm, or either +container (runtime.cluster)
    "slurm_mode": "auto",        # auto (srun inside an allocation, sbatch outside) | srun | sbatch
    "slurm_partition": "",       # sbatch/srun --partition ("" = the cluster's default)
    "slurm_account": "",         # --account
    "slurm_time": "",            # --time, e.g. 02:00:00
    "slurm_extra": "",           # more srun/sbatch options, space-separated (e.g. "--qos=high")
    "container_engine": "",      # docker | podman | apptainer (runtime=container)
    "container_image": "",
    "container_mounts": "",      # more SRC:DST[:ro] mounts, comma-separated (the checkout and run dir always are)
    "container_python": "python3",   # the interpreter inside the image that runs the agent and ranks
    "container_extra": "",       # more `run` options, space-separated (e.g. "--pull=never")
    "container_env": "",         # more of this machine's variables to pass in, comma-separated: NAME or PREFIX*
    "megatron_path": "",         # a Megatron-LM checkout: train.launch --backend megatron runs its scripts
    "hooks_dir": "hooks",        # the only folder hooks are taken from
    "hook_timeout": 600,         # seconds a hook may take before it is killed and the task stops; 0 = no limit
    "connect_timeout": 10,       # seconds, SSH connect
    "command_timeout": 0,        # seconds per remote command, 0 = no limit
}


class SettingsError(UserError):
    """A runner setting has a value that cannot work."""


@dataclass
class Settings:
    """The settings as the program uses them (from_mapping makes one; the defaults are DEFAULTS')."""
    root: Path                   # project root (where tasks.py / invoke.yaml live)
    runs_dir: Path
    hosts: list[str]
    user: str
    key_filename: list[str]
    remote_path: str
    remote_inv: str
    runtime: Runtime
    slurm_mode: str
    slurm_partition: str
    slurm_account: str
    slurm_time: str
    slurm_extra: list[str]
    container_engine: str
    container_image: str
    container_mounts: list[str]
    container_python: str
    container_extra: list[str]
    container_env: list[str]
    megatron_path: str
    hooks_dir: Path
    hook_timeout: float
    connect_timeout: float
    command_timeout: float
    ssh_flags: SshOptions | None = None   # inv's own -i, -S, -t and prompts, over the settings' (runtime.program.cli)

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, (Path, Runtime)) else v) for k, v in self.__dict__.items()
                if k != "ssh_flags"}

    # ---- what the transports take (runtime.cluster.options)
    def slurm_options(self) -> SlurmOptions:
        return SlurmOptions(mode=self.slurm_mode, partition=self.slurm_partition, account=self.slurm_account,
                            time=self.slurm_time, extra=list(self.slurm_extra))

    def container_options(self) -> ContainerOptions:
        return ContainerOptions(engine=self.container_engine or "docker", image=self.container_image,
                                mounts=list(self.container_mounts), python=self.container_python,
                                extra=list(self.container_extra), env=list(self.container_env))

    def ssh_options(self) -> SshOptions:
        if self.ssh_flags is not None:
            return self.ssh_flags
        return SshOptions(remote_path=self.remote_path or str(self.root), remote_inv=self.remote_inv,
                          user=self.user or None, key_filename=list(self.key_filename),
                          connect_timeout=float(self.connect_timeout))

    def cluster_options(self, **fields) -> Options:
        """Options for runtime.open(): these settings, then the task's `fields` (nodes=2, exclude=[...])."""
        defaults = dict(hosts=list(self.hosts), command_timeout=self.command_timeout, slurm=self.slurm_options(),
                        ssh=self.ssh_options(), container=self.container_options())
        return Options(**{**defaults, **fields})


def split_list(value: Any, name: str = "") -> list[str]:
    """'a, b' or ['a', 'b'] -> ['a', 'b']; anything else (a mapping, a number) is a SettingsError
    naming anvil.<name>."""
    if value is None:
        return []
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                  for v in value):
        items = [str(v) for v in value]
    else:
        raise SettingsError(f"anvil.{name or 'setting'} must be a comma-separated string or a list of "
                            f"names, got {_shown(value)}")
    return [v.strip() for v in items if v and v.strip()]


def _shown(value: Any) -> str:
    """A value as the user wrote it, with its YAML type: "a mapping ({'a': 1})"."""
    kinds = {dict: "a mapping", list: "a list", tuple: "a list", bool: "true/false", int: "a number",
             float: "a number"}
    kind = next((text for t, text in kinds.items() if type(value) is t), type(value).__name__)
    return f"{kind} ({value!r})"


def _text(name: str, value: Any) -> str:
    """A setting that is one word or path: a string (an integer is taken as written); a list, a
    mapping or true/false is a SettingsError rather than a folder named "['x']"."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if name == "slurm_time":   # YAML 1.1 reads 2:00:00 as 7200 (base 60): not what was meant
            raise SettingsError(f"anvil.slurm_time must be a string such as '02:00:00', got the number "
                                f"{value} (YAML reads an unquoted H:MM:SS in base 60); quote it")
        return str(value)
    raise SettingsError(f"anvil.{name} must be a string, got {_shown(value)}")


def _words(name: str, value: Any) -> list[str]:
    """Options given as one string (split as a shell would) or as a list of strings (taken as they are)."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise SettingsError(f"anvil.{name} must be a string of options or a list of strings, got "
                                f"{_shown(value)}")
        return list(value)
    try:
        return shlex.split(_text(name, value))
    except ValueError as exc:   # an unbalanced quote
        raise SettingsError(f"anvil.{name}: {exc} in {value!r}") from None


def project_root(ctx=None) -> Path:
    """Where the loaded tasks.py lives; else the checkout this package is in."""
    config = getattr(ctx, "config", None)
    prefix = getattr(config, "_project_prefix", None) if config is not None else None
    if prefix:
        return Path(prefix).resolve()
    return CHECKOUT


def _number(name: str, value: Any) -> float:
    if isinstance(value, (bool, list, tuple, dict)):
        raise SettingsError(f"anvil.{name} must be a number of seconds, got {_shown(value)}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"anvil.{name} must be a number of seconds, got {value!r}") from None
    if number < 0:
        raise SettingsError(f"anvil.{name} must be >= 0, got {value!r}")
    return number


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    value = _text(name, value).strip()
    if value not in allowed:
        raise SettingsError(f"anvil.{name} must be one of {' | '.join(allowed)}, got {value!r}")
    return value


def from_mapping(values: Mapping[str, Any] | None, root: Path) -> Settings:
    raw = dict(DEFAULTS)
    raw.update({k: v for k, v in (values or {}).items()})
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise SettingsError(f"unknown anvil setting(s): {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(DEFAULTS))})")

    def text(name: str) -> str:
        """The setting as a string; empty means its default."""
        return _text(name, raw[name]) or str(DEFAULTS[name])

    def under_root(name: str) -> Path:
        path = Path(os.path.expanduser(text(name)))
        return path if path.is_absolute() else root / path

    return Settings(
        root=root,
        runs_dir=under_root("runs_dir"),
        hosts=split_list(raw["hosts"], "hosts"),
        user=_text("user", raw["user"]),
        key_filename=[os.path.expanduser(k) for k in split_list(raw["key_filename"], "key_filename")],
        remote_path=_text("remote_path", raw["remote_path"]),
        remote_inv=_text("remote_inv", raw["remote_inv"]),
        runtime=Runtime.parse(text("runtime"), "anvil.runtime"),
        slurm_mode=_choice("slurm_mode", text("slurm_mode"), SLURM_MODES),
        slurm_partition=_text("slurm_partition", raw["slurm_partition"]),
        slurm_account=_text("slurm_account", raw["slurm_account"]),
        slurm_time=_text("slurm_time", raw["slurm_time"]),
        slurm_extra=_words("slurm_extra", raw["slurm_extra"]),
        container_engine=_text("container_engine", raw["container_engine"]),
        container_image=_text("container_image", raw["container_image"]),
        container_mounts=split_list(raw["container_mounts"], "container_mounts"),
        container_python=text("container_python"),
        container_extra=_words("container_extra", raw["container_extra"]),
        container_env=split_list(raw["container_env"], "container_env"),
        megatron_path=str(under_root("megatron_path")) if _text("megatron_path", raw["megatron_path"]) else "",
        hooks_dir=under_root("hooks_dir"),
        hook_timeout=_number("hook_timeout", raw["hook_timeout"]),
        connect_timeout=_number("connect_timeout", raw["connect_timeout"]),
        command_timeout=_number("command_timeout", raw["command_timeout"]),
    )


#: Set by a fan-out (ssh, srun) for the task it starts on a node: where that node's run directory
#: goes and how it runs its part. They win over every configuration level, -f FILE included, since
#: the fan-out forwards that file too.
NODE_RUNTIME_VAR = names.NODE_RUNTIME
NODE_OVERRIDES = {NODE_RUNS_DIR_VAR: "runs_dir", NODE_RUNTIME_VAR: "runtime"}
#: Where inv leaves its own SSH flags (-i, -S, -t, prompts) for everything that reaches hosts over SSH.
SSH_FLAGS = "anvil_cli_ssh_options"
#: Where inv leaves what its command line has after `--`, word for word (train.launch's program).
PROGRAM_ARGS = "anvil_cli_program_args"


def program_args(ctx) -> list[str]:
    """The words after `--` on inv's command line (Invoke keeps them only joined by spaces)."""
    config = getattr(ctx, "config", None)
    words = config.get(PROGRAM_ARGS, None) if config is not None and hasattr(config, "get") else None
    return list(words or [])


def load(ctx=None) -> Settings:
    """Settings from ``ctx.config.anvil`` (invoke.yaml, -f FILE, INVOKE_ANVIL_* env), then NODE_OVERRIDES."""
    config = getattr(ctx, "config", None)
    values = {}
    if config is not None:
        section = config.get("anvil", None) if hasattr(config, "get") else None
        if section is not None:
            values = {k: section[k] for k in section}
    for variable, key in NODE_OVERRIDES.items():
        if os.environ.get(variable):
            values[key] = os.environ[variable]
    settings = from_mapping(values, project_root(ctx))
    if config is not None and hasattr(config, "get"):
        settings.ssh_flags = config.get(SSH_FLAGS, None)
    return settings

"""What a run directory names that could run code, for a replay to leave out unless the user agrees.

A run directory is data: anyone who can write to it (a colleague's run on a shared file system, a
downloaded one) can edit the command line and environment a replay would restore. A replay therefore
runs code only from this checkout and this environment; what the directory adds that could start
code of its own choosing is an Item, left out with a note unless `snapshot.replay --trust-run` is given:

- variables the loader, Python, bash, Invoke or the task discovery read to find code (executes):
  LD_PRELOAD, LD_LIBRARY_PATH (every LD_* and DYLD_*), PYTHONPATH and the other PYTHON* that name
  code or an interpreter, PATH, BASH_ENV, exported bash functions, INVOKE_* (a settings file, the
  hooks folder, the interpreter in a container), names.TASKS_PATH, and compiled-code caches (Triton,
  TorchInductor, torch extensions). Only a value that differs from this environment's is an item:
  a value the replaying shell already has changes nothing.
- `--patch FILE` (a hook file run before the task), Invoke's `-c/--collection` and `-r/--search-root`
  (which tasks.py is loaded), and `-f FILE` when it is not the user's own (someone else owns it, or
  others can write it) and is Python (Invoke runs it) or sets where code comes from (`tasks:`,
  anvil.hooks_dir, remote_inv, remote_path, container_python).
- a recorded working directory outside this checkout, other than where inv runs now (`python -m`
  imports from it; Invoke looks for tasks.py there).

    found = trust.variables(recorded_env, os.environ)      # [Item]
    trust.executes("LD_PRELOAD")                            # why it can run code, or ""
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from core import names

#: Set by snapshot.replay for the replaying child: the user gave --trust-run.
TRUST_ENV = names.REPLAY_TRUSTED
_REPLAY_CONTROL = (names.REPLAY_PREFIX,)    # the replay's own variables: never taken from a directory

_PYTHON_HARMLESS = {"PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER",
                    "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONTRACEMALLOC",
                    "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONVERBOSE", "PYTHONWARNDEFAULTENCODING"}
_EXACT = {
    "PATH": "where commands (bash, srun, python) are found",
    "BASH_ENV": "a file bash runs before every shell hook",
    "ENV": "a file sh runs at its start",
    "PROMPT_COMMAND": "a command bash runs",
    "SHELLOPTS": "bash's options", "BASHOPTS": "bash's options",
    names.TASKS_PATH: "folders of task modules inv imports",
    "TRITON_CACHE_DIR": "compiled kernels Triton loads", "TRITON_HOME": "compiled kernels Triton loads",
    "TORCHINDUCTOR_CACHE_DIR": "compiled code torch.compile loads",
    "TORCH_EXTENSIONS_DIR": "compiled extensions torch loads",
}
# (prefix, why) in order: the first that matches says why
_PREFIXES = (
    ("LD_", "the dynamic loader's libraries and search path"),
    ("DYLD_", "the dynamic loader's libraries and search path"),
    ("BASH_FUNC_", "a bash function every shell hook gets"),
    ("INVOKE_", "inv's own settings (a settings file, the hooks folder, the interpreter in a container)"),
    ("PYTHON", "where Python finds code, or which interpreter runs"),
)


def executes(name: str) -> str:
    """Why a variable of this name can make a replay run code it names ("" when it cannot)."""
    if name.startswith(_REPLAY_CONTROL):
        return "the replay's own control variable"
    if name in _EXACT:
        return _EXACT[name]
    for prefix, why in _PREFIXES:
        if name.startswith(prefix) and name not in _PYTHON_HARMLESS:
            return why
    return ""


@dataclass
class Item:
    """One thing the run directory names that could run code."""
    what: str           # "env LD_PRELOAD=/x.so", "--patch fix.py", "working directory /x"
    why: str            # what it can run
    allows: str         # what --trust-run would do with it
    variable: str = ""  # the variable's name, for an item of the environment

    def line(self) -> str:
        return f"{self.what}: {self.why}; --trust-run {self.allows}"


def variables(recorded: Mapping[str, str], here: Mapping[str, str]) -> list[Item]:
    """The recorded variables that can run code and differ from this environment's."""
    found = []
    for name, value in sorted(recorded.items()):
        why = executes(name)
        if why and (name.startswith(_REPLAY_CONTROL) or here.get(name) != value):
            allows = "cannot replay it" if name.startswith(_REPLAY_CONTROL) else "sets it as recorded"
            found.append(Item(f"env {name}={value}", why, allows, variable=name))
    return found


def untrusted(recorded: Mapping[str, str], here: Mapping[str, str], trusted: bool) -> set[str]:
    """The names of `variables` that a replay leaves out: all of them, unless trusted (the replay's own
    control variables always)."""
    return {item.variable for item in variables(recorded, here)
            if not trusted or item.variable.startswith(_REPLAY_CONTROL)}


CODE_SETTINGS = ("hooks_dir", "remote_inv", "remote_path", "container_python")


def yours(path: Path) -> bool:
    """The file is the user's own: owned by them and writable by no one else (as ssh asks of its keys)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def settings_file(path: Path) -> str:
    """Why a -f FILE from a recorded command line can run code ("" when it cannot): a file of someone
    else's (or one others can write) that is Python, which Invoke executes, or holds settings that say
    where code comes from. A settings file of the user's own is theirs to trust. A file that cannot be
    read as YAML or JSON is left to inv to refuse."""
    if yours(path):
        return ""
    if path.suffix == ".py":
        return "a Python file of someone else's, which Invoke runs as its settings"
    try:
        import json

        from core import safe_yaml
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else safe_yaml.load(text)
    except Exception:  # noqa: BLE001 - unreadable: inv says why when it reads it
        return ""
    if not isinstance(data, dict):
        return ""
    named = ["tasks"] if "tasks" in data else []
    anvil = data.get("anvil")
    named += [f"anvil.{key}" for key in CODE_SETTINGS if isinstance(anvil, dict) and anvil.get(key)]
    return (f"settings of someone else's, or that others can write, that say where code comes from "
            f"({', '.join(named)})") if named else ""


def inside(path: Path, root: Path) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
    except (OSError, ValueError):
        return False

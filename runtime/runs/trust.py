"""What a run directory names that could run code, for a replay to leave out unless the run is trusted.

Which runs are trusted: the ones made by this user, or where the user says so (`--trust-run`). A run's
records (metadata.json, env.json, ...) carry a checksum anyone can recompute (core.files.seal) and an
HMAC with the key of the user who wrote them (KEY_FILE: created on first use, mode 0600, in the user's
config folder). A run whose metadata.json and env.json both carry an HMAC with this user's key was made
by this user, on this machine or one sharing the home folder: the variables it recorded are replayed.
What it points to outside its records (a --patch file, -c/-r, an -f file not the user's own, a working
directory outside this checkout) may have changed since, and needs --trust-run for any run. Any other
run (sealed without a key: made elsewhere, or before keys; with another user's key; not sealed) is
untrusted.

A run directory is data: anyone who can write to it (a colleague's run on a shared file system, a
downloaded one) can edit the command line and environment a replay would restore. A replay therefore
runs code only from this checkout and this environment; what the directory adds that could start
code of its own choosing is an Item, left out with a note unless the run is trusted:

- variables the loader, Python, bash, git, Invoke or the task discovery read to find code (executes):
  LD_PRELOAD, LD_LIBRARY_PATH (every LD_* and DYLD_*), PYTHONPATH and the other PYTHON* that name
  code or an interpreter, HOME (Python's user site), PATH, BASH_ENV, ENV, exported bash functions,
  GIT_* (git runs for the snapshot), Perl, Ruby and Node options, glibc's GCONV_PATH, OpenSSL's
  configuration, NCCL plugins, INVOKE_* (a settings file, the hooks folder, the interpreter in a
  container), *_HOOKS_DIR, names.TASKS_PATH, compiled-code caches (Triton, TorchInductor, torch
  extensions, MIOpen, CUDA), and where the user's run key is found. Wherever the run names them: its
  env.json, --env and --set env.NAME on its command line, the env: block of its config copy (the
  replaying task leaves those out itself: run.create, `untrusted_layers`). Only a value that differs
  from this environment's is an item: a value the replaying shell already has changes nothing.
- `--patch FILE` (a hook file run before the task), Invoke's `-c/--collection` and `-r/--search-root`
  (which tasks.py is loaded), and `-f FILE` when it is not the user's own (someone else owns it, or
  others can write it, or it lies in the replayed run directory) and is Python (Invoke runs it) or
  sets where code comes from (`tasks:`, anvil.hooks_dir, remote_inv, remote_path, megatron_path, container_python,
  container_image) or options of every rank's launch (container_extra, slurm_extra).
- a recorded working directory outside this checkout, other than where inv runs now (`python -m`
  imports from it; Invoke looks for tasks.py there).
- train.launch's program (what followed `--`, with --backend and --megatron): the replay cannot run
  without it, so an untrusted run's replay is refused instead of leaving it out.

    found = trust.variables(recorded_env, os.environ)      # [Item]
    trust.executes("LD_PRELOAD")                            # why it can run code, or ""
    trust.sealed_by(record)                                 # YOURS, OTHER_KEY, NO_KEY or NOT_SEALED
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from core import names
from core.files import keyed_by

#: Set by snapshot.replay for the replaying child: "1" the user gave --trust-run; "key" the run is
#: sealed with the user's key (the child checks env.json's seal again as it reads it).
TRUST_ENV = names.REPLAY_TRUSTED
EXPLICIT, BY_KEY = "1", "key"
_REPLAY_CONTROL = (names.REPLAY_PREFIX,)    # the replay's own variables: never taken from a directory
#: The user's run key file, where it is not KEY_FILE under the config folder (tests; a shared home).
KEY_ENV = names.RUN_KEY
KEY_FILE = Path("anvil") / "run-key"     # under $XDG_CONFIG_HOME, else ~/.config

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
    "CUDA_CACHE_PATH": "compiled kernels the CUDA driver loads",
    "MIOPEN_CUSTOM_CACHE_DIR": "compiled kernels MIOpen loads", "MIOPEN_USER_DB_PATH": "kernels MIOpen loads",
    "HOME": "where Python's user site-packages and the run key are found",
    "XDG_CONFIG_HOME": "where the run key (which runs are yours) is found",
    KEY_ENV: "the run key: which runs are yours",
    "GCONV_PATH": "character-set modules glibc loads",
    "OPENSSL_CONF": "OpenSSL's settings, which load engines and providers",
    "OPENSSL_ENGINES": "engines OpenSSL loads", "OPENSSL_MODULES": "providers OpenSSL loads",
    "PERL5LIB": "where Perl finds code", "PERLLIB": "where Perl finds code",
    "PERL5OPT": "Perl's options (-M loads code)",
    "RUBYLIB": "where Ruby finds code", "RUBYOPT": "Ruby's options (-r loads code)",
    "NODE_OPTIONS": "Node's options (--require loads code)", "NODE_PATH": "where Node finds code",
    "NCCL_NET_PLUGIN": "a network plugin NCCL loads", "NCCL_TUNER_PLUGIN": "a tuner plugin NCCL loads",
    "NCCL_PROFILER_PLUGIN": "a profiler plugin NCCL loads",
    "TRITON_LIBCUDA_PATH": "the libcuda Triton loads", "TRITON_PTXAS_PATH": "the ptxas Triton runs",
}
# (prefix, why) in order: the first that matches says why
_PREFIXES = (
    ("LD_", "the dynamic loader's libraries and search path"),
    ("DYLD_", "the dynamic loader's libraries and search path"),
    ("BASH_FUNC_", "a bash function every shell hook gets"),
    ("INVOKE_", "inv's own settings (a settings file, the hooks folder, the interpreter in a container)"),
    ("PYTHON", "where Python finds code, or which interpreter runs"),
    ("GIT_", "git's settings (git runs for every run's snapshot; core.fsmonitor, GIT_SSH_COMMAND run commands)"),
)
_SUFFIXES = (("_HOOKS_DIR", "a folder of hooks that run"),)


def controls(name: str) -> bool:
    """A variable of the replay's own (TRUST_ENV, ...), which a run directory never sets."""
    return bool(name) and name.startswith(_REPLAY_CONTROL)


def executes(name: str) -> str:
    """Why a variable of this name can make a replay run code it names ("" when it cannot)."""
    if controls(name):
        return "the replay's own control variable"
    if name in _EXACT:
        return _EXACT[name]
    for prefix, why in _PREFIXES:
        if name.startswith(prefix) and name not in _PYTHON_HARMLESS:
            return why
    for suffix, why in _SUFFIXES:
        if name.endswith(suffix):
            return why
    return ""


@dataclass
class Item:
    """One thing the run directory names that could run code."""
    what: str           # "env LD_PRELOAD=/x.so", "--patch fix.py", "working directory /x"
    why: str            # what it can run
    allows: str         # what --trust-run would do with it
    variable: str = ""  # the variable's name, for an item of the environment
    where: str = ""     # where the run names it: "env.json", "--env", "configs/train.yaml (env:)"
    kept: bool = False  # the replay passes it on (a trusted run)
    required: bool = False   # the replay cannot go without it: refused rather than left out (train.launch's program)

    def line(self) -> str:
        return f"{self.what}{self.origin()}: {self.why}; --trust-run {self.allows}"

    def note(self) -> str:
        """The replay's note on leaving it out (or, for a required item, on refusing the replay)."""
        if self.required:
            return f"refused: {self.what} ({self.why}; --trust-run {self.allows})"
        return f"left out {self.what} ({self.why}; --trust-run {self.allows})" + (
            f", from {self.where}" if self.where else "")

    def origin(self) -> str:
        return f" (from {self.where})" if self.where else ""


def variables(recorded: Mapping[str, str], here: Mapping[str, str], where: str = "") -> list[Item]:
    """The recorded variables that can run code and differ from this environment's."""
    found = []
    for name, value in sorted(recorded.items()):
        why = executes(name)
        if why and (controls(name) or here.get(name) != value):
            allows = "cannot replay it" if controls(name) else "sets it as recorded"
            found.append(Item(f"env {name}={value}", why, allows, variable=name, where=where))
    return found


def untrusted(recorded: Mapping[str, str], here: Mapping[str, str], trusted: bool) -> set[str]:
    """The names of `variables` that a replay leaves out: all of them, unless trusted (the replay's own
    control variables always)."""
    return {item.variable for item in variables(recorded, here) if not trusted or controls(item.variable)}


def untrusted_layers(sources: Mapping[str, dict], values: Mapping[str, str], here: Mapping[str, str],
                     layers: tuple[str, ...]) -> dict[str, dict | None]:
    """{name: the change it falls back to (None: unset)} for each variable that can run code whose value
    came from one of `layers` (a replayed run's own input: its config's env: block, --env) and differs
    from `here`: the last change of an earlier layer (this checkout's profiles), else none."""
    out = {}
    for name, record in sources.items():
        value = values.get(name)
        if record.get("source") not in layers or not executes(name) or value is None or value == here.get(name):
            continue
        earlier = [c for c in record.get("history") or [] if isinstance(c, dict) and c.get("layer") not in layers]
        out[name] = earlier[-1] if earlier else None
    return out


# ---- who sealed a run's records

YOURS, OTHER_KEY, NO_KEY, NOT_SEALED = "yours", "another key", "no key", "not sealed"
_SEALS = {YOURS: "sealed with your run key: made by you",
          OTHER_KEY: "sealed with another key (another user's, or another home's)",
          NO_KEY: "sealed without a key (made elsewhere, or before runs were keyed)",
          NOT_SEALED: "not sealed"}


def key_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where this user's run key is: names.RUN_KEY's file, else anvil/run-key under $XDG_CONFIG_HOME (an
    absolute one: the XDG rule), else under ~/.config."""
    environ = os.environ if environ is None else environ
    if environ.get(KEY_ENV):
        return Path(environ[KEY_ENV]).expanduser()
    config = environ.get("XDG_CONFIG_HOME", "")
    return (Path(config) if os.path.isabs(config) else Path.home() / ".config") / KEY_FILE


_KEYS: dict[str, tuple[bytes | None, str]] = {}


def run_key(create: bool = True) -> tuple[bytes | None, str]:
    """(this user's run key, "") or (None, why there is none). Created on first use (`create`): 32
    random bytes, mode 0600, in a folder of mode 0700. A key others can read or write, or that someone
    else owns, is no key (anyone who can read it can seal a run as yours). Kept for the process."""
    path = key_path()
    cached = _KEYS.get(str(path))
    if cached is not None and (cached[0] is not None or not create):
        return cached
    try:
        found = _read_key(path)
        if found is None and create:
            _make_key(path)
            found = _read_key(path)
    except OSError as exc:
        found = (None, f"{path}: {exc.strerror or exc}")
    found = found or (None, f"{path}: none yet")
    _KEYS[str(path)] = found
    return found


def _read_key(path: Path) -> tuple[bytes | None, str] | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if st.st_uid != os.geteuid():
            return None, f"{path} belongs to someone else"
        if st.st_mode & 0o077:
            return None, f"{path} can be read or written by others (chmod 600 {path})"
        text = handle.read(256).decode("ascii", "replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    return (key, "") if len(key) >= 32 else (None, f"{path} holds no key (remove it to make a new one)")


def _make_key(path: Path) -> None:
    """Write a new key where there is none; the first of two writers at once wins (a link never
    replaces a file), so every process of the user seals with the same key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def sealed_by(record: object) -> str:
    """Who sealed a record: YOURS (an HMAC with this user's key), OTHER_KEY, NO_KEY (a checksum alone)
    or NOT_SEALED. (Whether its checksum matches is core.files.seal_problem's.)"""
    from core.files import SEAL
    if not isinstance(record, dict) or SEAL not in record:
        return NOT_SEALED
    key, _ = run_key(create=False)
    mine = keyed_by(record, key)
    return NO_KEY if mine is None else YOURS if mine else OTHER_KEY


def trusted_by_key(seals: Mapping[str, str]) -> tuple[bool, str]:
    """(every record is sealed with the user's key, why or why not in words) for {file: sealed_by}."""
    if not seals:
        return False, "no records"
    if all(kind == YOURS for kind in seals.values()):
        return True, _SEALS[YOURS]
    worst = next(kind for kind in (NOT_SEALED, NO_KEY, OTHER_KEY) if kind in seals.values())
    why = f"{', '.join(sorted(f for f, kind in seals.items() if kind == worst))} {_SEALS[worst]}"
    key, problem = run_key(create=False)
    return False, why + (f"; your run key: {problem}" if key is None else "")


CODE_SETTINGS = ("hooks_dir", "remote_inv", "remote_path", "container_python", "container_image", "megatron_path")
# Settings whose options reach every rank's launch line, and so its environment
LAUNCH_SETTINGS = ("container_extra", "slurm_extra")


def yours(path: Path) -> bool:
    """The file is the user's own: owned by them and writable by no one else (as ssh asks of its keys)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def settings_file(path: Path, within: Path | None = None) -> str:
    """Why a -f FILE from a recorded command line can run code ("" when it cannot): a file of someone
    else's (or one others can write) that is Python, which Invoke executes, or holds settings that say
    where code comes from, or options for every rank's launch line (which can set its environment). A
    settings file of the user's own is theirs to trust, unless it lies `within` the replayed run
    directory (a copied run's files are the copier's). A file that cannot be read as YAML or JSON is
    left to inv to refuse."""
    if yours(path) and not (within is not None and inside(path, within)):
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
    named += [f"anvil.{key}" for key in CODE_SETTINGS + LAUNCH_SETTINGS if isinstance(anvil, dict) and anvil.get(key)]
    return (f"settings of someone else's, or that others can write, that say where code comes from "
            f"({', '.join(named)})") if named else ""


def inside(path: Path, root: Path) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
    except (OSError, ValueError):
        return False

"""Run a recorded task again: same task, same arguments, recorded config and env.

    plan = replay.plan("runs/2026-11-22T10-31-05_preflight.all")
    problems = replay.check_machine(plan.recorded)   # differences with this machine
    code = replay.run(plan)                          # a new run dir, linked to the old one

The recorded command line is replayed without its fan-out flags (-H, -i, ...;
kept where -H was the input of a task that reaches the hosts itself), with
a scheduled training run's runtime and node count pinned (--runtime, --nodes),
`--resume auto` pinned to the checkpoint it found then (or dropped, if none),
a benchmark's sizes pinned to those it resolved (bench.gemm: -M, -N, -K), a
settings file that is gone (-f) dropped with a note, and
with every config path that the run recorded (config_sources) swapped for the
copy inside the run directory (a copy gone, or changed since the run wrote it,
is a damaged run: refused). The child gets the recorded environment over
this one, and names.REPLAY_OF, so runtime.runs.run lays that environment over the
task's own resolution (source "replay:<run>") and links the new run to the old.

A run directory is data (runtime.runs.trust): what it names that could run code
(a --patch file, -c/-r/-f naming where tasks and hooks come from, LD_PRELOAD,
PYTHONPATH and other loader and interpreter variables in its env.json, its
command line's --env and --set env.NAME or its config's env: block, a working
directory outside this checkout) is left out with a note unless the run is
trusted: `snapshot.replay --trust-run`, or for the variables, a run sealed with
the user's own run key; plan.items lists each, with where it came from, for
the dry run.

Incompatible (refused unless forced): another GPU vendor, model or count, or
another torch major.minor. Other differences (driver, ROCm/CUDA, triton,
python) are shown but do not block.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from core import names
from runtime.cluster.runtime import BadRuntime, Runtime
from runtime.launch.spec import CHECKOUT
from runtime.runs import history, rundir, snapshot, trust
from runtime.runs.run import MACHINE_IDENTITY, REPLAY_ENV
from core.errors import UserError
from core.secrets import MASK

# Core flags that say where inv loads its tasks (name -> what), and its settings file.
_TASK_SOURCE_FLAGS = {"-c": "the task collection", "--collection": "the task collection",
                      "-r": "the folder tasks.py is found from", "--search-root": "the folder tasks.py is found from"}
_SETTINGS_FLAGS = ("-f", "--config")     # before the task name: Invoke's settings file
# Core flags of the recorded command line that a local replay drops (name -> takes a value).
_DROPPED_FLAGS = {"-H": True, "--hosts": True, "-i": True, "--identity": True, "-t": True,
                  "--connect-timeout": True, "-S": True, "--ssh-config": True,
                  "--prompt-for-login-password": False, "--prompt-for-passphrase": False}


class ReplayError(UserError):
    """The run cannot be replayed as recorded."""


@dataclass
class Difference:
    item: str
    recorded: str
    here: str
    blocking: bool


@dataclass
class ReplayPlan:
    recorded: history.Recorded
    argv: list[str]                 # inv arguments (no program name)
    env: dict[str, str]             # recorded variables laid over this environment
    cwd: Path
    dropped: list[str] = field(default_factory=list)   # notes on what was not replayed
    items: list[trust.Item] = field(default_factory=list)   # what the directory names that could run code
    trusted: bool = False                                # the items are replayed: by --trust-run, or by key
    explicit: bool = False                               # --trust-run
    trust: str = ""                                      # why the run is trusted or not, in words

    @property
    def refused(self) -> list[trust.Item]:
        """What the replay cannot leave out and may not run (train.launch's program of an untrusted run)."""
        return [item for item in self.items if item.required and not item.kept]


def _major_minor(version: str | None) -> str | None:
    if not version:
        return None
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def check_machine(recorded: history.Recorded, current_machine: dict | None = None,
                  current_versions: dict | None = None) -> list[Difference]:
    """Differences between the recorded machine/versions and this one."""
    machine = current_machine if current_machine is not None else snapshot.machine()
    versions = current_versions if current_versions is not None else snapshot.versions(gpu=machine.get("gpu"))
    was, now = recorded.gpu, machine.get("gpu") or {}
    out = []
    for key in ("vendor", "model", "count", "driver", "platform_version", "arch"):
        a, b = was.get(key), now.get(key)
        if str(a) != str(b):
            out.append(Difference(f"gpu.{key}", str(a), str(b), key in ("vendor", "model", "count")))
    for key in ("torch", "triton", "python"):
        a, b = recorded.versions.get(key), versions.get(key)
        if str(a) != str(b):
            blocking = key == "torch" and _major_minor(a) != _major_minor(b)
            out.append(Difference(key, str(a), str(b), blocking))
    return out


def _replay_argv(metadata: dict, run_dir: Path, keep=lambda item: False,
                 cwd: Path | None = None) -> tuple[list[str], list[str], list[trust.Item]]:
    """(argv, notes, items): the command line to replay, what was changed and why, and what it names
    that could run code (left out unless `keep(item)`). Relative paths of -f are read from `cwd`,
    where the run ran."""
    recorded = metadata.get("argv") or []
    if not isinstance(recorded, list) or not all(isinstance(a, str) for a in recorded):
        raise ReplayError(f"{run_dir}: the recorded command line (metadata.json 'argv') is not a list "
                          f"of strings; the run directory is damaged")
    argv = recorded[1:]
    if not argv:
        raise ReplayError(f"{run_dir}: no recorded command line")
    task = metadata.get("task")
    core_end = argv.index(task) if task in argv else len(argv)   # the program's flags come before the task
    # -H is dropped where it fanned the task out (the replay runs here); a task that reaches the
    # hosts itself (preflight.comm) took it as its input, and keeps it with the SSH flags.
    hosts_are_input = not metadata.get("fanout") and any(t.split("=", 1)[0] in ("-H", "--hosts")
                                                           for t in argv[:core_end])
    swaps = _config_swaps(metadata, run_dir)
    out, notes, items = [], [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" and i > core_end:   # train.launch's program: taken as it is, or not at all
            if task == "train.launch":
                items.append(_program_item(argv[:i], argv[i + 1:]))
            out += argv[i:]
            break
        flag, has_value, attached = token.partition("=")
        value = attached if has_value else (argv[i + 1] if i + 1 < len(argv) else "")
        width = 1 if has_value else 2     # tokens of a flag that takes a value
        if flag in _DROPPED_FLAGS and i < core_end and not hosts_are_input:
            takes_value = _DROPPED_FLAGS[flag] and not has_value
            notes.append(f"dropped {token}{' ' + argv[i + 1] if takes_value and i + 1 < len(argv) else ''}")
            i += 2 if takes_value else 1
            continue
        if token == "--env" and i + 1 < len(argv) and MASK in argv[i + 1]:
            notes.append(f"dropped --env {argv[i + 1]} (a secret: this environment's value is used)")
            i += 2
            continue
        if MASK in token:
            raise ReplayError(f"the recorded command line has a masked secret ({token}); "
                              f"give it through the environment and run the task by hand")
        if i < core_end and flag in _SETTINGS_FLAGS and not _beside(value, cwd).is_file():
            notes.append(f"dropped {flag} {value} (the settings file is gone; this checkout's settings are used)")
            i += width
            continue
        code = _runs_code(flag, value, i < core_end, cwd, run_dir)
        if code is not None:
            items.append(code)
            if not keep(code):
                notes.append(code.note())
                i += width
                continue
            if flag in _SETTINGS_FLAGS and not has_value:   # kept: as an absolute path (the cwd may differ)
                out += [flag, str(_beside(value, cwd))]
                i += 2
                continue
        if token in swaps:
            token = swaps[token]
        elif flag != token and token.split("=", 1)[1] in swaps:
            token = f"{flag}={swaps[token.split('=', 1)[1]]}"
        out.append(token)
        i += 1
    out += _pinned_topology(metadata, out, notes)
    out = _pinned_resume(metadata, out, notes)
    out += _pinned_sizes(metadata, run_dir, out, notes)
    for name, option in (metadata.get("config_options") or {}).items():
        copy = run_dir / names.CONFIGS_DIR / rundir.slug(Path(name).name)
        if copy.is_file() and str(copy) not in out and f"{option}={copy}" not in out:
            if option in out or any(t.startswith(option + "=") for t in out):
                continue   # given explicitly with another value: already swapped above, or kept as typed
            out += [option, str(copy)]
            notes.append(f"added {option} {copy} (the run used the default {name})")
    return out, notes, items


def _program_item(options: list[str], program: list[str]) -> trust.Item:
    """train.launch's program (with its --backend and --megatron): code it names, which a replay cannot leave
    out."""
    given = {flag: options[k + 1] for k, flag in enumerate(options[:-1]) if flag in ("--backend", "--megatron")}
    given.update(dict(t.split("=", 1) for t in options if t.startswith(("--backend=", "--megatron="))))
    said = " ".join(f"{k} {v}" for k, v in given.items())
    return trust.Item(f"the program {shlex.join(program) or '(none)'}" + (f" ({said})" if said else ""),
                      "what train.launch runs on every rank", "runs it", where="the command line (after --)",
                      required=True)


def _config_swaps(metadata: dict, run_dir: Path) -> dict[str, str]:
    """{recorded config path: its copy in RUN/configs/}; a copy that is gone, or that differs from the
    checksum the sealed metadata keeps of it, is a damaged run (ReplayError)."""
    for key in ("config_sources", "config_options", "config_sha256"):
        if not isinstance(metadata.get(key) or {}, dict):
            raise ReplayError(f"{run_dir}: metadata.json '{key}' is not a JSON object; the run "
                              f"directory is damaged")
    sums = metadata.get("config_sha256") or {}
    swaps = {}
    for name, source in (metadata.get("config_sources") or {}).items():
        copy = run_dir / names.CONFIGS_DIR / rundir.slug(Path(name).name)
        if copy.is_file() and source:
            if copy.name in sums and hashlib.sha256(copy.read_bytes()).hexdigest() != sums[copy.name]:
                raise ReplayError(f"{copy}: changed since the run wrote it (its checksum is in metadata.json); "
                                  "the run directory is damaged")
            swaps[str(source)] = str(copy)
        elif source:    # the replay would read today's file, or the default, instead: not this run
            raise ReplayError(f"{run_dir}: its copy of the config it ran with ({copy.relative_to(run_dir)}, "
                              f"from {source}) is missing; the run directory is damaged")
    return swaps


def _beside(value: str, cwd: Path | None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() or cwd is None else cwd / path


def _runs_code(flag: str, value: str, core: bool, cwd: Path | None, run_dir: Path) -> trust.Item | None:
    """The item a flag of the recorded command line is, when it names code (runtime.runs.trust); None
    for the others. core: the flag comes before the task name (one of inv's own)."""
    if not core and flag == "--patch":
        return trust.Item(f"--patch {value}", "a hook file run before the task", "runs it")
    if not core and flag in ("--env", "--set"):
        # --env NAME=VALUE, and --set env.NAME=VALUE (the config's env: block)
        name, _, setting = value.partition("=")
        if flag == "--set":
            if not name.startswith("env."):
                return None
            name = name[len("env."):]
        found = trust.variables({name: setting}, os.environ, where=f"the command line ({flag})")
        if found:
            found[0].what = f"{flag} {value}"
            return found[0]
        return None
    if core and flag in _TASK_SOURCE_FLAGS:
        return trust.Item(f"{flag} {value}", f"{_TASK_SOURCE_FLAGS[flag]}, whose code inv runs",
                          "loads the tasks from there")
    if core and flag in _SETTINGS_FLAGS:
        why = trust.settings_file(_beside(value, cwd), within=run_dir)
        if why:
            return trust.Item(f"{flag} {value}", why, "reads it")
    return None


# Tasks whose recorded launcher and node count a replay pins when the command line left them to the
# settings or to the allocation (a 2-node run replayed outside its allocation would run on 1 node).
_TOPOLOGY_TASKS = ("train.pretrain", "train.launch")
#: Tasks that continue a stopped run with --resume RUN.
_RESUMING_TASKS = ("train.pretrain", "train.launch")


def recorded_runtime(metadata: dict) -> Runtime | None:
    """The runtime the run recorded (None: none, or one this checkout does not know)."""
    try:
        return Runtime.parse(str(metadata.get("runtime") or ""), "the recorded runtime")
    except BadRuntime:
        return None


def recorded_nodes(metadata: dict) -> int:
    """The node count of a training run that a scheduler placed (0: not one)."""
    nodes = metadata.get("nodes")
    runtime = recorded_runtime(metadata)
    if metadata.get("task") not in _TOPOLOGY_TASKS or runtime is None or not runtime.scheduler:
        return 0
    return nodes if isinstance(nodes, int) and nodes > 0 else 0


def _pinned_topology(metadata: dict, argv: list[str], notes: list[str]) -> list[str]:
    nodes = recorded_nodes(metadata)
    if not nodes:
        return []

    def given(option: str) -> bool:
        return any(t == option or t.startswith(option + "=") for t in argv)
    added = []
    if not given("--runtime"):
        added += ["--runtime", str(metadata["runtime"])]
        notes.append(f"added --runtime {metadata['runtime']} (how the run was launched)")
    if not given("--nodes"):
        added += ["--nodes", str(nodes)]
        world = metadata.get("world_size")
        notes.append(f"added --nodes {nodes} (the run had {nodes} node(s)"
                     + (f", world size {world})" if world else ")"))
    return added


def _pinned_resume(metadata: dict, argv: list[str], notes: list[str]) -> list[str]:
    """--resume auto found a checkpoint when the run started (metadata 'resume'); today it would find
    another (a newer run's, or the run's own last one). The replay resumes from the recorded one, or
    starts fresh where the run found none."""
    found = metadata.get("resume")
    for i, token in enumerate(argv):
        if token == "--resume" and i + 1 < len(argv) and argv[i + 1] == "auto":
            end = i + 2
        elif token == "--resume=auto":
            end = i + 1
        else:
            continue
        if isinstance(found, str) and found not in ("", "auto"):
            notes.append(f"--resume auto -> --resume {found} (the checkpoint the run resumed from)")
            return argv[:i] + ["--resume", found] + argv[end:]
        notes.append("dropped --resume auto (the run found no checkpoint and started fresh)")
        return argv[:i] + argv[end:]
    return argv


def resume_command(metadata: dict, run_dir: Path | str) -> str:
    """What continues a stopped train.pretrain or train.launch run, where it ran: the command line as it was typed (its -H
    hosts and inv's SSH and settings flags, --runtime, --nodes, --partition, --master, --exclude, its config
    and --set overrides; secrets masked), its --resume pointing at `run_dir`, and the runtime and node
    count it ran with where the command line left them to the settings (a scheduler's, as a replay pins
    them; or ssh over anvil.hosts, a container)."""
    argv = list(metadata.get("argv") or [])[1:]
    task = metadata.get("task")
    if task not in _RESUMING_TASKS or task not in argv:   # profile.train: no --resume
        return f"inv train.pretrain --resume {shlex.quote(str(run_dir))}"
    start = argv.index(task) + 1
    program = argv[argv.index("--", start):] if "--" in argv[start:] else []   # train.launch's, kept last
    argv = argv[:len(argv) - len(program)]
    out, i = argv[:start], start
    while i < len(argv):
        flag, attached, _ = argv[i].partition("=")
        if flag == "--resume":
            i += 1 if attached else 2
            continue
        out.append(argv[i])
        i += 1
    out += ["--resume", str(run_dir)]
    out += _pinned_topology(metadata, out, [])
    runtime = recorded_runtime(metadata)

    def given(*options: str) -> bool:
        return any(t.split("=", 1)[0] in options for t in out)
    if runtime is not None and str(runtime) != "direct" and not given("--runtime", "-H", "--hosts"):
        out += ["--runtime", str(runtime)]
    return shlex.join(["inv", *out, *program])


def _pinned_sizes(metadata: dict, run_dir: Path, argv: list[str], notes: list[str]) -> list[str]:
    """bench.gemm without -M picks its size from the machine (8192 on a GPU, 1024 on a CPU): the replay
    gives the sizes the run measured (its gemm.json), so that it measures the same product."""
    if metadata.get("task") != "bench.gemm":
        return []
    try:
        result = rundir.read_json(run_dir / names.GEMM, {})
    except (rundir.RunDirError, OSError):
        return []
    added = []
    for flag, key in (("-M", "m"), ("-N", "n"), ("-K", "k")):
        size = result.get(key) if isinstance(result, dict) else None
        given = any(t == flag or t.startswith(flag + "=") for t in argv)
        if not given and isinstance(size, int) and not isinstance(size, bool) and size > 0:
            added += [flag, str(size)]
    if added:
        notes.append(f"added {' '.join(added)} (the sizes the run resolved and measured)")
    return added


def check_topology(recorded: history.Recorded, env: Mapping[str, str] | None = None) -> list[Difference]:
    """Inside an allocation (a Slurm job): fewer nodes than the recorded run had is a blocking difference."""
    env = os.environ if env is None else env
    nodes = recorded_nodes(recorded.metadata)
    here = recorded_runtime(recorded.metadata).kind.allocation(env) if nodes else None
    if here is None or here[0] >= nodes:
        return []
    return [Difference("nodes", str(nodes), f"{here[0]} ({here[1]})", True)]


def plan(path: str | Path, runs_dir: Path | None = None, trusted: bool = False,
         root: Path | None = None) -> ReplayPlan:
    """The replay of a recorded run. What the directory names that could run code is replayed when
    the run is trusted: `trusted` (--trust-run), or, for the variables its records hold, sealed with
    the user's own run key (runtime.runs.trust); otherwise it is left out (plan.items, plan.dropped
    say what). `root`: this checkout (default: the one this package is
    in); a run recorded in a working directory outside it replays here."""
    try:
        recorded = history.load(path, runs_dir)
    except rundir.RunDirError as exc:
        raise ReplayError(str(exc)) from None
    metadata = recorded.metadata
    root = Path(root) if root is not None else CHECKOUT
    by_key, why = trust.trusted_by_key(recorded.seals)

    def keep(item: trust.Item) -> bool:
        if trust.controls(item.variable):
            return False    # the replay's own control variables: never from a run
        # The key vouches for what the records hold (the variables), not for files and folders they
        # point to, which may have changed since: those need --trust-run as before.
        return trusted or (by_key and bool(item.variable))

    cwd, items, notes = _working_directory(metadata, root, keep)
    argv, more_notes, more_items = _replay_argv(metadata, recorded.path, keep, cwd=_recorded_cwd(metadata))
    env = {name: str(rec["value"]) for name, rec in recorded.env.items()
           if isinstance(rec, dict) and rec.get("value") not in (None, MASK) and name not in MACHINE_IDENTITY}
    env_items = trust.variables(env, os.environ, where=names.ENV_RECORD)
    for item in env_items:
        if not keep(item):
            notes.append(item.note())
            env.pop(item.variable)
    config_items, config_notes = _config_env(recorded, argv, keep)
    items = items + more_items + env_items + config_items
    for item in items:
        item.kept = keep(item)
    return ReplayPlan(recorded, argv, env, cwd, notes + more_notes + config_notes, items, trusted or by_key,
                      trusted, "--trust-run" if trusted else why)


def _config_env(recorded: history.Recorded, argv: list[str], keep) -> tuple[list[trust.Item], list[str]]:
    """(items, notes) for the variables that can run code in the env: block of each config copy the
    replay passes on. The copy is passed as written (its checksum is sealed); the replaying task leaves
    them out itself when the run is not trusted (run.create: trust.untrusted_layers)."""
    copies = recorded.path / "configs"
    items, notes = [], []
    for name, content in sorted(recorded.configs.items()):
        copy = str(copies / name)
        if not any(token == copy or token.endswith("=" + copy) for token in argv):
            continue
        block = content.get("env") if isinstance(content, dict) else None
        if not isinstance(content, dict):
            notes.append(f"configs/{name} could not be read as a mapping to list its env: block; the "
                         "replaying task leaves out what in it can run code all the same")
            continue
        if not isinstance(block, dict):
            continue
        values = {str(k): str(v) for k, v in block.items() if v is not None}
        for item in trust.variables(values, os.environ, where=f"configs/{name} (env:)"):
            items.append(item)
            if not keep(item):
                notes.append(item.note())
    return items, notes


def _recorded_cwd(metadata: dict) -> Path | None:
    for key in ("cwd", "project_root"):
        value = metadata.get(key)
        if isinstance(value, str) and value and Path(value).is_dir():
            return Path(value)
    return None


def _working_directory(metadata: dict, root: Path, keep) -> tuple[Path, list[trust.Item], list[str]]:
    """Where the replay runs: the recorded working directory when it is inside this checkout or is where
    inv runs now (Invoke already took its tasks.py from here), or when the run is trusted (`keep`); else
    here (python -m imports from the working directory, and Invoke looks for tasks.py there)."""
    here = Path.cwd()
    recorded = _recorded_cwd(metadata)
    if recorded is None:
        return here, [], []
    if trust.inside(recorded, root) or os.path.realpath(recorded) == os.path.realpath(here):
        return recorded, [], []
    item = trust.Item(f"working directory {recorded}", "outside this checkout: Python imports and Invoke's "
                      "tasks.py come from there", "runs there")
    if keep(item):
        return recorded, [item], []
    return here, [item], [f"runs in {here}, not in {recorded} ({item.why}; --trust-run {item.allows})"]


def command(plan: ReplayPlan) -> list[str]:
    return [sys.executable, "-m", "runtime.program.main", *plan.argv]


def run(plan: ReplayPlan) -> tuple[int, Path | None]:
    """Run the replay; (exit code, the new run directory if one was made)."""
    started = time.time()
    env = {**os.environ, **plan.env, REPLAY_ENV: str(plan.recorded.path)}
    env.pop(trust.TRUST_ENV, None)
    if plan.trusted:
        env[trust.TRUST_ENV] = trust.EXPLICIT if plan.explicit else trust.BY_KEY
    code = subprocess.call(command(plan), cwd=plan.cwd, env=env)
    return code, find_replay(plan.recorded.path, started)


def find_replay(original: Path, since: float) -> Path | None:
    """The newest run made after `since` that says it replays `original`."""
    root = Path(original).parent
    newest = None
    for path, md in rundir.iter_runs(root):
        if md.get("replay_of") == str(original) and (md.get("start_ts") or 0) >= since - 1:
            newest = path
    return newest

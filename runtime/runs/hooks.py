"""Hook engine: hooks/<collection>/<task>/{pre,post}/NN_name.{py,sh}, name order.

A Python hook defines ``def hook(ctx):`` (ctx: HookContext) and fails by
raising. A shell hook gets the environment (plus names.TASK, names.PHASE,
names.RUN_DIR, names.OUTCOME for post hooks) and fails by exiting non-zero;
stdout lines ``KEY=VALUE`` extend the environment.

Every hook runs in a process of its own, in a session of its own, for at most
the hooks' timeout (the anvil.hook_timeout setting): one that takes longer is
killed with everything it started (its session, and what left the session with
setsid: names.HOOK_SESSION marks those), and the task stops naming it (exit 124). A
Python hook runs in a child interpreter (`python -m runtime.runs.hooks FOLDER`,
`_child` below) that gets its HookContext as JSON and hands back what it added
to ctx.env and what it logged, so nothing a hook does to its process (os._exit,
a signal handler, a module it replaces) reaches inv: a hook that ends its
process without returning from hook(ctx) has failed.

Hooks are only ever taken from the hooks root (project hooks/ or
settings.hooks_dir): the task name is validated word by word and every path
is resolved and must stay inside the root, so neither ``..`` nor a symlink can
pull in a file from elsewhere. A `--patch FILE` is the one exception, and it
is named explicitly by the user on the command line.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from core import names
from core.errors import AnvilError
from core.secrets import Masker

PHASES = ("pre", "post")
HOOK_FILE = re.compile(r"^\d+_[A-Za-z0-9_.-]+\.(py|sh)$")
_TASK_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
EXIT_TIMEOUT = 124         # a hook past its timeout, as a launch or command past its own (docs/architecture.md)
DEFAULT_TIMEOUT_S = 600.0


class HookError(AnvilError):
    """A hook failed (or could not be loaded); message names the file and its output."""

    def __init__(self, path: Path, detail: str, output: str = "", exit_code: int | None = None):
        self.path, self.detail, self.output = Path(path), detail, output
        text = f"hook {path} failed: {detail}"
        if output.strip():
            text += "\n--- hook output ---\n" + output.rstrip()
        super().__init__(text, exit_code)


@dataclass
class HookContext:
    task: str
    phase: str
    config: Any = None                      # the task's (first) config dict
    env: dict = field(default_factory=dict)  # mutable: hooks may extend it
    run_dir: Path | None = None
    host: str = ""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    outcome: dict | None = None             # post only: {"status": ok|failed|preempted|interrupted|submitted,
    #                                                           "error": str|None}
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("anvil.hooks"))
    configs: dict = field(default_factory=dict)  # every config of the run by file name


@dataclass
class HookRecord:
    path: Path
    phase: str
    ok: bool
    output: str
    env_added: dict


def hook_dir(root: Path, task: str, phase: str) -> Path:
    """root/<collection>/<task>/<phase>, refusing anything that leaves root."""
    if phase not in PHASES:
        raise ValueError(f"unknown hook phase {phase!r}")
    parts = task.split(".")
    if not all(_TASK_PART.match(p) for p in parts):
        raise HookError(Path(root), f"task name {task!r} cannot name a hook folder")
    root = Path(root).resolve()
    folder = root.joinpath(*parts, phase)
    resolved = folder.resolve()
    if not resolved.is_relative_to(root):
        raise HookError(folder, f"hook folder leaves the hooks root {root}")
    return resolved


def discover(root: Path, task: str, phase: str) -> list[Path]:
    """Hook files for task/phase in name order ([] when there are none)."""
    folder = hook_dir(root, task, phase)
    if not folder.is_dir():
        return []
    root = Path(root).resolve()
    found = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if not HOOK_FILE.match(entry.name):
            continue
        resolved = entry.resolve()
        if not resolved.is_relative_to(root) or not resolved.is_file():
            raise HookError(entry, f"resolves to {resolved}, outside the hooks root {root}")
        found.append(resolved)
    return found


def _run_child(path: Path, argv: list[str], *, env: dict, cwd: Path | None, timeout: float,
               merge: bool) -> tuple[int, str, str]:
    """Run a hook's process in a session of its own; (exit status, stdout, stderr). Past `timeout`
    seconds (0: none), or on Ctrl-C, it is killed with every process it started (_kill_hook); a
    timeout is a HookError."""
    mark = f"{os.getpid()}-{os.urandom(8).hex()}"
    # Added to a mark already there: the hooks of an inv a hook runs carry the outer hook's too.
    env = {**env, names.HOOK_SESSION: ",".join(filter(None, (env.get(names.HOOK_SESSION), mark)))}
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                                errors="replace", start_new_session=True)
    except OSError as exc:
        raise HookError(path, str(exc)) from None
    try:
        out, err = proc.communicate(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        _kill_hook(proc, mark)
        out, err = _rest(proc)
        output = (out or "") + (err or "")
        raise HookError(path, f"did not finish within {timeout:g} s (anvil.hook_timeout); it was killed", output,
                        EXIT_TIMEOUT) from None
    except BaseException:   # Ctrl-C while a hook runs: it does not outlive the task
        _kill_hook(proc, mark)
        _rest(proc)
        raise
    return proc.returncode, out or "", err or ""


def _kill_hook(proc: subprocess.Popen, mark: str) -> None:
    """SIGKILL the hook's session (its process group, and groups of their own made in it) and every
    process whose environment carries its names.HOOK_SESSION mark: one that left the session (setsid,
    a daemon) still has it. Rounds until none is left, so that what forked meanwhile goes too. Without
    /proc (macOS), the process group alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if not os.path.isdir("/proc"):
        return
    for _ in range(20):
        found = [pid for pid in _live_pids() if pid != os.getpid() and _of_hook(pid, proc.pid, mark)]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)   # (a killed process is a zombie a moment later)


def _live_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _of_hook(pid: int, session: int, mark: str) -> bool:
    """Whether live (not zombie) process `pid` is in the hook's session or carries its mark."""
    prefix = f"{names.HOOK_SESSION}=".encode()
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return False
        if int(fields[4]) == session:
            return True
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except (OSError, IndexError, ValueError):
        return False   # gone, or another user's (which no hook of ours can have started)
    return any(entry.startswith(prefix) and mark.encode() in entry[len(prefix):].split(b",") for entry in entries)


def _rest(proc: subprocess.Popen) -> tuple[str, str]:
    """What a killed hook had written (a process it started outside its group may hold the pipe)."""
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "", ""


def _run_python(path: Path, ctx: HookContext, timeout: float) -> tuple[str, dict]:
    with tempfile.TemporaryDirectory(prefix="anvil-hook-") as folder:
        request = {"path": str(path), "sys_path": [p for p in sys.path if p], "task": ctx.task, "phase": ctx.phase,
                   "config": ctx.config, "configs": ctx.configs, "env": {k: str(v) for k, v in ctx.env.items()},
                   "run_dir": str(ctx.run_dir) if ctx.run_dir is not None else None, "host": ctx.host,
                   "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
                   "outcome": ctx.outcome}
        (Path(folder) / names.HOOK_REQUEST).write_text(json.dumps(request, default=str), encoding="utf-8")
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []   # (not the working directory's modules)
        try:
            code, output, _ = _run_child(path, [sys.executable, *safe_path, "-m", "runtime.runs.hooks", folder],
                                         env=dict(os.environ), cwd=None, timeout=timeout, merge=True)
        finally:
            _relay_log(Path(folder) / names.HOOK_LOG, ctx)
        try:
            result = json.loads((Path(folder) / names.HOOK_RESULT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise HookError(path, f"ended its process (exit status {code}) without returning from hook(ctx)",
                            output) from None
    if result.get("error"):
        raise HookError(path, result["error"], output)
    added = {str(k): str(v) for k, v in (result.get("env_added") or {}).items()}
    ctx.env.update(added)
    return output, added


def _relay_log(records: Path, ctx: HookContext) -> None:
    """What the hook logged through ctx.log, into the run's logger, masked (its values may come from
    --env or another hook, which inv's own environment does not hold)."""
    try:
        lines = records.read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    masker = Masker.from_environ({k: str(v) for k, v in ctx.env.items()})
    for line in lines:
        try:
            level, message = json.loads(line)
        except (ValueError, TypeError):
            continue
        ctx.log.log(int(level), "%s", masker.text(str(message)))


def _run_shell(path: Path, ctx: HookContext, cwd: Path | None, timeout: float) -> tuple[str, dict]:
    env = {**os.environ, **{k: str(v) for k, v in ctx.env.items()},
           names.TASK: ctx.task, names.PHASE: ctx.phase,
           names.RUN_DIR: str(ctx.run_dir or ""), names.RANK: str(ctx.rank)}
    if ctx.outcome is not None:
        env[names.OUTCOME] = ctx.outcome.get("status", "")
        env[names.OUTCOME_ERROR] = str(ctx.outcome.get("error") or "")
    code, stdout, stderr = _run_child(path, ["bash", str(path)], env=env, cwd=cwd, timeout=timeout, merge=False)
    output = stdout + stderr
    if code != 0:
        raise HookError(path, f"exit status {code}", output)
    added = {}
    for line in stdout.splitlines():
        match = _ENV_LINE.match(line.strip())
        if match:
            added[match.group(1)] = match.group(2)
    ctx.env.update(added)
    return output, added


def run_file(path: Path, ctx: HookContext, cwd: Path | None = None,
             timeout: float = DEFAULT_TIMEOUT_S) -> HookRecord:
    """Run one hook file (Python or shell), for at most `timeout` seconds (0: no limit); raises
    HookError on failure."""
    path = Path(path)
    if path.suffix == ".py":
        output, added = _run_python(path, ctx, timeout)
    elif path.suffix == ".sh":
        output, added = _run_shell(path, ctx, cwd, timeout)
    else:
        raise HookError(path, "hooks and patches must be .py or .sh files")
    ctx.log.info("hook %s ok%s", path.name, f" (env: {', '.join(sorted(added))})" if added else "")
    return HookRecord(path, ctx.phase, True, output, added)


def run_phase(root: Path, ctx: HookContext, cwd: Path | None = None,
              keep_going: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> list[HookRecord]:
    """Run every hook of ctx.task/ctx.phase in order.

    Pre hooks stop at the first failure (HookError). Post hooks use
    keep_going=True: all run, failures are recorded, then the first is raised.
    """
    records, first_error = [], None
    for path in discover(root, ctx.task, ctx.phase):
        try:
            records.append(run_file(path, ctx, cwd, timeout))
        except HookError as exc:
            records.append(HookRecord(path, ctx.phase, False, exc.output + exc.detail, {}))
            if not keep_going:
                exc.records = records
                raise
            first_error = first_error or exc
    if first_error is not None:
        first_error.records = records
        raise first_error
    return records


# ---------------------------------------------------------------- the child that runs a Python hook

class _JsonLines(logging.Handler):
    """ctx.log in the child: each record a line [level, message], written as it comes (a hook that
    is killed keeps what it logged)."""

    def __init__(self, path: Path):
        super().__init__()
        self.handle_ = open(path, "a", encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.handle_.write(json.dumps([record.levelno, record.getMessage()]) + "\n")
            self.handle_.flush()
        except Exception:  # noqa: BLE001 - a log line that cannot be written is not the hook's failure
            pass


def _child(folder: Path) -> int:
    """python -m runtime.runs.hooks FOLDER: run FOLDER/request.json's hook, write FOLDER/result.json
    ({"env_added": {...}} or {"error": "..."}); its output is this process's stdout and stderr."""
    import importlib.util

    request = json.loads((folder / names.HOOK_REQUEST).read_text(encoding="utf-8"))
    sys.path[:0] = [p for p in request.pop("sys_path") if p not in sys.path]
    path = Path(request.pop("path"))
    log = logging.getLogger("anvil.hooks")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.addHandler(_JsonLines(folder / names.HOOK_LOG))
    run_dir = request.pop("run_dir")
    ctx = HookContext(**request, run_dir=Path(run_dir) if run_dir else None, log=log)
    before = dict(ctx.env)
    result: dict[str, Any]
    try:
        spec = importlib.util.spec_from_file_location("anvil_hook_" + re.sub(r"\W", "_", str(path)), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        function = getattr(module, "hook", None)
        if not callable(function):
            result = {"error": "defines no `def hook(ctx):`"}
        else:
            function(ctx)
            result = {"env_added": {k: str(v) for k, v in ctx.env.items() if before.get(k) != v}}
    except BaseException as exc:  # noqa: BLE001 - a hook may raise anything, even SystemExit
        result = {"error": f"{type(exc).__name__}: {exc}"}
    from core.files import write_json_atomic
    write_json_atomic(folder / names.HOOK_RESULT, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # the hook's threads, if any, end with its process


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1])))

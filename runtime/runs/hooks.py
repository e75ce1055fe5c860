"""Hook engine: hooks/<collection>/<task>/{pre,post}/NN_name.{py,sh}, name order.

A Python hook defines ``def hook(ctx):`` (ctx: HookContext) and fails by
raising. A shell hook gets the environment (plus ANVIL_TASK, ANVIL_PHASE,
ANVIL_RUN_DIR, ANVIL_OUTCOME for post hooks) and fails by exiting non-zero;
stdout lines ``KEY=VALUE`` extend the environment.

Hooks are only ever taken from the hooks root (project hooks/ or
settings.hooks_dir): the task name is validated word by word and every path
is resolved and must stay inside the root, so neither ``..`` nor a symlink can
pull in a file from elsewhere. A `--patch FILE` is the one exception, and it
is named explicitly by the user on the command line.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from trainer.errors import AnvilError

PHASES = ("pre", "post")
HOOK_FILE = re.compile(r"^\d+_[A-Za-z0-9_.-]+\.(py|sh)$")
_TASK_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


class HookError(AnvilError):
    """A hook failed (or could not be loaded); message names the file and its output."""

    def __init__(self, path: Path, detail: str, output: str = ""):
        self.path, self.detail, self.output = Path(path), detail, output
        text = f"hook {path} failed: {detail}"
        if output.strip():
            text += "\n--- hook output ---\n" + output.rstrip()
        super().__init__(text)


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


def _run_python(path: Path, ctx: HookContext) -> tuple[str, dict]:
    name = "anvil_hook_" + re.sub(r"\W", "_", str(path))
    spec = importlib.util.spec_from_file_location(name, path)
    buffer = io.StringIO()
    before = dict(ctx.env)
    try:
        module = importlib.util.module_from_spec(spec)
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            spec.loader.exec_module(module)
            function = getattr(module, "hook", None)
            if not callable(function):
                raise HookError(path, "defines no `def hook(ctx):`")
            function(ctx)
    except HookError as exc:
        raise HookError(path, exc.detail, buffer.getvalue()) from None
    except KeyboardInterrupt:     # Ctrl-C or a stop signal (trainer.signals.Interrupt): the run's, not the hook's
        raise
    except BaseException as exc:  # noqa: BLE001 - a hook may raise anything, even SystemExit
        raise HookError(path, f"{type(exc).__name__}: {exc}", buffer.getvalue()) from None
    added = {k: v for k, v in ctx.env.items() if before.get(k) != v}
    return buffer.getvalue(), added


def _run_shell(path: Path, ctx: HookContext, cwd: Path | None) -> tuple[str, dict]:
    env = {**os.environ, **{k: str(v) for k, v in ctx.env.items()},
           "ANVIL_TASK": ctx.task, "ANVIL_PHASE": ctx.phase,
           "ANVIL_RUN_DIR": str(ctx.run_dir or ""), "ANVIL_RANK": str(ctx.rank)}
    if ctx.outcome is not None:
        env["ANVIL_OUTCOME"] = ctx.outcome.get("status", "")
        env["ANVIL_OUTCOME_ERROR"] = str(ctx.outcome.get("error") or "")
    try:
        proc = subprocess.run(["bash", str(path)], cwd=cwd, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise HookError(path, str(exc)) from None
    output = proc.stdout + (proc.stderr if proc.stderr else "")
    if proc.returncode != 0:
        raise HookError(path, f"exit status {proc.returncode}", output)
    added = {}
    for line in proc.stdout.splitlines():
        match = _ENV_LINE.match(line.strip())
        if match:
            added[match.group(1)] = match.group(2)
    ctx.env.update(added)
    return output, added


def run_file(path: Path, ctx: HookContext, cwd: Path | None = None) -> HookRecord:
    """Run one hook file (Python or shell); raises HookError on failure."""
    path = Path(path)
    if path.suffix == ".py":
        output, added = _run_python(path, ctx)
    elif path.suffix == ".sh":
        output, added = _run_shell(path, ctx, cwd)
    else:
        raise HookError(path, "hooks and patches must be .py or .sh files")
    ctx.log.info("hook %s ok%s", path.name, f" (env: {', '.join(sorted(added))})" if added else "")
    return HookRecord(path, ctx.phase, True, output, added)


def run_phase(root: Path, ctx: HookContext, cwd: Path | None = None,
              keep_going: bool = False) -> list[HookRecord]:
    """Run every hook of ctx.task/ctx.phase in order.

    Pre hooks stop at the first failure (HookError). Post hooks use
    keep_going=True: all run, failures are recorded, then the first is raised.
    """
    records, first_error = [], None
    for path in discover(root, ctx.task, ctx.phase):
        try:
            records.append(run_file(path, ctx, cwd))
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

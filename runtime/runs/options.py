"""What a task hands to a run: the RunSpec, the options every run-creating task takes, the decorator.

    from runtime.runs.options import run_task      # also importable from runtime.runs.run

    @run_task(help={"config": "training config"})
    def pretrain(c, config="", run_options=None):   # run_options: a RunOptions
        ...

Task-facing only (what Invoke parses); the run itself (directory, snapshot,
hooks, outcome) is runtime/runs/run.py.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from invoke import task as invoke_task

from runtime.cluster.runtime import Runtime
from core.errors import UserError


@dataclass
class RunSpec:
    task: str                                   # dotted task name, e.g. "train.pretrain"
    name: str | None = None                     # run directory suffix
    configs: dict[str, Any] = field(default_factory=dict)  # file name -> dict (as used) or a Path to copy
    env: Any = None                             # envs.ResolvedEnv, a {name: value} dict, or None
    hooks: bool = True
    patch: str | Path | None = None             # one-off hook file run before the pre hooks
    config_sources: dict[str, str] = field(default_factory=dict)  # file name -> path given on the CLI
    config_options: dict[str, str] = field(default_factory=dict)  # file name -> the task option taking it
    #   ("--config"): lets a replay pass the recorded copy even when the run used the default file
    argv: list[str] | None = None               # default: sys.argv
    world_size: int = 1
    extra: dict = field(default_factory=dict)   # more metadata.json entries


@dataclass
class RunOptions:
    """The options `run_task` adds to a task, handed to it as ``run_options``."""
    name: str | None = None
    env: list[str] = field(default_factory=list)
    no_hooks: bool = False
    patch: str | None = None
    runtime: str = ""          # per-node tasks: read by the inv program (fan-out), not by the task
    nodes: int = 0

    def spec(self, task: str, **fields):
        """The RunSpec of a run of `task` with these options (fields: RunSpec's others). A missing
        --patch file is refused here, before a run directory exists."""
        fields.setdefault("name", self.name or None)
        if self.patch:
            patch_file(self.patch)
        return RunSpec(task=task, hooks=not self.no_hooks, patch=self.patch or None, **fields)


def patch_file(given: str | Path) -> Path:
    """The --patch file; UserError when there is none or it is not a hook file (.py, .sh)."""
    path = Path(given).expanduser()
    if not path.is_file():
        raise UserError(f"--patch {given}: no such file")
    if path.suffix not in (".py", ".sh"):
        raise UserError(f"--patch {given}: expected a .py file with def hook(ctx) or a .sh script")
    return path


def _given(option: str, value: str | None, expected: str) -> str | None:
    """An option's value, None when not given; given empty is a UserError (not the same as leaving it out)."""
    if value is not None and not str(value).strip():
        raise UserError(f"--{option} is empty; expected {expected}")
    return value or None


RUN_OPTION_HELP = {
    "name": "Suffix for the run directory name (runs/<time>_<task>_<name>)",
    "env": "Extra environment variable KEY=VALUE, the top layer (repeatable)",
    "no-hooks": "Skip the hooks in hooks/<collection>/<task>/{pre,post}/",
    "patch": "One-off hook file (.py with def hook(ctx), or .sh) run before the pre hooks",
}
_RUN_OPTION_NAMES = ("name", "env", "no_hooks", "patch")
PER_NODE_HELP = {
    "runtime": "direct (this node) | slurm: every node of the Slurm allocation, one task per node | ssh: every "
               "host of anvil.hosts; the results merged (default: the anvil.runtime setting, without its container)",
    "nodes": "Slurm: how many nodes (default: the whole allocation; 1 outside one)",
}


def per_node_runtime(given: str, setting: Runtime) -> tuple[Runtime, str]:
    """The runtime a per-node task runs under, and a notice when the setting's container is dropped.

    A per-node task checks or measures the node itself (its GPUs, driver, network), so it takes no
    container: --runtime container or slurm+container is a UserError. The same runtime from the
    anvil.runtime setting (which is there for training) keeps its transport, drops the container and
    says so."""
    if given:
        runtime = Runtime.parse(given)
        if runtime.container:
            raise UserError(f"--runtime {given} is not supported here: a per-node task runs on the node itself; "
                            "use --runtime direct (this node), slurm (every node of the allocation) or ssh "
                            "(every host of anvil.hosts)")
        return runtime, ""
    if not setting.container:
        return setting, ""
    runtime = setting.bare()
    return runtime, (f"runs on the node itself, not in a container (anvil.runtime is {setting}); "
                     f"--runtime {runtime} says so and hides this note")


def run_task(*args, per_node: bool = False, takes_hosts: bool = False, **task_kwargs):
    """@task for run-creating tasks: adds --name, --env (iterable), --no-hooks, --patch.

    The task function takes ``run_options`` (a RunOptions) instead of those
    four. Auto short flags are off unless asked for, so no option can take
    -h from --help (Invoke gives a task's first option letter as a short flag by default).

    per_node=True (preflight, single-node benchmarks) also adds --runtime and
    --nodes: under a runtime that spans nodes (slurm, ssh) the inv program runs
    the task once on every node and merges the results (runtime.jobs.fanout);
    the task itself always runs on one node.

    takes_hosts=True (preflight.comm, train.pretrain): the task reaches the nodes
    itself through its --hosts option, so `inv -H a,b TASK` runs it once, here,
    with those hosts (and the SSH flags given to inv) rather than once on every host.
    """
    def decorate(func: Callable) -> Any:
        signature = inspect.signature(func)
        if "run_options" not in signature.parameters:
            raise TypeError(f"{func.__name__}: a @run_task task takes a `run_options` parameter")
        clash = [n for n in _RUN_OPTION_NAMES + (("runtime", "nodes") if per_node else ())
                 if n in signature.parameters]
        if clash:
            raise TypeError(f"{func.__name__}: parameter(s) {clash} clash with the run options")
        params = [p for p in signature.parameters.values()
                  if p.name != "run_options" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        defaults = [("name", None), ("env", None), ("no_hooks", False), ("patch", None)]
        defaults += [("runtime", ""), ("nodes", 0)] if per_node else []
        added = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d) for n, d in defaults]

        @functools.wraps(func)
        def wrapper(c, *a, **kw):
            options = RunOptions(name=_given("name", kw.pop("name", None), "a word for runs/<time>_<task>_<name>"),
                                 env=list(kw.pop("env", None) or []), no_hooks=bool(kw.pop("no_hooks", False)),
                                 patch=_given("patch", kw.pop("patch", None), "a .py or .sh hook file"))
            if per_node:   # (a task of its own with a `runtime` option keeps it: train.pretrain)
                options.runtime, options.nodes = kw.pop("runtime", "") or "", int(kw.pop("nodes", 0) or 0)
            return func(c, *a, run_options=options, **kw)

        wrapper.__signature__ = signature.replace(parameters=params + added)
        kwargs = dict(task_kwargs)
        kwargs["iterable"] = list(kwargs.get("iterable") or []) + ["env"]
        kwargs["help"] = {**RUN_OPTION_HELP, **(PER_NODE_HELP if per_node else {}), **(kwargs.get("help") or {})}
        kwargs.setdefault("auto_shortflags", False)
        made = invoke_task(**kwargs)(wrapper)
        made.per_node = per_node
        made.takes_hosts = takes_hosts
        return made

    if len(args) == 1 and callable(args[0]) and not task_kwargs:
        return decorate(args[0])
    return decorate

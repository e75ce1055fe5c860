"""Other trainers under Anvil's runner (`inv train.launch --backend NAME`): one module each.

    backend = backends.get("megatron")          # UnknownBackend (a UserError, exit 2) for a name not here
    plan = backend.plan(argv, Options(...))     # before any run directory: the command, its files; BackendError
    # on every node, by the agent (runtime.launch.agent), for each attempt of the run:
    found = backend.latest(backend.checkpoint_dir(argv, run_dir))   # the run's own newest checkpoint, or None
    argv = backend.command(argv, run_dir, found)                    # the rank's command line, resuming from it
    parser = backend.parser(argv, world_size)                       # its log lines -> metrics records

A backend answers four questions, and nothing else differs between them (the run directory,
snapshot, environment, preflight gate, transports, rank logs, reports are the runner's):

- how to start it: `plan` checks what the user gave (the program after `--`, --config, the
  Megatron-LM checkout) and says the rank's command (Plan.argv: a .py script or `-m MODULE` runs
  with the node's Python, as torchrun runs it), the files to keep with the run and the folders a
  container must see; `command` adds what depends on the run directory and the checkpoint to
  resume from (Megatron's --save and --load, torchtitan's dump folder);
- how it resumes: `checkpoint_dir` (where it saves in a run), `latest` (the newest complete
  checkpoint in a folder), `at` (a path that is a checkpoint itself);
- how it takes a preemption signal: `stop_signal`, the signal its ranks get for SIGTERM, SIGUSR2,
  Ctrl-C or SIGHUP (None: the one that came; the others reaching a rank straight from the
  scheduler or the terminal are ignored, so it is told once and the way it expects);
  `stops_with_zero` (it exits 0 after its checkpoint on that signal, as Megatron-LM does: a
  requeue all the same); `on_signal`, what a preemption gets, in words;
- how to read its logs: `parser` turns each line of the metrics rank (`metrics_rank`) into a
  record for metrics.jsonl, None (no metric line), or UNREADABLE (a metric line it could not
  read: kept in the rank's log and counted, never fatal).

A new backend is one module in this folder whose BACKEND is a Backend (docs/extending.md): BACKENDS finds
it by itself, here and in every node's agent.
"""
from __future__ import annotations

import importlib
import pkgutil

from runtime.backends.base import (UNREADABLE, Backend, BackendError, Checkpoint, Options, Plan,  # noqa: F401
                                   UnknownBackend, regex_parser)


def _modules() -> dict[str, Backend]:
    """{name: backend} of every module of this package (but base) with a BACKEND, in name order."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            backend = getattr(importlib.import_module(f"{__name__}.{module.name}"), "BACKEND", None)
            if isinstance(backend, Backend):
                found[backend.name] = backend
    return found


BACKENDS: dict[str, Backend] = _modules()


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackend(f"--backend {name!r}: expected {' | '.join(BACKENDS)}") from None

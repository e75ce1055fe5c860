"""Stop signals in the `inv` program: every task ends on them as on a Ctrl-C.

SIGINT, SIGTERM, SIGHUP and SIGUSR2 raise core.signals.Interrupt, a KeyboardInterrupt, from the
program's first moment (the .pth shim's line for `inv`, runtime/program/shim.py; `main` for the
others). Each task then cleans up as after a Ctrl-C: a run directory is recorded "interrupted"
(runtime/runs/run.py), data.prepare stops its workers and keeps its finished parts, removes its
temporary folder and its lock. The exit status is the signal's (the README's "Signals" table): 3
or 130 for a task that trains, as the trainer's own; 128+N for any other task (130 for Ctrl-C).

One that reaches Invoke itself (while the program starts or parses, or from a task with no run of
its own) is one line here instead of Invoke's silent exit 1.
"""
from __future__ import annotations

import sys

from core import names, signals

#: Tasks whose stop signals end them as the trainer's do (3: requeue me; 130): they train.
TRAINING_TASKS = names.TRAINING_TASKS


def install(words: list[str]) -> bool:
    """Stop signals raise Interrupt from now on, as in a task that trains when `words` (the command
    line) names one; returns whether it does."""
    training = any(word in TRAINING_TASKS for word in words)
    signals.interrupting(training=training)
    return training


def said(program, stop: KeyboardInterrupt, words: list[str], training: bool) -> int:
    """Say on stderr what `stop` interrupted, and return the exit status (program: the parsed
    program, None while it is imported)."""
    name, code = signals.interrupted_by(stop)
    tasks = [context.name for context in (getattr(program, "tasks", None) or [])]
    task = " ".join(tasks) or next((w for w in words if w in TRAINING_TASKS), "") or "inv"
    where = " before the first step: no run directory was made" if training else ""
    try:
        print(f"{task} interrupted ({name}){where}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    return code

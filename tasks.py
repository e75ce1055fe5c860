"""Anvil's root task collection: what `inv --list` shows.

Invoke loads this file as the module ``tasks``. The collections live in the
tasks/ folder beside it (one module each, found by runtime.program.discover:
a new file there is a new collection); giving this module a ``__path__`` makes
that folder its package, so ``tasks.env`` and friends import as submodules
whether Invoke loaded us or plain ``import tasks`` did. Site tasks: folders in
names.TASKS_PATH.
"""
import os as _os

__path__ = [_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "tasks")]

from runtime.program.discover import collect  # noqa: E402

ns = collect("tasks", __path__)

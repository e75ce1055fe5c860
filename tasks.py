"""Anvil's root task collection: what `inv --list` shows.

Invoke loads this file as the module ``tasks``. The collections live in the
tasks/ folder beside it; giving this module a ``__path__`` makes that folder
its package, so ``tasks.env`` and friends import as submodules whether Invoke
loaded us or plain ``import tasks`` did.
"""
import os as _os

__path__ = [_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "tasks")]

from invoke import Collection  # noqa: E402

from tasks import bench, data, env, preflight, profile, snapshot, train  # noqa: E402

ns = Collection()
for _module in (env, preflight, data, train, bench, profile, snapshot):
    ns.add_collection(_module.ns)

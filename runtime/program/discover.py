"""Find task collections: every module in tasks/ with an `ns` Collection, plus a site's own folders.

A new collection is a new file in tasks/; nothing else is edited. A site keeps
its private tasks outside the checkout in folders named by names.TASKS_PATH
(colon-separated, like PATH); each .py file there with an `ns` Collection is
added under its own name. A module that fails to import is reported by name on
stderr and left out, so one broken file never takes `inv --list` down.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

from invoke import Collection

from core import names

TASKS_PATH_VAR = names.TASKS_PATH


def _report(where: str, exc: BaseException) -> None:
    print(f"anvil: {where} cannot be loaded ({type(exc).__name__}: {exc}); its tasks are left out",
          file=sys.stderr)


def _add(ns: Collection, module, where: str) -> None:
    found = getattr(module, "ns", None)
    if isinstance(found, Collection):
        try:
            ns.add_collection(found)
        except ValueError as exc:   # two collections with one name
            _report(where, exc)


def collect(package: str, package_path: list[str], environ=os.environ) -> Collection:
    ns = Collection()
    for info in sorted(pkgutil.iter_modules(package_path), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:  # noqa: BLE001 - any error in a task file: report, keep the rest
            _report(f"{package}/{info.name}.py", exc)
            continue
        _add(ns, module, f"{package}/{info.name}.py")
    for folder in [f for f in environ.get(TASKS_PATH_VAR, "").split(os.pathsep) if f]:
        for path in sorted(Path(folder).expanduser().glob("*.py")):
            if path.name.startswith("_"):
                continue
            name = f"anvil_site_tasks_{path.stem}"
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001
                sys.modules.pop(name, None)
                _report(str(path), exc)
                continue
            _add(ns, module, str(path))
    return ns

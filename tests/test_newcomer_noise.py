"""What a newcomer sees that is not theirs to fix: warnings every run prints.

Anvil starts its own programs as `python -m PACKAGE.MODULE` (a Slurm step, the SSH far end, the
agent, the batch script's helpers, a node's share of data.prepare, hooks). When importing the
package already imports the module, runpy warns before running it ("'x' found in sys.modules
after import of package ..."): under Slurm once per node of every launch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "trainer", "benchmarks", "envs", "core", "kernels")


def _main_modules() -> list[str]:
    """Every module of the layers that runs as `python -m` (it has `if __name__ == "__main__"`), and the
    packages with a __main__.py, by dotted name."""
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "__main__.py":
                found.append(".".join(path.parent.relative_to(REPO).parts) + ".__main__")
                continue
            tree = ast.parse(path.read_text())
            if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
                found.append(".".join(path.with_suffix("").relative_to(REPO).parts))
    return found


def test_the_modules_anvil_launches_are_found():
    modules = _main_modules()
    for launched in ("runtime.cluster.slurm.step", "runtime.cluster.slurm.nodetask", "runtime.cluster.ssh.remote",
                     "runtime.launch.agent", "runtime.runs.jobend", "trainer.__main__", "trainer.data.node"):
        assert launched in modules


@pytest.mark.parametrize("module", _main_modules())
def test_python_m_runs_a_module_its_package_did_not_import_first(module):
    """`python -m X` imports X's package, then runs X: a package that imported X already makes runpy warn
    ('found in sys.modules ... prior to execution'), and the module runs twice over."""
    package = module.rpartition(".")[0]
    probe = (f"import importlib, sys\nimportlib.import_module({package!r})\n"
             f"print({module!r} in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", f"importing {package} imports {module} before `python -m {module}` runs it"

"""The house rules, checked: imports point one way (tasks -> runtime -> envs/benchmarks -> trainer
-> kernels -> core, the ground floor that imports nothing of Anvil's; and inside runtime: program -> jobs/preflight -> runs -> settings -> cluster -> launch -> backends),
no two modules import each other (directly or around a loop), tasks.py finds collections by itself."""
from __future__ import annotations

import ast
from pathlib import Path

from helpers.program import REPO as ROOT   # the checkout
LAYERS = {"tasks": 5, "runtime": 4, "envs": 3, "benchmarks": 3, "trainer": 2, "kernels": 1, "core": 0}
# Inside runtime/: the inv program on top; what tasks call; the run record; the settings; where work
# runs (every transport); what is the same under every transport; the other trainers it can start.
RUNTIME_FLOORS = {"program": 7, "jobs": 6, "preflight": 6, "report": 6, "runs": 5, "settings": 4, "cluster": 3,
                  "launch": 2, "backends": 1}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every project module this file imports, at any depth (function-level imports count)."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in LAYERS}


def _project_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


def _existing_module(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_imports_point_down_only():
    wrong = []
    for path in _project_files():
        own = path.relative_to(ROOT).parts[0]
        for name in _imports(path):
            other = name.split(".")[0]
            if other != own and LAYERS[other] >= LAYERS[own]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name} ({own} -> {other})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def _room(module: str) -> str | None:
    """runtime.cluster.ssh.session -> cluster; runtime.settings -> settings; None outside runtime/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "runtime" and len(parts) > 1 and parts[1] in RUNTIME_FLOORS else None


def test_inside_runtime_imports_point_down_only():
    """The program on top, the transports in runtime/cluster/ under the run record and the settings,
    launch/ at the bottom: a room imports only rooms on lower floors (jobs, preflight and report, side by
    side, not each other). Every runtime module is in a room."""
    wrong = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        own = _room(_module_name(path))
        if own is None:
            assert path == ROOT / "runtime" / "__init__.py", f"{path.relative_to(ROOT)} is in no room of runtime/"
            continue
        for name in _imports(path):
            other = _room(name)
            if other is not None and other != own and RUNTIME_FLOORS[other] >= RUNTIME_FLOORS[own]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name} ({own} -> {other})")
    assert not wrong, "imports against runtime's floors:\n" + "\n".join(sorted(wrong))


def test_the_transports_are_in_one_room():
    """Fabric, srun, sbatch and scontrol are runtime/cluster/'s alone: no other room reaches a scheduler
    or SSH itself; they ask the Runtime value and its transport."""
    wrong = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        if _room(_module_name(path)) == "cluster":
            continue
        text = path.read_text()
        for word in ("import fabric", "from fabric", '"srun"', '"sbatch"', '"scontrol"', '"scancel"', "import paramiko",
                     'startswith("slurm', '"container" in'):
            if word in text:
                wrong.append(f"{path.relative_to(ROOT)}: {word}")
    assert not wrong, "transport matters outside runtime/cluster/:\n" + "\n".join(wrong)


def test_task_modules_are_thin_and_stand_alone():
    """A task module imports no other task module (shared logic lives in runtime/) and raises no
    invoke Exit (errors are AnvilErrors; runtime.program.cli is the one place that makes exit codes)."""
    wrong = []
    for path in sorted((ROOT / "tasks").glob("*.py")):
        for name in _imports(path):
            if name.startswith("tasks.") or name == "tasks":
                wrong.append(f"{path.name} imports {name}")
        if "raise Exit(" in path.read_text():
            wrong.append(f"{path.name} raises invoke's Exit")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    files = _project_files()
    modules = {_module_name(p) for p in files}
    graph = {}
    for path in files:
        me = _module_name(path)
        targets = {_existing_module(n, modules) for n in _imports(path)}
        # A package's __init__ re-exporting its own modules is not a cycle of meaning.
        graph[me] = {t for t in targets if t and t != me and not me.startswith(t + ".")
                     and not (path.name == "__init__.py" and t.startswith(me + "."))}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_test_catches_an_upward_import(tmp_path, monkeypatch):
    """The rules above can fail: a trainer module importing the runtime is reported, and so is a
    transport importing the run record."""
    for bad, text, rule, said in (
            (ROOT / "trainer" / "_layer_probe_tmp.py", "from runtime.runs import rundir\n",
             test_imports_point_down_only, "trainer/_layer_probe_tmp.py imports runtime.runs"),
            (ROOT / "core" / "_layer_probe_tmp.py", "from kernels import rms_norm\n",
             test_imports_point_down_only, "core/_layer_probe_tmp.py imports kernels"),
            (ROOT / "runtime" / "cluster" / "_layer_probe_tmp.py", "from runtime.runs import rundir\n",
             test_inside_runtime_imports_point_down_only,
             "runtime/cluster/_layer_probe_tmp.py imports runtime.runs (cluster -> runs)")):
        bad.write_text(text)
        try:
            try:
                rule()
            except AssertionError as exc:
                assert said in str(exc)
            else:
                raise AssertionError("an upward import went unnoticed")
        finally:
            bad.unlink()


def test_collections_are_found_and_a_broken_one_is_named(tmp_path, capsys):
    from invoke import Collection

    from runtime.program.discover import collect

    pkg = tmp_path / "sitepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    good = "from invoke import Collection, task\n@task\ndef hi(c):\n    pass\nns = Collection('{n}')\nns.add_task(hi)\n"
    (pkg / "alpha.py").write_text(good.format(n="alpha"))
    (pkg / "broken.py").write_text("import no_such_module_here\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "cluster.py").write_text(good.format(n="cluster"))
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        ns = collect("sitepkg", [str(pkg)], environ={"ANVIL_TASKS_PATH": str(site)})
    finally:
        sys.path.remove(str(tmp_path))
    assert isinstance(ns, Collection) and sorted(ns.collections) == ["alpha", "cluster"]
    err = capsys.readouterr().err
    assert "sitepkg/broken.py cannot be loaded (ModuleNotFoundError" in err

"""The house rules of the test suite, checked: every test file lives in the room of the feature it tests
(tests/<room>/), under a name no other test file has (pytest imports each by its name: the folders have
no __init__.py); what the tests share is defined once, in tests/helpers/ or tests/conftest.py, and no test
module defines it again, copies a function or a value of another, or imports another; the folders named
like the project's packages never stand in for them.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest

from helpers.program import REPO

TESTS = Path(__file__).resolve().parents[1]
# The project's rooms, and house: the rules of the code base (test_layers) and of the suite itself.
ROOMS = {"runner", "cluster", "envs", "data", "trainer", "kernels", "reports", "bench", "house"}
# Helper names a test module must never define, whatever tests/helpers/ calls its own today.
RESERVED = {"inv", "run_inv", "runs", "REPO", "INV", "explain", "clean_env"}


@functools.cache
def module_level(path: Path) -> tuple[dict[str, ast.AST], set[str]]:
    """({name: the statement defining it}, the names of the modules it imports) of a Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    defined: dict[str, ast.AST] = {}
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update((target.id, node) for target in targets if isinstance(target, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module)
    return defined, imported


def shared(tests: Path) -> list[Path]:
    """What the tests share: tests/conftest.py and the modules of tests/helpers/."""
    return [tests / "conftest.py", *sorted((tests / "helpers").rglob("*.py"))]


def room_modules(tests: Path) -> list[Path]:
    """Every Python file of the rooms: the test modules and the scripts they run."""
    return sorted(p for room in sorted(tests.iterdir()) if room.is_dir() and room.name != "helpers"
                  for p in room.rglob("*.py"))


def defined_again(tests: Path) -> list[str]:
    """A name the shared modules define (or a RESERVED one) that a test module defines too."""
    helper_names = set(RESERVED)
    for path in shared(tests):
        helper_names |= set(module_level(path)[0]) - {"__all__"}
    return [f"{path.relative_to(tests)}: {name} (defined in tests/helpers/ or tests/conftest.py)"
            for path in room_modules(tests) for name in sorted(set(module_level(path)[0]) & helper_names)]


def skips_without(value: ast.AST) -> bool:
    """`pytest.importorskip(...)`: a module the test module needs, not a value it defines."""
    return isinstance(value, ast.Call) and ast.unparse(value.func) == "pytest.importorskip"


def defined_twice(tests: Path) -> list[str]:
    """A function or class (fixtures too; tests aside) of the same name in two test modules, or a value
    (not a plain number or string, nor a module it skips without) given to the same name in two: a copy,
    or one name for two things."""
    where: dict[tuple, list[str]] = defaultdict(list)
    for path in room_modules(tests):
        for name, node in module_level(path)[0].items():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not name.startswith("test_"):
                    where[("function", name)].append(str(path.relative_to(tests)))
            elif name != "pytestmark" and not isinstance(node.value, ast.Constant) and not skips_without(node.value):
                where[("value", name, ast.dump(node.value))].append(str(path.relative_to(tests)))
    return [f"{key[1]} ({key[0]}): {', '.join(paths)}" for key, paths in sorted(where.items()) if len(paths) > 1]


def imports_of_test_modules(tests: Path) -> list[str]:
    """A test module that imports another: that works only where pytest put the other's folder on sys.path."""
    names = {path.stem for path in room_modules(tests)}
    return [f"{path.relative_to(tests)} imports {module}" for path in room_modules(tests)
            for module in sorted(module_level(path)[1] & names)]


# ---- the suite as it is --------------------------------------------------------------------------

def test_every_test_file_is_in_a_room_and_no_room_is_a_package():
    outside = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
               if p.parent.parent != TESTS or p.parent.name not in ROOMS]
    assert not outside, f"test files outside tests/<room>/ ({', '.join(sorted(ROOMS))}): {outside}"
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in ("helpers", "__pycache__")} <= ROOMS
    packages = [str(p.relative_to(TESTS)) for room in ROOMS for p in (TESTS / room).rglob("__init__.py")]
    assert not packages, f"pytest's default import mode wants these folders without __init__.py: {packages}"


def test_test_file_names_are_unique():
    by_name = defaultdict(list)
    for path in room_modules(TESTS):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    assert not [paths for paths in by_name.values() if len(paths) > 1]


def test_no_test_module_defines_a_shared_helper_again():
    found = defined_again(TESTS)
    assert not found, "\n".join(found)


def test_no_function_or_value_is_defined_in_two_test_modules():
    found = defined_twice(TESTS)
    assert not found, "\n".join(found)


def test_no_test_module_imports_another():
    found = imports_of_test_modules(TESTS)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", ["kernels", "envs", "trainer"])
def test_the_folders_named_like_the_projects_packages_never_stand_in_for_them(package):
    found = importlib.util.find_spec(package)       # where `import kernels` would go, without importing it
    assert found.origin == str(REPO / package / "__init__.py"), found


# ---- the checks find what they are for -----------------------------------------------------------

def suite_of(root: Path, files: dict[str, str]) -> Path:
    """A tests/ folder of `files` ({path: source}) beside an empty conftest.py."""
    (root / "helpers").mkdir(parents=True)
    (root / "conftest.py").write_text("")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checks_find_a_helper_defined_again_a_copy_and_an_import(tmp_path):
    tests = suite_of(tmp_path, {
        "helpers/program.py": "def wait_for_it():\n    pass\n",
        "runner/test_a.py": "REPO = 1\n\ndef wait_for_it():\n    pass\n\nSTDLIB = make('stdlib')\nSEQ = 32\n"
                            "hf = pytest.importorskip('transformers')\n",
        "data/test_b.py": "import test_a\n\ndef take(loader):\n    pass\n\nSTDLIB = make('stdlib')\nSEQ = 32\n"
                          "hf = pytest.importorskip('transformers')\n",
        "bench/test_c.py": "def take(loader, n):\n    pass\n\ndef test_x():\n    pass\n",
        "kernels/test_d.py": "def test_x():\n    pass\n",
    })
    assert defined_again(tests) == ["runner/test_a.py: REPO (defined in tests/helpers/ or tests/conftest.py)",
                                    "runner/test_a.py: wait_for_it (defined in tests/helpers/ or tests/conftest.py)"]
    # two functions `take` (whatever they do) and one value under one name: reported; tests, numbers and
    # modules skipped without not
    assert defined_twice(tests) == ["take (function): bench/test_c.py, data/test_b.py",
                                    "STDLIB (value): data/test_b.py, runner/test_a.py"]
    assert imports_of_test_modules(tests) == ["data/test_b.py imports test_a"]

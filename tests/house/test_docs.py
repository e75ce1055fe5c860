"""Every file, folder and module the docs name exists in the repository.

The docs (README.md, docs/*.md, BENCHMARKS.md) name code all the time: `runtime/jobs/settle.py`,
`python -m benchmarks.ce_floor`, `core.signals.Interrupt`, `configs/llama3_8b.yaml`,
[run-flow.md](run-flow.md). A file that moves (trainer/files.py became core/files.py) leaves
those names behind; this test finds them. What it checks:

- a path whose first part is one of the repository's own top-level names (`ROOTS`), in inline
  code, a code block or plain text: `runtime/runs/replay.py`, `configs/tiny.yaml`, `tests/x.py::test_y`
  (the test function must be in the file too);
- a path ending in .py, .sh or .md whose first part is not one of them, such as
  `cluster/ssh/remote.py` inside a page about runtime/: some file of the repository must end with it;
- a dotted name starting with one of Anvil's packages (`runtime.runs.replay`,
  `core.signals.EXIT_REQUEUE`), the module after `python -m`, and the module of
  `from X import` / `import X` in a code block: the module must exist, and a name after it must be
  defined or imported in it;
- a relative link or image, [text](docs/x.md), relative to the page, and its #anchor: a heading of that page.

Placeholders (`envs/profiles/<model>.py`, `hooks/<collection>/<task>/{pre,post}/`) are matched as
globs. What a run makes rather than the repository (a run directory's files, .venv, a dataset) is
allowed only through `MADE_BY_A_RUN`, an explicit list. Absolute paths are a machine's, not the
repository's: none may point into the machine this project is developed on (`/work/...`), and no doc
may point outside the repository (`../shared`).
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from helpers.program import REPO


# The repository's own top-level names: a path that starts with one of them names a file of the
# repository and must exist. (data/, runs/ and .venv/ are made by commands, never committed.)
ROOTS = {"tasks", "tasks.py", "runtime", "envs", "benchmarks", "trainer", "kernels", "core", "configs",
         "hooks", "tests", "docs", ".ci", "bootstrap", "invoke.yaml", "pyproject.toml", "README.md",
         "BENCHMARKS.md"}
PACKAGES = ("tasks", "runtime", "envs", "benchmarks", "trainer", "kernels", "core")

# Names the docs give to what a command makes, not to files of the repository. Each entry is a
# glob over the name as written; keep the list short and explicit.
MADE_BY_A_RUN = [
    "runs/*", "RUN/*",             # run directories (RUN: one of them, as the docs write it)
    "configs/train.yaml",          # a run directory's copy of its config (RUN/configs/train.yaml)
    "hooks/pre.log", "hooks/post.log",   # a run directory's hook output (RUN/hooks/pre.log)
    "data/*",                      # datasets and tokenizers that data.prepare and data.tokenizer write
    ".venv/*",                     # ./bootstrap's environment
]

DOCS = ["README.md", "BENCHMARKS.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]

# A dotted word ending with one of these is a file's name (`trainer.pt`), not a module.
FILE_SUFFIXES = ("py", "md", "yaml", "sh", "json", "jsonl", "pt", "txt", "log", "csv", "png", "html", "gz", "toml")

_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_TOKEN_STRIP = " \t,;:()[]'\"!?"
_DOTTED = re.compile(r"^(?:%s)(?:\.[A-Za-z_][A-Za-z0-9_]*)+$" % "|".join(PACKAGES))
_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))")
_PATHISH = re.compile(r"^[\w.~<>{}*\[\]@,+-]+(?:/[\w.<>{}*\[\]@,+=-]*)+(?:::[\w\[\]-]+)?$")


def _code_lines(text: str):
    """(line, in a code block) for every line of a Markdown page."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            yield line, False
            continue
        yield line, fenced or line.startswith("    ")


def _placeholder_glob(name: str) -> str:
    """A name with placeholders as a glob: <model>, {pre,post}, NN_name (a hook's file), step_N."""
    name = re.sub(r"<[^>]*>|\{[^}]*\}|NN_name", "*", name)
    return re.sub(r"(?<![A-Za-z])[NX](?![A-Za-z])", "*", name)


def _allowed(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MADE_BY_A_RUN)


def _exists(rel: str) -> bool:
    rel = rel.rstrip("/") or "."
    if _placeholder_glob(rel) != rel or any(ch in rel for ch in "*["):
        return any(REPO.glob(_placeholder_glob(rel)))
    return (REPO / rel).exists()


_TRACKED: list[str] | None = None


def _all_files() -> list[str]:
    global _TRACKED
    if _TRACKED is None:
        made = {".git", ".venv", "runs", "data", ".pytest_cache"}      # made by commands, at the top
        _TRACKED = [str(rel) for rel in (p.relative_to(REPO) for p in REPO.rglob("*"))
                    if rel.parts[0] not in made and "__pycache__" not in rel.parts]
    return _TRACKED


def _module_file(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def check_module(dotted: str) -> str | None:
    """None when `dotted` is a module of the repository, or a module followed by a name it defines or
    imports (`core.signals.Interrupt`); else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        found = _module_file(".".join(parts[:cut]))
        if found is None:
            continue
        rest = parts[cut:]
        if not rest or rest[0] in ("X", "N"):       # python -m benchmarks.X: a placeholder
            return None
        source = found.read_text(encoding="utf-8")
        if re.search(r"(?m)^\s*(?:def|class|async\s+def)\s+%s\b|^\s*%s\s*[:=]|\bimport\b[^\n]*\b%s\b|\b%s\s*=" % ((re.escape(rest[0]),) * 4), source):
            return None
        if (found.parent / rest[0]).is_dir() or (found.parent / f"{rest[0]}.py").is_file():
            return None
        return f"{'.'.join(parts[:cut])} has no {rest[0]!r}"
    return "no such module"


def check_path(token: str) -> str | None:
    """None when `token` (a path as a doc writes it) names something that exists or is allowed."""
    name, _, test = token.partition("::")
    name = name.removeprefix("./")
    if _allowed(name):
        return None
    first = name.split("/", 1)[0]
    if first in ROOTS:
        if not _exists(name):
            return "no such file or folder"
        if test and (REPO / name).is_file():
            func = re.split(r"[\[:]", test)[0]
            if not re.search(r"(?m)^\s*(?:async\s+)?def\s+%s\b" % re.escape(func), (REPO / name).read_text(encoding="utf-8")):
                return f"{name} has no test {func}"
        return None
    if re.search(r"\.(py|sh|md)$", name) and "/" in name:
        pattern = "*/" + _placeholder_glob(name)
        if any(fnmatch.fnmatchcase(path, pattern) for path in _all_files()):
            return None
        return "no file of the repository ends with it"
    return None


def names_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, name) for every repository name a Markdown text gives."""
    found = []
    for number, (line, code) in enumerate(_code_lines(text), 1):
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                found.append((number, "link", target))
        pieces = [m for m in _SPAN.findall(line)]
        if code:
            pieces.append(line)
            imported = _IMPORT.match(line)
            if imported:
                module = imported.group(1) or imported.group(2)
                if module.split(".")[0] in PACKAGES:
                    found.append((number, "module", module))
        else:
            # plain text outside code spans: only paths that start with a repository name
            outside = _SPAN.sub(" ", _LINK.sub(" ", line))
            for word in outside.split():
                word = word.strip(_TOKEN_STRIP + ".")
                if "/" in word and word.split("/", 1)[0] in ROOTS and _PATHISH.match(word):
                    found.append((number, "path", word))
        for piece in pieces:
            words = piece.split()
            for i, word in enumerate(words):
                word = word.strip(_TOKEN_STRIP)
                if "=" in word:
                    word = word.split("=", 1)[1]
                if i and words[i - 1] == "-m" and re.match(r"^[\w.]+$", word):
                    if word.split(".")[0] in PACKAGES:
                        found.append((number, "module", word))
                    continue
                if _DOTTED.match(word) and not re.search(r"\.(%s)$" % "|".join(FILE_SUFFIXES), word):
                    found.append((number, "module", word))
                elif "/" in word and _PATHISH.match(word.rstrip(".")) and "://" not in word:
                    found.append((number, "path", word.rstrip(".")))
    return list(dict.fromkeys(found))


def anchors(text: str) -> set[str]:
    """The #anchors a Markdown page's headings get, as GitHub makes them (a repeated one gets -1, -2)."""
    seen: dict[str, int] = {}
    for line, code in _code_lines(text):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if code or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def problems_in(doc: str, text: str) -> list[str]:
    problems = []
    base = (REPO / doc).parent
    for number, kind, name in names_in(text):
        if kind == "link":
            page, _, anchor = name.partition("#")
            target = (base / page).resolve() if page else (REPO / doc)
            why = None if target.exists() else "broken link"
            if target.exists() and REPO not in (target, *target.parents):
                why = "links outside the repository"
            elif not why and anchor and target.suffix == ".md" and anchor not in anchors(target.read_text(encoding="utf-8")):
                why = f"{target.name} has no heading #{anchor}"
        elif kind == "module":
            why = check_module(name)
        elif name.startswith("/") or name.startswith("~"):
            why = None
        else:
            why = check_path(name)
        if why:
            problems.append(f"{doc}:{number}: {name}: {why}")
    for number, line in enumerate(text.splitlines(), 1):
        if re.search(r"(?<![\w.])/work/|\.\./shared\b", line):
            problems.append(f"{doc}:{number}: points outside the repository: {line.strip()[:80]}")
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_a_doc_gives_exists(doc):
    problems = problems_in(doc, (REPO / doc).read_text(encoding="utf-8"))
    assert not problems, "names in the docs that the repository does not have:\n" + "\n".join(problems)


def test_the_check_reports_what_does_not_exist():
    """The check can fail: made-up names of each kind are reported, real ones are not."""
    page = "\n".join([
        "See `runtime/runs/no_such_file.py` and `configs/no_such.yaml`, and runtime/jobs/nope.py in prose.",
        "The module `runtime.runs.no_such_module`, the name `core.signals.no_such_name`,",
        "the test `tests/test_layers.py::test_no_such_test` and `ssh/no_such_remote.py`.",
        "A [broken link](docs/no_such_page.md) and a machine path /work/somewhere.",
        "A [missing heading](docs/architecture.md#no-such-heading), a [real one](docs/architecture.md#the-one-error-path).",
        "",
        "    python -m benchmarks.no_such_benchmark --json",
        "",
        "```python",
        "from runtime.no_such_package import thing",
        "```",
        "Real ones: `runtime/jobs/settle.py`, `core.signals.Interrupt`, `runtime.runs.replay`,",
        "`tests/house/test_layers.py::test_no_import_cycles`, `cluster/ssh/remote.py`, [docs](docs/README.md),",
        "`envs/profiles/<model>.py`, `runs/<stamp>_train.pretrain/`, `RUN/logs/rank<R>.log`, `.venv/bin/inv`.",
        "    python -m benchmarks.ce_floor --hidden 4096",
    ])
    problems = problems_in("README.md", page)
    reported = "\n".join(problems)
    for made_up in ("runtime/runs/no_such_file.py", "configs/no_such.yaml", "runtime/jobs/nope.py",
                    "runtime.runs.no_such_module", "core.signals.no_such_name", "test_no_such_test",
                    "ssh/no_such_remote.py", "docs/no_such_page.md", "/work/", "benchmarks.no_such_benchmark",
                    "runtime.no_such_package", "#no-such-heading"):
        assert made_up in reported, f"{made_up} was not reported:\n{reported}"
    assert len(problems) == 12, reported


def test_the_docs_are_all_checked():
    """The guides the README links to are among the pages checked, and every page has a name to check."""
    assert {"README.md", "BENCHMARKS.md", "docs/README.md", "docs/architecture.md"} <= set(DOCS)
    for doc in DOCS:
        assert names_in((REPO / doc).read_text(encoding="utf-8")), f"{doc} names nothing: is it parsed?"


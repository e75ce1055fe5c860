"""One spelling per shared name: the ANVIL_* variables and the run-directory files are written out
in core/names.py alone; code everywhere else says names.HOST, run_dir / names.METRICS. The table
of variables in docs/variables.md is the registry's own."""
from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

from core import names
from helpers.program import REPO

#: ANVIL_ as a word of its own: INVOKE_ANVIL_<KEY> is Invoke's variable for a setting, not ours.
VARIABLE = re.compile(r"(?<![A-Za-z0-9_])ANVIL_[A-Z0-9_]*")
RUN_FILES = {value for key, value in vars(names).items()
             if key.isupper() and isinstance(value, str) and "." in value and "*" not in value}
#: Run folders whose names are no checkout folder's too (configs/ and hooks/ are both).
RUN_DIRS = {names.LOGS_DIR, names.CHECKPOINTS_DIR, names.PROFILE_DIR, names.HOSTS_DIR, names.NODES_DIR}


def _code_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    return [REPO / f for f in listed if not f.startswith("tests/") and f != "core/names.py"
            and (f.endswith((".py", ".sh")) or f == "bootstrap") and (REPO / f).is_file()]


def variables_spelled_out(files) -> list[str]:
    return [f"{path.relative_to(REPO)}:{n}: {m.group(0)}" for path in files
            for n, line in enumerate(path.read_text().splitlines(), 1) for m in VARIABLE.finditer(line)]


def run_files_spelled_out(files) -> list[str]:
    """String literals that are a run file's name, or a run folder's name joined onto a path (x / "logs")."""
    found = []
    for path in files:
        if path.suffix != ".py" and path.name != "bootstrap":
            continue
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
        for before, token in zip([None] + tokens, tokens):
            if token.type != tokenize.STRING or not re.fullmatch(r"[\"'][^\"']*[\"']", token.string):
                continue
            text = token.string[1:-1]
            if text in RUN_FILES or (text in RUN_DIRS and before is not None and before.string == "/"):
                found.append(f"{path.relative_to(REPO)}:{token.start[0]}: {token.string}")
    return found


def test_no_anvil_variable_is_spelled_outside_the_names_module():
    wrong = variables_spelled_out(_code_files())
    assert not wrong, "say names.X instead:\n" + "\n".join(wrong)


def test_no_run_file_name_is_spelled_outside_the_names_module():
    wrong = run_files_spelled_out(_code_files())
    assert not wrong, "say names.X instead:\n" + "\n".join(wrong)


def test_the_checks_find_a_spelled_out_name(tmp_path):
    """Both rules can fail."""
    probe = tmp_path / "probe.py"
    probe.write_text('import os\nhost = os.environ.get("ANVIL_HOST")\nlog = run_dir / "logs" / "metrics.jsonl"\n'
                     'fine = os.environ.get("INVOKE_ANVIL_RUNS_DIR"), {"logs": 1}\n')
    probe_root = tmp_path.relative_to(tmp_path.anchor)
    assert [w.split(": ")[1] for w in _relative(variables_spelled_out, probe)] == ["ANVIL_HOST"]
    assert [w.split(": ")[1] for w in _relative(run_files_spelled_out, probe)] == ['"logs"', '"metrics.jsonl"']
    assert probe_root


def _relative(check, path: Path) -> list[str]:
    global REPO
    saved, REPO = REPO, path.parent
    try:
        return check([path])
    finally:
        REPO = saved


def test_every_variable_the_docs_and_code_name_is_registered():
    """A variable named anywhere (docs, code, configs) is one the registry knows: no typo, no orphan."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    unknown = set()
    for name in listed:
        path = REPO / name
        if path.suffix in (".md", ".py", ".sh", ".yaml") and path.is_file():
            for match in VARIABLE.finditer(path.read_text(errors="replace")):
                word = match.group(0)
                if word not in names.VARIABLES and word not in (names.PREFIX, names.REPLAY_PREFIX) \
                        and not (word.endswith("_") and any(v.startswith(word) for v in names.VARIABLES)):
                    unknown.add(f"{name}: {word}")
    assert not unknown, "unregistered ANVIL_ variables (add them to core/names.py):\n" + "\n".join(sorted(unknown))


def test_the_docs_table_of_variables_is_the_registry():
    doc = (REPO / "docs" / "variables.md").read_text()
    assert names.markdown_table() in doc, "docs/variables.md: paste `python -m core.names` into its table"


def test_each_variable_has_a_meaning_and_a_setter():
    for variable in names.VARIABLES.values():
        assert variable.meaning and variable.set_by in ("user", "anvil", "test"), variable

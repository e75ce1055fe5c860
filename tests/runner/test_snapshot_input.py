"""Bad input to snapshot.list, snapshot.show, snapshot.diff and snapshot.replay through the installed
`inv`, as a user types it: options out of range, a run that is empty, missing or no run, records that are
damaged (not JSON, not an object, not UTF-8). Each is one line naming the file or the option and what is
expected, exit 2, no traceback, no run directory made; snapshot.list shows a run whose metadata it cannot
read, with the reason.

Every command runs with its working directory in a fresh temporary folder, the runs under it.
"""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from helpers.program import inv, one_line_error


def test_list_shows_runs_with_unreadable_metadata(tmp_path):
    root = tmp_path / "runs"
    for name, content in [("2026-01-01T00-00-00_good", json.dumps({"task": "env.show", "status": "ok",
                                                                     "start": "2026-01-01T00:00:00"})),
                          ("2026-01-02T00-00-00_cut", '{"task": "train.pretrain", "sta'),
                          ("2026-01-03T00-00-00_binary", b"\xff\xfe\x00"),
                          ("2026-01-04T00-00-00_list", "[1, 2]")]:
        (root / name).mkdir(parents=True)
        target = root / name / "metadata.json"
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    (root / "not-a-run").mkdir()  # no metadata.json at all: not a run, not listed
    proc = inv(tmp_path, "snapshot.list", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    table, _, below = proc.stdout.partition("\n2026-01-02T00-00-00_cut: ")
    lines = {line.split()[-1]: line for line in table.splitlines()[2:]}
    assert sorted(lines) == ["2026-01-01T00-00-00_good", "2026-01-02T00-00-00_cut",
                             "2026-01-03T00-00-00_binary", "2026-01-04T00-00-00_list"]
    assert "env.show" in lines["2026-01-01T00-00-00_good"]
    assert all("(unreadable)" in lines[name] for name in lines if not name.endswith("good"))
    assert below.startswith("metadata.json unreadable: not valid JSON: Unterminated string")   # one reason a line
    assert "\n2026-01-03T00-00-00_binary: metadata.json unreadable: not UTF-8 text at byte 0\n" in below
    assert "\n2026-01-04T00-00-00_list: metadata.json unreadable: not a JSON object (a list)" in below
    assert max(map(len, table.splitlines())) < 150
    rows = json.loads(inv(tmp_path, "snapshot.list", "--json", timeout=60).stdout)
    assert [r["dir"] for r in rows if r.get("problem")] == ["2026-01-02T00-00-00_cut", "2026-01-03T00-00-00_binary",
                                                           "2026-01-04T00-00-00_list"]


@pytest.fixture
def damaged_runs(tmp_path, finished_run) -> Path:
    """tmp_path/runs with a copy of the finished run and damaged copies of it."""
    runs_dir = tmp_path / "runs"

    def copy(name, edit=None):
        shutil.copytree(finished_run, runs_dir / name, ignore=shutil.ignore_patterns("checkpoints"))
        if edit:
            edit(runs_dir / name)

    copy("good")
    copy("cut_md", lambda p: (p / "metadata.json").write_text('{"task": '))
    copy("bad_env", lambda p: (p / "env.json").write_text("[1"))
    copy("list_machine", lambda p: (p / "machine.json").write_text("[1, 2]"))
    copy("str_vars", lambda p: (p / "env.json").write_text('{"vars": "x"}'))
    copy("bin_versions", lambda p: (p / "versions.json").write_bytes(b"\xff\xfe"))

    def argv(value):
        def edit(p):
            md = json.loads((p / "metadata.json").read_text())
            md["argv"] = value
            md.pop("record_sha256")   # as a run recorded before records were sealed: its types are checked
            (p / "metadata.json").write_text(json.dumps(md))
        return edit

    copy("no_argv", argv([]))
    copy("str_argv", argv("inv train.pretrain"))
    (tmp_path / "afile").write_text("x")
    return runs_dir


SNAPSHOT_CASES = [
    ("snapshot.list --limit -1", "--limit: expected a number of runs >= 1 (0 or left out: all), got -1"),
    ("snapshot.show ''", "the run is empty; expected a run directory (a path, or a name under {runs})"),
    ("snapshot.show nosuch", "nosuch: no such run directory; expected a run directory (a path, or a name under {runs})"),
    ("snapshot.show afile", "afile: not a directory; expected a run directory"),
    ("snapshot.show .", ".: not a run directory (no metadata.json); expected a run directory"),
    ("snapshot.show cut_md", "cut_md/metadata.json: not valid JSON (Expecting value: line 1 column 10 (char 9)); "
                             "the run directory is damaged"),
    ("snapshot.show bad_env", "bad_env/env.json: not valid JSON ("),
    ("snapshot.show list_machine", "list_machine/machine.json: expected a JSON object, got a list; the run directory is damaged"),
    ("snapshot.show str_vars", "str_vars/env.json: 'vars' is not a JSON object; the run directory is damaged"),
    ("snapshot.show bin_versions", "bin_versions/versions.json: not UTF-8 text (byte 0); the run directory is damaged"),
    ("snapshot.diff -a good -b list_machine", "list_machine/machine.json: expected a JSON object, got a list"),
    ("snapshot.diff -a '' -b good", "the run is empty; expected a run directory"),
    ("snapshot.replay '' --dry-run", "the run is empty; expected a run directory"),
    ("snapshot.replay no_argv --dry-run", "no_argv: no recorded command line"),
    ("snapshot.replay str_argv --dry-run",
     "str_argv: the recorded command line (metadata.json 'argv') is not a list of strings; the run directory is damaged"),
    ("snapshot.replay str_vars --dry-run", "str_vars/env.json: 'vars' is not a JSON object"),
]


@pytest.mark.parametrize("command,message", SNAPSHOT_CASES, ids=[c for c, _ in SNAPSHOT_CASES])
def test_snapshot_option_is_one_line_and_exit_2(tmp_path, damaged_runs, command, message):
    names = sorted(p.name for p in damaged_runs.iterdir())
    args = shlex.split(command)
    proc = inv(tmp_path, *args, timeout=120)
    one_line_error(proc, f"{args[0]}: ", message.replace("{runs}", str(damaged_runs)))
    assert sorted(p.name for p in damaged_runs.iterdir()) == names  # no run directory made


def test_snapshot_show_and_diff_still_work(tmp_path, damaged_runs):
    shown = inv(tmp_path, "snapshot.show", "good", timeout=120)
    assert shown.returncode == 0 and "train.pretrain" in shown.stdout, shown.stderr
    assert inv(tmp_path, "snapshot.diff", "-a", "good", "-b", "good", timeout=120).stdout.strip() == "no differences"
    listed = inv(tmp_path, "snapshot.list", "--limit", "2", "--json", timeout=120)
    assert [row["dir"] for row in json.loads(listed.stdout)] == ["str_argv", "str_vars"]


def test_a_missing_argument_is_exit_2(tmp_path):
    proc = inv(tmp_path, "snapshot.diff", "-a", "x")
    assert proc.returncode == 2 and "did not receive required positional arguments" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()

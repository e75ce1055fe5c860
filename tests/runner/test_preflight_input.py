"""Bad input to preflight.perf through the installed `inv`, as a user types it: one line, exit 2, no
traceback, refused before any run directory or measurement; and the `inv --list` lines of preflight.*
and env.* are whole sentences.

Every command runs in a fresh temporary folder with its run directories under it.
"""
from __future__ import annotations

import re

import pytest

from helpers.program import SHELL_CHOICES, inv, one_line_error, runs


# ---------------------------------------------------------------- 1. --save-baseline checked first

@pytest.mark.parametrize("where, fragment", [
    ("/proc/x.json", "cannot write a file in /proc"),
    ("{tmp}", "is a directory"),
    ("{tmp}/notes.txt/x.json", "is a file, not a folder"),
])
def test_unwritable_save_baseline_is_refused_before_measuring(tmp_path, where, fragment):
    (tmp_path / "notes.txt").write_text("mine")
    path = where.format(tmp=tmp_path)
    proc = inv(tmp_path, "preflight.perf", "--save-baseline", path, unset=SHELL_CHOICES)
    one_line_error(proc, "--save-baseline", path, fragment)
    assert "preflight on" not in proc.stdout and runs(tmp_path) == []
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- 2. --tolerance is a fraction, or N%

def test_tolerance_takes_a_percentage():
    from runtime.preflight import perf
    assert perf.check_tolerance("5%") == pytest.approx(0.05)
    assert perf.check_tolerance("0.05") == perf.check_tolerance(0.05) == 0.05
    for bad in ("abc", "150%", "2", "-1%", "nan"):
        with pytest.raises(perf.PerfOptionError, match=r"expected a fraction .* such as 0\.05 for 5%"):
            perf.check_tolerance(bad)


def test_tolerance_5_percent_is_accepted_and_a_word_is_one_line(tmp_path):
    # 5% passes the option checks: the next check (--save-baseline) is the one that stops the run.
    accepted = inv(tmp_path, "preflight.perf", "--tolerance", "5%", "--save-baseline", "/proc/x.json",
                   unset=SHELL_CHOICES)
    one_line_error(accepted, "--save-baseline /proc/x.json")
    assert "--tolerance" not in accepted.stderr
    bad = inv(tmp_path, "preflight.perf", "--tolerance", "five", unset=SHELL_CHOICES)
    one_line_error(bad, "--tolerance five", "expected a fraction", "0.05 for 5%")
    assert runs(tmp_path) == []


# ---------------------------------------------------------------- 3. inv --list shows whole sentences

def test_list_lines_of_preflight_and_env_are_whole_sentences(tmp_path):
    proc = inv(tmp_path, "--list", unset=SHELL_CHOICES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries: dict[str, str] = {}
    name = None
    for line in proc.stdout.splitlines():
        head = re.match(r"  (\S+)\s+(.*)", line)
        if head:
            name = head.group(1)
            entries[name] = head.group(2)
        elif name and line.startswith("    "):   # Invoke's wrapped continuation of the same help line
            entries[name] += " " + line.strip()
    ours = {n: text for n, text in entries.items() if n.startswith(("preflight.", "env."))}
    assert "preflight.perf" in ours and "env.explain" in ours, proc.stdout
    cut = {n: text for n, text in ours.items() if not text.endswith(".")}
    assert not cut, f"--list shows these cut mid-sentence: {cut}"

"""train.plot given what it cannot use, through the installed `inv`, as a user types it: an output it
cannot write, something else than a run, metrics that are not text. Each is one line naming what was
wrong and what is expected; nothing that was there is lost and nothing half-written is left. What it
draws is in test_plot.py.

Every command runs with its working directory in a fresh temporary folder.
"""
from __future__ import annotations

import os

import pytest

from helpers.program import assert_output_refused, inv, one_line_error


@pytest.mark.parametrize("out,fragments", [
    ("/proc/forbidden/x.png", ["--out /proc/forbidden/x.png: cannot create /proc/forbidden",
                               "No such file or directory"]),
    ("afile/x.png", ["--out afile/x.png: a file is in the way where a directory is needed"]),
    ("afile", ["a file is in the way where a directory is needed", "afile)"]),
    ("x.jpg", ["x.jpg: the output must be a .png file or a directory"]),
])
def test_a_plot_to_an_unwritable_output_is_one_line(tmp_path, finished_run, out, fragments):
    assert_output_refused(tmp_path, "train.plot", finished_run, out, *fragments)


@pytest.mark.parametrize("run,fragments", [
    ("afile", ["afile: not a directory; expected a run directory"]),
    ("", ["the run is empty; expected a run directory"]),
])
def test_plot_of_something_else_than_a_run(tmp_path, finished_run, run, fragments):
    (tmp_path / "afile").write_text("mine")
    proc = inv(tmp_path, "train.plot", run.replace("RUN", str(finished_run)), timeout=120)
    one_line_error(proc, "train.plot: ", *fragments)


def test_plot_still_writes(tmp_path, finished_run):
    png = tmp_path / "plots" / "loss.png"
    assert inv(tmp_path, "train.plot", finished_run, "--out", png, timeout=120).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_mode & 0o777 == 0o666 & ~umask  # as before write_atomic: the umask, not 0600
    assert not list(png.parent.glob(".*"))


def test_plot_of_binary_metrics(tmp_path):
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\xff\xfe\x00\n")
    proc = inv(tmp_path, "train.plot", "binary", "--out", tmp_path / "p.png", timeout=120)
    one_line_error(proc, "train.plot: binary/metrics.jsonl: no training steps logged yet")

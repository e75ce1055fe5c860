"""train.export given what it cannot use, through the installed `inv`, as a user types it: an output it
cannot write, something else than a run, a run whose checkpoint is damaged. Each is one line naming
what was wrong and what is expected; nothing that was there is lost and nothing half-written is left.
What it writes when it can is in test_export.py.

Every command runs with its working directory in a fresh temporary folder.
"""
from __future__ import annotations

import shutil

import pytest

from helpers.program import assert_output_refused, inv, one_line_error


@pytest.mark.parametrize("out,fragments", [
    ("/proc/forbidden/x", ["--out /proc/forbidden/x: cannot create /proc/forbidden", "No such file or directory"]),
    ("afile/x", ["--out afile/x: a file is in the way where a directory is needed", "afile)"]),
    ("afile", ["--out afile is a file; expected a new directory"]),
    ("adir", ["--out adir exists; expected a new directory"]),
])
def test_an_export_to_an_unwritable_output_is_one_line(tmp_path, finished_run, out, fragments):
    assert_output_refused(tmp_path, "train.export", finished_run, out, *fragments)


@pytest.mark.parametrize("run,fragments", [
    ("afile", ["afile: not a directory; expected a run directory or a checkpoint (step_N)"]),
    ("RUN/metrics.jsonl", ["not a directory; expected a run directory or a checkpoint"]),
    ("", ["the run is empty; expected a run directory or a checkpoint (step_N)"]),
])
def test_export_of_something_else_than_a_run(tmp_path, finished_run, run, fragments):
    (tmp_path / "afile").write_text("mine")
    proc = inv(tmp_path, "train.export", run.replace("RUN", str(finished_run)), timeout=120)
    one_line_error(proc, "train.export: ", *fragments)


def test_export_still_writes(tmp_path, finished_run):
    proc = inv(tmp_path, "train.export", finished_run, "--out", tmp_path / "hf", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_export_of_a_damaged_checkpoint(tmp_path, finished_run):
    damaged = tmp_path / "damaged"
    shutil.copytree(finished_run, damaged)
    for shard in (damaged / "checkpoints" / "step_2").glob("*.distcp"):
        shard.unlink()
    proc = inv(tmp_path, "train.export", "damaged", "--out", tmp_path / "hf", timeout=300)
    one_line_error(proc, "train.export: the run damaged: no intact checkpoint in damaged "
                         "(step_2: __0_0.distcp is missing)")   # seen from checksums.json, before reading
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))

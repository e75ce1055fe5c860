"""A full disk, on a real tmpfs (root; skipped elsewhere, as in test_data_prepare):

- during training, a checkpoint that cannot be written is one line naming the file and the newest
  intact checkpoint; its partial .tmp_step_N is removed; the run is recorded failed, exit 1
  (asynchronous and synchronous saves);
- a run directory records its end when the disk is full to the last byte (its reserve).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import checkpoint as ck

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_resume import REPO, SHORT, env  # noqa: E402

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(disk: Path, leave: int = 0) -> None:
    """Take all the free space of `disk` but `leave` bytes."""
    with open(disk / "filler", "wb") as handle:
        chunk = bytes(1 << 16)
        try:
            while free_bytes(disk) > leave + len(chunk):
                handle.write(chunk)
                handle.flush()
            handle.write(bytes(max(0, free_bytes(disk) - leave)))
            handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_full_disk_during_training_is_one_line_and_a_failed_run(tmp_path, dataset, asynchronous):
    inv = REPO / ".venv" / "bin" / "inv"
    with tmpfs(tmp_path / "disk", "64m") as disk:
        runs = disk / "runs"
        sets = [arg for item in [f"data.path={dataset}", *SHORT, "train.steps=1000000", "checkpoint.interval=10",
                                 "checkpoint.keep_last=1", f"checkpoint.async_save={str(asynchronous).lower()}"]
                for arg in ("--set", item)]
        proc = subprocess.Popen([str(inv), "train.pretrain", *sets], cwd=tmp_path,
                                env={**env(), "INVOKE_ANVIL_RUNS_DIR": str(runs)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not list(runs.glob("*/checkpoints/step_*/COMPLETE")):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.02)
            (run,) = runs.iterdir()
            first = next((run / "checkpoints").glob("step_*"))
            size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
            fill(disk, leave=size // 2)          # the next checkpoint finds half the room it needs
            _out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
        (line,) = [line for line in err.splitlines() if line.startswith("train.pretrain failed")]
        (kept,) = (run / "checkpoints").iterdir()            # the partial one is gone, the one before stays
        step = re.search(r"checkpoint step_(\d+) not saved", line)
        assert step and int(step[1]) > int(kept.name[5:]), line
        assert f"cannot write {run}/checkpoints/.tmp_step_{step[1]}/" in line, line
        assert f": No space left on device; removed the partial .tmp_step_{step[1]}; the newest intact checkpoint " \
               f"is {kept}" in line, line
        assert ck.verify(kept) is True
        metadata = json.loads((run / "metadata.json").read_text())
        assert (metadata["status"], metadata["exit_code"]) == ("failed", 1)
        assert "No space left on device" in metadata["error"]


def test_a_run_records_its_end_on_a_disk_full_to_the_last_byte(tmp_path):
    from invoke import Context

    from runtime.program.cli import AnvilConfig
    from runtime.runs import rundir
    from runtime.runs.run import RunFailed, RunSpec, execute
    from core.errors import AnvilError

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with tmpfs(tmp_path / "disk", "16m") as disk:
        ctx = Context(config=AnvilConfig(overrides={"anvil": {"runs_dir": str(disk / "runs"),
                                                              "hooks_dir": str(hooks)}}))
        seen = {}

        def body(run):
            reserve = run.path / rundir.SPACE_RESERVE
            seen["reserve"] = reserve.stat().st_size if reserve.exists() else None
            fill(disk)
            assert free_bytes(disk) < 4096
            raise AnvilError("the disk filled up")

        with pytest.raises(RunFailed, match="the disk filled up"):
            execute(ctx, RunSpec(task="demo.work", name="full"), body)
        (run,) = (disk / "runs").iterdir()
        metadata = json.loads((run / "metadata.json").read_text())
        assert (metadata["status"], metadata["error"], metadata["exit_code"]) == ("failed", "the disk filled up", 1)
        assert seen["reserve"] == rundir.RESERVE_BYTES and not (run / rundir.SPACE_RESERVE).exists()

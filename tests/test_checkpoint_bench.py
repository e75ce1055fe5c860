"""benchmarks.checkpoint_bench on the CPU (--device cpu, the tiny config): every part runs and
reports, the folder it wrote is gone, and a bad --skip is one line. The figures are the GPU's
business; here only that the program holds together."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def bench(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_bench", "--device", "cpu",
                           "--config", str(REPO / "configs" / "tiny.yaml"), "--batch", "2", "--seq", "32",
                           "--baseline-steps", "3", "--dir", str(tmp_path / "disk"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_every_part_reports_and_the_written_folder_is_removed(tmp_path):
    proc = bench(tmp_path, "--out", str(tmp_path / "result.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == json.loads((tmp_path / "result.json").read_text())
    assert result["state_bytes"] > 0 and result["disk"]["bytes"] == result["state_bytes"]
    for key in ("anvil_sync", "anvil_async", "dcp_save", "dcp_async"):
        assert result[key]["gb_per_s"] > 0 and result[key]["of_disk"] > 0 and result[key]["stall_s"] >= 0, key
    assert result["anvil_async"]["first"]["write_s"] > 0 and len(result["anvil_async"]["saves"]) == 1
    assert result["titan_pinned"] == {"skipped": "pinned staging needs a GPU"}
    for mode in ("async", "sync"):
        assert result["train"][mode]["steps"] >= 2 and "overhead_pct" in result["train"][mode]
    assert list((tmp_path / "disk").iterdir()) == []


def test_an_unknown_part_to_skip_is_one_line(tmp_path):
    proc = bench(tmp_path, "--skip", "disk,nope")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "--skip nope: expected some of disk, anvil_sync, anvil_async, dcp, train, titan")

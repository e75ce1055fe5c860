"""benchmarks.checkpoint_bench on the CPU (--device cpu, the tiny config): every part runs and
reports, the folder it wrote is gone, and a bad --skip is one line. The figures are the GPU's
business; here only that the program holds together."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.program import REPO
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


def test_checkpoint_run_charges_the_steps_beside_a_write(tmp_path):
    """benchmarks.checkpoint_run on a run directory holding a real checkpoint: the pace is the
    median step before the save, the steps logged while it was writing are charged what they
    took beyond it, and --remove then --dd time the same bytes after deleting the checkpoint."""
    import torch

    from trainer import checkpoint as ck

    run = tmp_path / "run"
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    saver = ck.Checkpointer(run / "checkpoints", async_save=True)
    saver.save(4, model=model, optimizer=optimizer)
    path = saver.wait()
    saver.close()
    meta = ck.read_meta(path)
    start, end = meta["time"], meta["time"] + meta["save_s"]
    times = {1: start - 0.3, 2: start - 0.2, 3: start - 0.1, 4: start, 5: end + 0.05, 6: end + 0.15}
    paces = {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1, 5: 0.25, 6: 0.1}   # step 5 ran beside the write
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "step": k, "time": times[k], "step_time_s": paces[k]}) + "\n"
        for k in sorted(times)) + json.dumps({"kind": "val", "step": 6, "val_loss": 1.0}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_run", str(run), "--warmup", "0",
                           "--every", "10", "--remove", "--dd", "--out", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    (save,) = result["saves"]
    assert result["step_s"] == 0.1 and result["steps_in_pace"] == 4
    assert save["step"] == 4 and save["async"] is True and save["bytes"] > 0
    assert save["steps_while_writing"] == 1 and save["added_s"] == pytest.approx(0.15)
    assert save["trained_past_commit"] is True
    assert save["overhead"] == pytest.approx((0.15 + save["stall_s"]) / (10 * 0.1), abs=1e-3)
    assert result["disk"]["bytes"] == save["bytes"] and save["of_disk"] > 0
    assert not (run / "checkpoints").exists() and not (run / "dd.bin").exists()
    assert json.loads((tmp_path / "r.json").read_text()) == result


def test_checkpoint_run_outside_a_run_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_run", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"{tmp_path}: no metrics.jsonl (not a training run directory?)"

"""trainer.plot: metrics.jsonl -> PNG with the loss, throughput, memory and lr panels.

The records follow the metrics.jsonl format trainer/metrics.py writes (GPU fields filled, as on a
GPU run); trainer/test_resume.py also plots a real killed-and-resumed CPU run."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from trainer.plot import PANELS, PlotError, build_figure, plot_run, read_metrics

pytest.importorskip("matplotlib")


def train_record(step: int) -> dict:
    return {"kind": "train", "step": step, "time": 1.0e9 + step, "loss": 5.0 * math.exp(-step / 40) + 2,
            "lr": 3e-4 * min(1, step / 10), "grad_norm": 1.0 + 1 / step, "tokens": step * 65536,
            "tokens_per_s": 60000 + 100 * (step % 7), "tokens_per_s_per_device": 60000.0,
            "step_time_s": 1.09, "tflops": 550.0, "mfu": 0.55 + 0.001 * (step % 5),
            "gpu_mem_gib": 26.0 + 0.01 * step, "gpu_mem_reserved_gib": 30.0, "gpu_util": 99.0,
            "cpu_percent": 100.0, "rss_gib": 3.2}


def write_run(run_dir: Path, replay_from: int = 60) -> None:
    """100 logged steps, killed after 70 and resumed from the step-60 checkpoint, so steps
    61..70 appear twice; the kill also cut the last line before the resume."""
    run_dir.mkdir(parents=True)
    lines = [json.dumps(train_record(s)) for s in range(1, 71)]
    lines += [json.dumps({"kind": "val", "step": s, "time": 0, "val_loss": 2.5 + 10 / s}) for s in (25, 50)]
    lines.append('{"kind": "train", "step": 71, "lo')  # cut by SIGKILL
    lines += [json.dumps(train_record(s)) for s in range(replay_from + 1, 101)]
    lines.append(json.dumps({"kind": "val", "step": 100, "time": 0, "val_loss": 2.55}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "config": "llama3_1b",
                                                      "world_size": 1, "device": "NVIDIA H200"}))


def test_plot_writes_a_png_with_all_panels(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    train, val, resumes = read_metrics(run_dir)
    assert sorted(train) == list(range(1, 101)) and sorted(val) == [25, 50, 100]
    assert resumes == [61]  # where the log restarted after the resume

    fig = build_figure(train, val, resumes)
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]
    assert titles == list(PANELS)
    loss_ax = fig.axes[0]
    labels = [line.get_label() for line in loss_ax.get_legend().get_lines()]
    assert labels == ["train", "validation", "resumed from a checkpoint"]
    train_line = loss_ax.get_lines()[1]  # after the resume marker
    assert list(train_line.get_xdata()) == list(range(1, 101))  # each step once
    ylabels = {ax.get_ylabel() for ax in fig.axes}
    assert {"loss (nats/token)", "thousand tokens/s", "MFU (%)", "GiB", "learning rate"} <= ylabels

    out = plot_run(run_dir)
    assert out == run_dir / "plots" / "metrics.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert (width, height) == (1320, 825) and len(data) > 50_000
    assert not list(out.parent.glob(".*.tmp"))

    assert plot_run(run_dir, tmp_path / "elsewhere" / "x.png").is_file()
    assert plot_run(run_dir, tmp_path / "a_dir") == tmp_path / "a_dir" / "metrics.png"


def test_plot_rejects_runs_without_metrics(tmp_path):
    with pytest.raises(PlotError, match="no such run directory"):
        plot_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        plot_run(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "val", "step": 1, "val_loss": 3}\n')
    with pytest.raises(PlotError, match="no training steps"):
        plot_run(tmp_path / "empty")
    assert not (tmp_path / "empty" / "plots").exists()
    write_run(tmp_path / "run")
    with pytest.raises(PlotError, match=".png"):
        plot_run(tmp_path / "run", tmp_path / "out.svg")

"""`inv snapshot.report`: one self-contained HTML file, checked as a person would see it.

The runs are real: a 2-rank training run stopped at its step 12 and resumed with --resume into
a second run directory, a preflight run, a bench.gemm run, a preflight.comm run (its task body with
made-up pair measurements, as in test_preflight_comm). Each report is opened in a real headless
Chromium (Debian's package, tests/helpers/browser.py): every chart has data, the page makes no request
but for its own file, and nothing on it errors in the console. Outside CI a machine without
chromium skips the browser tests; in CI (CI=true) they fail instead.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from core.files import seal
from helpers import browser
from helpers.comm import FakeTransport
from helpers.program import run_inv, sets
CHARTS_WITH_DATA = """Array.from(document.querySelectorAll('.chart')).map(function(el){
  return {title: el.dataset.title, traces: (el.data || []).length,
          points: (el.data || []).reduce(function(n, t){ return n + ((t.x || t.z || []).length); }, 0),
          drawn: el.querySelector('svg.main-svg') !== null};
})"""


@pytest.fixture(scope="module")
def report_runs(tmp_path_factory, dataset) -> dict[str, Path]:
    """Real runs: two training segments (2 ranks, stragglers checked every 4 steps), preflight, gemm."""
    root = tmp_path_factory.mktemp("report") / "runs"
    run_sets = [f"data.path={dataset}", "data.seq_len=64", "data.batch_size=4", "train.log_interval=2",
                "train.val_interval=6", "schedule.warmup_steps=2", "checkpoint.interval=6",
                "health.straggler_interval=4"]
    common = ["train.pretrain", "--name", "rep", "--nproc", "2", "--env", "OMP_NUM_THREADS=1"]
    first = run_inv(*common, *sets(*run_sets, "train.steps=12"), runs=root)
    assert first.returncode == 0, first.stderr[-3000:]
    (seg1,) = sorted(root.iterdir())
    second = run_inv(*common, *sets(*run_sets, "train.steps=20"), "--resume", seg1 / "checkpoints" / "step_12",
                     runs=root)
    assert second.returncode == 0, second.stderr[-3000:]
    assert run_inv("preflight.all", runs=root).returncode in (0, 1)
    assert run_inv("bench.gemm", "-M", "128", "--iters", "2", runs=root).returncode == 0
    found = sorted(root.iterdir())
    pick = {name: next(p for p in found if p.name.endswith(name)) for name in ("preflight.all", "bench.gemm")}
    seg2 = next(p for p in found if p.name.endswith("_train.pretrain_rep") and p != seg1)
    return {"seg1": seg1, "seg2": seg2, "root": root, **pick}


def check_page(chromium, path: Path, min_charts: int = 1) -> "browser.Page":
    page = chromium.open(path)
    charts = page.evaluate(CHARTS_WITH_DATA)
    assert len(charts) >= min_charts, charts
    empty = [c["title"] for c in charts if not (c["traces"] and c["points"] and c["drawn"])]
    assert not empty, f"charts without data: {empty}"
    # data: and blob: URLs are the page's own bytes (plotly draws heatmaps through them); anything else left it
    left = [url for url in page.requests if url != page.url and not url.startswith(("data:", "blob:"))]
    assert not left, f"requests left the file: {left}"
    assert not page.errors, page.errors
    return page


def test_training_report_joins_both_segments(report_runs, chromium, tmp_path):
    made = run_inv("snapshot.report", report_runs["seg2"].name, runs=report_runs["root"])
    assert made.returncode == 0, made.stderr
    out = Path(made.stdout.strip())
    assert out == report_runs["seg2"] / "report.html" and not list(out.parent.glob(".report.html.*"))
    page = check_page(chromium, out, min_charts=5)
    titles = [c["title"] for c in page.evaluate(CHARTS_WITH_DATA)]
    assert titles[:5] == ["loss", "throughput", "memory", "lr", "rank spread"]
    loss_steps = page.evaluate("document.querySelector('[data-title=loss]').data[0].x")
    assert loss_steps == list(range(2, 21, 2))          # steps 2..12 from the first segment, 14..20 its own
    marks = page.evaluate("document.querySelector('[data-title=loss]').layout.shapes.map(s => s.x0)")
    assert marks == [12]                                 # the checkpoint the second segment went on from
    ranks = page.evaluate("document.querySelector('[data-title=\"rank spread\"]').data.map(t => t.name)")
    assert ranks[:2] == ["rank 0", "rank 1"]
    text = page.evaluate("document.body.textContent")     # folded tables too
    for expected in ("segments: resumed 1 time(s)", "final train loss", "NCCL_SOCKET_IFNAME", "base",
                     "10_dataset_fingerprint.py", "train.yaml", "data.seq_len"):
        assert expected in text, expected
    # the picture a README shows
    shot = page.screenshot(tmp_path / "training.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_preflight_bench_and_comm_reports(report_runs, chromium, tmp_path):
    from invoke import Config, Context

    from runtime.preflight import comm
    from runtime.runs.run import RunFailed

    root = report_runs["root"]
    made = run_inv("snapshot.report", report_runs["preflight.all"], runs=root)
    page = check_page(chromium, Path(made.stdout.strip()), min_charts=0)
    assert page.evaluate("document.querySelectorAll('svg.topology').length") == 1
    assert "topology.map" in page.evaluate("document.body.innerText")
    made = run_inv("snapshot.report", report_runs["bench.gemm"], runs=root)
    gemm = check_page(chromium, Path(made.stdout.strip()))
    assert [c["title"] for c in gemm.evaluate(CHARTS_WITH_DATA)] == ["gemm"]
    # preflight.comm: the real task body, a made-up transport (one slow node)
    comm_runs = tmp_path / "comm"
    c = Context(config=Config(overrides={"anvil": {"runs_dir": str(comm_runs), "hosts": "n1,n2,n3,n4"}}))
    with pytest.raises(RunFailed):
        comm.run_comm_check(c, None, None, "1M", 5, transport=FakeTransport(slow={"n3"}))
    (comm_run,) = comm_runs.iterdir()
    made = run_inv("snapshot.report", comm_run.name, runs=comm_runs)
    page = check_page(chromium, Path(made.stdout.strip()))
    assert [c["title"] for c in page.evaluate(CHARTS_WITH_DATA)] == ["slow-link matrix"]
    text = page.evaluate("document.body.innerText")
    assert "n3" in text and "node lists: 3 passing, 1 failing" in text


def test_several_runs_are_overlaid_with_their_diff(report_runs, chromium, tmp_path):
    out = tmp_path / "both.html"
    made = run_inv("snapshot.report", report_runs["seg1"].name, "--also", report_runs["seg2"].name, "--out", out,
                   runs=report_runs["root"])
    assert made.returncode == 0 and made.stdout.strip() == str(out), made.stderr
    page = check_page(chromium, out, min_charts=6)
    titles = [c["title"] for c in page.evaluate(CHARTS_WITH_DATA)]
    assert titles[:2] == ["compare loss", "compare throughput"]
    names = page.evaluate("document.querySelector('[data-title=\"compare loss\"]').data.map(t => t.name)")
    assert report_runs["seg1"].name in names and report_runs["seg2"].name in names
    text = page.evaluate("document.body.innerText")
    assert f"snapshot.diff: A = {report_runs['seg1'].name}" in text and "train.steps" in text


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "report.html", "tensorboard"))
    metadata = json.loads((dst / "metadata.json").read_text())
    metadata["resume"] = None
    (dst / "metadata.json").write_text(json.dumps(seal(metadata)))
    return dst


def test_a_100000_step_run_stays_small(report_runs, chromium, tmp_path):
    run = _copy_run(report_runs["seg1"], tmp_path / "runs" / "long_train.pretrain_rep")
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 100_001):
            f.write(json.dumps({"kind": "train", "step": step, "loss": 2 + 5 * math.exp(-step / 9000),
                                "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 50000 + step % 97, "mfu": 0.41,
                                "gpu_mem_gib": 60.0, "gpu_mem_reserved_gib": 70.0, "rss_gib": 3.0}) + "\n")
            if step % 1000 == 0:
                f.write(json.dumps({"kind": "val", "step": step, "val_loss": 2.1 + 5 * math.exp(-step / 9000)}) + "\n")
            if step % 50 == 0:
                f.write(json.dumps({"kind": "rank_times", "step": step, "median": 0.1,
                                    "step_time": [0.1 + 0.001 * r for r in range(8)]}) + "\n")
    made = run_inv("snapshot.report", run.name, runs=tmp_path / "runs")
    assert made.returncode == 0, made.stderr
    out = Path(made.stdout.strip())
    assert out.stat().st_size < 10 * 1024 * 1024
    page = check_page(chromium, out, min_charts=5)
    points = page.evaluate("document.querySelector('[data-title=loss]').data[0].x.length")
    assert 700 < points <= 1500             # downsampled for drawing
    print(f"100,000-step report: {out.stat().st_size / 2 ** 20:.1f} MiB, every chart drawn in "
          f"{page.load_seconds:.2f} s")


def test_damaged_missing_and_unfinished_input_gives_what_is_there(report_runs, chromium, tmp_path):
    run = _copy_run(report_runs["seg1"], tmp_path / "runs" / "bad_train.pretrain_rep")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(3, '{"kind": "train", "step": \x00garbage\n')
    (run / "metrics.jsonl").write_text("".join(lines) + '{"kind": "train", "step": 99, "lo')   # still writing
    (run / "summary.json").unlink()
    (run / "result.json").unlink()
    metadata = json.loads((run / "metadata.json").read_text())
    metadata["status"] = "running"
    (run / "metadata.json").write_text(json.dumps(seal(metadata)))
    made = run_inv("snapshot.report", run.name, runs=tmp_path / "runs")
    assert made.returncode == 0, made.stderr
    page = check_page(chromium, Path(made.stdout.strip()), min_charts=4)
    notes = page.evaluate("document.querySelector('.notes').innerText")
    assert "metrics.jsonl: 1 damaged line(s) skipped (line 4)" in notes
    assert "the last line is unfinished" in notes and "still running" in notes
    # the env record damaged too: still a report, with a note
    (run / "env.json").write_text("{not json")
    again = run_inv("snapshot.report", run.name, runs=tmp_path / "runs")
    assert again.returncode == 0, again.stderr
    assert "env.json: not valid JSON" in check_page(chromium, Path(again.stdout.strip())).evaluate(
        "document.querySelector('.notes').innerText")


def test_bad_output_paths_are_one_line_exit_2_and_leave_nothing(report_runs, tmp_path):
    (tmp_path / "a_file").write_text("x")
    report = report_runs["seg1"] / "report.html"
    before = report.read_bytes() if report.exists() else None
    for out, words in ((tmp_path / "a_file" / "r.html", "is a file"), (tmp_path / "r.txt", "expected an .html"),
                       (Path("/proc/anvil-report.html"), "cannot write")):
        made = run_inv("snapshot.report", report_runs["seg1"].name, "--out", str(out), runs=report_runs["root"])
        assert made.returncode == 2, made
        assert len(made.stderr.strip().splitlines()) == 1 and words in made.stderr and "Traceback" not in made.stderr
    missing = run_inv("snapshot.report", "no-such-run", runs=report_runs["root"])
    assert missing.returncode == 2 and "no such run directory" in missing.stderr
    after = report.read_bytes() if report.exists() else None
    assert before == after and not list(tmp_path.glob("**/.*.tmp"))


def test_experts_load_is_drawn_and_labels_from_the_run_stay_text(report_runs, chromium, tmp_path):
    """A mixture-of-experts run's load (its "moe" records): the layer x expert heatmap, the step x expert
    one and the balance curves are drawn, and multi-token prediction's loss beside the train loss. A
    metrics key holding markup (a blend source named <a href=...>, written into the run directory by
    anyone) reaches the page as text: no link."""
    run = _copy_run(report_runs["seg1"], tmp_path / "runs" / "moe_train.pretrain_rep")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        if record.get("kind") == "train":
            record["mtp_loss"] = record["loss"] + 0.1
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    link = '<a href="https://example.invalid/x">click</a>'
    with open(run / "metrics.jsonl", "a") as f:
        for step in (2, 4, 6, 8):
            f.write(json.dumps({"kind": "moe", "step": step, "layers": [1, 2],
                                "load": [[10 + step, 20, 30, 40], [25, 25, 25, 25 + step]],
                                "load_min": [10, 25], "load_max": [40, 25 + step], "load_cv": [0.4, 0.05],
                                "aux_loss": 1.01 + step / 100}) + "\n")
            f.write(json.dumps({"kind": "val", "step": step, "val_loss": 3.0, f"val_loss/{link}": 3.1}) + "\n")
    made = run_inv("snapshot.report", run.name, runs=tmp_path / "runs")
    assert made.returncode == 0, made.stderr
    page = check_page(chromium, Path(made.stdout.strip()), min_charts=7)
    titles = page.evaluate("Array.from(document.querySelectorAll('.chart')).map(e => e.dataset.title)")
    assert {"experts' load over the run", "load balance", "balance loss"} <= set(titles), titles
    assert "layer 1's load over the steps" in titles      # its CV (0.4) the least even
    assert page.evaluate("document.querySelectorAll('.chart a[href]').length") == 0
    legend = page.evaluate("Array.from(document.querySelectorAll('.chart .legendtext')).map(e => e.textContent)")
    assert link in legend, legend
    assert "multi-token prediction" in legend, legend

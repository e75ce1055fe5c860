"""snapshot.show and snapshot.diff give a training run's results (status, steps, final train and
val loss, tokens/s, MFU, wall time) from its summary.json, and a benchmark's (GEMM and all-reduce figures),
through the installed inv; runs whose summary is damaged still show."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers.program import ONE_THREAD, inv, sets
from helpers.training import TINY_MODEL

# Validation on one batch at the end, so that the results have a final val loss.
RECORDED_RUN = [*TINY_MODEL, "data.seq_len=64", "data.batch_size=4", "train.log_interval=1", "train.val_interval=0",
                "train.val_batches=1", "checkpoint.interval=0", "logging.progress=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def result_runs(tmp_path_factory, dataset) -> dict[str, Path]:
    """A 2-step training run, its resumption to step 4, and a benchmark run (no summary)."""
    work = tmp_path_factory.mktemp("snapshot-results")
    run_sets = sets(f"data.path={dataset}", *RECORDED_RUN)
    made = {}
    for name, args in (("first", ["train.pretrain", *run_sets, "--set", "train.steps=2"]),
                       ("resumed", ["train.pretrain", *run_sets, "--set", "train.steps=4", "--resume", "FIRST"]),
                       ("bench", ["bench.gemm", "-M", "64", "--iters", "2", "--dtype", "fp32"])):
        proc = inv(work, *[str(made.get("first")) if a == "FIRST" else a for a in args], env=ONE_THREAD)
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = sorted((work / "runs").iterdir())[-1]
    made["work"] = work
    return made


def section(stdout: str, title: str) -> dict[str, str]:
    """The `title` block of snapshot.show: {label: value}."""
    lines = stdout.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return {line[:18].strip(): line[18:].strip() for line in lines}


def columns(stdout: str, title: str) -> dict[str, str]:
    """The `title` block of snapshot.show: {label: text}, split where two or more spaces are."""
    lines = stdout.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines)


def test_show_gives_the_results_of_a_training_run(result_runs):
    run = result_runs["resumed"]
    summary = json.loads((run / "summary.json").read_text())
    proc = inv(result_runs["work"], "snapshot.show", run)
    assert proc.returncode == 0, proc.stderr
    results = section(proc.stdout, "results")
    assert results == {
        "status": "ok", "steps": "4", "final train loss": f"{summary['final_loss']:.4f}",
        "final val loss": f"{summary['val_loss']:.4f}", "tokens/s": f"{summary['tokens_per_s']:,.0f}",
        "MFU": "n/a",  # CPU: no peak to measure against
        "wall time": f"{summary['wall_s']:.1f} s (this segment; 2 segments, {summary['wall_s_total']:.1f} s in all)"}
    first = section(inv(result_runs["work"], "snapshot.show", result_runs["first"]).stdout, "results")
    assert first["steps"] == "2" and first["wall time"].endswith(" s") and "segment" not in first["wall time"]
    shown = json.loads(inv(result_runs["work"], "snapshot.show", run, "--json").stdout)
    assert shown["results"]["final_loss"] == summary["final_loss"] and shown["results"]["segments"] == 2


def test_show_of_a_run_without_results_does_not_fail(result_runs, tmp_path):
    proc = inv(result_runs["work"], "snapshot.show", result_runs["bench"])   # a benchmark: its own results
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    gemm = json.loads((result_runs["bench"] / "gemm.json").read_text())
    assert columns(proc.stdout, "results") == {
        "GEMM": "64x64x64 fp32 on cpu", "median time": f"{gemm['median_ms']:.3f} ms",
        "TFLOP/s": f"{gemm['tflops']:.2f}", "of peak": "n/a (ran on the CPU)"}
    shown = json.loads(inv(result_runs["work"], "snapshot.show", result_runs["bench"], "--json").stdout)
    assert shown["results"]["gemm"]["tflops"] == gemm["tflops"]

    damaged = tmp_path / "runs" / "damaged"   # a training run whose summary files are damaged
    shutil.copytree(result_runs["first"], damaged, ignore=shutil.ignore_patterns("checkpoints"))
    (damaged / "summary.json").write_text('{"steps": ')
    (damaged / "result.json").unlink()
    proc = inv(tmp_path, "snapshot.show", "damaged")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "results: none (summary.json: not valid JSON (" in proc.stdout and "machine and versions" in proc.stdout
    (damaged / "summary.json").unlink()     # stopped before its summary
    assert "results: none (no summary.json" in inv(tmp_path, "snapshot.show", "damaged").stdout
    (damaged / "result.json").write_text(json.dumps({"summary": json.loads(
        (result_runs["first"] / "summary.json").read_text())}))   # what the task returned is enough
    assert section(inv(tmp_path, "snapshot.show", "damaged").stdout, "results")["steps"] == "2"


def test_diff_gives_the_results_that_differ(result_runs):
    a, b = result_runs["first"], result_runs["resumed"]
    proc = inv(result_runs["work"], "snapshot.diff", a, b, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in json.loads(proc.stdout) if r["kind"] == "result"]
    by_key = {r["key"]: (r["a"], r["b"]) for r in rows}
    assert by_key["steps"] == ("2", "4")
    assert "final train loss" in by_key and "status" not in by_key and "MFU" not in by_key  # equal: no row
    table = inv(result_runs["work"], "snapshot.diff", a, b)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[2].split()[:4] == ["result", "steps", "2", "4"]  # results come first

    with_bench = inv(result_runs["work"], "snapshot.diff", result_runs["bench"], a)
    assert with_bench.returncode == 0 and "Traceback" not in with_bench.stderr, with_bench.stderr
    line = next(line for line in with_bench.stdout.splitlines() if line.split()[:3] == ["result", "final", "train"])
    assert "(no results)" in line
    # A run without results still compares by its own status (both ok here: no status row).
    assert not any(line.split()[:2] == ["result", "status"] for line in with_bench.stdout.splitlines())
    same = inv(result_runs["work"], "snapshot.diff", result_runs["bench"], result_runs["bench"])
    assert same.stdout.strip() == "no differences"
    assert inv(result_runs["work"], "snapshot.diff", a, a).stdout.strip() == "no differences"


# ---- a benchmark's results (GEMM, all-reduce) in snapshot.show and snapshot.diff, never with a traceback

@pytest.fixture(scope="module")
def benches(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("bench-results")
    made = {"work": work}
    for name, args in (("gemm64", ["bench.gemm", "-M", "64", "--dtype", "fp32", "--iters", "2"]),
                       ("gemm96", ["bench.gemm", "-M", "96", "--dtype", "fp32", "--iters", "2"]),
                       ("allreduce", ["bench.allreduce", "--sizes", "64K,1M", "--iters", "2"])):
        proc = inv(work, *args, env=ONE_THREAD, no_traceback=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = sorted((work / "runs").iterdir())[-1]
    return made


def test_show_gives_a_benchmarks_results(benches):
    work = benches["work"]
    gemm = json.loads((benches["gemm64"] / "gemm.json").read_text())
    shown = inv(work, "snapshot.show", benches["gemm64"], no_traceback=True)
    assert shown.returncode == 0, shown.stderr
    assert columns(shown.stdout, "results") == {
        "GEMM": "64x64x64 fp32 on cpu", "median time": f"{gemm['median_ms']:.3f} ms",
        "TFLOP/s": f"{gemm['tflops']:.2f}", "of peak": "n/a (ran on the CPU)"}

    report = json.loads((benches["allreduce"] / "collectives.json").read_text())
    results = columns(inv(work, "snapshot.show", benches["allreduce"], no_traceback=True).stdout, "results")
    assert list(results) == ["all_reduce 64 KiB x 2 ranks", "all_reduce 1 MiB x 2 ranks"]
    for row, text in zip(report["results"], results.values()):
        assert text == f"busbw {row['busbw_GBps']:.2f} GB/s, algbw {row['algbw_GBps']:.2f} GB/s"
    as_json = json.loads(inv(work, "snapshot.show", benches["allreduce"], "--json", no_traceback=True).stdout)
    assert as_json["results"]["collectives"]["results"] == report["results"]


def test_diff_gives_the_benchmark_results_that_differ(benches):
    work, gemm64 = benches["work"], benches["gemm64"]
    proc = inv(work, "snapshot.diff", gemm64, benches["gemm96"], "--json", no_traceback=True)
    assert proc.returncode == 0, proc.stderr
    rows = {r["key"]: (r["a"], r["b"]) for r in json.loads(proc.stdout) if r["kind"] == "result"}
    assert rows["GEMM"] == ("64x64x64 fp32 on cpu", "96x96x96 fp32 on cpu")
    assert "median time" in rows and "of peak" not in rows       # the same on both: no row
    table = inv(work, "snapshot.diff", gemm64, benches["gemm96"], no_traceback=True).stdout.splitlines()
    assert table[2].split()[:2] == ["result", "GEMM"]           # results come first
    other = {r["key"]: (r["a"], r["b"]) for r in json.loads(inv(
        work, "snapshot.diff", gemm64, benches["allreduce"], "--json", no_traceback=True).stdout)
        if r["kind"] == "result"}
    assert other["GEMM"] == ("64x64x64 fp32 on cpu", "n/a")
    assert other["all_reduce 1 MiB x 2 ranks"][0] == "n/a"
    same = inv(work, "snapshot.diff", gemm64, gemm64, no_traceback=True)
    assert same.stdout.strip() == "no differences"

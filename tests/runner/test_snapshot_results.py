"""snapshot.show and snapshot.diff give a training run's results (status, steps, final train and
val loss, tokens/s, MFU, wall time) from its summary.json, and a benchmark's (tests/test_exits_results.py
has more), through the installed inv; runs whose summary is damaged still show."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INV = REPO / ".venv" / "bin" / "inv"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=160",
        "data.seq_len=64", "data.batch_size=4", "train.log_interval=1", "train.val_interval=0",
        "train.val_batches=1", "checkpoint.interval=0", "logging.progress=false",
        "logging.tensorboard=false"]


def inv(cwd: Path, *args) -> subprocess.CompletedProcess:
    environ = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(Path(cwd) / "runs"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(INV), *map(str, args)], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, dataset) -> dict[str, Path]:
    """A 2-step training run, its resumption to step 4, and a benchmark run (no summary)."""
    work = tmp_path_factory.mktemp("snapshot-results")
    sets = [arg for item in [f"data.path={dataset}", *TINY] for arg in ("--set", item)]
    made = {}
    for name, args in (("first", ["train.pretrain", *sets, "--set", "train.steps=2"]),
                       ("resumed", ["train.pretrain", *sets, "--set", "train.steps=4", "--resume", "FIRST"]),
                       ("bench", ["bench.gemm", "-M", "64", "--iters", "2", "--dtype", "fp32"])):
        proc = inv(work, *[str(made.get("first")) if a == "FIRST" else a for a in args])
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = sorted((work / "runs").iterdir())[-1]
    made["work"] = work
    return made


def section(stdout: str, title: str) -> dict[str, str]:
    """The `title` block of snapshot.show: {label: value}."""
    lines = stdout.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return {line[:18].strip(): line[18:].strip() for line in lines}


def test_show_gives_the_results_of_a_training_run(recorded):
    run = recorded["resumed"]
    summary = json.loads((run / "summary.json").read_text())
    proc = inv(recorded["work"], "snapshot.show", run)
    assert proc.returncode == 0, proc.stderr
    results = section(proc.stdout, "results")
    assert results == {
        "status": "ok", "steps": "4", "final train loss": f"{summary['final_loss']:.4f}",
        "final val loss": f"{summary['val_loss']:.4f}", "tokens/s": f"{summary['tokens_per_s']:,.0f}",
        "MFU": "n/a",  # CPU: no peak to measure against
        "wall time": f"{summary['wall_s']:.1f} s (this segment; 2 segments, {summary['wall_s_total']:.1f} s in all)"}
    first = section(inv(recorded["work"], "snapshot.show", recorded["first"]).stdout, "results")
    assert first["steps"] == "2" and first["wall time"].endswith(" s") and "segment" not in first["wall time"]
    shown = json.loads(inv(recorded["work"], "snapshot.show", run, "--json").stdout)
    assert shown["results"]["final_loss"] == summary["final_loss"] and shown["results"]["segments"] == 2


def test_show_of_a_run_without_results_does_not_fail(recorded, tmp_path):
    proc = inv(recorded["work"], "snapshot.show", recorded["bench"])   # a benchmark: its own results
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    gemm = json.loads((recorded["bench"] / "gemm.json").read_text())
    block = proc.stdout.split("\nresults\n", 1)[1].split("\n\n", 1)[0]
    assert dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in block.splitlines()) == {
        "GEMM": "64x64x64 fp32 on cpu", "median time": f"{gemm['median_ms']:.3f} ms",
        "TFLOP/s": f"{gemm['tflops']:.2f}", "of peak": "n/a (ran on the CPU)"}
    shown = json.loads(inv(recorded["work"], "snapshot.show", recorded["bench"], "--json").stdout)
    assert shown["results"]["gemm"]["tflops"] == gemm["tflops"]

    damaged = tmp_path / "runs" / "damaged"   # a training run whose summary files are damaged
    shutil.copytree(recorded["first"], damaged, ignore=shutil.ignore_patterns("checkpoints"))
    (damaged / "summary.json").write_text('{"steps": ')
    (damaged / "result.json").unlink()
    proc = inv(tmp_path, "snapshot.show", "damaged")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "results: none (summary.json: not valid JSON (" in proc.stdout and "machine and versions" in proc.stdout
    (damaged / "summary.json").unlink()     # stopped before its summary
    assert "results: none (no summary.json" in inv(tmp_path, "snapshot.show", "damaged").stdout
    (damaged / "result.json").write_text(json.dumps({"summary": json.loads(
        (recorded["first"] / "summary.json").read_text())}))   # what the task returned is enough
    assert section(inv(tmp_path, "snapshot.show", "damaged").stdout, "results")["steps"] == "2"


def test_diff_gives_the_results_that_differ(recorded):
    a, b = recorded["first"], recorded["resumed"]
    proc = inv(recorded["work"], "snapshot.diff", a, b, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in json.loads(proc.stdout) if r["kind"] == "result"]
    by_key = {r["key"]: (r["a"], r["b"]) for r in rows}
    assert by_key["steps"] == ("2", "4")
    assert "final train loss" in by_key and "status" not in by_key and "MFU" not in by_key  # equal: no row
    table = inv(recorded["work"], "snapshot.diff", a, b)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[2].split()[:4] == ["result", "steps", "2", "4"]  # results come first

    with_bench = inv(recorded["work"], "snapshot.diff", recorded["bench"], a)
    assert with_bench.returncode == 0 and "Traceback" not in with_bench.stderr, with_bench.stderr
    line = next(line for line in with_bench.stdout.splitlines() if line.split()[:3] == ["result", "final", "train"])
    assert "(no results)" in line
    # A run without results still compares by its own status (both ok here: no status row).
    assert not any(line.split()[:2] == ["result", "status"] for line in with_bench.stdout.splitlines())
    same = inv(recorded["work"], "snapshot.diff", recorded["bench"], recorded["bench"])
    assert same.stdout.strip() == "no differences"
    assert inv(recorded["work"], "snapshot.diff", a, a).stdout.strip() == "no differences"

"""What users expected to be told, through the installed inv: a benchmark's results in snapshot.show
and snapshot.diff; the summary's tokens/s and step time said as medians after warm-up, beside the
run's average; --compile saying that the first step compiles."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INV = REPO / ".venv" / "bin" / "inv"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=160",
        "data.seq_len=64", "data.batch_size=4", "train.val_batches=0", "checkpoint.interval=0",
        "schedule.warmup_steps=2", "logging.progress=false", "logging.tensorboard=false", "logging.gpu_stats=false"]


def inv(work: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    environ = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(work / "runs"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(INV), *map(str, args)], cwd=work, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def block(stdout: str, title: str) -> dict[str, str]:
    """snapshot.show's `title` block as {label: text}."""
    lines = stdout.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines)


@pytest.fixture(scope="module")
def benches(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("bench-results")
    made = {"work": work}
    for name, args in (("gemm64", ["bench.gemm", "-M", "64", "--dtype", "fp32", "--iters", "2"]),
                       ("gemm96", ["bench.gemm", "-M", "96", "--dtype", "fp32", "--iters", "2"]),
                       ("allreduce", ["bench.allreduce", "--sizes", "64K,1M", "--iters", "2"])):
        proc = inv(work, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = sorted((work / "runs").iterdir())[-1]
    return made


def test_show_gives_a_benchmarks_results(benches):
    gemm = json.loads((benches["gemm64"] / "gemm.json").read_text())
    shown = inv(benches["work"], "snapshot.show", benches["gemm64"])
    assert shown.returncode == 0, shown.stderr
    assert block(shown.stdout, "results") == {
        "GEMM": "64x64x64 fp32 on cpu", "median time": f"{gemm['median_ms']:.3f} ms",
        "TFLOP/s": f"{gemm['tflops']:.2f}", "of peak": "n/a (ran on the CPU)"}

    report = json.loads((benches["allreduce"] / "collectives.json").read_text())
    results = block(inv(benches["work"], "snapshot.show", benches["allreduce"]).stdout, "results")
    assert list(results) == ["all_reduce 64 KiB x 2 ranks", "all_reduce 1 MiB x 2 ranks"]
    for row, text in zip(report["results"], results.values()):
        assert text == f"busbw {row['busbw_GBps']:.2f} GB/s, algbw {row['algbw_GBps']:.2f} GB/s"
    as_json = json.loads(inv(benches["work"], "snapshot.show", benches["allreduce"], "--json").stdout)
    assert as_json["results"]["collectives"]["results"] == report["results"]


def test_diff_gives_the_benchmark_results_that_differ(benches):
    proc = inv(benches["work"], "snapshot.diff", benches["gemm64"], benches["gemm96"], "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["key"]: (r["a"], r["b"]) for r in json.loads(proc.stdout) if r["kind"] == "result"}
    assert rows["GEMM"] == ("64x64x64 fp32 on cpu", "96x96x96 fp32 on cpu")
    assert "median time" in rows and "of peak" not in rows       # the same on both: no row
    table = inv(benches["work"], "snapshot.diff", benches["gemm64"], benches["gemm96"]).stdout.splitlines()
    assert table[2].split()[:2] == ["result", "GEMM"]           # results come first
    other = {r["key"]: (r["a"], r["b"]) for r in json.loads(inv(
        benches["work"], "snapshot.diff", benches["gemm64"], benches["allreduce"], "--json").stdout)
        if r["kind"] == "result"}
    assert other["GEMM"] == ("64x64x64 fp32 on cpu", "n/a")
    assert other["all_reduce 1 MiB x 2 ranks"][0] == "n/a"
    same = inv(benches["work"], "snapshot.diff", benches["gemm64"], benches["gemm64"])
    assert same.stdout.strip() == "no differences"


def test_the_summary_says_what_its_throughput_figures_are(tmp_path, dataset):
    """One run showed 22,250 tok/s while it averaged 5.4k: the median of the steady intervals, unlabelled."""
    sets = [arg for item in [f"data.path={dataset}", *TINY, "train.steps=12", "train.log_interval=2"]
            for arg in ("--set", item)]
    proc = inv(tmp_path, "train.pretrain", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["median_steps"] == [3, 12] and summary["warmup_in_median"] is False
    assert 0 < summary["tokens_per_s_avg"] and 0 < summary["step_time_s_avg"]
    assert summary["step_time_s_avg"] == pytest.approx(12 * 64 * 4 / summary["tokens_per_s_avg"] / 12, rel=1e-6)
    table = {cells[0].strip(): cells[1].strip() for line in proc.stderr.splitlines()
             if (cells := line.strip("│ \n").split("│")) and len(cells) == 2}
    assert table["tokens/s"] == (f"{summary['tokens_per_s']:,.0f} (median, steps 3-12, after warm-up); "
                                 f"{summary['tokens_per_s_avg']:,.0f} average over the run")
    assert table["step time"] == (f"{summary['step_time_s']:.3f} s (median, steps 3-12, after warm-up); "
                                  f"{summary['step_time_s_avg']:.3f} s average over the run")
    assert table["tokens/s per device (median)"] == f"{summary['tokens_per_s_per_device']:,.0f}"


def test_compile_says_the_first_step_compiles(tmp_path, dataset):
    sets = [arg for item in [f"data.path={dataset}", *TINY, "train.steps=2", "train.log_interval=1"]
            for arg in ("--set", item)]
    proc = inv(tmp_path, "train.pretrain", *sets, "--compile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split("][INFO] ", 1)[-1] for line in proc.stderr.splitlines()]
    before = lines.index("step 1 compiles the model (torch.compile) before it trains: minutes for a large model, once")
    after = next(i for i, line in enumerate(lines)
                 if re.fullmatch(r"step 1: compiled and ran in [\d.]+ s \(torch\.compile\); the steps after it run "
                                 r"compiled", line))
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/2 | loss"))
    assert before < after < first_step

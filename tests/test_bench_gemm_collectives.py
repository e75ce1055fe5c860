"""GEMM and collective benchmarks: real products and real gloo collectives on CPU."""
import json
import subprocess
import sys

import pytest

from benchmarks.collectives import bus_factor, parse_size
from benchmarks.gemm import run_gemm


def test_parse_size_units_and_errors():
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("4096") == 4096
    assert parse_size("2kb") == 2048
    for bad in ("abc", "0", "-1M"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_bus_factor_matches_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 16) == 1.0
    with pytest.raises(ValueError):
        bus_factor("all_to_nowhere", 2)


def test_gemm_reports_flops_from_the_measured_time():
    r = run_gemm(96, 64, 32, dtype="fp32", warmup=1, iters=3, peak_tflops=1.0)
    assert (r.m, r.n, r.k, r.device) == (96, 64, 32, "cpu")
    assert r.median_ms > 0
    assert r.tflops == pytest.approx(2 * 96 * 64 * 32 / (r.median_ms * 1e-3) / 1e12)
    assert r.percent_of_peak == pytest.approx(100 * r.tflops)
    with pytest.raises(ValueError):
        run_gemm(0)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_collective_under_torchrun_checks_values_and_reports_busbw(op):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "benchmarks.collectives", "--op", op, "--sizes", "64K,256K", "--iters", "2",
         "--warmup", "1", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["backend"] == "gloo"
    rows = result["results"]
    assert [r["bytes"] for r in rows] == [64 << 10, 256 << 10]
    for r in rows:
        assert r["ranks"] == 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(op, 2))

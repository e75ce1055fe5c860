"""GEMM and collective benchmarks: real products and real gloo collectives on CPU; a stop signal during one
(as a terminal or a scheduler sends it) records it interrupted."""
import json
import re
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.collectives import bus_factor, parse_size
from benchmarks.gemm import run_gemm
from helpers.interrupts import LONG_GEMM, SIGNAL_NAME, interrupted_run, send
from helpers.processes import wait_until
from helpers.program import ONE_THREAD, inv, metadata, run_inv, runs, start_inv


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


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_collective_under_torchrun_checks_values_and_reports_busbw(op):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "benchmarks.collectives", "--op", op, "--sizes", "64K,256K", "--iters", "2",
         "--warmup", "1", "--json"] + (["--dtype", "bf16"] if op == "all_reduce" else []),
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]     # (torch >= 2.12 renamed the *_tensor collectives)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["backend"] == "gloo"
    rows = result["results"]
    assert [r["bytes"] for r in rows] == [64 << 10, 256 << 10]
    for r in rows:
        assert r["ranks"] == 2
        assert r["dtype"] == ("bfloat16" if op == "all_reduce" else "float32")   # gloo's default is fp32
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(op, 2))


def test_collective_timing_runs_calls_back_to_back_like_nccl_tests(monkeypatch):
    """A loop of calls per timer, no barrier or sync between calls (per-call timing cost 17% at 16 MiB),
    many calls without overflow, and the values still checked afterwards."""
    import torch.distributed as dist

    from benchmarks import collectives

    calls = {"barrier": 0, "op": 0}
    real_barrier, real_run = dist.barrier, collectives._run_op
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (calls.__setitem__("barrier", calls["barrier"] + 1),
                                                          real_barrier(*a, **k))[1])
    monkeypatch.setattr(collectives, "_run_op", lambda *a: (calls.__setitem__("op", calls["op"] + 1),
                                                            real_run(*a))[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        rows = collectives.measure("all_reduce", [4096], warmup=2, iters=300, repeats=3)
        assert calls == {"barrier": 3, "op": 2 + 3 * 300 + 1}   # one barrier per timed loop; one checked call
        assert rows[0]["time_us"] > 0 and rows[0]["launch"] == "eager"
        with pytest.raises(ValueError, match="needs GPUs"):     # CUDA graphs capture device work only
            collectives.measure("all_reduce", [4096], graph=True)
        monkeypatch.setattr(collectives, "_check", lambda *a: (_ for _ in ()).throw(RuntimeError("wrong sums")))
        with pytest.raises(RuntimeError, match="wrong sums"):
            collectives.measure("all_reduce", [4096], warmup=0, iters=1, repeats=1)
    finally:
        dist.destroy_process_group()


def test_inv_bench_gemm_and_allreduce_make_runs(tmp_path):
    runs_dir = tmp_path / "runs"
    env_args = ("-f", str(_settings(tmp_path, runs_dir)))
    out = run_inv(*env_args, "bench.gemm", "-M", "64", "--dtype", "fp32", "--iters", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert (result["m"], result["n"], result["k"]) == (64, 64, 64)
    [run] = list(runs_dir.glob("*_bench.gemm"))
    assert json.loads((run / "gemm.json").read_text())["tflops"] == result["tflops"]

    out = run_inv(*env_args, "bench.allreduce", "--sizes", "64K", "--iters", "2", "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    [run] = list(runs_dir.glob("*_bench.allreduce"))
    report = json.loads((run / "collectives.json").read_text())
    assert report["results"][0]["ranks"] == 2 and report["results"][0]["bytes"] == 64 << 10
    assert report["results"][0]["dtype"] == "bfloat16"   # --dtype reached the ranks (gloo's default: fp32)
    assert report["results"][0]["launch"] == "eager"   # gloo: no CUDA graph to replay
    assert "busbw GB/s" in out.stdout and "launch" in out.stdout
    assert json.loads((run / "metadata.json").read_text())["eager"] is False


def test_inv_bench_rejects_bad_input_in_one_line(tmp_path):
    env_args = ("-f", str(_settings(tmp_path, tmp_path / "runs")))
    for args, message in ((("bench.gemm", "-M", "0"), "must be positive"),
                          (("bench.gemm", "-M", "abc"), "-M: expected an integer, got 'abc'"),
                          (("bench.allreduce", "--sizes", "12Q"), "bad size"),
                          (("bench.allreduce", "--dtype", "fp8"), "unknown --dtype 'fp8' (bf16, fp32)"),
                          (("bench.kernels",), "needs a CUDA or ROCm GPU")):
        out = run_inv(*env_args, *args)
        assert out.returncode != 0
        assert message in out.stderr and "Traceback" not in out.stderr
    assert run_inv(*env_args, "bench.gemm", "-M", "abc").returncode == 2


def test_inv_bench_dry_run_prints_the_environment_and_command_and_starts_nothing(tmp_path):
    env_args = ("-f", str(_settings(tmp_path, tmp_path / "runs")))
    gemm = run_inv(*env_args, "bench.gemm", "-M", "64", "--dry-run")
    assert gemm.returncode == 0, gemm.stderr
    assert gemm.stdout.splitlines()[-1].endswith("-m benchmarks.gemm -M 64 --dtype bf16 --iters 20 --json")
    assert "export TOKENIZERS_PARALLELISM=false" in gemm.stdout
    collective = run_inv(*env_args, "bench.allreduce", "--sizes", "64K", "--dry-run")
    assert collective.returncode == 0, collective.stderr
    assert "-m runtime.launch.agent --nproc 2 -- " in collective.stdout and "--sizes 64K" in collective.stdout
    assert "--eager" not in collective.stdout          # on GPUs the default times CUDA-graph replays
    eager = run_inv(*env_args, "bench.allreduce", "--sizes", "64K", "--eager", "--dry-run")
    assert eager.returncode == 0, eager.stderr
    assert "--iters 20 --eager --out RUN_DIR/collectives.json" in eager.stdout
    fp32 = run_inv(*env_args, "bench.allreduce", "--sizes", "64K", "--dtype", "fp32", "--dry-run")
    assert fp32.returncode == 0, fp32.stderr
    assert "--iters 20 --dtype fp32 --out RUN_DIR/collectives.json" in fp32.stdout
    assert not (tmp_path / "runs").exists()


def _settings(tmp_path, runs_dir):
    path = tmp_path / "anvil.yaml"
    path.write_text(f"anvil:\n  runs_dir: {runs_dir}\n")
    return path


# ---- a stop signal during a benchmark, through the installed inv

@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, True), (signal.SIGHUP, False), (signal.SIGUSR2, True),
                                           (signal.SIGINT, True)])
def test_a_signal_during_a_benchmark_records_it_interrupted(tmp_path, signum, group):
    """It used to kill inv: exit 143 with no word, the run left "running" and later recorded lost.
    The run is also a long CPU GEMM, which says how long it will take and how far it is."""
    proc = start_inv(tmp_path, *LONG_GEMM)

    def progressing() -> bool:
        logs = [run / "logs" / "gemm.log" for run in runs(tmp_path)]
        return any(log.is_file() and "products," in log.read_text() for log in logs)
    assert wait_until(progressing, proc, timeout=120, pause=0.1), "no progress line in 120 s"
    send(proc, signum, group)
    run, err = interrupted_run(proc, tmp_path, "bench.gemm", signum)
    assert f"bench.gemm interrupted ({SIGNAL_NAME[signum]})\nrun directory: {run}" in err
    assert re.search(r"gemm on the CPU: about .+ per product, 10000005 products \(5 warm-up, 10000000 timed\): "
                     r"about .+ in all", err) and re.search(r"gemm: \d+/10000005 products, .+, about .+ left", err)
    assert metadata(run)["error"] == f"interrupted ({SIGNAL_NAME[signum]})"
    listed = inv(tmp_path, "snapshot.list", "--json", env=ONE_THREAD, timeout=120)
    assert [r["status"] for r in json.loads(listed.stdout)] == ["interrupted"]      # not "lost"


@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_signal_during_a_launched_benchmark_records_it_interrupted(tmp_path, signum, group):
    """bench.allreduce launches its ranks through the agent, which inv passes the signal on to: the
    ranks ended by it used to make "the benchmark exited with status 143", a failed run."""
    proc = start_inv(tmp_path, "bench.allreduce", "--sizes", "64K", "--iters", "1000000")

    def launched() -> bool:
        return any((run / "logs" / "launcher.log").is_file() for run in runs(tmp_path))
    assert wait_until(launched, proc, timeout=120)
    time.sleep(3)       # the ranks import torch, then measure: either way the same end
    send(proc, signum, group)
    interrupted_run(proc, tmp_path, "bench.allreduce", signum)

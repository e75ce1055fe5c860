"""inv bench.gemm / bench.allreduce input, as a user types it: bad values are one line and exit 2
before any run directory, --json is the only thing on stdout, and the CPU default is CPU-sized.

Every command runs in a fresh temporary folder with its run directories under it (cwd/runs).
"""
from __future__ import annotations

import json

import pytest
from user_input import inv, one_line_error, runs


def has_gpu() -> bool:
    from envs.detect import detect
    return detect(environ={}).has_gpu


@pytest.mark.parametrize("args", [("bench.gemm", "-M", "64", "--iters", "0"),
                                  ("bench.gemm", "-M", "64", "--iters", "-3"),
                                  ("bench.allreduce", "--sizes", "4K", "--iters", "0")])
def test_iters_below_one_is_refused_before_a_run(tmp_path, args):
    proc = inv(tmp_path, *args)
    one_line_error(proc, args[0], f"--iters {args[-1]}", "1 or more")
    assert runs(tmp_path) == []


@pytest.mark.parametrize("sizes", ["", " , ", ","])
def test_allreduce_empty_sizes_is_refused_before_a_run(tmp_path, sizes):
    proc = inv(tmp_path, "bench.allreduce", "--sizes", sizes, "--iters", "2")
    one_line_error(proc, "bench.allreduce", "--sizes", "no message size")
    assert runs(tmp_path) == []


def test_allreduce_negative_nproc_is_refused_before_a_run(tmp_path):
    proc = inv(tmp_path, "bench.allreduce", "--sizes", "4K", "--nproc", "-1")
    one_line_error(proc, "bench.allreduce", "--nproc -1")
    assert runs(tmp_path) == []


def test_json_is_all_of_stdout(tmp_path):
    gemm = inv(tmp_path, "bench.gemm", "-M", "64", "--dtype", "fp32", "--iters", "2", "--json")
    assert gemm.returncode == 0, gemm.stderr[-3000:]
    assert json.loads(gemm.stdout)["m"] == 64
    collective = inv(tmp_path, "bench.allreduce", "--sizes", "4K", "--iters", "2", "--json")
    assert collective.returncode == 0, collective.stderr[-3000:]
    report = json.loads(collective.stdout)
    assert [r["bytes"] for r in report["results"]] == [4096]
    assert "busbw GB/s" in collective.stderr     # the table still shows, on stderr


@pytest.mark.parametrize("task", ["bench.gemm", "bench.allreduce"])
def test_unsupported_runtime_is_refused_before_a_run(tmp_path, task):
    proc = inv(tmp_path, task, "-M" if task == "bench.gemm" else "--sizes", "64" if task == "bench.gemm" else "4K",
               "--runtime", "container")
    one_line_error(proc, task, "container", "direct", "slurm")
    assert runs(tmp_path) == []
    # the same runtime from the anvil.runtime setting: refused too, and --runtime direct gets past it
    proc = inv(tmp_path, task, "--dry-run", env={"INVOKE_ANVIL_RUNTIME": "container"})
    one_line_error(proc, task, "container", "anvil.runtime", "--runtime direct")
    proc = inv(tmp_path, task, "--dry-run", "--runtime", "direct", env={"INVOKE_ANVIL_RUNTIME": "container"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "container" not in proc.stdout.splitlines()[-1]
    assert runs(tmp_path) == []


@pytest.mark.skipif(has_gpu(), reason="the CPU default applies only where no GPU is visible")
def test_gemm_default_size_on_a_cpu_is_cpu_sized(tmp_path):
    proc = inv(tmp_path, "bench.gemm", "--iters", "1", "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert (result["device"], result["m"], result["n"], result["k"]) == ("cpu", 1024, 1024, 1024)
    notes = [line for line in proc.stderr.splitlines() if "-M" in line and "1024" in line and "8192" in line]
    assert len(notes) == 1, proc.stderr
    dry = inv(tmp_path, "bench.gemm", "--dry-run")
    assert dry.stdout.splitlines()[-1].endswith("-m benchmarks.gemm -M 1024 --dtype bf16 --iters 20 --json")
    given = inv(tmp_path, "bench.gemm", "-M", "8192", "--dry-run")   # given: used as is, no note
    assert " -M 8192 " in given.stdout.splitlines()[-1] and "1024" not in given.stderr
    named = inv(tmp_path, "bench.gemm", "--gpu", "H100", "--dry-run")   # a named profile: still this CPU
    assert named.stdout.splitlines()[-1].endswith("-M 1024 --dtype bf16 --iters 20 --json"), named.stdout[-2000:]


def test_gemm_help_states_the_defaults(tmp_path):
    proc = inv(tmp_path, "--help", "bench.gemm")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "default 8192 on a GPU, 1024 on a CPU" in text

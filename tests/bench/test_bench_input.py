"""inv bench.gemm / bench.allreduce input, as a user types it: bad values are one line and exit 2
before any run directory, --json is the only thing on stdout, and the CPU default is CPU-sized;
the per-node tasks (bench, preflight) take no container runtime; a GEMM larger than this machine's
memory is refused before a run unless forced.

Every command runs in a fresh temporary folder with its run directories under it (cwd/runs).
"""
from __future__ import annotations

import json

import pytest

from helpers.program import ONE_THREAD, inv, metadata, one_line_error, runs


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


TASK_ARGS = {"bench.gemm": ("-M", "64", "--dtype", "fp32", "--iters", "1"),
             "bench.allreduce": ("--sizes", "4K", "--iters", "1"), "preflight.host": ()}


@pytest.mark.parametrize("task", list(TASK_ARGS))
@pytest.mark.parametrize("runtime", ["container", "slurm+container"])
def test_a_container_runtime_is_refused_by_per_node_tasks_before_a_run(tmp_path, task, runtime):
    proc = inv(tmp_path, task, *TASK_ARGS[task], "--runtime", runtime)
    one_line_error(proc, task, f"--runtime {runtime}", "node itself", "direct", "slurm")
    assert runs(tmp_path) == []


@pytest.mark.parametrize("task", list(TASK_ARGS))
def test_a_container_in_the_runtime_setting_is_dropped_with_a_notice(tmp_path, task):
    """anvil.runtime: container (set for training) runs the per-node task on the node, and says so once."""
    proc = inv(tmp_path, task, *TASK_ARGS[task], "--json", env={"INVOKE_ANVIL_RUNTIME": "container"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if "not in a container" in line]
    assert len(notes) == 1 and "anvil.runtime is container" in notes[0] and "--runtime direct" in notes[0], proc.stderr
    json.loads(proc.stdout)     # the notice is not on stdout
    assert len(runs(tmp_path)) == 1
    # --runtime direct names the runtime: no notice
    proc = inv(tmp_path, task, *TASK_ARGS[task], "--runtime", "direct", env={"INVOKE_ANVIL_RUNTIME": "container"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not in a container" not in proc.stderr


def test_slurm_with_a_container_in_the_setting_fans_out_over_slurm(tmp_path):
    """anvil.runtime: slurm+container keeps the Slurm fan-out: outside an allocation that is Slurm's refusal."""
    proc = inv(tmp_path, "preflight.host", env={"INVOKE_ANVIL_RUNTIME": "slurm+container"},
               unset=("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
    assert "anvil.runtime is slurm+container" in proc.stderr and "--runtime slurm" in proc.stderr, proc.stderr
    one_line_error(proc, "preflight.host", "Slurm")
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


@pytest.mark.parametrize("flag", ["-M", "-N", "-K"])
def test_gemm_zero_size_is_refused_like_a_negative_one(tmp_path, flag):
    """-N 0 and -K 0 used to mean "as M"; a typed 0 is refused, only a left-out -N/-K is M."""
    sizes = (flag, "0") if flag == "-M" else ("-M", "64", flag, "0")
    proc = inv(tmp_path, "bench.gemm", *sizes, "--iters", "1")
    one_line_error(proc, "bench.gemm", f"{flag} 0", "must be positive")
    assert runs(tmp_path) == []
    dry = inv(tmp_path, "bench.gemm", "-M", "64", "-K", "16", "--dry-run")   # -N left out: M, in the child
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1].endswith("--json -K 16"), dry.stdout[-2000:]


def test_gemm_on_a_cpu_is_not_compared_with_a_named_gpus_peak(tmp_path):
    from runtime.jobs.benchmarks import peak_cell

    assert peak_cell({"device": "cpu", "percent_of_peak": 0.001}) == "n/a (ran on the CPU)"
    assert peak_cell({"device": "NVIDIA H100 80GB HBM3", "percent_of_peak": 61.25}) == "61.2%"
    assert peak_cell({"device": "NVIDIA H100 80GB HBM3", "percent_of_peak": None}) == "n/a (no GPU profile)"
    if has_gpu():
        pytest.skip("a GPU is visible: the product runs there, against the named profile's peak")
    args = ("bench.gemm", "-M", "64", "--dtype", "fp32", "--iters", "1", "--gpu", "H100")
    result = json.loads(inv(tmp_path, *args, "--json").stdout)
    assert result["device"] == "cpu" and result["peak_tflops"] is None and result["percent_of_peak"] is None
    table = inv(tmp_path, *args)
    assert table.returncode == 0 and "n/a (ran on the CPU)" in table.stdout and "%" not in table.stdout, table.stdout


# ---- a GEMM that cannot fit in this machine's memory: refused before a run, unless forced

def test_a_gemm_larger_than_memory_is_refused(tmp_path):
    """It used to launch and fail with exit 1 and an allocator's message."""
    proc = inv(tmp_path, "bench.gemm", "-M", "10000000", env=ONE_THREAD)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("bench.gemm: -M 10000000 -N 10000000 -K 10000000 bf16: A, B and the product take "
                                   f"558,793.5 GiB, more than this machine's memory ({_ram():.0f} GiB); choose a "
                                   "smaller M, N or K (--force runs it anyway)")
    assert runs(tmp_path) == []
    thin = inv(tmp_path, "bench.gemm", "-M", "10000000", "-N", "8", "-K", "8", "--dtype", "fp32", "--iters", "1",
               "--json", env=ONE_THREAD)
    assert thin.returncode == 0, thin.stderr          # what fits runs, however tall
    assert inv(tmp_path, "bench.gemm", "-M", "10000000", "--dry-run", env=ONE_THREAD).returncode == 0


def test_a_forced_gemm_that_cannot_allocate_fails_in_one_line(tmp_path):
    proc = inv(tmp_path, "bench.gemm", "-M", "10000000", "--force", env=ONE_THREAD)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "bench.gemm failed: the benchmark failed: gemm: " in proc.stderr and "allocate" in proc.stderr
    (run,) = runs(tmp_path)
    assert metadata(run)["status"] == "failed"


def _ram() -> float:
    from runtime.jobs.planning import host_memory_gib
    return host_memory_gib()

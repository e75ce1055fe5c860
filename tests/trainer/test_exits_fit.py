"""What the plan knows cannot fit is refused before launch (exit 2, no run directory) unless forced;
what probably will not fit is a warning; through the installed inv.

`--set model.dim=1000000000000` and `bench.gemm -M 10000000` used to warn (or say nothing), launch, and
fail with exit 1 and an allocator's message.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INV = REPO / ".venv" / "bin" / "inv"
HUGE = ["--set", "model.dim=1000000000000"]     # 10**12: more memory than any machine has


def inv(work: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    environ = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(work / "runs"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(INV), *args], cwd=work, env=environ, capture_output=True, text=True, timeout=timeout)


def runs(work: Path) -> list[Path]:
    return sorted((work / "runs").iterdir()) if (work / "runs").is_dir() else []


def test_a_model_that_cannot_fit_is_refused_before_launch(tmp_path, dataset):
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={dataset}", *HUGE)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("train.pretrain: the memory plan says this run cannot fit: its peak alone, before any "
                           "allowance, is ") and line.endswith("; --force launches it anyway"), line
    assert " GiB per rank (data.batch_size 16, activation checkpointing none) on this machine's " in line
    assert runs(tmp_path) == []          # before any run directory


def test_dry_run_shows_the_refusal_as_a_warning(tmp_path, dataset):
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={dataset}", *HUGE, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the memory plan says this run cannot fit" in proc.stderr
    assert "; a launch is refused without --force" in proc.stderr and runs(tmp_path) == []


def test_force_launches_what_the_plan_refuses(tmp_path, dataset):
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={dataset}", *HUGE, "--force")
    assert "WARNING: the memory plan says this run cannot fit" in proc.stderr, proc.stderr
    (run,) = runs(tmp_path)              # it launched; the rank then could not allocate the model
    assert proc.returncode == 1 and json.loads((run / "metadata.json").read_text())["status"] == "failed"
    assert "can't allocate memory" in proc.stderr


def test_a_run_that_probably_will_not_fit_is_only_warned_about(tmp_path):
    """Between the peak and the peak with the plan's allowances (fragmentation, context, buffers):
    two H100s for llama3_8b need about 87 GiB each with them, 81.3 GiB without."""
    proc = inv(tmp_path, "train.pretrain", "--config", str(REPO / "configs" / "llama3_8b.yaml"), "--set", "data.path=synthetic",
               "--gpu", "H100:2", "--nproc", "2", "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the memory plan says this run will not fit: it needs about 87" in proc.stderr
    assert "refused" not in proc.stderr


def test_fit_tells_certain_from_probable(monkeypatch):
    """The line between them: the peak alone against the memory, beyond the plan's own error."""
    import envs
    from runtime.jobs import planning
    from trainer.config import load
    from trainer.plan import Device, memory

    cfg = load("configs/tiny.yaml", [])
    cpu = envs.resolve(config_env=cfg.env)
    if cpu.machine.has_gpu:
        pytest.skip("a GPU is visible: the host-memory check is for machines without one")
    fp32 = planning.with_changes(cfg, **{"precision.compute": "fp32"})
    peak = memory(fp32, 1, Device("CPU", 1000.0, "cpu")).peak_bytes / planning.GIB
    for ram, certain in ((peak / 1.05, True), (peak / 1.01, False)):
        monkeypatch.setattr(planning, "host_memory_gib", lambda ram=ram: ram)
        verdict = planning.fit(cfg, cpu, 1, 1, on_this_machine=True)
        assert verdict is not None and verdict.certain is certain, (ram, verdict)
        assert ("cannot fit" if certain else "will not fit") in verdict.message
    monkeypatch.setattr(planning, "host_memory_gib", lambda: peak * 2)
    assert planning.fit(cfg, cpu, 1, 1, on_this_machine=True) is None
    assert planning.fit(cfg, cpu, 1, 1, on_this_machine=False) is None   # Slurm nodes, unseen from here


def test_a_gemm_larger_than_memory_is_refused(tmp_path):
    proc = inv(tmp_path, "bench.gemm", "-M", "10000000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("bench.gemm: -M 10000000 -N 10000000 -K 10000000 bf16: A, B and the product take "
                                   f"558,793.5 GiB, more than this machine's memory ({_ram():.0f} GiB); choose a "
                                   "smaller M, N or K (--force runs it anyway)")
    assert runs(tmp_path) == []
    thin = inv(tmp_path, "bench.gemm", "-M", "10000000", "-N", "8", "-K", "8", "--dtype", "fp32", "--iters", "1",
               "--json")
    assert thin.returncode == 0, thin.stderr          # what fits runs, however tall
    assert inv(tmp_path, "bench.gemm", "-M", "10000000", "--dry-run").returncode == 0


def test_a_forced_gemm_that_cannot_allocate_fails_in_one_line(tmp_path):
    proc = inv(tmp_path, "bench.gemm", "-M", "10000000", "--force")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "bench.gemm failed: the benchmark failed: gemm: " in proc.stderr and "allocate" in proc.stderr
    (run,) = runs(tmp_path)
    assert json.loads((run / "metadata.json").read_text())["status"] == "failed"


def _ram() -> float:
    from runtime.jobs.planning import host_memory_gib
    return host_memory_gib()

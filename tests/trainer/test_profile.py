"""Rank-targeted profiling: trainer.profiling's window and `inv profile.train` end to end (2 gloo ranks)."""
import json

import pytest

from helpers.program import run_inv
from trainer.profiling import ProfileSettingsError, StepProfiler, parse_ranks, parse_steps


def test_window_and_rank_parsing():
    assert parse_steps("3:6") == (3, 6)
    assert parse_steps("5") == (5, 6)
    assert parse_ranks("0,8") == {0, 8}
    assert parse_ranks("all") is None
    for bad in ("0:3", "6:3", "x", "3:"):
        with pytest.raises(ProfileSettingsError):
            parse_steps(bad)
    with pytest.raises(ProfileSettingsError):
        parse_ranks("zero")


def test_only_the_asked_ranks_profile(tmp_path):
    env = {"ANVIL_PROFILE_STEPS": "2:3", "ANVIL_PROFILE_RANKS": "1"}
    assert StepProfiler.from_env(tmp_path, 0, env) is None
    assert StepProfiler.from_env(tmp_path, 1, env) is not None
    assert StepProfiler.from_env(tmp_path, 1, {}) is None


def test_profiler_records_only_its_window(tmp_path):
    import torch

    profiler = StepProfiler(tmp_path, rank=0, start=2, end=3)
    a = torch.randn(32, 32)
    profiler.step_done(0)       # the loop's call before its first step
    for step in range(1, 5):
        (torch.mm if step == 2 else torch.add)(a, a)   # mm only inside the window
        profiler.step_done(step)
    profiler.close()
    report = json.loads((tmp_path / "profile" / "rank0.ops.json").read_text())
    names = {op["name"] for op in report["ops"]}
    assert "aten::mm" in names and "aten::add" not in names
    assert json.loads((tmp_path / "profile" / "rank0.trace.json").read_text())["traceEvents"]




@pytest.mark.parametrize("start_step, window, recorded", [(0, (1, 3), {1, 2}), (5, (4, 8), {6, 7}), (9, (4, 8), set())])
def test_a_window_from_step_1_or_one_a_resumed_run_starts_inside_is_recorded(tmp_path, start_step, window,
                                                                               recorded):
    """Step N's work runs between step_done(N-1) and step_done(N); the loop first calls step_done with the
    step it starts from (0, or a resumed run's). Each step here leaves its number as a tensor size."""
    import torch

    profiler = StepProfiler(tmp_path, rank=0, start=window[0], end=window[1])
    profiler.step_done(start_step)
    for step in range(start_step + 1, 10):
        torch.zeros(step, 1000 + step).add_(1)
        profiler.step_done(step)
    profiler.close()
    ops = tmp_path / "profile" / "rank0.ops.json"
    if not recorded:
        assert not ops.exists()
        return
    trace = json.loads((tmp_path / "profile" / "rank0.trace.json").read_text())["traceEvents"]
    sizes = {dims[0][1] for e in trace if e.get("name") == "aten::add_"
             for dims in [e.get("args", {}).get("Input Dims") or [[0, 0]]]}
    assert {s - 1000 for s in sizes} == recorded


@pytest.mark.slow
def test_inv_profile_train_traces_one_rank_of_two(tmp_path, dataset):
    sets = [f"data.path={dataset}", "data.seq_len=32", "data.batch_size=2", "model.n_layers=1",
            "train.val_interval=0", "train.log_interval=1"]
    args = ["profile.train", "--nproc", "2", "--ranks", "1", "--steps", "1:3", "--env", "OMP_NUM_THREADS=1"]
    for item in sets:
        args += ["--set", item]
    proc = run_inv(*args, runs=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.endswith("_profile.train_tiny")
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank1.breakdown.json", "rank1.ops.json",
                                                                    "rank1.trace.json", "summary.json"]
    report = json.loads((run / "profile" / "rank1.ops.json").read_text())
    assert report["steps"] == [1, 3] and report["ops"]      # from step 1: the loop's call before its first step
    assert report["wall_ms"] > 0                             # the window's time, synchronised at both ends
    summary = json.loads((run / "profile" / "summary.json").read_text())
    assert summary["ranks"]["1"]["breakdown"]["error"].startswith("no GPU kernels")   # a CPU run: no split
    assert "no step-time breakdown: no GPU kernels in the trace" in proc.stdout
    assert "rank 1, steps 1..2" in proc.stdout and "aten::" in proc.stdout
    assert "self CPU ms" in proc.stdout and "self device ms" not in proc.stdout     # a CPU run: no device column
    assert "USDT:" not in proc.stdout + proc.stderr and "profiler_start" not in proc.stdout + proc.stderr
    assert json.loads((run / "metadata.json").read_text())["status"] == "ok"


def test_inv_profile_train_rejects_a_bad_window(tmp_path):
    proc = run_inv("profile.train", "--steps", "5:2", runs=tmp_path / "runs")
    assert proc.returncode == 2
    assert "--steps '5:2': expected START:END with 1 <= START < END" in proc.stderr and "Traceback" not in proc.stderr
    # A rank the job will not have is said before anything runs (it trained, then found no trace).
    absent = run_inv("profile.train", "--ranks", "0,5", "--nproc", "2", "--set", "data.path=synthetic",
                     runs=tmp_path / "runs")
    assert absent.returncode == 2 and "--ranks 0,5: this job has 2 rank(s), 0..1" in absent.stderr, absent.stderr
    assert not (tmp_path / "runs").exists()


def test_inv_profile_train_dry_run_prints_config_and_command_and_starts_nothing(tmp_path, dataset):
    proc = run_inv("profile.train", "--dry-run", "--steps", "2:4", "--ranks", "1", "--nproc", "2", "--set",
                   f"data.path={dataset}", "--set", "model.n_layers=1", runs=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import yaml
    config_text, _, rest = proc.stdout.partition("\n\n")   # (warnings go to stderr)
    config = yaml.safe_load(config_text)
    assert config["data"]["path"] == str(dataset) and config["model"]["n_layers"] == 1
    assert config["train"]["steps"] == 3 and config["checkpoint"]["save_final"] is False  # cut after the window
    (command,) = [line for line in rest.splitlines() if "-m runtime.launch.agent" in line]
    assert "--nproc 2" in command and command.endswith("-m trainer --config RUN_DIR/configs/train.yaml --run-dir RUN_DIR")
    assert "ANVIL_PROFILE_STEPS=2:4 ANVIL_PROFILE_RANKS=1" in rest
    assert not (tmp_path / "runs").exists()   # no run directory, nothing started

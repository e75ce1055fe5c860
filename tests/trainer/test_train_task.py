"""`inv train.pretrain` through the installed inv, end to end on a tiny CPU run: run dir with the
snapshot, the config as used, metrics.jsonl, rank logs and the summary; bad input is one message; the
summary's tokens/s and step time said as medians after warm-up, beside the run's average; --compile
saying that the first step compiles."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers.program import INV, ONE_THREAD, REPO, inv, run_inv, runs, sets
from helpers.training import TINY_RUN


@pytest.mark.slow
def test_pretrain_end_to_end(tmp_path, dataset):
    sets = [f"data.path={dataset}", "data.seq_len=64", "data.batch_size=8", "train.steps=12",
            "train.log_interval=4", "train.val_interval=0", "schedule.warmup_steps=2",
            "checkpoint.interval=0"]
    args = ["train.pretrain", "--name", "e2e", "--env", "OMP_NUM_THREADS=1", "--json"]
    for item in sets:
        args += ["--set", item]
    proc = run_inv(*args, runs=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(tmp_path)
    assert run.name.endswith("_train.pretrain_e2e")
    summary = json.loads(proc.stdout)
    assert summary["status"] == "ok" and summary["steps"] == 12 and summary["run_dir"] == str(run)
    assert json.loads((run / "summary.json").read_text())["final_loss"] == summary["final_loss"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 8, 12, 12]  # three train intervals, the final validation
    assert "| loss " in (run / "logs" / "rank0.log").read_text()
    assert "final train loss" in proc.stderr  # the trainer's summary table (tabulate)
    # logging.tensorboard: null (tiny.yaml): event files when TensorBoard is installed, no warning when not
    import importlib.util
    assert (run / "tensorboard").is_dir() == (importlib.util.find_spec("tensorboard") is not None)
    assert "TensorBoard cannot be used here" not in proc.stderr
    from trainer.config import load
    used = load(run / "configs" / "train.yaml")  # the config as used, overrides applied: the ranks read it
    assert used.train.steps == 12 and used.data.path == str(dataset)
    assert not (run / "config.yaml").exists()   # once in a run directory (a replay reads the same file)
    assert "--config " + str(run / "configs" / "train.yaml") in (run / "logs" / "launcher.log").read_text()
    assert json.loads((run / "metadata.json").read_text())["status"] == "ok"
    assert (run / "env.json").is_file() and (run / "checkpoints" / "step_12" / "COMPLETE").is_file()

    # --resume auto on the finished run: says it is complete, makes no new run, saves nothing again.
    again = run_inv(*args, "--resume", "auto", runs=tmp_path / "runs")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete at step 12 of train.steps=12" in again.stderr
    assert runs(tmp_path) == [run]


def test_bad_config_is_one_message_and_no_run(tmp_path):
    proc = run_inv("train.pretrain", "--set", "optim.lr=fast", runs=tmp_path / "runs", timeout=60)
    assert proc.returncode == 2
    assert "tiny.yaml with --set optim.lr=fast: optim.lr: expected a number, got 'fast'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert runs(tmp_path) == []


def test_missing_data_says_how_to_prepare(tmp_path):
    proc = run_inv("train.pretrain", "--config", "configs/llama3_8b.yaml", "--set", f"data.path={tmp_path / 'llama3'}",
                   runs=tmp_path / "runs", timeout=60)
    assert proc.returncode == 2
    assert "inv data.prepare --input" in proc.stderr and "tokenizer.json" in proc.stderr
    assert runs(tmp_path) == []


@pytest.mark.slow
def test_progress_bar_on_the_terminal_only(tmp_path, dataset):
    """Rank 0 draws its bar on the terminal inv runs on (a pty from `script`), never into logs or pipes."""
    import shlex
    import shutil

    if shutil.which("script") is None:
        pytest.skip("needs util-linux script (a pseudo-terminal)")
    argv = [str(INV), "train.pretrain", "--set", f"data.path={dataset}", "--set", "train.steps=6",
            "--set", "data.seq_len=32", "--set", "train.val_interval=0", "--set", "checkpoint.interval=0"]
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["INVOKE_ANVIL_RUNS_DIR"] = str(tmp_path / "runs")
    typescript = tmp_path / "typescript"
    done = subprocess.run(["script", "-qec", shlex.join(argv), str(typescript)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "6/6 100%" in typescript.read_text(errors="replace")      # drawn on the terminal
    (run,) = runs(tmp_path)
    for log in (run / "logs").glob("*.log"):
        assert "[#" not in log.read_text(), log                          # never in the logs
    piped = run_inv(*argv[1:], runs=tmp_path / "runs")                                    # no terminal: no bar at all
    assert piped.returncode == 0 and "\r\x1b[K" not in piped.stdout + piped.stderr


def test_resume_auto_on_a_fanned_out_host_finds_its_own_earlier_runs(tmp_path):
    """`inv -H n1,n2 train.pretrain --resume auto`: each host's runs live in FANOUT/hosts/<host>/,
    a new fan-out run each time; auto finds this host's newest checkpoint in an earlier one."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from runtime.jobs.training import previous_checkpoint
    from trainer.checkpoint import COMPLETE_MARKER

    one = tmp_path / "one"    # a real DCP checkpoint of one tensor: find_latest reads its .metadata as data
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=one, no_dist=True)

    def checkpoint(fanout: str, host: str, run: str, step: int) -> Path:
        path = tmp_path / "runs" / fanout / "hosts" / host / run / "checkpoints" / f"step_{step}"
        shutil.copytree(one, path)
        (path / COMPLETE_MARKER).write_text("")
        return path

    older = checkpoint("2026-01-01T00-00-00_train.pretrain", "n1", "2026-01-01T00-00-01_train.pretrain_tiny", 2)
    mine = checkpoint("2026-01-02T00-00-00_train.pretrain", "n1", "2026-01-02T00-00-01_train.pretrain_tiny", 4)
    checkpoint("2026-01-03T00-00-00_train.pretrain", "n2", "2026-01-03T00-00-01_train.pretrain_tiny", 9)
    checkpoint("2026-01-03T00-00-00_train.pretrain", "n1", "2026-01-03T00-00-01_train.pretrain_other", 9)
    now = tmp_path / "runs" / "2026-01-04T00-00-00_train.pretrain" / "hosts" / "n1"
    now.mkdir(parents=True)
    assert previous_checkpoint(now, "tiny") == str(mine) != str(older)
    assert previous_checkpoint(tmp_path / "runs", "tiny") is None      # not a host: only its own folder


def test_the_summary_says_what_its_throughput_figures_are(tmp_path, dataset):
    """One run showed 22,250 tok/s while it averaged 5.4k: the median of the steady intervals, unlabelled."""
    run_sets = sets(f"data.path={dataset}", *TINY_RUN, "train.steps=12", "train.log_interval=2")
    proc = inv(tmp_path, "train.pretrain", *run_sets, env=ONE_THREAD, timeout=600, no_traceback=True)
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
    run_sets = sets(f"data.path={dataset}", *TINY_RUN, "train.steps=2", "train.log_interval=1")
    proc = inv(tmp_path, "train.pretrain", *run_sets, "--compile", env=ONE_THREAD, timeout=600, no_traceback=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split("][INFO] ", 1)[-1] for line in proc.stderr.splitlines()]
    before = lines.index("step 1 compiles the model (torch.compile) before it trains: minutes for a large model, once")
    after = next(i for i, line in enumerate(lines)
                 if re.fullmatch(r"step 1: compiled and ran in [\d.]+ s \(torch\.compile\); the steps after it run "
                                 r"compiled", line))
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/2 | loss"))
    assert before < after < first_step

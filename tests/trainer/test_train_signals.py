"""Every exit tells the truth: SIGTERM, SIGHUP and SIGUSR2 end a task as Ctrl-C does, through the
installed inv, as a terminal (the whole process group) or a scheduler (inv alone) sends them.

train.pretrain before its first step (inv starting, its pre hooks, the ranks building the model)
says "interrupted (SIGX) before the first step" with the exit of the README's table (3 for SIGTERM
and SIGUSR2, 130 for SIGINT and SIGHUP), never "rank 0 failed first"; data.prepare, bench.* and
preflight.* exit 128+N (130 for Ctrl-C), record their run `interrupted`, and leave no temporary
folder, lock or process behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.processes import start_as_from_a_terminal, wait_until

REPO = Path(__file__).resolve().parents[2]
INV = REPO / ".venv" / "bin" / "inv"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=160",
        "data.seq_len=64", "data.batch_size=4", "train.steps=400", "train.log_interval=1", "train.val_batches=0",
        "checkpoint.interval=0", "logging.progress=false", "logging.tensorboard=false", "logging.gpu_stats=false"]
# About 103 M parameters: the ranks take seconds to build it (and say so), a window before the trainer's
# own signal handler is in place.
SLOW_TO_BUILD = ["model.dim=1024", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8",
                 "model.ffn_dim=2816", "data.seq_len=64", "data.batch_size=1"]
TRAINING_EXIT = {signal.SIGTERM: 3, signal.SIGUSR2: 3, signal.SIGINT: 130, signal.SIGHUP: 130}
NAME = {signal.SIGTERM: "SIGTERM", signal.SIGUSR2: "SIGUSR2", signal.SIGINT: "Ctrl-C", signal.SIGHUP: "SIGHUP"}


def environ(work: Path, **extra: str) -> dict:
    return {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(work / "runs"), "OMP_NUM_THREADS": "1", **extra}


def start(work: Path, *args: str, **extra: str) -> subprocess.Popen:
    """inv as typed on a terminal: its own process group (os.killpg is what the terminal does)."""
    return start_as_from_a_terminal([str(INV), *args], cwd=work, env=environ(work, **extra), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` yet (Linux: /proc/PID/status SigCgt). inv sets
    its handlers for the four stop signals together, first thing (runtime/program/interrupts.py)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (signum - 1) & 1)


def send(proc: subprocess.Popen, signum: int, group: bool = True) -> None:
    (os.killpg if group else os.kill)(proc.pid, signum)


def ended(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running {timeout} s after the signal:\n{err[-3000:]}")
    return proc.returncode, out, err


def group_gone(pgid: int, timeout: float = 30) -> bool:
    """Every process of the group (workers, agent, ranks) has ended."""
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
            return False
        except ProcessLookupError:
            return True
    return wait_until(gone, timeout=timeout)


def runs(work: Path) -> list[Path]:
    return sorted(p for p in (work / "runs").glob("*") if p.is_dir()) if (work / "runs").is_dir() else []


def metadata(run: Path) -> dict:
    return json.loads((run / "metadata.json").read_text())


def clean(out: str, err: str) -> None:
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, err[-3000:]


def interrupted_run(proc: subprocess.Popen, work: Path, task: str, signum: int) -> tuple[Path, str]:
    """(the run, stderr) of a task a stop signal ended: exit 128+N, "TASK interrupted (SIGX)" said, the
    run recorded interrupted with that status, and nothing of its process group left."""
    code, out, err = ended(proc)
    clean(out, err)
    (run,) = runs(work)
    assert code == 128 + signum and f"{task} interrupted ({NAME[signum]})" in err, err[-3000:]
    md = metadata(run)
    assert md["status"] == "interrupted" and md["exit_code"] == code
    assert group_gone(proc.pid)
    return run, err


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


# ---------------------------------------------------------------- train.pretrain before its first step

def sleeping_hook(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """A --patch hook that says it started (a file) and then waits: a run held in its pre hooks."""
    started = tmp_path / "hook-started"
    hook = tmp_path / f"wait.{kind}"
    if kind == "sh":
        hook.write_text(f"touch {started}\nsleep 120\n")
    else:
        hook.write_text(f"import time\nfrom pathlib import Path\n\ndef hook(ctx):\n"
                        f"    Path({str(started)!r}).touch()\n    time.sleep(120)\n")
    return hook, started


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_inv_starts_is_an_interruption_before_the_first_step(tmp_path, dataset, signum):
    """It used to end inv silently: exit 143 or 129, or exit 1 for a Ctrl-C (Invoke's)."""
    proc = start(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *TINY))
    # inv's handlers come all at once; SIGTERM's tells (Python handles SIGINT from its first moment,
    # and a Ctrl-C before inv's own handler is Python's: a traceback out of its site module)
    assert wait_until(lambda: catches(proc.pid, signal.SIGTERM), proc, timeout=60, pause=0.005)
    send(proc, signum)
    code, out, err = ended(proc)
    clean(out, err)
    assert code == TRAINING_EXIT[signum], err[-3000:]
    assert f"train.pretrain interrupted ({NAME[signum]}) before the first step" in err, err[-3000:]
    for run in runs(tmp_path):      # (one may exist: the signal may land once the run directory is made)
        assert metadata(run)["status"] == "interrupted" and metadata(run)["exit_code"] == code
    assert group_gone(proc.pid)


@pytest.mark.parametrize("hook_kind, signum", [("sh", signal.SIGTERM), ("py", signal.SIGUSR2),
                                               ("sh", signal.SIGHUP)])
def test_a_signal_in_the_pre_hooks_records_the_run_interrupted(tmp_path, dataset, hook_kind, signum):
    """A Python hook used to turn it into "hook ... failed: KeyboardInterrupt" and a failed run."""
    hook, started = sleeping_hook(tmp_path, hook_kind)
    proc = start(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *TINY), "--patch", str(hook))
    assert wait_until(started.exists, proc, timeout=120)
    send(proc, signum)
    code, out, err = ended(proc)
    clean(out, err)
    (run,) = runs(tmp_path)
    assert code == TRAINING_EXIT[signum] and metadata(run)["exit_code"] == code, err[-3000:]
    assert metadata(run)["status"] == "interrupted"
    said = f"train.pretrain interrupted ({NAME[signum]}) before the first step"
    assert said in err and f"run directory: {run}" in err and "failed" not in err, err[-3000:]
    assert group_gone(proc.pid)


@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, True), (signal.SIGTERM, False), (signal.SIGHUP, True),
                                           (signal.SIGUSR2, True), (signal.SIGINT, True)])
def test_a_signal_while_the_ranks_build_the_model_is_no_rank_failure(tmp_path, dataset, signum, group):
    """SIGTERM before the trainer's handler is in place ends the rank at once: it used to read
    "train.pretrain failed: rank 0 on HOST failed first (signal 15)", exit 143, status failed.
    `group`: to the whole process group (a terminal, Slurm), or to inv alone (which passes it on)."""
    proc = start(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *TINY, *SLOW_TO_BUILD))

    def building() -> bool:
        logs = [run / "logs" / "rank0.log" for run in runs(tmp_path)]
        return any(log.is_file() and "building model" in log.read_text() for log in logs)
    assert wait_until(building, proc, timeout=180, pause=0.02), "the ranks never said they build the model"
    send(proc, signum, group)
    code, out, err = ended(proc)
    clean(out, err)
    (run,) = runs(tmp_path)
    assert code == TRAINING_EXIT[signum], err[-3000:]
    assert (f"train.pretrain interrupted ({NAME[signum]}) before the first step: nothing to checkpoint" in err
            and "failed first" not in err), err[-3000:]
    md = metadata(run)
    assert md["status"] == "interrupted" and md["exit_code"] == code
    assert not list(run.glob("checkpoints/step_*")) and not (run / "summary.json").exists()
    agent = json.loads((run / "logs" / "agent-0.json").read_text())
    assert agent["exit_code"] == code and agent["first_failure"] is None
    assert re.search(r"building model tiny: 10\d,\d{3},\d{3} parameters on cpu; a model this size takes a while",
                     (run / "logs" / "rank0.log").read_text())     # said while it builds
    assert group_gone(proc.pid)


def test_after_the_first_step_a_signal_still_checkpoints(tmp_path, dataset):
    """The line between the two: once a step is done, SIGTERM checkpoints and says so (exit 3)."""
    proc = start(tmp_path, "train.pretrain", *sets(f"data.path={dataset}", *TINY))

    def stepped() -> bool:
        return any((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()
                   for run in runs(tmp_path))
    assert wait_until(stepped, proc, timeout=180)
    send(proc, signal.SIGTERM)
    code, out, err = ended(proc)
    clean(out, err)
    (run,) = runs(tmp_path)
    assert code == 3 and "stopped on a signal after checkpointing" in err, err[-3000:]
    assert metadata(run)["status"] == "preempted" and list(run.glob("checkpoints/step_*"))


# ---------------------------------------------------------------- data.prepare

@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(a corpus of about 6 MB, a BPE tokenizer.json): Hugging Face BPE tokenizes ~1 MB/s a worker,
    seconds of parts to interrupt."""
    import random

    root = tmp_path_factory.mktemp("slow-corpus")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = [f"w{rng.randrange(4000)}x{i % 13}" for i in range(20000)]
    for f in range(12):
        lines = (" ".join(rng.choice(words) for _ in range(40)) for _ in range(1300))
        (corpus / f"doc{f:02d}.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tok = root / "bpe.json"
    proc = subprocess.run([str(INV), "data.tokenizer", "--input", str(corpus / "doc00.jsonl"), "--vocab-size", "400",
                           "--out", str(tok)], cwd=root, env=environ(root), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return corpus, tok


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2])
def test_a_signal_while_prepare_tokenizes_keeps_the_finished_parts(tmp_path, slow_corpus, signum):
    """It used to kill inv and its workers where they stood: a temporary folder and the lock left
    beside the dataset, no word, exit 143 (SIGUSR2 also killed multiprocessing's resource tracker,
    which then printed tracebacks)."""
    from trainer.data.parts import WorkFolder

    corpus, tok = slow_corpus
    out = tmp_path / "ds"
    command = ["data.prepare", "--input", str(corpus), "--tokenizer", str(tok), "--out", str(out), "--workers", "2"]
    proc = start(tmp_path, *command)

    def a_part_done() -> bool:
        try:   # the work folder is made under a temporary name and renamed: glob can race with it
            return any(p.name != "plan.json" for p in tmp_path.glob(".ds.parts-*/*.json"))
        except FileNotFoundError:
            return False
    assert wait_until(a_part_done, proc, timeout=300, pause=0.02)
    assert proc.poll() is None, "prepare finished before it could be interrupted"
    send(proc, signum)
    code, out_text, err = ended(proc)
    clean(out_text, err)
    assert code == 128 + signum, err[-3000:]
    said = re.search(rf"data\.prepare: interrupted \({NAME[signum]}\): (\d+) of (\d+) parts of the new dataset "
                     rf"are finished and kept in (\S+); nothing was put at {re.escape(str(out))}; run the same "
                     rf"command again to continue from there", err)
    assert said, err[-3000:]
    assert "resource_tracker" not in err and "leaked" not in err
    assert group_gone(proc.pid), "a worker outlived the interrupted prepare"
    assert not out.exists() and not list(tmp_path.glob("ds.tmp-*")) and not (tmp_path / ".ds.lock").exists()
    (parts,) = tmp_path.glob(".ds.parts-*")
    assert str(parts) == said[3] and not list(parts.glob("*.tmp"))   # the workers dropped their unit halfway
    folder = WorkFolder(parts)
    finished = [int(p.stem) for p in parts.glob("0*.json")]
    assert len(finished) == int(said[1]) > 0 and all(folder.finished(i) is not None for i in finished)

    again = subprocess.run([str(INV), *command], cwd=tmp_path, env=environ(tmp_path), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"continued a stopped prepare: {said[1]} of {said[2]} parts were already finished" in again.stdout
    whole = subprocess.run([str(INV), *command[:-4], "--out", str(tmp_path / "whole"), "--workers", "2"],
                           cwd=tmp_path, env=environ(tmp_path), capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    assert tree(out) == tree(tmp_path / "whole")      # the same dataset as an uninterrupted build


def test_sigterm_while_prepare_assembles_keeps_the_old_dataset(tmp_path):
    """The same as Ctrl-C (tests/test_bad_input_more.py) at the last stage, the shards being written."""
    from trainer.data.dataset import read_manifest

    out = tmp_path / "ds"
    first = subprocess.run([str(INV), "data.prepare", "--out", str(out), "--max-docs", "50", "-q"], cwd=tmp_path,
                           env=environ(tmp_path), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    before = read_manifest(out)
    proc = start(tmp_path, "data.prepare", "--out", str(out), "--shard-tokens", "1000", "--force", "--workers", "2")

    def sharding() -> bool:
        tmps = list(tmp_path.glob("ds.tmp-*"))
        return bool(tmps) and len(list(tmps[0].glob("train/*.bin"))) >= 3
    assert wait_until(sharding, proc, timeout=300, pause=0.01)
    assert proc.poll() is None, "prepare finished before it could be interrupted"
    send(proc, signal.SIGTERM)
    code, out_text, err = ended(proc)
    clean(out_text, err)
    assert code == 143 and "data.prepare: interrupted (SIGTERM): " in err, err[-3000:]
    assert f"the dataset already at {out} is intact" in err
    assert read_manifest(out) == before
    assert not list(tmp_path.glob("ds.tmp-*")) and not list(tmp_path.glob("ds.old-*"))
    assert not (tmp_path / ".ds.lock").exists() and group_gone(proc.pid)


# ---------------------------------------------------------------- bench.*, preflight.*, any task

LONG_GEMM = ("bench.gemm", "-M", "512", "--dtype", "fp32", "--iters", "10000000")   # hours on a CPU


@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, True), (signal.SIGHUP, False), (signal.SIGUSR2, True),
                                           (signal.SIGINT, True)])
def test_a_signal_during_a_benchmark_records_it_interrupted(tmp_path, signum, group):
    """It used to kill inv: exit 143 with no word, the run left "running" and later recorded lost.
    The run is also a long CPU GEMM, which says how long it will take and how far it is."""
    proc = start(tmp_path, *LONG_GEMM)

    def progressing() -> bool:
        logs = [run / "logs" / "gemm.log" for run in runs(tmp_path)]
        return any(log.is_file() and "products," in log.read_text() for log in logs)
    assert wait_until(progressing, proc, timeout=120, pause=0.1), "no progress line in 120 s"
    send(proc, signum, group)
    run, err = interrupted_run(proc, tmp_path, "bench.gemm", signum)
    assert f"bench.gemm interrupted ({NAME[signum]})\nrun directory: {run}" in err
    assert re.search(r"gemm on the CPU: about .+ per product, 10000005 products \(5 warm-up, 10000000 timed\): "
                     r"about .+ in all", err) and re.search(r"gemm: \d+/10000005 products, .+, about .+ left", err)
    assert metadata(run)["error"] == f"interrupted ({NAME[signum]})"
    listed = subprocess.run([str(INV), "snapshot.list", "--json"], cwd=tmp_path, env=environ(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert [r["status"] for r in json.loads(listed.stdout)] == ["interrupted"]      # not "lost"


@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_signal_during_a_launched_benchmark_records_it_interrupted(tmp_path, signum, group):
    """bench.allreduce launches its ranks through the agent, which inv passes the signal on to: the
    ranks ended by it used to make "the benchmark exited with status 143", a failed run."""
    proc = start(tmp_path, "bench.allreduce", "--sizes", "64K", "--iters", "1000000")

    def launched() -> bool:
        return any((run / "logs" / "launcher.log").is_file() for run in runs(tmp_path))
    assert wait_until(launched, proc, timeout=120)
    time.sleep(3)       # the ranks import torch, then measure: either way the same end
    send(proc, signum, group)
    interrupted_run(proc, tmp_path, "bench.allreduce", signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2])
def test_a_signal_during_preflight_records_it_interrupted(tmp_path, signum):
    hook, started = sleeping_hook(tmp_path, "sh")
    proc = start(tmp_path, "preflight.all", "--patch", str(hook))
    assert wait_until(started.exists, proc, timeout=120)
    send(proc, signum)
    interrupted_run(proc, tmp_path, "preflight.all", signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_a_task_without_a_run_is_one_line(tmp_path, signum):
    """A task of a site folder (ANVIL_TASKS_PATH) with no handling of its own: Invoke used to end a
    Ctrl-C with exit 1 and no word, and SIGTERM killed it (143, no word)."""
    site = tmp_path / "site"
    site.mkdir()
    started = tmp_path / "started"
    (site / "slow.py").write_text(
        "import time\nfrom pathlib import Path\nfrom invoke import Collection, task\n\n\n@task\n"
        f"def wait(c):\n    Path({str(started)!r}).touch()\n    time.sleep(120)\n\n\nns = Collection('slow')\n"
        "ns.add_task(wait)\n")
    proc = start(tmp_path, "slow.wait", ANVIL_TASKS_PATH=str(site))
    assert wait_until(started.exists, proc, timeout=60)
    send(proc, signum)
    code, out, err = ended(proc)
    clean(out, err)
    assert code == 128 + signum and err.strip().splitlines()[-1] == f"slow.wait interrupted ({NAME[signum]})", err

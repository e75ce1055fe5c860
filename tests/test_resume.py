"""The real trainer (`python -m trainer`, under torchrun with gloo) killed and resumed:

- SIGKILL of the whole process tree mid-run, then `--resume auto`: the loss curve is
  bit-identical to an uninterrupted run (2 ranks, DDP), on one dataset and on a blend of two;
- SIGTERM reaching ONE rank of an FSDP run: both ranks stop at the same step, checkpoint and
  exit 3; the 2-rank checkpoint then resumes on 1 process and finishes;
- SIGUSR2 to a single process: checkpoint, summary "preempted", exit status 3.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import checkpoint as ck
from trainer.signals import EXIT_REQUEUE

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# configs/tiny.yaml shrunk so a step takes tens of milliseconds on one CPU core.
SHORT = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_dim=160", "data.seq_len=64", "data.batch_size=4", "train.log_interval=1",
         "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=4",
         "logging.progress=false", "logging.tensorboard=false", "logging.gpu_stats=false"]




def trainer_argv(run_dir: Path, dataset: Path, nproc: int | None, *sets: str, resume: str | None = None):
    """nproc None: the trainer as a plain process; else torchrun with nproc gloo workers."""
    args = ["-m", "trainer", "--run-dir", str(run_dir)]
    for item in [f"data.path={dataset}", *SHORT, *sets]:
        args += ["--set", item]
    if resume:
        args += ["--resume", resume]
    if nproc is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *args]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", ANVIL_LOG_RANK="all")


def run(argv, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice (before a kill and after the
    resume) keeps its last value."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by SIGKILL
            continue
        if record.get("kind") == "train":
            out[record["step"]] = record["loss"]
    return out


def last_step(run_dir: Path) -> int:
    try:
        return max(losses(run_dir), default=0)
    except FileNotFoundError:
        return 0


def wait_for(predicate, proc: subprocess.Popen, timeout=120.0, what="") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"trainer ended (rc {proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def worker_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (read from their environment)."""
    import psutil

    found = {}
    for child in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except (psutil.Error, OSError):
            continue
        if rank is not None and "trainer" in " ".join(child.cmdline()):
            found[int(rank)] = child.pid
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL torchrun and its workers (each worker runs in its own session, so killing
    torchrun's process group would leave them running)."""
    import psutil

    try:
        agent = psutil.Process(pid)
        family = agent.children(recursive=True) + [agent]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)


@pytest.fixture(scope="module")
def second_dataset(tmp_path_factory) -> Path:
    """Ten other standard-library files, byte tokenizer: a blend's second source."""
    import sysconfig

    from trainer.data import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib10"
    prepare(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[30:40], out, progress=False)
    return out


@pytest.mark.parametrize("data", ["one dataset", "a blend"])
def test_sigkill_then_resume_auto_reproduces_the_loss_curve(tmp_path, dataset, second_dataset, data):
    steps = ["train.steps=24", "checkpoint.interval=4", "checkpoint.keep_last=2"]
    if data == "a blend":   # the position in each source resumes exactly too
        steps += ["data.path=null", f"data.blend=[{{path: {dataset}, weight: 0.6}}, "
                                    f"{{path: {second_dataset}, weight: 0.4, name: other}}]"]
    reference = run(trainer_argv(tmp_path / "reference", dataset, 2, *steps))
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 25))

    victim = tmp_path / "victim"
    proc = subprocess.Popen(trainer_argv(victim, dataset, 2, *steps), cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ck.find_latest(victim) is not None and last_step(victim) >= 9, proc,
                 what="a checkpoint and step 9")
        kill_tree(proc.pid)  # agent and workers at once, like a lost node
    finally:
        kill_tree(proc.pid)
        proc.communicate()
    killed_at = last_step(victim)
    resume_from = ck.find_latest(victim)
    assert killed_at < 24 and ck.read_meta(resume_from)["step"] < 24

    resumed = run(trainer_argv(victim, dataset, 2, *steps, resume="auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {resume_from} at step {resume_from.name[5:]}" in (victim / "logs" / "rank0.log").read_text()
    got = losses(victim)
    assert got == expected  # every step, bit for bit, including those replayed after the kill
    if data == "a blend":
        def tokens(run_dir):
            last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
            return last["tokens/stdlib30"], last["tokens/other"]
        assert tokens(victim) == tokens(tmp_path / "reference") and 0 < tokens(victim)[1] < tokens(victim)[0]
    assert [p.name for p in ck.list_checkpoints(victim / "checkpoints")] == ["step_20", "step_24"]

    from trainer.plot import read_metrics, plot_run  # the real killed-and-resumed log plots
    assert read_metrics(victim)[2] == [int(resume_from.name[5:]) + 1]
    assert plot_run(victim).stat().st_size > 30_000


def test_sigterm_on_one_fsdp_rank_stops_both_then_resumes_on_one_process(tmp_path, dataset):
    run_dir = tmp_path / "run"
    sets = ["train.steps=40", "checkpoint.interval=0", "parallel.strategy=fsdp"]
    proc = subprocess.Popen(trainer_argv(run_dir, dataset, 2, *sets), cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: last_step(run_dir) >= 3, proc, what="step 3")
        pids = worker_pids(proc.pid)
        assert sorted(pids) == [0, 1]
        os.kill(pids[1], signal.SIGTERM)  # only rank 1 hears it: the ranks must agree
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
        proc.communicate()
    # torchrun reports its workers' exit codes; both must be the requeue status
    assert err.count(f"exitcode  : {EXIT_REQUEUE}") + out.count(f"exitcode  : {EXIT_REQUEUE}") >= 1, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["world_size"] == 2
    path = ck.find_latest(run_dir)
    stopped = ck.read_meta(path)["step"]
    assert 3 <= stopped < 40 and ck.read_meta(path)["world_size"] == 2
    for rank in (0, 1):
        assert f"stopping after step {stopped}" in (run_dir / "logs" / f"rank{rank}.log").read_text()

    resumed = run(trainer_argv(run_dir, dataset, None, *sets, resume="auto"))  # 1 process now
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 1 and summary["steps"] == 40
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 41))
    assert curve[40] < curve[1] - 0.5  # it kept learning after the move to one process


def test_sigusr2_single_process_exits_3_after_checkpoint(tmp_path, dataset):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(trainer_argv(run_dir, dataset, None, "train.steps=200", "checkpoint.interval=0"),
                            cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: last_step(run_dir) >= 2, proc, what="step 2")
        proc.send_signal(signal.SIGUSR2)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_REQUEUE
    summary = json.loads((run_dir / "summary.json").read_text())
    path = ck.find_latest(run_dir)
    assert summary["status"] == "preempted" and summary["checkpoint"] == str(path)
    assert ck.read_meta(path)["step"] == last_step(run_dir) < 200


def test_resumed_summary_gives_this_segments_wall_time_and_the_total(tmp_path, dataset):
    """`inv train.pretrain --resume RUN`: the summary's wall time is the new segment's alone;
    the number of segments and their total are beside it, in summary.json and the table."""
    inv = REPO / ".venv" / "bin" / "inv"
    environ = {**env(), "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs")}
    sets = [arg for item in [f"data.path={dataset}", *SHORT, "checkpoint.interval=0"] for arg in ("--set", item)]

    def pretrain(*args):
        proc = subprocess.run([str(inv), "train.pretrain", *sets, *args], cwd=tmp_path, env=environ,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, sorted((tmp_path / "runs").iterdir())[-1]

    _, first = pretrain("--set", "train.steps=2")
    one = json.loads((first / "summary.json").read_text())
    assert one["segments"] == 1 and one["wall_s_total"] == one["wall_s"]
    saved = ck.read_meta(first / "checkpoints" / "step_2")["extra"]
    assert saved["segments"] == 1 and 0 < saved["wall_s"] <= one["wall_s"]

    proc, second = pretrain("--set", "train.steps=4", "--resume", str(first))
    assert second != first
    two = json.loads((second / "summary.json").read_text())
    assert two["steps"] == 4 and two["segments"] == 2
    assert two["wall_s_total"] == pytest.approx(saved["wall_s"] + two["wall_s"])
    assert 0 < two["wall_s"] < two["wall_s_total"]
    (row,) = [line for line in (proc.stdout + proc.stderr).splitlines() if "wall time" in line]
    assert (f" {two['wall_s']:.1f} s (this segment; 2 segments, {two['wall_s_total']:.1f} s in all)"
            in row), row
    assert ck.read_meta(second / "checkpoints" / "step_4")["extra"]["segments"] == 2


def test_a_closed_terminal_checkpoints_and_records_an_interruption(tmp_path, dataset):
    """SIGHUP to `inv train.pretrain`'s process group (the terminal or SSH session closed): the ranks
    finish the step, checkpoint, and the run says interrupted (130), as after a Ctrl-C. Without a
    handler SIGHUP killed them with nothing saved and the run said failed."""
    from process_utils import start_as_from_a_terminal

    inv = REPO / ".venv" / "bin" / "inv"
    sets = [arg for item in [f"data.path={dataset}", *SHORT, "checkpoint.interval=0", "train.steps=400"]
            for arg in ("--set", item)]
    proc = start_as_from_a_terminal([str(inv), "train.pretrain", *sets], cwd=tmp_path,
                                    env={**env(), "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs")},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(last_step(r) >= 2 for r in (tmp_path / "runs").glob("*")), proc, what="step 2")
        os.killpg(proc.pid, signal.SIGHUP)      # what the kernel does when the terminal goes away
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    metadata = json.loads((run_dir / "metadata.json").read_text())
    assert metadata["status"] == "interrupted" and metadata["exit_code"] == 130
    path = ck.find_latest(run_dir)
    assert path is not None and 2 <= ck.read_meta(path)["step"] == last_step(run_dir) < 400
    assert "SIGHUP: stopping after step" in (run_dir / "logs" / "rank0.log").read_text()


def test_resuming_a_checkpoint_at_or_past_train_steps_is_refused_before_a_run(tmp_path, dataset):
    """It used to load the checkpoint, train nothing, save it again and say ok."""
    inv = REPO / ".venv" / "bin" / "inv"
    environ = {**env(), "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs")}
    sets = [arg for item in [f"data.path={dataset}", *SHORT, "checkpoint.interval=0"] for arg in ("--set", item)]
    first = subprocess.run([str(inv), "train.pretrain", *sets, "--set", "train.steps=3"], cwd=tmp_path, env=environ,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    for steps in (2, 3):
        proc = subprocess.run([str(inv), "train.pretrain", *sets, "--set", f"train.steps={steps}", "--resume",
                               str(run)], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert (f"--resume {run}: its checkpoint (step_3) is at step 3, and train.steps is {steps}: nothing to "
                f"train; --set train.steps=N with N > 3 trains on from there") in proc.stderr, proc.stderr
        assert list((tmp_path / "runs").iterdir()) == [run]


def test_a_killed_inv_stops_its_ranks_after_a_checkpoint_instead_of_leaving_them_running(tmp_path, dataset):
    """kill -9 of `inv train.pretrain` alone (a crash, the OOM killer): its agent gets SIGTERM from the
    kernel (PR_SET_PDEATHSIG) and the ranks checkpoint and stop, as at a preemption. They used to train
    on to the end, with no one left to record it."""
    from process_utils import start_as_from_a_terminal

    inv = REPO / ".venv" / "bin" / "inv"
    sets = [arg for item in [f"data.path={dataset}", *SHORT, "checkpoint.interval=0", "train.steps=100000"]
            for arg in ("--set", item)]
    proc = start_as_from_a_terminal([str(inv), "train.pretrain", *sets], cwd=tmp_path,
                                    env={**env(), "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs")},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    group = proc.pid
    try:
        wait_for(lambda: any(last_step(r) >= 2 for r in (tmp_path / "runs").glob("*")), proc, what="step 2")
        proc.kill()                 # inv only: the agent and the rank are left behind
        proc.wait()

        def group_gone() -> bool:
            try:
                os.killpg(group, 0)
                return False
            except ProcessLookupError:
                return True
        deadline = time.monotonic() + 60
        while not group_gone() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_gone(), "the agent or a rank kept running after its inv was killed"
    finally:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (run_dir,) = (tmp_path / "runs").iterdir()
    path = ck.find_latest(run_dir)
    assert path is not None and ck.read_meta(path)["step"] == last_step(run_dir) < 100000
    assert "SIGTERM: stopping after step" in (run_dir / "logs" / "rank0.log").read_text()
    # No one recorded the end; the next look at the runs does (its inv's pid is gone).
    assert json.loads((run_dir / "metadata.json").read_text())["status"] == "running"
    listed = subprocess.run([str(inv), "snapshot.list"], cwd=tmp_path, env={**env(), "INVOKE_ANVIL_RUNS_DIR": str(
        tmp_path / "runs")}, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and f"{run_dir.name}: its inv (pid {proc.pid}) ended without recording the end" \
        in listed.stderr, listed.stderr
    metadata = json.loads((run_dir / "metadata.json").read_text())
    assert (metadata["status"], metadata["exit_code"], metadata["settled_by"]) == ("lost", 1, "pid")

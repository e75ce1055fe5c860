"""The real trainer (`python -m trainer`, under torchrun with gloo) killed and resumed:

- SIGKILL of the whole process tree while a checkpoint is written in the background, then
  `--resume auto`: it resumes from the checkpoint before, and the loss curve is bit-identical
  to an uninterrupted run (2 ranks, DDP and FSDP2; on one dataset and on a blend of two);
- SIGTERM while a checkpoint is written in the background: the run still ends with a complete
  checkpoint of the step it stopped at, exit 3, and a summary of that step;
- a damaged checkpoint (flipped bytes, a missing .metadata): `--resume auto` takes the one
  before and names it; `--resume` of it is one line and exit 2;
- SIGTERM reaching ONE rank of an FSDP run: both ranks stop at the same step, checkpoint and
  exit 3; the 2-rank checkpoint then resumes on 1 process and finishes;
- SIGUSR2 to a single process: checkpoint, summary "preempted", exit status 3;
- a full disk: a checkpoint that cannot be written is one line naming the newest intact checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.signals import EXIT_REQUEUE
from helpers.files import fill, tmpfs
from helpers.interrupts import group_gone
from helpers.processes import start_as_from_a_terminal
from helpers.program import INV, REPO, inv, inv_environ, sets
from helpers.training import last_step, train_losses
from trainer import checkpoint as ck

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


# One thread per process, and every rank's log line on the console (the tests read them).
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "ANVIL_LOG_RANK": "all"}


def env(**extra: str) -> dict:
    return dict(os.environ, **TRAINER_ENV, **extra)


def writing_slowly(seconds: float) -> dict:
    """The environment of a run whose background checkpoint writes wait `seconds` between writing
    their files and committing them (a test-only hook of trainer.checkpoint.writer)."""
    from trainer.checkpoint.writer import TEST_DELAY_ENV
    return env(**{TEST_DELAY_ENV: str(seconds)})


def run_trainer(argv, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


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


# DDP with one dataset is in neither row: the blend row runs DDP, and its sources resume as one dataset does
@pytest.mark.parametrize("strategy, data", [("fsdp", "one dataset"), ("ddp", "a blend")])
def test_sigkill_during_a_background_write_then_resume_auto_reproduces_the_loss_curve(tmp_path, dataset, second_dataset,
                                                                                       strategy, data):
    steps = ["train.steps=16", "checkpoint.interval=4", "checkpoint.keep_last=2", f"parallel.strategy={strategy}"]
    if data == "a blend":   # the position in each source resumes exactly too
        steps += ["data.path=null", f"data.blend=[{{path: {dataset}, weight: 0.6}}, "
                                    f"{{path: {second_dataset}, weight: 0.4, name: other}}]"]
    reference = run_trainer(trainer_argv(tmp_path / "reference", dataset, 2, *steps))
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = train_losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 17))

    victim = tmp_path / "victim"
    checkpoints = victim / "checkpoints"
    proc = subprocess.Popen(trainer_argv(victim, dataset, 2, *steps), cwd=REPO, env=writing_slowly(8),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # step_4 committed, step_8's files written but not committed, and training two steps on
        wait_for(lambda: ck.is_complete(checkpoints / "step_4") and (checkpoints / ".tmp_step_8" / ".metadata").exists()
                 and last_step(victim) >= 10, proc, what="step 10 while step 8's checkpoint is written")
        kill_tree(proc.pid)  # agent and workers at once, like a lost node
    finally:
        kill_tree(proc.pid)
        proc.communicate()
    assert ck.find_latest(victim) == checkpoints / "step_4" and (checkpoints / ".tmp_step_8").is_dir()
    assert 10 <= last_step(victim) < 16

    resumed = run_trainer(trainer_argv(victim, dataset, 2, *steps, resume="auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step_4'} at step 4" in (victim / "logs" / "rank0.log").read_text()
    got = train_losses(victim)
    assert got == expected  # every step, bit for bit, including those replayed after the kill
    if data == "a blend":
        def tokens(run_dir):
            last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
            return last["tokens/stdlib30"], last["tokens/other"]
        assert tokens(victim) == tokens(tmp_path / "reference") and 0 < tokens(victim)[1] < tokens(victim)[0]
    assert [p.name for p in ck.list_checkpoints(checkpoints)] == ["step_12", "step_16"]
    assert not list(checkpoints.glob(".tmp_step_*"))

    if strategy == "ddp":
        from trainer.plot import read_metrics, plot_run  # the real killed-and-resumed log plots
        assert read_metrics(victim)[2] == [4]     # marked at the checkpoint it went on from (its resume record)
        assert plot_run(victim).stat().st_size > 30_000


def test_sigterm_during_a_background_write_still_ends_with_a_complete_checkpoint(tmp_path, dataset):
    """The stop waits for the write in flight, then writes the checkpoint of the step it stopped
    at, before exit 3. The summary's steps are that step, not the last logged one (7 here)."""
    run_dir = tmp_path / "run"
    sets = ["train.steps=200", "checkpoint.interval=4", "train.log_interval=7", "parallel.strategy=fsdp"]
    proc = subprocess.Popen(trainer_argv(run_dir, dataset, 2, *sets), cwd=REPO, env=writing_slowly(4),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / ".tmp_step_4" / ".metadata").exists(), proc,
                 what="step 4's checkpoint being written")
        for pid in worker_pids(proc.pid).values():
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
        proc.communicate()
    assert err.count(f"exitcode  : {EXIT_REQUEUE}") + out.count(f"exitcode  : {EXIT_REQUEUE}") >= 1, err[-3000:]
    log = (run_dir / "logs" / "rank0.log").read_text()
    stopped = int(log.split("stopping after step ")[1].split(",")[0])
    path = ck.find_latest(run_dir)
    assert path == run_dir / "checkpoints" / f"step_{stopped}" and 4 < stopped < 200
    assert ck.is_complete(run_dir / "checkpoints" / "step_4")     # the write in flight finished too
    assert ck.verify(path) is True                                 # complete and checksummed
    assert not list((run_dir / "checkpoints").glob(".tmp_step_*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["checkpoint"] == str(path)
    assert summary["steps"] == stopped == ck.read_meta(path)["step"]


def test_a_damaged_checkpoint_auto_resumes_from_the_one_before_and_resume_of_it_is_one_line(tmp_path, dataset):
    run_sets = sets(f"data.path={dataset}", *SHORT, "checkpoint.interval=4")

    def pretrain(*args):
        return inv(tmp_path, "train.pretrain", *run_sets, *args, env=TRAINER_ENV)

    first = pretrain("--set", "train.steps=8")
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    checkpoints = run / "checkpoints"
    shard = checkpoints / "step_8" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01                    # one bit, same size
    shard.write_bytes(bytes(data))

    named = pretrain("--set", "train.steps=12", "--resume", str(checkpoints / "step_8"))
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr[-3000:]
    (line,) = [line for line in named.stderr.splitlines() if line.startswith("train.pretrain failed")]
    assert (f"checkpoint {checkpoints / 'step_8'} is damaged: __0_0.distcp: its bytes differ from those saved"
            in line and f"--resume {checkpoints / 'step_4'}" in line), line

    auto = pretrain("--set", "train.steps=12", "--resume", "auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    latest = sorted((tmp_path / "runs").iterdir())[-1]
    log = (latest / "logs" / "rank0.log").read_text()
    assert f"checkpoint {checkpoints / 'step_8'} is damaged: __0_0.distcp" in log and "set aside" in log
    assert f"resumed from {checkpoints / 'step_4'} at step 4" in log
    assert (checkpoints / "damaged_step_8").is_dir() and ck.find_latest(run) == checkpoints / "step_4"
    assert json.loads((latest / "summary.json").read_text())["steps"] == 12

    (checkpoints / "step_4" / ".metadata").unlink()    # seen before any run: one line, no run directory
    runs_before = sorted((tmp_path / "runs").iterdir())
    missing = pretrain("--set", "train.steps=12", "--resume", str(checkpoints / "step_4"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert f"checkpoint {checkpoints / 'step_4'} is damaged: .metadata is missing" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert sorted((tmp_path / "runs").iterdir()) == runs_before


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

    resumed = run_trainer(trainer_argv(run_dir, dataset, None, *sets, resume="auto"))  # 1 process now
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 1 and summary["steps"] == 40
    curve = train_losses(run_dir)
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
    run_sets = sets(f"data.path={dataset}", *SHORT, "checkpoint.interval=0")

    def pretrain(*args):
        proc = inv(tmp_path, "train.pretrain", *run_sets, *args, env=TRAINER_ENV)
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
    proc = start_as_from_a_terminal([str(INV), "train.pretrain",
                                     *sets(f"data.path={dataset}", *SHORT, "checkpoint.interval=0", "train.steps=400")],
                                    cwd=tmp_path, env=inv_environ(tmp_path / "runs", TRAINER_ENV),
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
    run_sets = sets(f"data.path={dataset}", *SHORT, "checkpoint.interval=0")
    first = inv(tmp_path, "train.pretrain", *run_sets, "--set", "train.steps=3", env=TRAINER_ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    for steps in (2, 3):
        proc = inv(tmp_path, "train.pretrain", *run_sets, "--set", f"train.steps={steps}", "--resume", run,
                   env=TRAINER_ENV)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert (f"--resume {run}: its checkpoint (step_3) is at step 3, and train.steps is {steps}: nothing to "
                f"train; --set train.steps=N with N > 3 trains on from there") in proc.stderr, proc.stderr
        assert list((tmp_path / "runs").iterdir()) == [run]


def test_a_killed_inv_stops_its_ranks_after_a_checkpoint_instead_of_leaving_them_running(tmp_path, dataset):
    """kill -9 of `inv train.pretrain` alone (a crash, the OOM killer): its agent gets SIGTERM from the
    kernel (PR_SET_PDEATHSIG) and the ranks checkpoint and stop, as at a preemption. They used to train
    on to the end, with no one left to record it."""
    run_sets = sets(f"data.path={dataset}", *SHORT, "checkpoint.interval=0", "train.steps=100000")
    proc = start_as_from_a_terminal([str(INV), "train.pretrain", *run_sets], cwd=tmp_path,
                                    env=inv_environ(tmp_path / "runs", TRAINER_ENV),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    group = proc.pid
    try:
        wait_for(lambda: any(last_step(r) >= 2 for r in (tmp_path / "runs").glob("*")), proc, what="step 2")
        proc.kill()                 # inv only: the agent and the rank are left behind
        proc.wait()
        assert group_gone(group, timeout=60), "the agent or a rank kept running after its inv was killed"
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
    listed = inv(tmp_path, "snapshot.list", env=TRAINER_ENV, timeout=120)
    assert listed.returncode == 0 and f"{run_dir.name}: its inv (pid {proc.pid}) ended without recording the end" \
        in listed.stderr, listed.stderr
    metadata = json.loads((run_dir / "metadata.json").read_text())
    assert (metadata["status"], metadata["exit_code"], metadata["settled_by"]) == ("lost", 1, "pid")


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_full_disk_during_training_is_one_line_and_a_failed_run(tmp_path, dataset, asynchronous):
    """On a real tmpfs (root; skipped elsewhere): a checkpoint that cannot be written is one line naming the file
    and the newest intact checkpoint; its partial .tmp_step_N is removed; the run is recorded failed, exit 1
    (asynchronous and synchronous saves)."""
    with tmpfs(tmp_path / "disk", "64m") as disk:
        runs = disk / "runs"
        run_sets = sets(f"data.path={dataset}", *SHORT, "train.steps=1000000", "checkpoint.interval=10",
                        "checkpoint.keep_last=1", f"checkpoint.async_save={str(asynchronous).lower()}")
        proc = subprocess.Popen([str(INV), "train.pretrain", *run_sets], cwd=tmp_path,
                                env=inv_environ(runs, TRAINER_ENV), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            deadline = time.monotonic() + 120
            while not list(runs.glob("*/checkpoints/step_*/COMPLETE")):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.02)
            (run,) = runs.iterdir()
            first = next((run / "checkpoints").glob("step_*"))
            size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
            fill(disk, leave=size // 2)          # the next checkpoint finds half the room it needs
            _out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
        (line,) = [line for line in err.splitlines() if line.startswith("train.pretrain failed")]
        (kept,) = (run / "checkpoints").iterdir()            # the partial one is gone, the one before stays
        step = re.search(r"checkpoint step_(\d+) not saved", line)
        assert step and int(step[1]) > int(kept.name[5:]), line
        assert f"cannot write {run}/checkpoints/.tmp_step_{step[1]}/" in line, line
        assert f": No space left on device; removed the partial .tmp_step_{step[1]}; the newest intact checkpoint " \
               f"is {kept}" in line, line
        assert ck.verify(kept) is True
        metadata = json.loads((run / "metadata.json").read_text())
        assert (metadata["status"], metadata["exit_code"]) == ("failed", 1)
        assert "No space left on device" in metadata["error"]

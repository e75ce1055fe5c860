"""Run directories, snapshots and the execute() orchestration, in process (runtime/runs/run.py & co)."""
from __future__ import annotations

import json
import logging
from datetime import datetime

import pytest
from invoke import Context
from invoke.exceptions import Exit

from trainer import ranklog
from runtime.runs import rundir
from runtime.runs.run import RunFailed, RunSpec, execute

from helpers.files import fill, free_bytes, tmpfs
from helpers.program import anvil_context


@pytest.fixture
def ctx(tmp_path) -> Context:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    return anvil_context(tmp_path / "runs", hooks_dir=hooks)


def test_run_dir_names_are_unique_and_writes_atomic(tmp_path):
    when = datetime(2026, 11, 22, 10, 31, 5)
    first = rundir.create(tmp_path, "train.pretrain", "llama 8b", when=when)
    second = rundir.create(tmp_path, "train.pretrain", "llama 8b", when=when)
    third = rundir.create(tmp_path, "train.pretrain", "llama 8b", when=when)
    assert first.name == "2026-11-22T10-31-05_train.pretrain_llama-8b"
    assert second.name == first.name + "-2" and third.name == first.name + "-3"   # one suffix scheme
    target = first / "sub" / "x.json"
    rundir.write_text(target, "{}")
    assert target.read_text() == "{}" and [p.name for p in target.parent.iterdir()] == ["x.json"]


def test_execute_writes_the_snapshot_and_result(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("ANVIL_HOST", "node7")
    spec = RunSpec(task="demo.work", name="t1", configs={"train.yaml": {"optim": {"lr": 0.1}}},
                   env={"NCCL_DEBUG": "INFO"}, argv=["inv", "demo.work", "--name", "t1"])
    seen = {}

    def body(run):
        seen["env"] = run.env["NCCL_DEBUG"]
        run.write_json("extra/out.json", {"x": 1})
        return {"loss": 1.5}

    assert execute(ctx, spec, body) == {"loss": 1.5}
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert run_dir.name.endswith("_demo.work_t1") and seen["env"] == "INFO"
    names = {p.name for p in run_dir.iterdir()}
    assert {"metadata.json", "command.txt", "env.json", "environ.json", "machine.json", "versions.json",
            "git.json", "pip-freeze.txt", "configs", "logs", "result.json", "extra"} <= names
    md = json.loads((run_dir / "metadata.json").read_text())
    assert md["status"] == "ok" and md["hosts"] == ["node7"] and md["exit_code"] == 0
    assert md["end"] and md["duration_s"] >= 0 and md["argv"] == ["inv", "demo.work", "--name", "t1"]
    env = json.loads((run_dir / "env.json").read_text())["vars"]
    assert env["NCCL_DEBUG"] == {"value": "INFO", "source": "task"}
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["python"] and versions["torch"] and versions["invoke"].startswith("2.")
    assert "torch==" in (run_dir / "pip-freeze.txt").read_text()
    assert "lr: 0.1" in (run_dir / "configs" / "train.yaml").read_text()
    assert json.loads((run_dir / "result.json").read_text()) == {"loss": 1.5}
    git = json.loads((run_dir / "git.json").read_text())
    assert len(git["commit"]) == 40
    assert "gpu" in json.loads((run_dir / "machine.json").read_text())


def test_execute_failure_is_recorded_diagnosed_and_exits(ctx, tmp_path):
    def body(run):
        run.log.info("step 3")
        (run.path / "logs" / "rank1.log").write_text("NCCL WARN socket connect to 10.0.0.2 failed: Connection refused\n")
        raise RuntimeError("collective failed")

    with pytest.raises(RunFailed) as caught:
        execute(ctx, RunSpec(task="demo.fail"), body)
    assert caught.value.exit_code == 1
    assert "demo.fail failed: RuntimeError: collective failed" in str(caught.value)
    assert "nccl-socket" in str(caught.value) and "NCCL_SOCKET_IFNAME" in str(caught.value)
    (run_dir,) = list((tmp_path / "runs").iterdir())
    md = json.loads((run_dir / "metadata.json").read_text())
    assert md["status"] == "failed" and md["exit_code"] == 1
    assert [d["problem"] for d in md["diagnosis"]] == ["nccl-socket"]


def test_exit_codes_pass_through(ctx):
    with pytest.raises(RunFailed) as caught:
        execute(ctx, RunSpec(task="demo.exit"), lambda run: (_ for _ in ()).throw(Exit("bad input", 2)))
    assert caught.value.exit_code == 2 and "bad input" in str(caught.value)


def test_ranklog_format_files_and_console_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ANVIL_LOG_RANK", raising=False)
    monkeypatch.setenv("API_TOKEN", "tok-zzzzzz")
    log = ranklog.setup(tmp_path, rank=3, local_rank=1, host="node1", name="t.rank3")
    log.info("hello %s", "tok-zzzzzz")
    zero = ranklog.setup(tmp_path, rank=0, local_rank=0, host="node1", name="t.rank0")
    zero.warning("from zero")
    line = (tmp_path / "logs" / "rank3.log").read_text().strip()
    assert line.endswith("[node1 r3/l1][INFO] hello <masked>") and line.startswith("[20")
    err = capsys.readouterr().err
    assert "from zero" in err and "hello" not in err          # console: rank 0 only
    monkeypatch.setenv("ANVIL_LOG_RANK", "all")
    ranklog.setup(None, rank=5, host="h", name="t.rank5").info("now visible")
    assert "[h r5/l5][INFO] now visible" in capsys.readouterr().err
    for name in ("t.rank3", "t.rank0", "t.rank5"):
        for handler in logging.getLogger(name).handlers:
            handler.close()


def test_a_log_file_that_cannot_be_written_prints_no_traceback(tmp_path, capsys, monkeypatch):
    """A full disk under the run's logs: the record still reaches the console, and nothing else does
    (logging's own handler would print "--- Logging error ---" and a traceback)."""
    monkeypatch.delenv("ANVIL_LOG_RANK", raising=False)
    log = ranklog.setup(tmp_path, rank=0, host="h", name="t.full")
    (file_handler,) = [h for h in log.handlers if isinstance(h, logging.FileHandler)]

    def full(_text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(file_handler.stream, "write", full)
    log.info("still shown")
    err = capsys.readouterr().err
    assert "still shown" in err and "Traceback" not in err and "Logging error" not in err, err
    for handler in log.handlers:
        handler.close()


def test_atomic_writes_get_the_mode_open_would_give(tmp_path):
    """Not mkstemp's 0600: run directories on a shared file system are readable by the team."""
    import os

    from core.files import write_atomic

    old = os.umask(0o022)
    try:
        path = write_atomic(tmp_path / "a.json", "{}")
        assert path.stat().st_mode & 0o777 == 0o644
        assert write_atomic(tmp_path / "b", "x", mode=0o600).stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_a_run_records_its_end_on_a_disk_full_to_the_last_byte(tmp_path):
    """On a real tmpfs (root; skipped elsewhere), full to the last byte: the run directory's reserve makes room
    to record its end."""
    from core.errors import AnvilError

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    with tmpfs(tmp_path / "disk", "16m") as disk:
        ctx = anvil_context(disk / "runs", hooks_dir=hooks)
        seen = {}

        def body(run):
            reserve = run.path / rundir.SPACE_RESERVE
            seen["reserve"] = reserve.stat().st_size if reserve.exists() else None
            fill(disk)
            assert free_bytes(disk) < 4096
            raise AnvilError("the disk filled up")

        with pytest.raises(RunFailed, match="the disk filled up"):
            execute(ctx, RunSpec(task="demo.work", name="full"), body)
        (run,) = (disk / "runs").iterdir()
        metadata = json.loads((run / "metadata.json").read_text())
        assert (metadata["status"], metadata["error"], metadata["exit_code"]) == ("failed", "the disk filled up", 1)
        assert seen["reserve"] == rundir.RESERVE_BYTES and not (run / rundir.SPACE_RESERVE).exists()

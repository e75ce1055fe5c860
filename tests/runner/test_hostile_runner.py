"""Issue 44, the runner's items, as a user meets them through the installed `inv`: each ends in one
clear line with a non-zero exit (or the right result), never a traceback, and nothing of the user's
is lost.

1. An output option (-o/--out, --save-baseline) never writes over a file its task did not write
   (core.files.refuse_foreign): env.export -o README.md overwrote it with exit 0. --force does.
2. A hook past its timeout is killed with everything it started, a `setsid` grandchild included
   (runtime.runs.hooks): one left its session and ran on.

4. A run whose inv died is recorded "lost" once its ranks have stopped (saying that they checkpointed)
   or its logs went quiet, not while they still train (runtime.jobs.settle).

The Slurm items (a --partition Slurm does not have; ranks whose salloc and inv are killed) are in
test_hostile_runner_slurm.py.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from core import names
from helpers.processes import alive
from helpers.program import explain, inv, one_line_error, runs
from helpers.project import in_project, make_project

MINE = "# My project\nwritten by hand, not by Anvil\n"


def _metrics_run(folder: Path) -> Path:
    """A run directory with a few logged steps (what train.plot reads), made without training."""
    run = folder / "runs" / "2024-01-01T00-00-00_train.pretrain"
    run.mkdir(parents=True)
    lines = [json.dumps({"kind": "train", "step": s, "time": 1e9 + s, "loss": 5 * math.exp(-s / 4) + 2,
                         "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0}) for s in range(1, 9)]
    (run / names.METRICS).write_text("\n".join(lines) + "\n")
    return run


# ---------------------------------------------------------------- 1. outputs never over a file not theirs

def test_env_export_refuses_a_file_it_did_not_write_and_force_writes_over_it(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(MINE)
    refused = inv(tmp_path, "env.export", "--gpu", "H100", "-o", readme)
    one_line_error(refused, f"--output {readme} exists and is not a file env.export wrote", "--force")
    assert readme.read_text() == MINE

    # Its own file it replaces (a second export to the same path), and an empty one loses nothing.
    ours, empty = tmp_path / "anvil.env", tmp_path / "empty.env"
    empty.touch()
    for target in (ours, ours, empty):
        again = inv(tmp_path, "env.export", "--gpu", "H100", "-o", target)
        assert again.returncode == 0 and "ANVIL_GPU_ARCH=sm_90" in target.read_text(), explain(again)

    forced = inv(tmp_path, "env.export", "--gpu", "MI300X", "-o", readme, "--force")
    assert forced.returncode == 0 and "ANVIL_GPU_ARCH=gfx942" in readme.read_text(), explain(forced)


def test_a_device_is_never_an_output_even_forced(tmp_path):
    """As root, the atomic writer renamed its temporary file over /dev/null; a pipe would block the check."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, Path("/dev/null")):
        proc = inv(tmp_path, "env.export", "--gpu", "H100", "-o", target, "--force")
        one_line_error(proc, f"--output {target} is not a regular file")
    assert Path("/dev/null").is_char_device() and fifo.is_fifo()


def test_train_plot_and_snapshot_report_refuse_a_file_they_did_not_write(tmp_path):
    run = _metrics_run(tmp_path)
    picture = tmp_path / "holiday.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + b"my holiday" * 100)
    refused = inv(tmp_path, "train.plot", run, "--out", picture)
    one_line_error(refused, f"--out {picture} exists and is not a plot train.plot drew", "--force")
    assert picture.read_bytes().endswith(b"my holiday")

    drawn = tmp_path / "curves.png"
    for _ in range(2):                         # the second time over its own plot
        proc = inv(tmp_path, "train.plot", run, "--out", drawn)
        assert proc.returncode == 0 and drawn.stat().st_size > 10_000, explain(proc)
    forced = inv(tmp_path, "train.plot", run, "--out", picture, "--force")
    assert forced.returncode == 0 and not picture.read_bytes().endswith(b"my holiday"), explain(forced)

    page = tmp_path / "index.html"
    page.write_text("<html>my team's page</html>")
    refused = inv(tmp_path, "snapshot.report", run, "--out", page)
    one_line_error(refused, f"--out {page} exists and is not a report snapshot.report wrote", "--force")
    assert page.read_text() == "<html>my team's page</html>"


def test_snapshot_report_writes_over_a_page_of_its_own():
    """The mark the check looks for (runtime.report.MARK) is what page.render writes near the start."""
    from runtime import report
    from runtime.report import page

    assert report.MARK in page.render([], "a run", "")[:4096]


def test_save_baseline_refuses_a_file_that_is_not_a_baseline_before_measuring(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    proc = inv(tmp_path, "preflight.perf", "--save-baseline", notes, timeout=120, unset=("ANVIL_GPU",))
    one_line_error(proc, f"--save-baseline {notes} exists and is not a baseline preflight.perf wrote", "--force")
    assert notes.read_text() == '{"mine": true}\n' and runs(tmp_path) == []


def test_bench_kernels_refuses_its_out_before_looking_for_a_gpu(tmp_path):
    mine = tmp_path / "results.txt"
    mine.write_text("my measurements\n")
    proc = inv(tmp_path, "bench.kernels", "--quick", "--out", mine, timeout=120)
    one_line_error(proc, f"--out {mine} exists and is not a report bench.kernels wrote", "--force")
    assert mine.read_text() == "my measurements\n" and runs(tmp_path) == []
    from benchmarks import kernels
    for text in (kernels.render({"device": "d", "versions": {"torch": "t", "triton": "t", "liger_kernel": "l"},
                                 "date": "now", "ceilings": {"copy_tbps": 1.0, "matmul_tflops": 2.0},
                                 "notes": [], "rows": []}),
                 json.dumps({"device": "d", "ceilings": {"copy_tbps": 1.0}}, indent=2)):
        mine.write_text(text)
        kernels.check_out(str(mine))          # its own table or JSON: written over without --force


# ---------------------------------------------------------------- 2. a hook's setsid grandchild



@pytest.mark.parametrize("kind", ["sh", "py"])
def test_a_hook_past_its_timeout_leaves_no_setsid_grandchild(tmp_path, kind):
    """The hook runs in a session of its own, and a timeout killed that session's process group only:
    `setsid sleep 1000` (a session of its own) ran on after the task had failed."""
    project = make_project(tmp_path / "p")
    folder = project / "hooks" / "demo" / "hello" / "pre"
    folder.mkdir(parents=True)
    pids = tmp_path / "pids"
    if kind == "sh":
        (folder / "10_daemon.sh").write_text(f"setsid sleep 1000 &\necho $! > {pids}\nsleep 600\n")
    else:
        (folder / "10_daemon.py").write_text(
            "import subprocess, time\n"
            "def hook(ctx):\n"
            "    child = subprocess.Popen(['sleep', '1000'], start_new_session=True)   # setsid\n"
            f"    open({str(pids)!r}, 'w').write(str(child.pid))\n"
            "    time.sleep(600)\n")
    started = time.monotonic()
    proc = in_project(project, "demo.hello", env={"INVOKE_ANVIL_HOOK_TIMEOUT": "2"}, timeout=60)
    assert proc.returncode == 124 and "did not finish within 2 s" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 30
    pid = int(pids.read_text())
    try:
        assert os.getsid(pid) == pid          # it did leave the hook's session
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = alive(pid)
    if outlived:
        os.kill(pid, 9)
    assert not outlived, f"the hook's setsid child {pid} outlived the hook's timeout"


# ---------------------------------------------------------------- 4. a run whose inv died, recorded

def test_a_run_whose_inv_died_is_lost_once_its_ranks_stopped_or_went_quiet(tmp_path):
    """Recorded "lost" the moment its inv was gone, while the ranks still trained (or checkpointed) on;
    now once every node's agent has reported, which the record then says, or its logs are quiet."""
    import socket
    import subprocess

    from runtime.jobs import settle

    gone = subprocess.Popen(["true"])
    gone.wait()
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    metadata = {"task": "train.pretrain", "status": "running", "host": socket.gethostname(), "pid": gone.pid,
                "start_ts": time.time(), "world_size": 2}
    (run / "metadata.json").write_text(json.dumps(metadata))
    log = run / "logs" / "rank0.log"
    log.write_text("step 7\n")

    def status() -> str:
        settle.settle_dead_launchers([(run, json.loads((run / "metadata.json").read_text()))])
        return json.loads((run / "metadata.json").read_text())["status"]

    assert status() == "running"                        # its log was just written: still stopping
    for node in (0, 1):
        (run / "logs" / names.agent_report(node)).write_text(json.dumps(
            {"host": f"node{node + 1}", "node_rank": node, "exit_code": 3, "ranks": {str(node): 3},
             "first_failure": None, "signal": "SIGUSR2"}))
    assert status() == "lost"
    md = json.loads((run / "metadata.json").read_text())
    assert md["settled_by"] == "pid" and md["error"].endswith(
        f"every rank then checkpointed and stopped (`inv train.pretrain --resume {run}` continues it)")

    quiet = tmp_path / "quiet"
    (quiet / "logs").mkdir(parents=True)
    (quiet / "metadata.json").write_text(json.dumps(metadata))
    (quiet / "logs" / "rank0.log").write_text("step 7\n")
    os.utime(quiet / "logs" / "rank0.log", (time.time() - 120, time.time() - 120))
    assert [s.run_dir for s in settle.settle_dead_launchers([(quiet, metadata)])] == [quiet]
    assert "checkpointed" not in json.loads((quiet / "metadata.json").read_text())["error"]

"""Launching (runtime/launch/, runtime/cluster/): the per-node agent for real here; the Slurm and
container command lines as a dry run prints them.

The Slurm lines run for real against a live cluster in test_slurm_*.py, the SSH ones on namespace
hosts in test_ssh_train.py and test_fanout_netns.py, a container in test_container_podman.py.
"""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.processes import signal_until_exit
from runtime.cluster import BadRuntime, ContainerOptions, Options, Runtime, SlurmOptions
from runtime.cluster.slurm.srun import expand_hostlist
from runtime.cluster.slurm.step import layout as slurm_layout
from runtime.launch import LaunchError, LaunchSpec, launch, launch_env, visible_gpus
from core.secrets import Masker


def dry_run(runtime: str, spec: LaunchSpec, env: dict, run_dir=None, **options) -> str:
    """What `--dry-run` prints for spec under `runtime` (a Runtime opened with Options(**options))."""
    out = io.StringIO()
    assert Runtime.parse(runtime).open(Options(**options)).launch(spec, env, run_dir, dry_run=True, stdout=out) == 0
    return out.getvalue()


def argv_of(runtime: str, spec: LaunchSpec, env: dict, **options) -> list[str]:
    return shlex.split(dry_run(runtime, spec, env, **options).strip().splitlines()[-1])

WORKER = """
import os, signal, sys, time
from pathlib import Path
# one write per line (print() writes the newline separately when unbuffered: two ranks' lines could mix)
sys.stdout.write(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} token {os.environ.get('MY_TOKEN')}\\n")
sys.stdout.flush()
print("to stderr", file=sys.stderr, flush=True)
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
Path(os.environ["SYNC_DIR"], os.environ["RANK"]).touch()
deadline = time.time() + 60
while len(os.listdir(os.environ["SYNC_DIR"])) < int(os.environ["WORLD_SIZE"]) and time.time() < deadline:
    time.sleep(0.05)
fail_rank = os.environ.get("FAIL_RANK")
if fail_rank is not None:
    if os.environ["RANK"] == fail_rank:
        sys.exit(7)
    time.sleep(120)            # a peer that would wait forever: the agent must stop it
if os.environ.get("WAIT_SIGNAL"):
    while not got and time.time() < deadline:
        time.sleep(0.05)
    # as core.signals does once stopping: the agent forwards the signal the group also got,
    # and a Python handler is reset to SIG_DFL while the interpreter exits
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(3 if got else 9)
sys.exit(int(os.environ.get("WORKER_EXIT", "0")))
"""


def _wait_for_ranks(tmp_path, n: int) -> None:
    """Until the worker's n ranks have their handlers installed (each touched sync/RANK), and a moment more."""
    deadline = time.time() + 60
    while len(os.listdir(tmp_path / "sync")) < n and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)


def worker_environ(tmp_path, **extra):
    (tmp_path / "anvil_worker.py").write_text(WORKER)
    (tmp_path / "sync").mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(tmp_path), "MY_TOKEN": "tok-9876543", "OMP_NUM_THREADS": "1",
            "SYNC_DIR": str(tmp_path / "sync"), "ANVIL_AGENT_GRACE": "2", **extra}


def test_agent_streams_tees_masks_and_keeps_exit_3(tmp_path):
    env = worker_environ(tmp_path, WORKER_EXIT="3")
    out, err = io.StringIO(), io.StringIO()
    code = launch(LaunchSpec(module="anvil_worker", nproc=2, workdir=str(tmp_path)), env=env,
                  run_dir=tmp_path / "run", masker=Masker.from_environ(env), stdout=out, stderr=err)
    assert code == 3                              # every rank stopped to be requeued: so does the launch
    assert sorted(l.split(" token")[0] for l in out.getvalue().splitlines() if l.startswith("rank")) == \
        ["rank 0/2 local 0", "rank 1/2 local 1"]
    assert "to stderr" in err.getvalue()
    log = (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert log.startswith("$ ") and "runtime.launch.agent --nproc 2" in log
    assert "rank 0/2" in log and "tok-9876543" not in log and "token <masked>" in log
    record = json.loads((tmp_path / "run" / "logs" / "agent-0.json").read_text())
    assert record["ranks"] == {"0": 3, "1": 3} and record["exit_code"] == 3 and record["world_size"] == 2


def test_agent_stops_the_others_when_one_rank_fails(tmp_path):
    env = worker_environ(tmp_path, FAIL_RANK="1")
    err = io.StringIO()
    started = time.monotonic()
    code = launch(LaunchSpec(module="anvil_worker", nproc=3, workdir=str(tmp_path)), env=env,
                  run_dir=tmp_path / "run", stdout=io.StringIO(), stderr=err)
    assert code == 7 and time.monotonic() - started < 30     # not the peers' 120 s sleep
    assert "rank 1 on" in err.getvalue() and "exited with status 7" in err.getvalue()
    record = json.loads((tmp_path / "run" / "logs" / "agent-0.json").read_text())
    assert record["first_failure"]["rank"] == 1 and record["first_failure"]["exit_code"] == 7


def test_a_rank_sigkill_ended_is_blamed_before_its_peers_that_failed_on_it():
    """Its peers fail on their closed connection to it within milliseconds: on its node they may be seen
    ended in the same look (every 50 ms), on another node their agent may record them a moment earlier."""
    from runtime.launch.agent import blame_order
    from runtime.runs.outcome import TOGETHER_S, NodeReport, Outcome

    assert blame_order([(0, 1), (1, -signal.SIGKILL), (2, 1)]) == [(1, -signal.SIGKILL), (0, 1), (2, 1)]
    assert blame_order([(0, 1), (1, -signal.SIGTERM)]) == [(0, 1), (1, -signal.SIGTERM)]   # by rank otherwise

    def node(rank: int, code: int, at: float) -> NodeReport:
        return NodeReport(f"node{rank + 1}", rank, 1, {rank: code}, {"rank": rank, "exit_code": code, "time": at},
                          None)

    peer_first = Outcome(nodes=[node(0, 1, 100.0), node(1, -signal.SIGKILL, 100.2)])
    assert peer_first.first_failure()["rank"] == 1
    long_after = Outcome(nodes=[node(0, 1, 100.0), node(1, -signal.SIGKILL, 100.0 + TOGETHER_S + 5)])  # a grace's kill
    assert long_after.first_failure()["rank"] == 0
    assert Outcome(nodes=[node(0, 1, 100.3), node(1, 7, 100.0)]).first_failure()["rank"] == 1   # the earliest


def test_signal_to_the_launcher_reaches_every_rank_and_exit_3_survives(tmp_path):
    """What a scheduler does: signal the launching process; ranks checkpoint (here: exit 3)."""
    env = worker_environ(tmp_path, WAIT_SIGNAL="1")
    cmd = [sys.executable, "-c", "import sys; from runtime.launch import LaunchSpec, launch; "
           f"sys.exit(launch(LaunchSpec(module='anvil_worker', nproc=2, workdir={str(tmp_path)!r}), "
           f"dict(__import__('os').environ), run_dir=__import__('pathlib').Path({str(tmp_path / 'run')!r})))"]
    proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    _wait_for_ranks(tmp_path, 2)
    os.killpg(proc.pid, signal.SIGUSR2)              # the whole process group, as Slurm does
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err.decode()[-2000:]
    assert b"Traceback" not in err


def test_an_agent_that_stopped_on_a_signal_keeps_exit_3_through_more_signals(tmp_path):
    """A scheduler may signal again (scancel's TERM after the USR2 warning) while the agent ends."""
    env = worker_environ(tmp_path, WAIT_SIGNAL="1")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.launch.agent", "--nproc", "2", "--",
                             sys.executable, "-m", "anvil_worker"], env=env, cwd=os.getcwd(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    _wait_for_ranks(tmp_path, 2)
    os.killpg(proc.pid, signal.SIGUSR2)
    code = signal_until_exit(proc, signal.SIGTERM)           # the agent alone, again and again
    assert code == 3, proc.stderr.read().decode()[-2000:]


def test_one_process_per_visible_gpu():
    assert visible_gpus({}, 8) == 8
    assert visible_gpus({"HIP_VISIBLE_DEVICES": "0,1,2"}, 8) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 8) == 0
    here = Runtime.parse("direct").open()
    assert here.layout(LaunchSpec(module="m", gpus=0), {}).nproc == 1            # CPU: one process
    assert here.layout(LaunchSpec(module="m", gpus=8), {}).nproc == 8
    assert here.layout(LaunchSpec(module="m", gpus=8, nproc=2), {}).nproc == 2
    with pytest.raises(LaunchError):
        here.layout(LaunchSpec(module="m", nproc=0), {})
    with pytest.raises(BadRuntime, match=re.escape("--runtime 'k8s': expected direct | ssh | slurm | container")):
        Runtime.parse("k8s")


def test_the_runtime_is_one_value_parsed_once():
    """Every runtime the user can name parses to a value that answers what callers ask; str() gives it
    back as written; the setting, an option and the environment all go through Runtime.parse."""
    cases = {"direct": (False, False, False), "container": (False, False, True), "ssh": (False, True, False),
             "ssh+container": (False, True, True), "slurm": (True, True, False), "slurm+container": (True, True, True)}
    for text, (scheduler, spans, container) in cases.items():
        runtime = Runtime.parse(text)
        assert (runtime.scheduler, runtime.spans_nodes, runtime.container, str(runtime)) == \
            (scheduler, spans, container, text), text
    assert Runtime.parse("slurm+container").on_node() == Runtime.parse("container")
    assert Runtime.parse("slurm+container").bare() == Runtime.parse("slurm")
    assert Runtime.parse("container").over("ssh") == Runtime.parse("ssh+container")
    for bad in ("bogus", "slurm+docker", "container+slurm", "", "slurm+"):
        with pytest.raises(BadRuntime) as refused:
            Runtime.parse(bad, "anvil.runtime")
        assert refused.value.exit_code == 2 and str(refused.value).startswith(f"anvil.runtime {bad!r}: expected")
    from runtime import settings
    assert settings.from_mapping({"runtime": "slurm+container"}, Path(".")).runtime == Runtime("slurm", True)
    with pytest.raises(BadRuntime):
        settings.from_mapping({"runtime": "bogus"}, Path("."))


def test_hostlist_and_slurm_layout():
    assert expand_hostlist("node[1-3,7],gpu[08-10],login") == \
        ["node1", "node2", "node3", "node7", "gpu08", "gpu09", "gpu10", "login"]
    assert expand_hostlist("n1") == ["n1"] and expand_hostlist("") == []
    env = {"SLURM_JOB_NODELIST": "n[3-4]", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "42"}
    assert slurm_layout(env) == (2, 1, "n3", 20042)


def test_srun_line_inside_an_allocation_reads_slurm_in_python():
    args = ["--config", "my cfg.yaml", "--set", "x=$(whoami)"]
    alloc = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "4", "SLURM_JOB_NUM_NODES": "4"}
    argv = argv_of("slurm", LaunchSpec(module="trainer", args=args, gpus=8, vendor="rocm"), alloc,
                   slurm=SlurmOptions(partition="gpu", time="01:00:00"))
    assert argv[:4] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--signal=USR2@120" in argv and "--gpus-per-node=8" in argv and "--partition=gpu" in argv
    assert "bash" not in argv                              # no shell text at all
    step = argv.index("runtime.cluster.slurm.step")        # each node reads its place from SLURM_*
    assert argv[step + 1:step + 3] == ["--nproc", "8"] and "runtime.launch.agent" not in argv
    assert argv[-len(args):] == args                       # user arguments untouched
    with pytest.raises(LaunchError, match="only 4 node"):
        Runtime.parse("slurm").open(Options(nodes=6)).layout(LaunchSpec(module="trainer"), alloc)


def test_one_srun_builder_for_every_step():
    """Training steps, batch jobs, commands on every node and steps on chosen nodes share one builder."""
    from runtime.cluster.slurm.srun import srun_options

    options = SlurmOptions(partition="p", extra=["--qos=high"])
    assert srun_options(options, 2, warn=True) == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                                   "--signal=USR2@120", "--partition=p", "--qos=high"]
    assert srun_options(options, 2, warn=True, batch=True, job_name="anvil-x") == [
        "--nodes=2", "--ntasks-per-node=1", "--signal=B:USR2@120", "--partition=p", "--job-name=anvil-x",
        "--requeue", "--open-mode=append", "--qos=high"]
    assert srun_options(options, 3, kill_on_bad_exit=False, job_name="anvil-preflight.all")[:3] == [
        "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    assert srun_options(options, 2, nodelist=["n1", "n3"], gpus=4)[:5] == [
        "--nodes=2", "--ntasks-per-node=1", "--nodelist=n1,n3", "--kill-on-bad-exit=1", "--gpus-per-node=4"]


def test_node_local_values_are_left_to_each_node():
    spec = LaunchSpec(module="trainer", node_local=["GLOO_SOCKET_IFNAME", "ANVIL_HOST"])
    env = launch_env(spec, {"GLOO_SOCKET_IFNAME": "eth0", "ANVIL_HOST": "login1", "X": "1"}, None, spans_nodes=True)
    assert "GLOO_SOCKET_IFNAME" not in env and "ANVIL_HOST" not in env and env["X"] == "1"
    assert env["ANVIL_NODE_LOCAL"] == "GLOO_SOCKET_IFNAME,ANVIL_HOST"
    direct = launch_env(LaunchSpec(module="trainer", node_local=["ANVIL_HOST"]), {"ANVIL_HOST": "a"}, None)
    assert direct["ANVIL_HOST"] == "a"                     # one machine: its own values are right


def test_sbatch_script_outside_an_allocation(tmp_path):
    spec = LaunchSpec(module="trainer", args=["--run-dir", str(tmp_path)], gpus=4, vendor="cuda")
    printed = dry_run("slurm", spec, {}, tmp_path, nodes=2, exclude=["n7"], slurm=SlurmOptions(partition="big"))
    assert shlex.split(printed.strip().splitlines()[-1]) == ["sbatch", "--parsable",
                                                             str(tmp_path / "slurm" / "job.sbatch")]
    assert printed.startswith(f"# {tmp_path / 'slurm' / 'job.sbatch'}\n")
    script = printed.split("\n", 1)[1].rsplit("\nsbatch ", 1)[0]
    assert "#SBATCH --signal=B:USR2@120" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --nodes=2" in script
    assert "#SBATCH --exclude=n7" in script and "#SBATCH --partition=big" in script
    assert f"#SBATCH --job-name=anvil-{tmp_path.name}" in script     # the run's own job (runtime.jobs.settle)
    srun = next(l for l in script.splitlines() if l.startswith("srun "))
    assert "$SLURM" not in srun                            # nothing for the batch shell to expand
    assert shlex.split(srun.rstrip(" &"))[-2:] == ["--run-dir", str(tmp_path)]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    record = next(l for l in script.splitlines() if "runtime.runs.jobend" in l)
    assert shlex.split(record)[-4:] == ["runtime.runs.jobend", str(tmp_path), "$@;", "}"]
    assert 'record 3 --requeued; scontrol requeue "$SLURM_JOB_ID" && exit 0' in script and 'record "$code"' in script
    assert 'record --resumed "$SLURM_RESTART_COUNT"' in script.split("srun ", 1)[0]   # before the step
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)      # valid shell


def test_container_lines_pass_env_by_name():
    env = {"HF_TOKEN": "hf-secret-1", "NCCL_DEBUG": "INFO", "PATH": "/usr/bin"}
    docker = argv_of("container", LaunchSpec(module="trainer", gpus=8, vendor="rocm"), env,
                     container=ContainerOptions(engine="podman", image="rocm/pytorch:6.3"))
    assert docker[:3] == ["podman", "run", "--rm"] and "--device=/dev/kfd" in docker and "--device=/dev/dri" in docker
    assert "-e" in docker and "HF_TOKEN" in docker and "hf-secret-1" not in " ".join(docker)
    assert "PATH" not in docker
    assert docker[docker.index("rocm/pytorch:6.3") + 1:][:3] == ["python3", "-m", "runtime.launch.agent"]
    apptainer = argv_of("container", LaunchSpec(module="trainer", gpus=4, vendor="cuda"), env,
                        container=ContainerOptions(engine="apptainer", image="img.sif"))
    assert apptainer[:2] == ["apptainer", "exec"] and "--nv" in apptainer and "img.sif" in apptainer
    assert "--bind" in apptainer
    rocm = argv_of("container", LaunchSpec(module="trainer", gpus=8, vendor="rocm"), env,
                   container=ContainerOptions(engine="apptainer", image="img.sif"))
    assert "--rocm" in rocm
    composed = argv_of("slurm+container", LaunchSpec(module="trainer", gpus=8, vendor="cuda"),
                       {**env, "SLURM_JOB_ID": "5", "SLURM_NNODES": "2"},
                       container=ContainerOptions(engine="docker", image="nvcr.io/pytorch"))
    assert composed[0] == "srun" and composed.index("docker") < composed.index("runtime.cluster.slurm.step")
    assert "SLURM_NODEID" in composed and "SLURM_STEP_ID" in composed   # handed into the container by name
    with pytest.raises(LaunchError, match="image"):
        Runtime.parse("container").open().layout(LaunchSpec(module="m"), env)


def test_stop_status_comes_from_the_agents_reports(tmp_path):
    """Under srun a clean stop exits 0 (--kill-on-bad-exit would take 3 as a failure); the status
    the batch script and inv act on is read from the agents' reports, per job attempt."""
    import json as jsonlib

    from runtime.runs.outcome import main as outcome_main, stop_status

    logs = tmp_path / "logs"
    logs.mkdir()

    def report(node, code, restart=0, failure=None):
        (logs / f"agent-{node}.json").write_text(jsonlib.dumps(
            {"host": f"n{node}", "node_rank": node, "exit_code": code, "ranks": {str(node): code},
             "first_failure": failure, "signal": "SIGUSR2", "restart_count": restart}))

    assert stop_status(tmp_path) == 0                       # nothing reported: nothing to requeue
    report(0, 3), report(1, 3)
    assert stop_status(tmp_path) == 3 and outcome_main([str(tmp_path), "--restart", "0"]) == 3
    assert stop_status(tmp_path, restart=1) == 0            # those reports are the earlier attempt's
    report(1, 130)
    assert stop_status(tmp_path) == 130
    report(1, 1, failure={"rank": 1, "exit_code": 1})
    assert stop_status(tmp_path) == 0                       # a failure is not a clean stop


def test_an_unfollowed_batch_job_records_its_own_end(tmp_path):
    """--no-wait leaves the run "submitted"; the batch script's jobend call writes each attempt's end,
    and leaves a run that inv still follows ("running") to inv."""
    import json as jsonlib

    from runtime.runs import jobend
    from core.files import seal   # a test's edit of a sealed record, resealed as inv would write it

    logs = tmp_path / "logs"
    logs.mkdir()
    meta = tmp_path / "metadata.json"
    meta.write_text(jsonlib.dumps({"task": "train.pretrain", "status": "running", "start_ts": 1.0,
                                   "hosts": ["login"]}))

    def report(node, code, failure=None):
        (logs / f"agent-{node}.json").write_text(jsonlib.dumps(
            {"host": f"n{node}", "node_rank": node, "exit_code": code, "ranks": {str(2 * node): code,
                                                                                 str(2 * node + 1): code},
             "first_failure": failure}))

    def md():
        return jsonlib.loads(meta.read_text())

    report(0, 0), report(1, 0)
    assert not jobend.record(tmp_path, 0) and md()["status"] == "running"        # inv follows: it writes the end
    meta.write_text(jsonlib.dumps(seal({**md(), "status": "submitted"})))
    assert jobend.record(tmp_path, 3, requeued=True, environ={})
    assert md()["status"] == "requeued" and md()["exit_code"] == 3 and md()["end"]
    # the next attempt starts (the batch script's first lines): running again, not "requeued"
    assert jobend.main([str(tmp_path), "--resumed", "1"]) == 0
    assert (md()["status"], md()["requeues"], md()["end"], md()["exit_code"]) == ("resumed", 1, None, None)
    meta.write_text(jsonlib.dumps(seal({**md(), "status": "running"})))
    assert not jobend.resumed(tmp_path, 2) and md()["requeues"] == 1              # inv follows: its to write
    meta.write_text(jsonlib.dumps(seal({**md(), "status": "resumed"})))
    (tmp_path / "summary.json").write_text(jsonlib.dumps({"final_loss": 1.5}))
    assert jobend.record(tmp_path, 0, environ={})                                  # the resumed attempt
    assert md()["status"] == "ok" and md()["hosts"] == ["n0", "n1"] and md()["world_size"] == 4
    assert jsonlib.loads((tmp_path / "result.json").read_text())["summary"] == {"final_loss": 1.5}
    assert not jobend.record(tmp_path, 1, environ={}) and md()["status"] == "ok"   # ended: not rewritten

    meta.write_text(jsonlib.dumps(seal({**md(), "status": "detached"})))
    (logs / "rank3.log").write_text("[t][n1 r3/l1][ERROR] boom: token sk-hidden-1 leaked\n")
    report(1, 1, failure={"rank": 3, "host": "n1", "exit_code": 1, "time": 5})
    jobend.record(tmp_path, 1, environ={"HF_TOKEN": "sk-hidden-1"})
    assert md()["status"] == "failed" and "rank 3 on n1 failed first" in md()["error"]
    assert "boom" in md()["error"] and "sk-hidden-1" not in meta.read_text()       # masked like inv masks
    assert jobend.main([str(tmp_path)]) == 2 and jobend.main([str(tmp_path / "nope"), "0"]) == 0
    meta.write_text(jsonlib.dumps(seal({**md(), "status": "submitted"})))
    assert jobend.main([str(tmp_path), "3"]) == 0 and md()["status"] == "preempted"   # scancel: not requeued

    report(1, -9, failure={"rank": 2, "host": "n1", "exit_code": -9, "time": 6})
    meta.write_text(jsonlib.dumps(seal({**md(), "status": "submitted"})))
    jobend.record(tmp_path, 1, environ={})
    assert "rank 2 on n1 failed first (signal 9, SIGKILL: often the kernel's OOM killer" in md()["error"]

    # srun's words for a node Slurm declared failed (set DOWN, not responding): a node failure, named
    (logs / "slurm-7.out").write_text("anvil: job 7 start 0 on n[0-1]\nsrun: error: Node failure on n1\n"
                                      "anvil: step exited with status 3\n")
    meta.write_text(jsonlib.dumps(seal({**md(), "status": "submitted"})))
    jobend.record(tmp_path, 3, requeued=True, environ={})
    assert (md()["status"], md()["node_failures"]) == ("requeued", ["n1"])
    assert md()["error"] == "Slurm declared node(s) n1 failed; the job was requeued"


def test_a_job_that_ended_unrecorded_gets_slurms_verdict_and_nothing_is_guessed(tmp_path):
    """runtime.jobs.settle: what Slurm's record of a job says the run ended as; and where no
    controller answers, every run keeps what it said (tests/cluster/test_slurm_train.py runs it live)."""
    import json as jsonlib

    from runtime.jobs import settle

    killed = {"JobState": "FAILED", "ExitCode": "0:9", "JobName": f"anvil-{tmp_path.name}"}
    status, code, why = settle.verdict("12", killed)
    assert (status, code) == ("failed", 137) and "ended FAILED (ExitCode 0:9)" in why and "signal 9 (SIGKILL)" in why
    assert "signal" not in settle.verdict("12", {"JobState": "FAILED", "ExitCode": "130:0"})[2]   # an exit, not a signal
    assert settle.verdict("12", {"JobState": "CANCELLED", "ExitCode": "0:15"})[0] == "cancelled"
    assert settle.verdict("12", {"JobState": "TIMEOUT", "ExitCode": "0:0"})[:2] == ("failed", 1)
    assert settle.verdict("12", {"JobState": "COMPLETED", "ExitCode": "0:0"})[:2] == ("ok", 0)
    assert settle.verdict("12", None)[0] == "lost" and "no longer knows job 12" in settle.verdict("12", None)[2]
    assert settle._ours(tmp_path, killed) is killed
    assert settle._ours(tmp_path, {**killed, "JobName": "anvil-2026-01-01_other"}) is None   # the id was reused
    assert settle._ours(tmp_path, {**killed, "JobName": "somebody's-job"}) is not None        # not ours to judge
    assert settle._epoch("2026-11-23T10:00:00") and settle._epoch("Unknown") is None

    runs = {}
    for name, status in (("sub", "submitted"), ("det", "detached"), ("req", "requeued"), ("done", "ok"),
                         ("run", "running")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text(jsonlib.dumps(
            {"status": status, "start_ts": 1.0, "slurm_job_id": str(len(runs) + 1)}))
        runs[name] = tmp_path / name
    (tmp_path / "nojob").mkdir()
    (tmp_path / "nojob" / "metadata.json").write_text(jsonlib.dumps({"status": "submitted", "start_ts": 1.0}))
    found = settle.unfollowed(settle.rundir.iter_runs(tmp_path))
    assert sorted((p.name, j) for p, j in found) == [("det", "2"), ("req", "3"), ("sub", "1")]
    # No controller answers (Slurm's client missing, or no configuration): nothing is written.
    assert settle.settle(found, env={**os.environ, "SLURM_CONF": str(tmp_path / "none.conf")}, poll_s=0) == []
    assert {p.name: jsonlib.loads((p / "metadata.json").read_text())["status"] for p, _ in found} == \
        {"sub": "submitted", "det": "detached", "req": "requeued"}

    # A verdict from outside is provisional: the batch script's own record replaces it; then it is final.
    sub = runs["sub"]

    def md():
        return jsonlib.loads((sub / "metadata.json").read_text())

    assert settle.jobend.record(sub, 1, environ={}, status="lost", why="Slurm no longer knows job 1")
    assert md()["status"] == "lost" and md()["settled_by"] == "slurm" and "no longer knows" in md()["error"]
    assert settle.unfollowed([(sub, md())]) == []                            # settled once
    assert settle.jobend.record(sub, 0, environ={})                          # the script got there after all
    assert md()["status"] == "ok" and "settled_by" not in md() and md()["error"] is None
    assert not settle.jobend.record(sub, 1, environ={}, status="lost", why="x") and md()["status"] == "ok"
    assert not settle.jobend.record(sub, 1, environ={}) and md()["status"] == "ok"


def test_a_running_run_is_recorded_lost_only_when_its_inv_is_gone_from_this_host(tmp_path):
    import socket

    from runtime.jobs import settle

    def run(name: str, **metadata) -> Path:
        path = tmp_path / name
        (path / "logs").mkdir(parents=True)
        (path / "metadata.json").write_text(json.dumps({"task": "train.pretrain", "status": "running",
                                                        "host": socket.gethostname(), "start_ts": time.time(),
                                                        **metadata}))
        return path
    gone = subprocess.Popen(["true"])
    gone.wait()
    runs = {"alive": run("alive", pid=os.getpid()), "gone": run("gone", pid=gone.pid),
            "reused": run("reused", pid=os.getpid(), start_ts=1.0),    # a pid now held by a later process
            "elsewhere": run("elsewhere", pid=gone.pid, host="another-node"),
            "slurm": run("slurm", pid=gone.pid, slurm_job_id="7")}
    settled = settle.settle_dead_launchers([(p, json.loads((p / "metadata.json").read_text())) for p in runs.values()])
    assert sorted(s.run_dir.name for s in settled) == ["gone", "reused"]
    for name, path in runs.items():
        status = json.loads((path / "metadata.json").read_text())["status"]
        assert status == ("lost" if name in ("gone", "reused") else "running"), name

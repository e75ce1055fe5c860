"""Launchers (runtime/launch.py): a real torchrun here; Slurm and container command lines checked."""
from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys

import pytest

from runtime.launch import ContainerOptions, LaunchError, LaunchSpec, SlurmOptions, build, launch, visible_gpus
from runtime.secrets import Masker

WORKER = """
import os, sys, time
from pathlib import Path
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} token {os.environ.get('MY_TOKEN')}", flush=True)
print("to stderr", file=sys.stderr, flush=True)
# Both ranks print before either exits (torchrun stops the others at the first exit).
Path(os.environ["SYNC_DIR"], os.environ["RANK"]).touch()
deadline = time.time() + 60
while len(os.listdir(os.environ["SYNC_DIR"])) < int(os.environ["WORLD_SIZE"]) and time.time() < deadline:
    time.sleep(0.05)
sys.exit(int(os.environ.get("WORKER_EXIT", "0")))
"""


def test_direct_torchrun_streams_tees_masks_and_keeps_exit_3(tmp_path):
    (tmp_path / "anvil_worker.py").write_text(WORKER)
    (tmp_path / "sync").mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MY_TOKEN": "tok-9876543", "WORKER_EXIT": "3",
           "OMP_NUM_THREADS": "1", "SYNC_DIR": str(tmp_path / "sync")}
    out, err = io.StringIO(), io.StringIO()
    code = launch(LaunchSpec(module="anvil_worker", nproc=2, workdir=str(tmp_path)), env=env,
                  run_dir=tmp_path / "run", masker=Masker.from_environ(env), stdout=out, stderr=err)
    assert code == 3                              # torchrun says 1; the workers agreed on 3
    assert sorted(l.split(" token")[0] for l in out.getvalue().splitlines() if l.startswith("rank")) == \
        ["rank 0/2 local 0", "rank 1/2 local 1"]
    assert "to stderr" in err.getvalue()
    log = (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert log.startswith("$ ") and "torch.distributed.run" in log and "--nproc-per-node 2" in log
    assert "rank 0/2" in log and "tok-9876543" not in log and "token <masked>" in log


def test_one_process_per_visible_gpu():
    assert visible_gpus({}, 8) == 8
    assert visible_gpus({"HIP_VISIBLE_DEVICES": "0,1,2"}, 8) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 8) == 0
    assert build(LaunchSpec(module="m", gpus=0), {}).nproc == 1            # CPU: one process
    assert build(LaunchSpec(module="m", gpus=8), {}).nproc == 8
    assert build(LaunchSpec(module="m", gpus=8, nproc=2), {}).nproc == 2
    with pytest.raises(LaunchError):
        build(LaunchSpec(module="m", nproc=0), {})
    with pytest.raises(LaunchError):
        build(LaunchSpec(module="m", runtime="k8s"), {})


def test_srun_line_leaves_slurm_variables_to_each_task():
    args = ["--config", "my cfg.yaml", "--set", "x=$(whoami)"]
    built = build(LaunchSpec(module="trainer", args=args, runtime="slurm", gpus=8, vendor="rocm",
                             slurm=SlurmOptions(partition="gpu", time="01:00:00")), {"SLURM_NNODES": "4"})
    argv = built.argv
    assert argv[:5] == ["srun", "--nodes=4", "--ntasks-per-node=1", "-K1", "--signal=USR2@120"]
    assert "--gpus-per-node=8" in argv and "--partition=gpu" in argv
    prelude = argv[argv.index("-c") + 1]
    assert '"$SLURM_NODEID"' in prelude and 'exec "$@"' in prelude
    assert argv[-len(args):] == args                       # user arguments untouched, never in the shell text
    assert "whoami" not in prelude
    # The prelude, run the way srun runs it on a task, expands the task's own variables.
    inner = argv[argv.index("bash"):]
    shown = subprocess.run(inner[:4] + [sys.executable, "-c", "import os; print(os.environ['PET_NODE_RANK'], "
                                         "os.environ['PET_NNODES'], os.environ['PET_MASTER_PORT'])"],
                           env={**os.environ, "SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "n[1-4]"},
                           capture_output=True, text=True)
    assert shown.stdout.split() == ["2", "4", "29500"]


def test_sbatch_script_escapes_and_requeues(tmp_path):
    spec = LaunchSpec(module="trainer", args=["--run-dir", str(tmp_path)], runtime="slurm", gpus=4, vendor="cuda",
                      slurm=SlurmOptions(mode="sbatch", topology="tasks", nodes=2))
    built = build(spec, {}, run_dir=tmp_path)
    assert built.argv == ["sbatch", "--parsable", str(tmp_path / "slurm" / "job.sbatch")]
    script = built.script
    assert "#SBATCH --signal=B:USR2@120" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --nodes=2" in script
    srun = next(l for l in script.splitlines() if l.startswith("srun "))
    # $SLURM_PROCID must reach each task unexpanded: inside single quotes for the batch shell.
    words = shlex.split(srun.rstrip(" &"))
    assert 'RANK="$SLURM_PROCID"' in words[words.index("-c") + 1]
    assert "$SLURM_PROCID" not in srun.replace(shlex.quote(words[words.index("-c") + 1]), "")
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)      # valid shell


def test_container_lines_pass_env_by_name():
    env = {"HF_TOKEN": "hf-secret-1", "NCCL_DEBUG": "INFO", "PATH": "/usr/bin"}
    docker = build(LaunchSpec(module="trainer", runtime="container", gpus=8, vendor="rocm",
                              container=ContainerOptions(engine="podman", image="rocm/pytorch:6.3")), env).argv
    assert docker[:3] == ["podman", "run", "--rm"] and "--device=/dev/kfd" in docker
    assert "-e" in docker and "HF_TOKEN" in docker and "hf-secret-1" not in " ".join(docker)
    assert "PATH" not in docker
    assert docker[docker.index("rocm/pytorch:6.3") + 1:][:3] == ["python3", "-m", "torch.distributed.run"]
    apptainer = build(LaunchSpec(module="trainer", runtime="container", gpus=4, vendor="cuda",
                                 container=ContainerOptions(engine="apptainer", image="img.sif")), env).argv
    assert apptainer[:2] == ["apptainer", "exec"] and "--nv" in apptainer and "img.sif" in apptainer
    composed = build(LaunchSpec(module="trainer", runtime="slurm+container", gpus=8, vendor="cuda",
                                container=ContainerOptions(engine="docker", image="nvcr.io/pytorch")), env).argv
    assert composed[0] == "srun" and composed.index("docker") > composed.index("bash")
    assert "PET_NODE_RANK" in composed                       # handed into the container by name
    with pytest.raises(LaunchError, match="image"):
        build(LaunchSpec(module="m", runtime="container"), env)

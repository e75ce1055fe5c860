"""Issue 44, the runner's Slurm items, on the live two-node testbed (tests/cluster.py, slurm=True):

3. A --partition Slurm does not have is one line naming it and the partitions there are, before any
   run directory (runtime.cluster.slurm.control.require_partition). sbatch refused it only once the
   run existed (a failed run directory), and srun inside an allocation ran the step anyway.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from small_training import train_args

REPO = Path(__file__).resolve().parents[1]
INV = REPO / ".venv" / "bin" / "inv"
pytestmark = pytest.mark.slow


def _env(cluster, tmp_path, **extra):
    return {**os.environ, **cluster.slurm_env(), "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs"),
            "ANVIL_AGENT_GRACE": "3", **extra}


def _runs(tmp_path) -> list[Path]:
    folder = tmp_path / "runs"
    return sorted(folder.iterdir()) if folder.is_dir() else []


# ---------------------------------------------------------------- 3. a partition Slurm does not have

def test_a_partition_slurm_does_not_have_is_one_line_before_any_run_directory(slurm_cluster, dataset, tmp_path):
    env = _env(slurm_cluster, tmp_path)
    cases = [  # submitted (sbatch), in an allocation (srun: it ran the step anyway), a fan-out (the setting)
        ([str(INV), "train.pretrain", "--runtime", "slurm", "--nodes", "2", "--partition", "debug,nosuchpart"], env),
        (["salloc", "-N2", "--quiet", str(INV), "train.pretrain", "--runtime", "slurm", "--partition", "nosuchpart"],
         env),
        ([str(INV), "preflight.host", "--runtime", "slurm"], {**env, "INVOKE_ANVIL_SLURM_PARTITION": "nosuchpart"}),
    ]
    for argv, environ in cases:
        proc = subprocess.run([*argv, *(train_args(dataset) if "train.pretrain" in argv else [])], cwd=REPO,
                              env=environ, capture_output=True, text=True, timeout=120)
        task = argv[argv.index(str(INV)) + 1]
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{task}: ")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert lines == [f"{task}: Slurm partition (--partition, anvil.slurm_partition) nosuchpart: no such "
                         "partition on this cluster; its partitions: debug"], proc.stderr[-2000:]
        assert _runs(tmp_path) == [], argv
    assert slurm_cluster.slurm_run("squeue", "-h").stdout.strip() == ""      # nothing submitted

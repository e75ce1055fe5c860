"""Tests keep to themselves: no test reaches a Slurm it did not start (tests/conftest.py own_slurm). The
suite runs with its own Slurm configuration, whose controller is nowhere, and outside any allocation,
wherever pytest runs (a login node, inside salloc, a machine whose DNS names a configless cluster)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from helpers.program import inv, one_line_error, runs


def test_the_suite_runs_with_its_own_slurm_configuration(own_slurm):
    assert os.environ["SLURM_CONF"] == str(own_slurm) and own_slurm.is_file()
    assert "SlurmctldPort=9" in own_slurm.read_text()
    assert not [name for name in os.environ if name.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_"))
                and name != "SLURM_CONF"]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's client commands are not installed")
def test_a_slurm_command_a_test_reaches_finds_no_controller_at_once(tmp_path):
    started = time.monotonic()
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    assert ping.returncode != 0 and "DOWN" in ping.stdout, ping.stdout + ping.stderr
    assert time.monotonic() - started < 10


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's client commands are not installed")
def test_a_per_node_task_over_slurm_outside_a_cluster_stops_at_the_missing_controller(tmp_path):
    """What tests/bench/test_bench_input.py's slurm+container test reaches: the suite's nowhere controller, not
    the machine's cluster (before, it sent a real job step to /etc/slurm/slurm.conf's cluster)."""
    proc = inv(tmp_path, "preflight.host", "--runtime", "slurm")
    one_line_error(proc, "preflight.host", "Slurm's controller does not answer")
    assert runs(tmp_path) == []


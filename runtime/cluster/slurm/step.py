"""One node's agent in a Slurm step: srun starts it on every node (inside the container, under
slurm+container).

    python -m runtime.cluster.slurm.step --nproc N [--master-port P] -- PYTHON -m trainer ARGS...

The node's place comes from SLURM_* (read here, in Python: nothing in the srun
line is expanded by a shell): the node rank, the node count, the step's first
node as the master, and a port from the job id (20000 + id % 20000). It writes
JOB.STEP to RUN_DIR/logs/slurm-step (what a Ctrl-C of the inv that ran srun
signals: runtime.cluster.slurm.control.interrupt_step), then runs the agent
(runtime.launch.agent) here, with the job id and restart count in its report.

A clean stop (every rank checkpointed: 3, or 130 after Ctrl-C) ends this task
with 0: srun's --kill-on-bad-exit takes any other status as a failure and would
kill the nodes still shutting down after their checkpoint. The status itself is
in logs/agent-<node>.json, where inv and the batch script read it
(runtime.runs.outcome.stop_status).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from runtime.cluster.slurm.srun import STEP_FILE, expand_hostlist
from runtime.launch.agent import Agent, parse_args, program_options
from runtime.launch.spec import EXIT_INTERRUPTED, EXIT_REQUEUE, RUN_DIR_VAR
from core.files import write_atomic


def layout(environ: Mapping[str, str]) -> tuple[int, int, str, int]:
    """(nnodes, node_rank, master_addr, master_port) of this Slurm job step."""
    nodes = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", ""))
    nnodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or len(nodes) or 1)
    node_rank = int(environ.get("SLURM_NODEID", 0))
    master = nodes[0] if nodes else "127.0.0.1"
    port = 20000 + int(environ.get("SLURM_JOB_ID", "0") or 0) % 20000
    return nnodes, node_rank, master, port


def main(argv=None) -> int:
    args, command = parse_args(argv)
    nnodes, node_rank, master, port = layout(os.environ)
    job, step, run_dir = (os.environ.get(n) for n in ("SLURM_JOB_ID", "SLURM_STEP_ID", RUN_DIR_VAR))
    if job and step and run_dir and step.isdigit():   # the step itself (a batch script's is not one)
        try:
            write_atomic(Path(run_dir) / STEP_FILE, f"{job}.{step}\n")
        except OSError:
            pass
    report = {"slurm_job_id": job, "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0)}
    code = Agent(args.nproc, nnodes, node_rank, master, args.master_port or port, command, report=report,
                 **program_options(args)).run()
    if code in (EXIT_REQUEUE, EXIT_INTERRUPTED) and run_dir:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Launching, the part that is the same under every transport: what to start, the per-node agent
that starts the ranks, and running a command here with its output streamed and signals passed on.

    from runtime.launch import RUN_DIR, LaunchSpec, launch

    spec = LaunchSpec(module="trainer", args=["--run-dir", RUN_DIR],
                      nproc=None,              # None: one process per visible GPU, 1 on CPU
                      gpus=machine.count, vendor=machine.vendor)
    code = launch(spec, env=run.env, run_dir=run.path)   # the agent on this machine; streams, returns the status

spec.py (what to launch), commands.py (the agent's command line, the launch's
environment), agent.py (the per-node launcher of the ranks), tools.py (a vendor
profiler around chosen ranks, for profile.train --tool), process.py (run a
command here, stream, pass signals). Where a launch runs - SSH hosts, a Slurm
allocation, a container - is runtime.cluster's.
"""
from runtime.launch.commands import agent_command, launch_env
from runtime.launch.process import launch, run_logged, run_streaming
from runtime.launch.spec import (EXIT_INTERRUPTED, EXIT_REQUEUE, RUN_DIR, LaunchError, LaunchSpec, Layout,
                                 processes_per_node, visible_gpus)

__all__ = ["EXIT_INTERRUPTED", "EXIT_REQUEUE", "LaunchError", "LaunchSpec", "Layout", "RUN_DIR", "agent_command",
           "launch", "launch_env", "processes_per_node", "run_logged", "run_streaming", "visible_gpus"]

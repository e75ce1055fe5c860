"""Launching: the same module started the same way under every runtime.

    from runtime.launch import LaunchSpec, SlurmOptions, launch

    spec = LaunchSpec(module="trainer", args=["--config", cfg, "--run-dir", str(run.path)],
                      runtime="direct",        # or "slurm", "container", "slurm+container"
                      nproc=None,              # None: one process per visible GPU, 1 on CPU
                      gpus=machine.count, vendor=machine.vendor)
    code = launch(spec, env=run.env, run_dir=run.path)   # streams output, returns the exit status

spec.py (what to launch), commands.py (the command line per runtime),
agent.py (the per-node launcher that starts the ranks), process.py (run it
here, stream, pass signals), slurm.py (sbatch: submit and follow).
"""
from runtime.launch.commands import build, launch_env
from runtime.launch.process import launch, run_streaming
from runtime.launch.spec import (EXIT_INTERRUPTED, EXIT_REQUEUE, Built, ContainerOptions, LaunchError, LaunchSpec,
                                 SlurmOptions, processes_per_node, visible_gpus)

__all__ = ["Built", "ContainerOptions", "EXIT_INTERRUPTED", "EXIT_REQUEUE", "LaunchError", "LaunchSpec",
           "SlurmOptions", "build", "launch", "launch_env", "processes_per_node", "run_streaming", "visible_gpus"]

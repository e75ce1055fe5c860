"""Runtime slurm: srun steps inside an allocation, a batch job outside one (transport.py).

    srun.py       the one builder of srun's options; what the surrounding allocation says; the host list
    step.py       one node's agent in a step: its place from SLURM_* (python -m runtime.cluster.slurm.step)
    nodetask.py   one node's part of each_node (python -m runtime.cluster.slurm.nodetask)
    batch.py      the batch script; submit, follow, requeue
    control.py    scontrol and scancel: is Slurm there, what it knows of a job, interrupt a step
"""
from runtime.cluster.slurm.transport import Slurm

__all__ = ["Slurm"]

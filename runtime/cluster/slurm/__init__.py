"""Slurm: srun steps, sbatch jobs, scontrol."""

"""Where work runs: this machine, SSH hosts, a Slurm allocation or batch job, a container around either."""

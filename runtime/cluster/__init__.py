"""Where work runs: this machine, SSH hosts, a Slurm allocation or batch job, a container around any.

    from runtime.cluster import Options, Runtime

    runtime = Runtime.parse("ssh")                    # or settings.runtime (invoke.yaml), parsed there
    transport = runtime.open(Options(hosts=["n1", "n2"], ssh=settings.ssh_options()))
    layout = transport.layout(spec, env)              # nodes x processes, before any run directory
    code = transport.launch(spec, env, run_dir)       # one agent per node (runtime.launch.LaunchSpec)
    results = transport.each_node(["inv", "preflight.all", "--json"], hosts_dir=run_dir / "hosts")

runtime.py (the Runtime value), registry.py (the transports by name),
transport.py (what a transport does), options.py (what each takes), results.py
(a node's result of each_node), direct.py, ssh/, slurm/, container.py (the
transports). docs/extending.md shows how to add one.
"""
from runtime.cluster.options import ContainerOptions, Options, SlurmOptions, SshOptions
from runtime.cluster.registry import register
from runtime.cluster.results import HostResult, Interrupted
from runtime.cluster.runtime import BadRuntime, Runtime
from runtime.cluster.transport import Transport

__all__ = ["BadRuntime", "ContainerOptions", "HostResult", "Interrupted", "Options", "Runtime", "SlurmOptions",
           "SshOptions", "Transport", "register"]

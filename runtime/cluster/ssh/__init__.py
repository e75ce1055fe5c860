"""Runtime ssh: hosts named with -H or anvil.hosts, reached over SSH with Fabric (transport.py).

    session.py   one command on one host, its environment and signals over the session's stdin
    remote.py    the far end of a session (python -m runtime.cluster.ssh.remote)
"""
from runtime.cluster.ssh.transport import HostsError, Ssh, parse_hosts

__all__ = ["HostsError", "Ssh", "parse_hosts"]

"""This host's identity: the name the launcher reached it by.

    this_host()     # "node7" under `inv -H node7,...` or on Slurm node node7; else the host name

Hosts can share a host name (network namespaces, containers, machines cloned from one image), so
the name a run records for a host, and the one its rank logs and failure messages carry, is the
one it was reached by: the -H entry or the Slurm node name, which the launcher passes on in
names.HOST. Without a launcher it is the machine's host name, without its domain.
"""
from __future__ import annotations

import os
import socket
from typing import Mapping

from core import names


def host_name() -> str:
    """The machine's own host name, without its domain."""
    return socket.gethostname().split(".")[0]


def this_host(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(names.HOST) or env.get("SLURMD_NODENAME") or host_name()

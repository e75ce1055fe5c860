"""The transports by runtime name. A runtime of its own (PBS, Flux, Kubernetes, ...) is one module
with a Transport subclass, and one registration: add it to BUILT_IN here, or call register(cls)
from a module that names.TASKS_PATH loads. docs/extending.md shows one."""
from __future__ import annotations

from core import names
from runtime.cluster.direct import Direct
from runtime.cluster.slurm import Slurm
from runtime.cluster.ssh import Ssh
from runtime.cluster.transport import Transport

BUILT_IN: tuple[type[Transport], ...] = (Direct, Ssh, Slurm)
TRANSPORTS: dict[str, type[Transport]] = {}


def register(kind: type[Transport]) -> type[Transport]:
    """Make `kind` the transport of runtime `kind.name` (also usable as a class decorator)."""
    if not kind.name or "+" in kind.name or kind.name == "container":
        raise ValueError(f"{kind.__name__}: a transport's name is one word other than 'container', got "
                         f"{kind.name!r}")
    TRANSPORTS[kind.name] = kind
    return kind


def names() -> list[str]:
    return list(TRANSPORTS)


for _kind in BUILT_IN:
    register(_kind)

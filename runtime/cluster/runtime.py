"""Where work runs, as one value: a transport (direct, ssh, slurm, or one registered) and whether a
container wraps it. Made once, where the user's choice is read (--runtime, anvil.runtime in
invoke.yaml, INVOKE_ANVIL_RUNTIME); everything after takes the value and asks it.

    runtime = Runtime.parse("slurm+container")      # BadRuntime (exit 2) for anything else
    str(runtime) == "slurm+container"; runtime.container; runtime.scheduler; runtime.spans_nodes
    transport = runtime.open(options)               # a Transport: layout, launch, each_node
"""
from __future__ import annotations

import dataclasses

from runtime.cluster import registry
from runtime.cluster.container import Container
from runtime.cluster.options import Options
from runtime.cluster.transport import Transport
from core.errors import UserError

CONTAINER = "container"


class BadRuntime(UserError):
    """A runtime that is none of the registered transports, with or without +container."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    transport: str = "direct"
    container: bool = False

    @classmethod
    def parse(cls, text: str, what: str = "--runtime") -> "Runtime":
        """`direct`, `ssh`, `slurm` (or a registered name), each alone or +container; `container` alone
        is direct+container. `what` names where the text came from, for the one error."""
        name = str(text).strip()
        first, plus, rest = name.partition("+")
        if name == CONTAINER:
            return cls("direct", True)
        if first in registry.TRANSPORTS and (not plus or rest == CONTAINER):
            return cls(first, bool(plus))
        raise BadRuntime(f"{what} {name!r}: expected {choices()}")

    def __str__(self) -> str:
        if self.container:
            return CONTAINER if self.transport == "direct" else f"{self.transport}+{CONTAINER}"
        return self.transport

    @property
    def kind(self) -> type[Transport]:
        return registry.TRANSPORTS[self.transport]

    # ---- the questions (the transport's answers)
    @property
    def scheduler(self) -> bool:
        """A scheduler places the work: --nodes, --partition, --account, --time and --no-wait apply."""
        return self.kind.scheduler

    @property
    def spans_nodes(self) -> bool:
        """Other machines than this one run it (this machine's GPUs and memory are not the ranks')."""
        return self.kind.spans_nodes

    def bare(self) -> "Runtime":
        """The same transport without a container."""
        return dataclasses.replace(self, container=False)

    def over(self, transport: str) -> "Runtime":
        """Another transport, keeping the container."""
        return dataclasses.replace(self, transport=transport)

    def on_node(self) -> "Runtime":
        """What each node runs of work this runtime fanned out: its own part, here (keeping the container)."""
        return self.over("direct")

    def open(self, options: Options | None = None) -> Transport:
        transport = self.kind(options or Options())
        return Container(transport, transport.options.container) if self.container else transport


def choices() -> str:
    """What --runtime takes: every transport, then each with its container (direct's is `container`)."""
    names = registry.names()
    wrapped = [CONTAINER if n == "direct" else f"{n}+{CONTAINER}" for n in names]
    return " | ".join(names + wrapped)

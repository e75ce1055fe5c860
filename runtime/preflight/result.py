"""One preflight finding, and the inputs every check reads."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
_RANK = {PASS: 0, WARN: 1, FAIL: 2}


@dataclass
class CheckResult:
    name: str  # "<group>.<what>": "gpu.processes", "network.socket_ifname"
    status: str  # PASS | WARN | FAIL
    value: Any  # what was measured (str/number), compared across hosts by the fan-out merge
    reason: str  # one line: why this status
    fix: str = ""  # one line: what to do (empty on PASS)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CheckInputs:
    """What the checks look at: this machine, the environment a run would get, where runs go."""

    machine: Any  # envs.Machine, as detected here
    env: Any  # envs.ResolvedEnv the run would launch with
    run_dir: Path  # where runs are written (disk space is checked there)
    require_gpu: bool = False
    allow_unknown_gpu: bool = False
    root: Path = Path("/")  # stands in for "/" when reading /sys and /proc
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    cpus: Optional[set] = None  # CPUs ranks started from here may use (default: this process's affinity)
    timeout: float = 0.0  # seconds per device for the screen and perf checks (0: their defaults)
    floors: dict = field(default_factory=dict)  # perf floors given with --floor, over the GPU profile's
    baseline: Optional[dict] = None  # a recorded baseline (--baseline FILE)
    tolerance: float = 0.05  # how far under the baseline still passes
    measured: Optional[dict] = None  # perf: what was measured (for --save-baseline)
    topology: Optional[Any] = None  # topology: the node's map (envs.topology.Topology), kept as topology.json

    def var(self, name: str) -> Optional[str]:
        """The value a launched process sees: the resolved environment over the shell's."""
        var = self.env.vars.get(name) if self.env is not None else None
        if var is not None:
            return var.value
        return self.environ.get(name)


def worst(results) -> str:
    return max((r.status for r in results), key=_RANK.__getitem__, default=PASS)


#: The value column wraps here (at spaces; a longer word is broken): a value is shown whole, never cut short.
VALUE_WIDTH = 48


def table(results) -> str:
    from tabulate import tabulate
    rows = [(r.name, r.status, "" if r.value is None else str(r.value),
             r.reason + (f"\n  fix: {r.fix}" if r.fix else "")) for r in results]
    return tabulate(rows, headers=("check", "status", "value", "reason / fix"), tablefmt="simple",
                    disable_numparse=True, maxcolwidths=[None, None, VALUE_WIDTH, None])

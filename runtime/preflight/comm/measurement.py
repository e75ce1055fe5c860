"""What the comm check measures: a Measurement (one all-reduce over two nodes or all of them: its
busbw, or why there is none), a Probe (can a node run it, with how many GPUs), the Transport that
takes them, and read_result (a Measurement from the rank-0 JSON of benchmarks.collectives)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, Sequence

Pair = tuple[str, str]


@dataclass
class Measurement:
    """One all-reduce over `hosts` (two for a pair): its busbw, or why there is none."""
    hosts: tuple[str, ...]
    busbw: float | None = None       # GB/s (nccl-tests busbw); None: failed or timed out
    seconds: float = 0.0             # wall time of the launch
    error: str | None = None
    ranks: int = 0
    bytes: int = 0
    round: int = 0
    slow: bool | None = None         # set by mark_slow: None while nothing can be compared with it
    attempts: int = 1                # 2 once retested before naming a node (keep_best: the better figure)

    @property
    def label(self) -> str:
        return "<->".join(self.hosts)

    def to_dict(self) -> dict:
        return {**asdict(self), "hosts": list(self.hosts)}


@dataclass
class Probe:
    host: str
    ok: bool
    gpus: int = 0
    error: str | None = None
    seconds: float = 0.0


class Transport(Protocol):
    name: str

    def probe(self, hosts: Sequence[str], timeout: float) -> dict[str, Probe]: ...

    def allreduce(self, hosts: Sequence[str], size: str, iters: int, timeout: float) -> Measurement: ...

    def pairs(self, pairs: Sequence[Pair], size: str, iters: int, timeout: float,
              round_no: int) -> list[Measurement]: ...


def read_result(out: Path, hosts: Sequence[str], seconds: float, problems: Sequence[str]) -> Measurement:
    """The rank-0 JSON of benchmarks.collectives (--out), or a failed Measurement with the first problem."""
    try:
        report = json.loads(Path(out).read_text())
        row = report["results"][0]
        return Measurement(tuple(hosts), busbw=float(row["busbw_GBps"]), seconds=round(seconds, 2),
                           ranks=int(row.get("ranks", 0)), bytes=int(row.get("bytes", 0)))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return Measurement(tuple(hosts), seconds=round(seconds, 2), error=f"unreadable result {out}: {exc}")
    error = "; ".join(p for p in problems if p) or "no result written (see the launch logs)"
    return Measurement(tuple(hosts), seconds=round(seconds, 2), error=error)

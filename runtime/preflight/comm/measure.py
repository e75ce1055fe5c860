"""The comm check's measurements through any cluster transport (runtime.cluster): SSH hosts, or the
nodes of a Slurm allocation. The probe is each_node (can the node run Python and torch, with how many
GPUs); each all-reduce is one launch of benchmarks.collectives on its nodes, bounded by its timeout
(a dead link costs its timeout, never a hang).

    via = OverCluster(runtime.open(options), work_dir, record=run.write_json)
    via.probe(hosts, timeout); via.allreduce(hosts, size, iters, timeout); via.pairs(pairs, size, iters, timeout, n)

Each launch has a folder of its own under work_dir (pairs/NNN_<label>/): rank
0's collectives.json, the agents' logs/, and launch.json (the launch's status
and the last of its output, written through `record`: the run's masked
writer). Launches of one round run at the same time, each on its own master port.
"""
from __future__ import annotations

import io
import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Sequence

from core import names
from runtime.cluster.transport import Transport
from runtime.launch.process import TIMED_OUT
from runtime.launch.spec import LaunchSpec
from runtime.preflight.comm.measurement import Measurement, Probe, read_result
from core.files import write_json_atomic

WARMUP = 3
# Recomputed on each node by the agent (route to MASTER_ADDR): the interface gloo / NCCL bind.
NODE_LOCAL = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"]
_GPU_PROBE = "import torch; print('anvil-comm-gpus', torch.cuda.device_count())"


def _last_line(text: str | None) -> str:
    noise = ("socket.cpp", "[W", "Warning:")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    meaningful = [ln for ln in lines if not ln.startswith(noise) and "c10d" not in ln and not ln.startswith("$ ")]
    return (meaningful or lines or [""])[-1][:200]


def _collectives_args(size: str, iters: int, out: Path) -> list[str]:
    # --eager: the calls a training job makes, and no dependence on the library capturing CUDA graphs
    return ["--op", "all_reduce", "--sizes", size, "--iters", str(iters),
            "--warmup", str(min(WARMUP, max(1, iters))), "--eager", "--out", str(out)]


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


class _Ports:
    """Distinct master ports for the launches of one screen (two launches never share one)."""

    def __init__(self, base: int = 0):
        self._next = itertools.count(base or random.randrange(21000, 31000, 10))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            return next(self._next)


class OverCluster:
    """The comm check's Transport (measurement.Transport) over a cluster transport."""

    def __init__(self, transport: Transport, work_dir: Path, nproc: int = 0, base_port: int = 0,
                 env: Mapping[str, str] | None = None, record: Callable[[Path, dict], object] | None = None):
        import os

        self.transport = transport
        self.name = transport.via
        self.work_dir = Path(work_dir)
        self.nproc = nproc
        self.env = dict(os.environ if env is None else env)
        self.record = record or write_json_atomic
        self.gpus: dict[str, int] = {}          # from the probe
        self.ports = _Ports(base_port)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def _folder(self, label: str) -> Path:
        with self._lock:
            folder = self.work_dir / f"{next(self._counter):03d}_{_safe(label)}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def nproc_for(self, nodes: Sequence[str]) -> int:
        """Ranks per node: --nproc, else one per GPU (the fewest any of these nodes has), one on CPU."""
        if self.nproc > 0:
            return self.nproc
        return max(1, min((self.gpus.get(h, 0) for h in nodes), default=0))

    # ---- the three steps
    def probe(self, hosts: Sequence[str], timeout: float) -> dict[str, Probe]:
        if self.nproc > 0:
            return {h: Probe(h, True) for h in hosts}
        command = [self.transport.python(), "-c", _GPU_PROBE]
        results = {r.host: r for r in self.transport.each_node(command, hosts_dir=self.work_dir / "probe",
                                                                timeout=timeout, nodes=list(hosts))}
        found = {}
        for host in hosts:
            r = results.get(host)
            line = next((ln for ln in (r.stdout if r else "").splitlines() if ln.startswith("anvil-comm-gpus")), "")
            if r is not None and r.ok and line:
                found[host] = Probe(host, True, gpus=max(int(line.split()[1]), 0), seconds=r.seconds)
                self.gpus[host] = found[host].gpus
            elif r is None:
                found[host] = Probe(host, False, error="no answer from this node")
            else:
                error = r.error or f"exit {r.exit_code}: {_last_line(r.stderr) or _last_line(r.stdout)}"
                found[host] = Probe(host, False, error=error, seconds=r.seconds)
        return found

    def launch(self, nodes: Sequence[str], label: str, size: str, iters: int, timeout: float) -> Measurement:
        folder = self._folder(label)
        out = folder / names.COLLECTIVES
        spec = LaunchSpec(module="benchmarks.collectives", args=_collectives_args(size, iters, out),
                          nproc=self.nproc_for(nodes), gpus=min((self.gpus.get(h, 0) for h in nodes), default=0),
                          master_port=self.ports.take(), python=self.transport.python(), node_local=NODE_LOCAL)
        said_out, said_err = io.StringIO(), io.StringIO()
        started = time.monotonic()
        code = self.transport.launch(spec, self.env, folder, nodes=list(nodes), stdout=said_out, stderr=said_err,
                                     timeout=timeout)
        seconds = time.monotonic() - started
        self.record(folder / "launch.json", {"exit_code": code, "timed_out": code == TIMED_OUT,
                                             "stdout": said_out.getvalue()[-4000:],
                                             "stderr": said_err.getvalue()[-4000:]})
        problems = []
        if code == TIMED_OUT:
            problems.append(f"timed out after {timeout:.0f} s")
        elif code:
            problems.append(f"exit {code}: {_last_line(said_err.getvalue()) or _last_line(said_out.getvalue())}")
        result = read_result(out, nodes, seconds, problems)
        if result.busbw is not None and problems:   # a figure, yet a node failed: do not trust it
            result = Measurement(tuple(nodes), seconds=round(seconds, 2), error="; ".join(problems))
        return result

    def allreduce(self, hosts, size, iters, timeout) -> Measurement:
        return self.launch(list(hosts), f"all-{len(hosts)}", size, iters, timeout)

    def pairs(self, pairs, size, iters, timeout, round_no) -> list[Measurement]:
        """The pairs of one round at the same time (each launch on its own port)."""
        with ThreadPoolExecutor(max_workers=max(1, len(pairs))) as pool:
            return list(pool.map(lambda p: self.launch(list(p), f"r{round_no}_{p[0]}-{p[1]}", size, iters,
                                                       timeout), pairs))

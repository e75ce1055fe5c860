"""The transports of the comm check: how one all-reduce is launched on the nodes and its figure read
back. SshTransport over Fabric (the agent started on every host of a launch at once, `timeout -k 5 T`
on the node) and SlurmTransport (one srun step per launch inside the allocation, killed at the
timeout), and what both share (_Launcher: a folder per launch, distinct master ports, ranks per node)."""
from __future__ import annotations

import itertools
import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

from runtime.preflight.comm.measurement import Measurement, Probe, read_result

WARMUP = 3
# Recomputed on each node by the agent (route to MASTER_ADDR): the interface gloo / NCCL bind.
NODE_LOCAL = "GLOO_SOCKET_IFNAME,NCCL_SOCKET_IFNAME,NCCL_IB_HCA"
_GPU_PROBE = "import torch; print('anvil-comm-gpus', torch.cuda.device_count())"
_GPU_PROBE_HOST = ("import socket, torch; "
                   "print('anvil-comm-gpus', torch.cuda.device_count(), socket.gethostname())")
_TIMED_OUT = (124, 137)     # coreutils timeout: timed out / killed after the grace


def _last_line(text: str | None) -> str:
    noise = ("socket.cpp", "[W", "Warning:")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    meaningful = [ln for ln in lines if not ln.startswith(noise) and "c10d" not in ln]
    return (meaningful or lines or [""])[-1][:200]


def _collectives_args(size: str, iters: int, out: Path) -> list[str]:
    return ["-m", "benchmarks.collectives", "--op", "all_reduce", "--sizes", size, "--iters", str(iters),
            "--warmup", str(min(WARMUP, max(1, iters))), "--out", str(out)]


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


class _Launcher:
    """What both transports share: one folder per launch under work_dir (pairs/NNN_<label>/ with
    collectives.json, the agents' logs/ and the launch's output), distinct ports, ranks per node."""

    name = "?"

    def __init__(self, work_dir: Path, nproc: int = 0, python: str = "", base_port: int = 0):
        self.work_dir = Path(work_dir)
        self.nproc = nproc
        self.python = python
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

    @staticmethod
    def _result(out: Path, nodes: Sequence[str], seconds: float, problems: list[str]) -> Measurement:
        result = read_result(out, nodes, seconds, problems)
        if result.busbw is not None and problems:   # a figure, yet a node failed: do not trust it
            result = Measurement(tuple(nodes), seconds=round(seconds, 2), error="; ".join(problems))
        return result

    def launch(self, nodes: Sequence[str], label: str, size: str, iters: int, timeout: float) -> Measurement:
        raise NotImplementedError

    def allreduce(self, hosts, size, iters, timeout) -> Measurement:
        return self.launch(list(hosts), f"all-{len(hosts)}", size, iters, timeout)

    def pairs(self, pairs, size, iters, timeout, round_no) -> list[Measurement]:
        """The pairs of one round at the same time (each launch on its own port)."""
        with ThreadPoolExecutor(max_workers=max(1, len(pairs))) as pool:
            return list(pool.map(lambda p: self.launch(list(p), f"r{round_no}_{p[0]}-{p[1]}", size, iters,
                                                       timeout), pairs))


# ---- over SSH (Fabric) ----------------------------------------------------------------------------

class SshTransport(_Launcher):
    """The agent started on every host of a launch at once over Fabric; rank 0 writes the JSON into
    work_dir (a run directory on the file system all hosts share, as the checkout is). The remote
    python is the one beside remote_inv (default: this one)."""

    name = "ssh"

    def __init__(self, options, work_dir: Path, nproc: int = 0, python: str = "", base_port: int = 0,
                 config=None):
        from runtime.cluster import ssh

        remote_inv = options.remote_inv or ssh.local_inv()
        super().__init__(work_dir, nproc, python or str(Path(remote_inv).with_name("python")), base_port)
        self.options = options
        self.config = config

    # -- plumbing
    def _config(self):
        if self.config is None:
            from runtime.cluster import ssh
            ssh._quiet_paramiko()
            self.config = ssh.fabric_config(self.options.ssh_config)
        return self.config

    def _run(self, host: str, command: str, timeout: float) -> tuple[int | None, str, str, str | None]:
        """(exit status, stdout, stderr, error) of one command on one host; never raises."""
        from runtime.cluster import ssh

        return ssh.run_command(host, command, self.options, self._config(), timeout=timeout)

    def _prefix(self, host: str) -> str:
        return f"cd {shlex.quote(self.options.remote_path)} && ANVIL_HOST={shlex.quote(host)}"

    def command(self, host: str, nodes: Sequence[str], rank: int, port: int, size: str, iters: int,
                out: Path, timeout: float, nproc: int) -> str:
        """The shell line one host runs for one launch (every piece quoted)."""
        from runtime.cluster.results import slurm_name

        agent = [self.python, "-m", "runtime.launch.agent", "--nproc", str(nproc), "--nnodes", str(len(nodes)),
                 "--node-rank", str(rank), "--master-addr", slurm_name(nodes[0]), "--master-port", str(port),
                 "--", self.python, *_collectives_args(size, iters, out)]
        return (f"{self._prefix(host)} ANVIL_NODE_LOCAL={NODE_LOCAL} ANVIL_RUN_DIR={shlex.quote(str(out.parent))} "
                f"timeout -k 5 {int(max(1, timeout))} {shlex.join(agent)}")

    # -- the three steps
    def probe(self, hosts: Sequence[str], timeout: float) -> dict[str, Probe]:
        code = _GPU_PROBE if self.nproc <= 0 else "print('anvil-comm-gpus', -1)"

        def one(host):
            t0 = time.monotonic()
            line = f"{self._prefix(host)} {shlex.quote(self.python)} -c {shlex.quote(code)}"
            exit_code, out, err, error = self._run(host, line, timeout)
            seconds = time.monotonic() - t0
            if error:
                return Probe(host, False, error=error, seconds=seconds)
            if exit_code != 0:
                return Probe(host, False, error=f"exit {exit_code}: {_last_line(err) or _last_line(out)}",
                             seconds=seconds)
            gpus = next((int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("anvil-comm-gpus")), 0)
            return Probe(host, True, gpus=max(gpus, 0), seconds=seconds)

        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            found = dict(zip(hosts, pool.map(one, hosts)))
        self.gpus.update({h: p.gpus for h, p in found.items() if p.ok})
        return found

    def launch(self, nodes: Sequence[str], label: str, size: str, iters: int, timeout: float) -> Measurement:
        port = self.ports.take()
        folder = self._folder(label)
        out = folder / "collectives.json"
        nproc = self.nproc_for(nodes)
        started = time.monotonic()

        def one(rank_host):
            rank, host = rank_host
            return self._run(host, self.command(host, nodes, rank, port, size, iters, out, timeout, nproc),
                             timeout + 30)

        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            ran = list(pool.map(one, enumerate(nodes)))
        seconds = time.monotonic() - started
        problems, logs = {}, {}
        for (rank, host), (exit_code, stdout, stderr, error) in zip(enumerate(nodes), ran):
            logs[host] = {"exit_code": exit_code, "error": error, "stdout": stdout[-4000:], "stderr": stderr[-4000:]}
            if error:
                problems[host] = error
            elif exit_code in _TIMED_OUT:
                problems[host] = f"timed out after {timeout:.0f} s"
            elif exit_code:
                problems[host] = f"exit {exit_code}: {_last_line(stderr) or _last_line(stdout)}"
        (folder / "hosts.json").write_text(json.dumps(logs, indent=1))
        if len(problems) == len(nodes) and len(set(problems.values())) == 1:
            merged = [next(iter(problems.values()))]          # "timed out after 20 s" on every host: say it once
        else:
            merged = [f"{host}: {text}" for host, text in problems.items()]
        return self._result(out, nodes, seconds, merged)


# ---- inside a Slurm allocation (srun) ----------------------------------------------------------------

class SlurmTransport(_Launcher):
    """One srun step per launch inside the allocation: `srun --nodes=K --nodelist=a,b
    --ntasks-per-node=1 python -m runtime.launch.agent --slurm --nproc N --master-port P -- ...`.
    The steps of one round run at the same time on their disjoint nodes."""

    name = "srun"

    def __init__(self, work_dir: Path, settings=None, env: Mapping[str, str] | None = None, nproc: int = 0,
                 python: str = "", base_port: int = 0):
        super().__init__(work_dir, nproc, python or sys.executable, base_port)
        self.settings = settings
        self.env = dict(os.environ if env is None else env)

    def _srun(self, nodes: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
        checkout = self.settings.root if self.settings is not None else os.getcwd()
        options = [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}", "--ntasks-per-node=1",
                   "--kill-on-bad-exit=1", f"--chdir={checkout}"]
        if self.settings is not None:
            options += list(self.settings.slurm_extra)
        return ["srun", *options, *extra]

    def _step(self, argv: list[str], timeout: float, run_dir: Path | None = None) -> tuple[int | None, str, str, bool]:
        """(exit status, stdout, stderr, timed out) of one srun step; killed at the timeout."""
        env = {**self.env, "ANVIL_NODE_LOCAL": NODE_LOCAL}
        if run_dir is not None:
            env["ANVIL_RUN_DIR"] = str(run_dir)          # the agents write logs/agent-<node rank>.json there
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err, False
        except subprocess.TimeoutExpired:
            proc.terminate()                 # srun passes it on and ends the step
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            return proc.returncode, out, err, True

    def probe(self, hosts, timeout):
        if self.nproc > 0:
            return {h: Probe(h, True) for h in hosts}
        code = _GPU_PROBE_HOST
        exit_code, out, err, timed_out = self._step(self._srun(hosts) + [self.python, "-c", code], timeout)
        found = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "anvil-comm-gpus":
                found[parts[2].split(".")[0]] = int(parts[1])
        result = {}
        for host in hosts:
            if host in found:
                self.gpus[host] = found[host]
                result[host] = Probe(host, True, gpus=found[host])
            else:
                why = "timed out" if timed_out else f"srun exit {exit_code}: {_last_line(err) or 'no answer'}"
                result[host] = Probe(host, False, error=f"no answer from this node ({why})")
        return result

    def command(self, nodes: Sequence[str], port: int, size: str, iters: int, out: Path) -> list[str]:
        nproc = self.nproc_for(nodes)
        gpus = min((self.gpus.get(h, 0) for h in nodes), default=0)
        extra = [f"--gpus-per-node={nproc}"] if gpus else []
        agent = [self.python, "-m", "runtime.launch.agent", "--slurm", "--nproc", str(nproc),
                 "--master-port", str(port), "--", self.python, *_collectives_args(size, iters, out)]
        return self._srun(nodes, extra) + agent

    def launch(self, nodes, label, size, iters, timeout) -> Measurement:
        folder = self._folder(label)
        out = folder / "collectives.json"
        started = time.monotonic()
        exit_code, stdout, stderr, timed_out = self._step(self.command(nodes, self.ports.take(), size, iters, out),
                                                          timeout, folder)
        seconds = time.monotonic() - started
        (folder / "srun.json").write_text(json.dumps({"exit_code": exit_code, "timed_out": timed_out,
                                                      "stdout": stdout[-4000:], "stderr": stderr[-4000:]}, indent=1))
        problems = []
        if timed_out:
            problems.append(f"timed out after {timeout:.0f} s")
        elif exit_code:
            problems.append(f"srun exit {exit_code}: {_last_line(stderr) or _last_line(stdout)}")
        return self._result(out, nodes, seconds, problems)

"""The per-node launcher: start this node's ranks, pass signals on, end them together.

    python -m runtime.launch.agent --nproc N [--nnodes M --node-rank R --master-addr A]
                                   [--master-port P] -- PYTHON -m trainer ARGS...
    python -m runtime.launch.agent --nproc N [...] --backend megatron [--metrics-regex RE]
                                   [--hang-timeout S] [--chdir DIR] -- PYTHON pretrain_gpt.py ARGS...

It does what torchrun does for a static job (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT in each rank's
environment; env:// rendezvous), and what torchrun does not:

- Exit status is the ranks' own. All ranks stopped on a signal after
  checkpointing (3) -> 3, so "requeue on exit 3" works; Ctrl-C (130) -> 130;
  otherwise the first failing rank's status. torchrun turns a signal into its
  own SignalException and exit 1, which hid all of that.
- A signal to this process (SIGTERM, SIGUSR1/2, SIGINT, SIGHUP) is passed to
  every rank once and the agent keeps waiting: ranks finish their step and
  checkpoint (core.signals). Slurm and most schedulers signal the whole
  process group; a rank keeps the first signal it sees, so twice is harmless, and
  once every rank has ended after a signal, the agent ignores further ones. A rank that the
  signal ended before the trainer's handler was in place (before its first step) stopped:
  the agent exits with the trainer's status for that signal (3 or 130), not as a failure.
- When one rank fails, the others are stopped (SIGTERM, then SIGKILL after
  names.AGENT_GRACE seconds, default 10) and the failure is one line naming
  the rank and host. A rank the hang watchdog ended (EXIT_HUNG, 4) is such a
  failure; a hung peer ignores the SIGTERM and is killed after the grace.
- The node's place (node rank, node count, master) is given by the transport
  that started it (runtime.cluster: over SSH on the command line; under Slurm
  runtime.cluster.slurm.step reads it from SLURM_* and runs this agent); values
  computed from the machine (names.NODE_LOCAL names them: socket interface,
  host name, ...) are recomputed on this node, not inherited from the host
  where `inv` ran.
- With names.PROFILE_TOOL set (inv profile.train --tool), the ranks names.PROFILE_RANKS names
  run under that vendor profiler (runtime.launch.tools); a profiler missing on this node is one
  line and exit 2, before any rank starts.
- With --backend NAME (inv train.launch) the ranks run another trainer's program
  (runtime.backends): the agent picks the checkpoint each attempt resumes from,
  writes each rank's output to logs/rank<R>.log, its metric lines to
  metrics.jsonl, passes stop signals on the way the backend expects (Megatron-LM's
  SIGTERM, after which its exit 0 is a clean stop), and with --hang-timeout ends
  ranks that made no progress for that long (runtime.launch.output). --chdir
  runs them in that folder (where inv ran, on a shared file system).
- With names.RUN_DIR set it watches the node's GPUs while the ranks run (runtime.launch.gpuwatch:
  clocks, power, temperature, ECC, Xid into logs/gpu-<node rank>.jsonl, trouble said and reported),
  and writes RUN_DIR/logs/agent-<node rank>.json
  (host, ranks, exit statuses, first failure, and what its starter adds: a
  Slurm job id and restart count) for the runner's summary.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from core import names
from core.host import this_host
import runtime.launch.tools as tools
from runtime.launch.spec import (EXIT_INTERRUPTED, EXIT_REQUEUE, LAUNCHER_PID_VAR, NODE_LOCAL_VAR, PASSED_SIGNALS,
                                 RUN_DIR_VAR)
from core.files import write_json_atomic
from core.signals import EXIT_HUNG, STOP_SIGNALS, exit_status, killed_outright, on_parent_death
from runtime.launch.output import Program


def container_engine(environ) -> str | None:
    """The engine this agent runs under, if any: podman sets container=podman, docker leaves
    /.dockerenv, apptainer sets APPTAINER_CONTAINER."""
    if environ.get("container"):
        return environ["container"]
    if environ.get("APPTAINER_CONTAINER") or environ.get("SINGULARITY_CONTAINER"):
        return "apptainer"
    return "docker" if os.path.exists("/.dockerenv") else None

def free_port() -> int:
    """A port for the rendezvous store that rank 0 will listen on, probed the way the store
    binds (every address, both stacks). Once, a probe on 127.0.0.1 alone gave the second of two
    `inv bench.allreduce` in a row the first one's port, and rank 0 failed with EADDRINUSE
    (a lent H200 pair; not seen again in 8 tries)."""
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # both stacks
                sock.bind((wildcard, 0))
                sock.listen(1)
                return sock.getsockname()[1]
        except OSError:   # no IPv6 here
            continue
    raise OSError("no free TCP port for the rendezvous")


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m runtime.launch.agent [options] -- COMMAND...")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m runtime.launch.agent")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--backend", default="", help="the ranks run this backend's program (runtime.backends)")
    p.add_argument("--metrics-regex", default="", help="--backend: metric lines this regex reads, too")
    p.add_argument("--hang-timeout", type=float, default=0.0, help="--backend: seconds without progress = hung")
    p.add_argument("--chdir", default="", help="--backend: the ranks' working directory (when it is there)")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("no command after --")
    if args.nproc < 1:
        p.error("--nproc must be >= 1")
    return args, command


def program_options(args: argparse.Namespace) -> dict:
    """The Agent's keywords for a backend's program, from parse_args's options."""
    return dict(backend=args.backend, metrics_regex=args.metrics_regex, hang_timeout=args.hang_timeout,
                chdir=args.chdir)


def blame_order(ended: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranks found ended in one look (local rank, exit status), in the order they are blamed: one SIGKILL
    ended first (core.signals.killed_outright), then by rank; its peers, failing on their closed connection
    to it, often end within the 50 ms between looks."""
    return sorted(ended, key=lambda ended_rank: not killed_outright(ended_rank[1]))


class Agent:
    def __init__(self, nproc: int, nnodes: int, node_rank: int, master_addr: str, master_port: int,
                 command: list[str], environ=None, grace: float | None = None, report: dict | None = None,
                 backend: str = "", metrics_regex: str = "", hang_timeout: float = 0.0, chdir: str = ""):
        self.nproc, self.nnodes, self.node_rank = nproc, nnodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port or free_port()
        self.command = command
        self.environ = dict(os.environ if environ is None else environ)
        self.grace = float(grace if grace is not None else self.environ.get(names.AGENT_GRACE, 10))
        self.host = this_host(self.environ)
        self.procs: list[subprocess.Popen] = []
        self.codes: dict[int, int] = {}
        self.stop_signal: int | None = None
        self.first_failure: dict | None = None
        self.stopped_early = False        # a rank ended by the stop signal before its first step
        self.started = time.time()
        self.report = {"restart_count": 0, **(report or {})}   # what the starter adds (a scheduler's job id)
        self.backend, self.metrics_regex, self.hang_timeout = backend, metrics_regex, hang_timeout
        self.chdir = chdir if chdir and os.path.isdir(chdir) else None
        self.program: Program | None = None     # --backend: the other trainer's ranks (runtime.launch.output)
        self.forwarded: int | None = None       # the signal the ranks were sent for the stop signal

    # ---- environment
    def base_env(self) -> dict[str, str]:
        env = dict(self.environ)
        env.update(MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port),
                   WORLD_SIZE=str(self.nproc * self.nnodes), LOCAL_WORLD_SIZE=str(self.nproc),
                   GROUP_RANK=str(self.node_rank), GROUP_WORLD_SIZE=str(self.nnodes),
                   NODE_RANK=str(self.node_rank))
        node_local = [n for n in env.pop(NODE_LOCAL_VAR, "").split(",") if n]
        if node_local:
            from envs import compute_here   # only multi-node launches recompute
            # launch_env left inv's own values of these out: one that is here was set by this node's
            # launcher (a host's name as it was given), and the computation keeps it
            computed = compute_here(node_local, environ=env)
            for name in node_local:
                env.pop(name, None)
            env.update(computed)
        self.host = env.get(names.HOST) or self.host
        if self.nproc > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"   # as torchrun: N ranks must not each take every core
        return env

    def ranks(self) -> range:
        """The global ranks this node starts."""
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)

    def rank_env(self, base: dict[str, str], local_rank: int) -> dict[str, str]:
        rank = self.node_rank * self.nproc + local_rank
        return {**base, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "ROLE_RANK": str(rank)}

    # ---- signals
    def _on_signal(self, signum, _frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        sent = self.program.forwarded(signum) if self.program is not None else signum
        if signum in STOP_SIGNALS and self.forwarded is None:
            self.forwarded = sent
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(sent)
                except ProcessLookupError:
                    pass

    # ---- run
    def run(self) -> int:
        base = self.base_env()
        for signum in PASSED_SIGNALS:
            signal.signal(signum, self._on_signal)
        if not _end_with_launcher():
            print("anvil-agent: the inv that started this run is gone; no rank started", file=sys.stderr)
            return EXIT_INTERRUPTED
        run_dir = base.get(RUN_DIR_VAR)
        profiled = [rank for rank in self.ranks() if tools.chosen(rank, base)] if base.get(tools.TOOL_VAR) else []
        absent = tools.missing(base[tools.TOOL_VAR], base.get("PATH")) if profiled else None
        if absent:
            print(f"anvil-agent: {absent} (on {self.host}); no rank started", file=sys.stderr, flush=True)
            self._write_record(2)
            return 2
        if profiled and run_dir:
            Path(run_dir, "profile").mkdir(parents=True, exist_ok=True)   # the tools write there, and make no folder
        if self.backend:
            started = self._start_program(base, run_dir)
            if started is not None:
                return started
        else:
            for local_rank in range(self.nproc):
                command = tools.wrap(self.command, self.node_rank * self.nproc + local_rank, base, run_dir)
                self.procs.append(subprocess.Popen(command, env=self.rank_env(base, local_rank)))
        from runtime.launch.gpuwatch import GpuWatcher
        watcher = GpuWatcher.start(base, self.nproc, self.node_rank, self.host) if run_dir else None
        kill_at = None
        while len(self.codes) < len(self.procs):
            ended = [(local_rank, proc.returncode) for local_rank, proc in enumerate(self.procs)
                     if local_rank not in self.codes and proc.poll() is not None]
            for local_rank, code in blame_order(ended):
                self.codes[local_rank] = code
                if self._ended_by_the_stop_signal(local_rank, code):
                    continue
                if code not in (0, EXIT_REQUEUE, EXIT_INTERRUPTED) and self.first_failure is None:
                    self._failed(local_rank, code)
                    kill_at = time.monotonic() + self.grace
            if kill_at is not None and time.monotonic() >= kill_at:
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.kill()
                kill_at = None
            quiet = self.program.silent() if self.program is not None and self.first_failure is None else None
            if quiet is not None:
                self._hung(quiet)
                kill_at = time.monotonic() + self.grace
            time.sleep(0.05)
        if self.program is not None:
            self.program.close()
        if watcher is not None:
            self.report.update(watcher.stop())
        if self.stop_signal is not None:
            # Every rank has ended: a later copy of the stop signal (scancel's TERM after the
            # warning) must not turn this clean stop into a death by signal, which it would while
            # the interpreter exits (Python puts SIG_DFL back for its own handlers then).
            for signum in PASSED_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        code = self.exit_code()
        self._write_record(code)
        return code

    def _start_program(self, base: dict[str, str], run_dir: str | None) -> int | None:
        """--backend: this node's ranks of the other trainer, their output followed; None once they run, else
        the exit status of a rank that could not start (the others stopped)."""
        self.program = Program.start(self.backend, self.command, base, Path(run_dir) if run_dir else None,
                                     self.host, self.node_rank, self.nproc, self.nproc * self.nnodes,
                                     self.metrics_regex, self.hang_timeout)
        if self.program.resume is not None and self.program.hosts_metrics_rank:
            print(f"anvil-agent: resuming from {self.program.resume.path} (step {self.program.resume.step})",
                  file=sys.stderr, flush=True)
        started = []
        for local_rank in range(self.nproc):
            try:
                proc = subprocess.Popen(self.program.command, env=self.rank_env(self.program.env, local_rank),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        cwd=self.chdir, preexec_fn=self.program.preexec())
            except OSError as exc:
                rank = self.node_rank * self.nproc + local_rank
                said = f"cannot start {self.program.command[0]}: {exc.strerror or exc}"
                print(f"anvil-agent: rank {rank} on {self.host}: {said}", file=sys.stderr, flush=True)
                self.program.error(local_rank, said)
                self.first_failure = {"rank": rank, "local_rank": local_rank, "host": self.host, "exit_code": 127,
                                      "time": time.time()}
                for other in started:
                    other.kill()
                    other.wait()
                self._write_record(127)
                return 127
            started.append(proc)
        self.procs = started
        for local_rank, proc in enumerate(self.procs):
            self.program.follow(local_rank, proc.stdout, proc.stderr)
        return None

    def _hung(self, quiet: float) -> None:
        """No progress for `quiet` seconds (--hang-timeout): hang reports, this node's ranks ended, exit 4."""
        self.program.hang_reports(quiet)
        rank = self.node_rank * self.nproc
        self.first_failure = {"rank": rank, "local_rank": 0, "host": self.host, "exit_code": EXIT_HUNG,
                              "time": time.time()}
        print(f"anvil-agent: no progress for {quiet:.0f} s (--hang-timeout {self.hang_timeout:g}); stopping the "
              f"{self.nproc} rank(s) on {self.host} ({names.LOGS_DIR}/hang-rank*.json)", file=sys.stderr, flush=True)
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _ended_by_the_stop_signal(self, local_rank: int, code: int) -> bool:
        """A rank that the stop signal this agent got ended before its handler was in place (the
        trainer's is installed once its model is built, before the first step; SIGTERM, SIGHUP and
        SIGUSR2 end it at once until then): stopped, with nothing to checkpoint, not failed."""
        if code >= 0 or -code not in STOP_SIGNALS:
            return False
        if self.stop_signal is None:   # the group's signal reached the rank first: this agent's handler runs now
            time.sleep(0.1)
        if -code not in (self.stop_signal, self.forwarded):
            return False
        if not self.stopped_early:
            print(f"anvil-agent: rank {self.node_rank * self.nproc + local_rank} on {self.host} ended by "
                  f"{signal.Signals(-code).name} (stopped, not failed)", file=sys.stderr, flush=True)
        self.stopped_early = True
        return True

    def _failed(self, local_rank: int, code: int) -> None:
        rank = self.node_rank * self.nproc + local_rank
        self.first_failure = {"rank": rank, "local_rank": local_rank, "host": self.host,
                              "exit_code": code, "time": time.time()}
        others = [p for p in self.procs if p.poll() is None]
        what = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        if code == EXIT_HUNG:
            what += f" (hung: no training step in time; {names.LOGS_DIR}/{names.hang_report(rank)})"
        print(f"anvil-agent: rank {rank} on {self.host} exited with {what}"
              + (f"; stopping the other {len(others)} rank(s) here" if others else ""),
              file=sys.stderr, flush=True)
        for proc in others:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def exit_code(self) -> int:
        if self.first_failure is not None:
            code = self.first_failure["exit_code"]
            return 128 - code if code < 0 else code
        codes = set(self.codes.values())
        if self.stop_signal is not None and self.program is not None and self.program.backend.stops_with_zero \
                and codes == {0}:   # Megatron-LM: its checkpoint on the signal, then exit 0
            codes = {exit_status(self.stop_signal, training=True)}
        if self.stopped_early:     # the trainer's status for the signal, as after a checkpoint (3 or 130)
            codes.add(exit_status(self.stop_signal, training=True))
        if EXIT_INTERRUPTED in codes:
            return EXIT_INTERRUPTED
        if EXIT_REQUEUE in codes:
            return EXIT_REQUEUE
        return 0

    def _write_record(self, code: int) -> None:
        run_dir = self.environ.get(RUN_DIR_VAR)
        if not run_dir:
            return
        record = {"host": self.host, "node_rank": self.node_rank, "nnodes": self.nnodes, "nproc": self.nproc,
                  "world_size": self.nproc * self.nnodes, "master": f"{self.master_addr}:{self.master_port}",
                  "ranks": {str(self.node_rank * self.nproc + lr): c for lr, c in sorted(self.codes.items())},
                  "exit_code": code, "first_failure": self.first_failure,
                  "signal": signal.Signals(self.stop_signal).name if self.stop_signal else None,
                  "start": self.started, "end": time.time(), "container": container_engine(self.environ),
                  **({"program": self.program.report()} if self.program is not None else {}), **self.report}
        path = Path(run_dir) / names.LOGS_DIR / names.agent_report(self.node_rank)
        try:
            write_json_atomic(path, record)
        except OSError as exc:
            print(f"anvil-agent: cannot write {path}: {exc}", file=sys.stderr)


def _end_with_launcher() -> bool:
    """A direct run's agent gets SIGTERM when the inv that started it dies (kill -9, a crash, an OOM
    kill): the ranks checkpoint and stop, as at a preemption, instead of training on with no one to
    record the end. Linux (prctl PR_SET_PDEATHSIG); call with the handlers in place. False when that
    inv is gone already. (Under Slurm the agent is srun's task, on another machine: srun gets the
    same from inv, runtime.cluster.slurm.transport.)"""
    launcher = os.environ.get(LAUNCHER_PID_VAR, "")
    if not launcher.isdigit():
        return True
    arm = on_parent_death(signal.SIGTERM, int(launcher))
    return True if arm is None else arm()


def main(argv=None) -> int:
    args, command = parse_args(argv)
    return Agent(args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port, command,
                 **program_options(args)).run()


if __name__ == "__main__":
    sys.exit(main())

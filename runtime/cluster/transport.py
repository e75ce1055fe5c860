"""A transport: how a runtime reaches its nodes. One class per runtime name, registered in
runtime/cluster/registry.py; Runtime.open(options) makes one (with a container around it when the
runtime says +container).

Callers use three methods, the same under every transport:

    layout = transport.layout(spec, env)           # nodes x processes; checks them, before any run directory
    code = transport.launch(spec, env, run_dir)    # one agent per node; output streamed; the exit status
    results = transport.each_node(command, env)    # a command once on every node at the same time: HostResults

and ask it questions instead of reading the runtime's name:

    scheduler     a scheduler places the work: --nodes, --partition, --account, --time, --no-wait apply
    spans_nodes   other machines than this one run it: values computed from this machine are computed again
                  on each node; this machine's GPUs and memory are not the ranks'
    via           how a report says the nodes were reached ("here", "ssh", "srun")
    requeues(env) a stopped launch runs again by itself (a Slurm batch job after its preemption)

A launch's contract, under every transport: one agent per node (runtime.launch.agent, with its node
rank and the master), each node's ranks in RUN_DIR/logs/; SIGINT, SIGTERM, SIGUSR1/2 and SIGHUP to
`inv` reach every node's agent (the ranks checkpoint and stop); a node that fails ends the launch in
bounded time; the status is the first failure's, else 130 (Ctrl-C) or 3 (requeue me) when every
node stopped that way, else 0 (a Slurm step ends a clean stop with 0 and leaves its status to the
agents' reports: runtime.runs.outcome.stop_status). each_node's: `command` runs in the checkout on every node with
names.HOST, names.NODE_RANK and names.NODE_COUNT in its environment (and names.NODE_RUNS_DIR when
given hosts_dir); a node that cannot run it is a HostResult with its error, never an exception;
Ctrl-C stops it on every node and raises results.Interrupted with what each ended with.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO, Callable, ClassVar, Mapping, Sequence

from core import names
from runtime.cluster.options import Options
from runtime.cluster.results import HostResult
from runtime.launch.spec import LaunchSpec, Layout

#: What runs the agent on a node, given the names of the variables it must pass on: a container's
#: command line (runtime.cluster.container), or nothing.
Wrap = Callable[[Sequence[str]], list[str]]
#: Told each node's result as it comes in.
Progress = Callable[[HostResult], None]

HOST_VAR, NODE_RANK_VAR, NODE_COUNT_VAR, NODE_RUNS_DIR_VAR = (names.HOST, names.NODE_RANK, names.NODE_COUNT,
                                                              names.NODE_RUNS_DIR)


class Transport:
    name: ClassVar[str] = ""             # the runtime's name: --runtime NAME
    via: ClassVar[str] = ""              # how reports say the nodes were reached
    scheduler: ClassVar[bool] = False    # a scheduler places the work (--nodes, --partition, --time, ...)
    spans_nodes: ClassVar[bool] = True   # other machines than this one run it

    def __init__(self, options: Options | None = None):
        self.options = options or Options()

    # ---- questions
    @classmethod
    def allocation(cls, env: Mapping[str, str]) -> tuple[int, str] | None:
        """The nodes a launch from here may use without asking a scheduler for more: (count, what they
        are, e.g. 'Slurm job 7'); None where nothing bounds them."""
        return None

    def requeues(self, env: Mapping[str, str]) -> bool:
        """Whether a launch that stopped to be requeued (exit 3) runs again by itself."""
        return False

    def check(self, env: Mapping[str, str], *, each_node: bool = False) -> None:
        """Before any run directory: what a launch (each_node: a command on every node) needs is
        there (LaunchError, exit 2, if not)."""

    def nodes(self, env: Mapping[str, str]) -> list[str]:
        """The nodes a launch runs on, in node-rank order."""
        raise NotImplementedError

    def inv(self) -> str:
        """The inv program on the nodes."""
        return local_inv()

    def python(self) -> str:
        """The Python on the nodes (the one beside their inv)."""
        return sys.executable

    def where(self, env: Mapping[str, str]) -> str:
        """Where each_node runs, for the line that says so ("2 host(s): n1, n2")."""
        nodes = self.nodes(env)
        return f"{len(nodes)} node(s): {', '.join(nodes)}"

    # ---- the three things every transport does
    def layout(self, spec: LaunchSpec, env: Mapping[str, str]) -> Layout:
        raise NotImplementedError

    def launch(self, spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None, *,
               wrap: Wrap | None = None, nodes: Sequence[str] | None = None, log_name: str = names.LAUNCHER_LOG,
               dry_run: bool = False, masker=None, stdout: IO | None = None, stderr: IO | None = None,
               timeout: float | None = None) -> int:
        """Run spec's agents, one per node (`nodes`: only these), until they end; the exit status.
        Output goes to stdout/stderr and RUN_DIR/logs/<log_name> (masked); dry_run prints the command
        and starts nothing; a launch still running at `timeout` seconds is ended and returns 124."""
        raise NotImplementedError

    def each_node(self, command: list[str], env: Mapping[str, str] | None = None, *,
                  hosts_dir: Path | None = None, timeout: float | None = None, progress: Progress | None = None,
                  nodes: Sequence[str] | None = None) -> list[HostResult]:
        """Run `command` once on every node (`nodes`: only these) at the same time and wait; the nodes'
        results in node order. hosts_dir: where each node's run directory goes (names.NODE_RUNS_DIR =
        hosts_dir/<node>) and, for transports that need one, where results are handed back."""
        raise NotImplementedError


def local_inv() -> str:
    """The absolute path of the inv running now (what a shared checkout has too)."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if program and os.path.basename(program) in ("inv", "anvil") and os.path.exists(program):
        return os.path.abspath(program)
    return str(Path(sys.executable).with_name("inv"))


def node_env(env: Mapping[str, str] | None, host: str, rank: int, count: int,
             hosts_dir: Path | None) -> dict[str, str]:
    """What each_node's command gets on one node, over `env`."""
    out = {**(env or {}), HOST_VAR: host, NODE_RANK_VAR: str(rank), NODE_COUNT_VAR: str(count)}
    if hosts_dir is not None:
        out[NODE_RUNS_DIR_VAR] = str(Path(hosts_dir) / host)
    return out

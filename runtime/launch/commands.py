"""The pieces of a launch's command that every transport shares: the agent's command line and the
environment a launch gets. Built as argument lists: user text is never pasted into a shell.

    agent_command(spec, nproc, python)      python -m runtime.launch.agent --nproc N -- python -m MODULE ARGS
    agent_command(spec, nproc, python, layout=["--nnodes", "2", "--node-rank", "1", "--master-addr", "n1"])
    agent_command(spec, nproc, python, module="runtime.cluster.slurm.step")   # a transport's own entry
    launch_env(spec, env, run_dir, spans_nodes=True)
    travelling(env)                         # the names that go with a launch to a node or into a container
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping, Sequence

from runtime.launch.spec import NODE_LOCAL_VAR, RUN_DIR_VAR, LaunchSpec

AGENT_MODULE = "runtime.launch.agent"


def agent_command(spec: LaunchSpec, nproc: int, python: str = "", run_dir: Path | str | None = None, *,
                  layout: Sequence[str] = (), module: str = AGENT_MODULE) -> list[str]:
    """The per-node agent starting `nproc` ranks of spec (its module or program). `layout` names the node's place
    (--nnodes, --node-rank, --master-addr, --master-port); `module` is the agent itself or an entry of a
    transport's that works the layout out on the node and runs the agent (runtime.cluster.slurm.step)."""
    python = python or spec.python or sys.executable
    options = ["--nproc", str(nproc), *layout]
    if spec.master_port and "--master-port" not in layout:
        options += ["--master-port", str(spec.master_port)]
    return [python, "-m", module, *options, *spec.agent_args, "--", *spec.rank_command(python, run_dir)]


def launch_env(spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None, spans_nodes: bool = False
               ) -> dict[str, str]:
    """The environment the launch command gets. Across nodes, the values computed from this machine
    (spec.node_local) are left out and named in names.NODE_LOCAL: each node's agent computes them."""
    out = dict(env)
    if run_dir is not None:
        out[RUN_DIR_VAR] = str(run_dir)
    if spans_nodes and spec.node_local:
        for name in spec.node_local:
            out.pop(name, None)
        out[NODE_LOCAL_VAR] = ",".join(spec.node_local)
    return out


# This machine's own: a node or a container has its own, and ours would be wrong there.
_STAYS = {"PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "TERM", "LD_LIBRARY_PATH",
          "PYTHONPATH", "VIRTUAL_ENV", "SHELL", "USER", "LOGNAME", "MAIL", "DISPLAY"}
_STAYS_PREFIXES = ("BASH_FUNC_", "SSH_", "XDG_", "LC_")


def travelling(env: Mapping[str, str]) -> list[str]:
    """The names of `env` that go with a launch to another node or into a container: all but this
    machine's own (PATH, HOME, the SSH session's, the locale, ...)."""
    return [name for name in env if name not in _STAYS and not name.startswith(_STAYS_PREFIXES)]

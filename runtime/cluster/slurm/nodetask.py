"""One node's part of each_node under Slurm (a command on every node); srun starts one per node.

    python -m runtime.cluster.slurm.nodetask HOSTS_DIR [--timeout S] -- COMMAND...

Runs COMMAND on this node with names.HOST (the Slurm node name),
names.NODE_RANK, names.NODE_COUNT and names.NODE_RUNS_DIR=HOSTS_DIR/<node> (an
inv command's run directory goes there; runtime.settings.NODE_OVERRIDES) in
its environment. On starting it writes HOSTS_DIR/.<node>.step (JOB.STEP,
which a Ctrl-C of the inv that ran srun signals), then HOSTS_DIR/<node>.json:
{host, exit_code, stdout, stderr, seconds, step_nodes, error}. It exits 0 once
that file is written, so a node whose command fails is a result, not the end
of the srun step for the other nodes. SIGTERM/SIGINT/SIGUSR2 (scancel, Ctrl-C
on srun) go on to the command, whose result is still recorded.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from core.host import host_name
from runtime.cluster.transport import node_env
from core.files import write_atomic, write_json_atomic


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or host_name()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hosts_dir")
    parser.add_argument("--timeout", type=float, default=0, help="seconds; 0 = none")
    args = parser.parse_args(argv[:split])       # (a REMAINDER argument would swallow --timeout)
    command = argv[split + 1:]
    host = node_name()
    hosts_dir = Path(args.hosts_dir)
    rank = int(os.environ.get("SLURM_NODEID", 0))
    count = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    env = node_env(os.environ, host, rank, count, hosts_dir)
    record = {"host": host, "exit_code": None, "stdout": "", "stderr": "", "error": None,
              "step_nodes": os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")}
    started = time.monotonic()
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if job and step:        # what Ctrl-C on the fanning inv signals (scancel JOB.STEP)
        write_atomic(hosts_dir / f".{host}.step", f"{job}.{step}\n")
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    except (OSError, IndexError) as exc:
        record["error"] = f"cannot start {command[0] if command else '(nothing)'}: {getattr(exc, 'strerror', exc)}"
    else:
        def forward(signum, _frame):
            proc.send_signal(signum)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(sig, forward)
        try:
            out, err = proc.communicate(timeout=args.timeout or None)
            record["exit_code"] = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            record["error"] = f"command timed out after {args.timeout:g} s"
        record["stdout"], record["stderr"] = out, err
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):   # nothing left to pass on: a late
            signal.signal(sig, signal.SIG_IGN)                        # signal must not lose the record
    record["seconds"] = round(time.monotonic() - started, 2)
    write_json_atomic(hosts_dir / f"{host}.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

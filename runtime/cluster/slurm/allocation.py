"""Slurm transport of a per-node task: `inv preflight.all --runtime slurm` runs on every node.

    require_slurm(env)
    count = node_count(nodes, env)
    results = run_on_allocation(["preflight.all", "--json"], run_dir, settings, count)

One srun step, one task per node (inside salloc/sbatch: the whole allocation
unless --nodes says fewer; outside one: srun asks Slurm for --nodes nodes, 1
by default). Each node runs runtime.cluster.slurm.nodetask, which runs the same
`inv TASK` locally and writes RUN/hosts/<node>.json; those files become
HostResults, merged and printed exactly like `inv -H` (runtime.jobs.fanout).
A node that was in the step but wrote no result (it died, srun was killed) is
a failed host with srun's own last words. srun's options come from the
settings as for training (slurm_partition, slurm_account, slurm_time,
slurm_extra), so a site's --gpus-per-node or --exclusive goes there.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from runtime.launch.commands import allocated_nodes, in_allocation
from runtime.cluster.slurm.control import hostnames, interrupt_step, require, require_controller
from runtime.cluster.results import HostResult, Interrupted, error_line, parse_json_output
from trainer.errors import UserError

NODE_TASK = "runtime.cluster.slurm.nodetask"


class AllocationError(UserError):
    """srun could not run the step at all (a bad partition, too many nodes, no controller)."""


def require_slurm(env: Mapping[str, str]) -> None:
    """srun is installed and slurmctld answers (LaunchError, exit 2, otherwise)."""
    require("srun")
    require_controller(env)


def node_count(nodes: int, env: Mapping[str, str]) -> int:
    allocated = allocated_nodes(env) if in_allocation(env) else 0
    if nodes < 0:
        raise AllocationError(f"--nodes {nodes}: expected 1 or more")
    if allocated and nodes > allocated:
        raise AllocationError(f"--nodes {nodes}: this allocation (job {env.get('SLURM_JOB_ID')}) has only "
                              f"{allocated} node(s)")
    return nodes or allocated or 1


def _srun_options(settings, nodes: int, job_name: str) -> list[str]:
    options = [f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--job-name={job_name[:60]}"]
    for name, value in (("partition", settings.slurm_partition), ("account", settings.slurm_account),
                        ("time", settings.slurm_time)):
        if value:
            options.append(f"--{name}={value}")
    return options + list(settings.slurm_extra)


def srun_command(argv: list[str], hosts_dir: Path, settings, nodes: int, inv: str,
                 job_name: str = "anvil", config_file: str | None = None) -> list[str]:
    """config_file: this inv's -f FILE, read by each node's inv too (a shared file system, as for -H)."""
    timeout = ["--timeout", str(settings.command_timeout)] if settings.command_timeout else []
    runtime_config = ["-f", config_file] if config_file else []
    return ["srun", *_srun_options(settings, nodes, job_name), sys.executable, "-m", NODE_TASK, str(hosts_dir),
            *timeout, "--", inv, *runtime_config, *argv]


def check_request(settings, nodes: int, env: Mapping[str, str], job_name: str = "anvil") -> None:
    """Outside an allocation srun asks Slurm for the nodes and, when they can never be had (more than
    the partition has), waits for ever without a word: `srun --test-only` asks first. AllocationError."""
    if in_allocation(env):
        return      # node_count checked the count against the allocation
    try:
        proc = subprocess.run(["srun", "--test-only", *_srun_options(settings, nodes, job_name), "true"],
                              env=dict(env), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise AllocationError("srun --test-only did not answer in 60 s (is slurmctld up?)") from None
    if proc.returncode != 0:
        said = error_line(proc.stderr) or error_line(proc.stdout) or f"exit {proc.returncode}"
        raise AllocationError(f"--nodes {nodes}: Slurm cannot run this: {said.removeprefix('srun: error: ')}")


def run_on_allocation(argv: list[str], run_dir: Path, settings, count: int, inv: str = "",
                      env: Mapping[str, str] | None = None, job_name: str = "anvil",
                      progress=None, config_file: str | None = None) -> list[HostResult]:
    """Run `inv ARGV` once on each of `count` nodes (node_count's answer, after require_slurm);
    results in the step's node order."""
    from runtime.cluster.ssh import local_inv

    env = dict(os.environ if env is None else env)
    hosts_dir = Path(run_dir) / "hosts"
    hosts_dir.mkdir(parents=True, exist_ok=True)
    command = srun_command(argv, hosts_dir, settings, count, inv or local_inv(), job_name, config_file)
    # srun's own messages only; each node's output goes to its result file.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    interrupted = False
    try:
        out, err = proc.communicate()
    except KeyboardInterrupt:
        interrupted = True
        out, err = _stop(proc, hosts_dir, env, count)
    records = _read_results(hosts_dir)
    srun_said = error_line(err or "") or error_line(out or "")
    if not records and not interrupted:
        raise AllocationError(f"srun ran nothing (exit {proc.returncode}): {srun_said or 'no message'}")
    step = (records[0].get("step_nodes") or "") if records else ""
    expected = hostnames(step, env) if step else []
    found = {r["host"]: r for r in records}
    results = []
    for host in expected + [h for h in found if h not in expected]:
        record = found.get(host)
        if record is None and interrupted:
            results.append(HostResult(host, error="interrupted: no result from this node", interrupted=True))
        elif record is None:
            why = f"srun exit {proc.returncode}: {srun_said}" if srun_said else f"srun exit {proc.returncode}"
            results.append(HostResult(host, error=f"no result from this node ({why})"))
        else:
            results.append(HostResult(host, exit_code=record.get("exit_code"), stdout=record.get("stdout", ""),
                                      stderr=record.get("stderr", ""), error=record.get("error"),
                                      payload=parse_json_output(record.get("stdout", "")),
                                      seconds=float(record.get("seconds") or 0), interrupted=interrupted))
        if progress:
            progress(results[-1])
    if interrupted:
        raise Interrupted(results)
    return results


def _stop(proc: subprocess.Popen, hosts_dir: Path, env: Mapping[str, str], count: int) -> tuple[str, str]:
    """Ctrl-C: SIGINT to every node's task, as a terminal's Ctrl-C would give it, then wait for their
    results; a second Ctrl-C ends the step. (srun alone forwards SIGINT only at a second Ctrl-C within
    a second, and ends the step on SIGTERM, so it is asked for through scancel.)"""
    print(f"interrupted: stopping the task on {count} node(s) (Ctrl-C again to stop waiting)",
          file=sys.stderr, flush=True)
    interrupt_step(_step_of(hosts_dir), proc, env)
    try:
        try:
            return proc.communicate()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _step_of(hosts_dir: Path) -> str:
    """JOB.STEP of the running step, as nodetask wrote it on starting ('' before any did)."""
    for path in sorted(hosts_dir.glob(".*.step")):
        try:
            step = path.read_text().strip()
        except OSError:
            continue
        if step:
            return step
    return ""


def _read_results(hosts_dir: Path) -> list[dict]:
    records = []
    for path in sorted(hosts_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("host"):
            records.append(record)
    return records

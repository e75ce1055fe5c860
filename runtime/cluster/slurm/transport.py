"""Runtime slurm: srun steps inside an allocation, a batch job outside one.

Inside an allocation (salloc, or a line of your own sbatch script) a launch is
one srun step, `srun --nodes=M --ntasks-per-node=1 --kill-on-bad-exit=1
--signal=USR2@120 ... python -m runtime.cluster.slurm.step --nproc N -- python
-m MODULE ARGS`: one agent per node, each reading its place from SLURM_*.
Outside one (slurm_mode auto or sbatch) the same srun line goes into
RUN_DIR/slurm/job.sbatch, which is submitted and followed (batch.py). Ctrl-C of
the inv running srun becomes `scancel --signal=INT JOB.STEP`
(control.interrupt_step): every rank checkpoints and stops.

each_node is one srun step with one task per node (inside an allocation: the
whole allocation unless --nodes says fewer; outside one: srun asks Slurm for
the nodes, after `srun --test-only` has checked that it ever can). Each node
runs runtime.cluster.slurm.nodetask, which runs the command there and writes
HOSTS_DIR/<node>.json; a node that was in the step but wrote no result (it
died, srun was killed) is a failed host with srun's own last words.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Mapping, Sequence

from core import names
from runtime.cluster.options import SLURM_MODES
from runtime.cluster.results import HostResult, Interrupted, error_line, parse_json_output
from runtime.cluster.slurm import batch, control
from runtime.cluster.slurm.srun import (STEP_FILE, TASK_VARS, allocated_nodes, check_options, in_allocation,
                                        srun_options, step_nodes)
from runtime.cluster.transport import Progress, Transport, Wrap
from runtime.launch.commands import agent_command, launch_env, travelling
from runtime.launch.process import run_logged
from runtime.launch.spec import LaunchError, LaunchSpec, Layout, processes_per_node
from core.files import write_atomic

STEP_MODULE = "runtime.cluster.slurm.step"
NODE_TASK = "runtime.cluster.slurm.nodetask"


class Slurm(Transport):
    name, via = "slurm", "srun"
    scheduler = True

    @classmethod
    def allocation(cls, env: Mapping[str, str]) -> tuple[int, str] | None:
        return (allocated_nodes(env), f"Slurm job {env.get('SLURM_JOB_ID')}") if in_allocation(env) else None

    def mode(self, env: Mapping[str, str]) -> str:
        mode = self.options.slurm.mode
        if mode not in SLURM_MODES:
            raise LaunchError(f"unknown slurm mode {mode!r} ({' | '.join(SLURM_MODES)})")
        if mode == "auto":
            return "srun" if in_allocation(env) else "sbatch"
        return mode

    def requeues(self, env: Mapping[str, str]) -> bool:
        return self.mode(env) == "sbatch"

    def check(self, env: Mapping[str, str], *, each_node: bool = False) -> None:
        """srun (sbatch) is installed, slurmctld answers and has the partition asked for. Before each_node
        outside an allocation: `srun --test-only` says whether Slurm can ever give the nodes (srun would
        wait for ever, without a word, for more than the partition has). The options first: a bad value
        is the user's to fix whatever Slurm would say."""
        check_options(self.options.slurm, self.options.exclude)
        control.require("srun" if each_node or self.mode(env) == "srun" else "sbatch")
        control.require_controller(env)
        control.require_partition(self.options.slurm.partition, env)
        if each_node and not in_allocation(env):
            count = self._count(env, (), inside=in_allocation(env))
            try:
                proc = subprocess.run(["srun", "--test-only", *self._each_node_options(count), "true"],
                                      env=dict(env), capture_output=True, text=True, timeout=60,
                                      stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise LaunchError("srun --test-only did not answer in 60 s (is slurmctld up?)") from None
            if proc.returncode != 0:
                said = error_line(proc.stderr) or error_line(proc.stdout) or f"exit {proc.returncode}"
                raise LaunchError(f"--nodes {count}: Slurm cannot run this: {said.removeprefix('srun: error: ')}")

    def nodes(self, env: Mapping[str, str]) -> list[str]:
        if not in_allocation(env):
            raise LaunchError("runtime slurm: this runs inside an allocation (salloc -N<nodes> inv ...), "
                              "where srun places it on the allocation's nodes")
        members = control.hostnames(env.get("SLURM_JOB_NODELIST", ""), env)
        return [n for n in members if n not in set(self.options.exclude)]

    def where(self, env: Mapping[str, str]) -> str:
        return f"{self._count(env, (), inside=in_allocation(env))} Slurm node(s)"

    def _count(self, env: Mapping[str, str], exclude: Sequence[str], inside: bool) -> int:
        if self.options.nodes < 0:
            raise LaunchError(f"--nodes {self.options.nodes}: expected 1 or more")
        return step_nodes(self.options.nodes, exclude, env, inside=inside)

    def layout(self, spec: LaunchSpec, env: Mapping[str, str]) -> Layout:
        check_options(self.options.slurm, self.options.exclude)   # (a dry run asks nothing else of Slurm)
        nodes = self._count(env, self.options.exclude, inside=self.mode(env) == "srun")
        return Layout(processes_per_node(spec, env), nodes)

    # ---- a launch: one agent per node
    def launch(self, spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None, *,
               wrap: Wrap | None = None, nodes: Sequence[str] | None = None, log_name: str = names.LAUNCHER_LOG,
               dry_run: bool = False, masker=None, stdout: IO | None = None, stderr: IO | None = None,
               timeout: float | None = None) -> int:
        layout = Layout(processes_per_node(spec, env), len(nodes)) if nodes else self.layout(spec, env)
        child_env = launch_env(spec, env, run_dir, spans_nodes=True)
        inner = ((wrap([*travelling(child_env), *TASK_VARS]) if wrap else [])
                 + agent_command(spec, layout.nproc, run_dir=run_dir, module=STEP_MODULE))
        opts = self.options.slurm
        gpus = layout.nproc if spec.gpus else 0       # GPU nodes: one GPU per rank
        step = ["srun", *srun_options(opts, layout.nodes, nodelist=nodes or (), exclude=self.options.exclude,
                                      gpus=gpus, warn=not nodes), *inner]
        out = stdout or sys.stdout
        if self.mode(env) == "srun" or nodes:
            if dry_run:
                print(shlex.join(step), file=out)
                return 0
            interrupt = _interrupt_recorded_step(run_dir, child_env) if run_dir else None
            # Should inv die (kill -9, with its salloc or not), srun gets USR2, which it passes to every node's
            # agent: the ranks checkpoint and stop (3). srun lives on without inv, and so did the ranks, to
            # the end, with no one to record it; SIGTERM would make srun kill them with nothing saved.
            return run_logged(step, child_env, run_dir, log_name=log_name, masker=masker, interrupt=interrupt,
                              cwd=spec.workdir or None, stdout=stdout, stderr=stderr, timeout=timeout,
                              orphaned=signal.SIGUSR2 if run_dir else None)
        job_name = opts.job_name or (f"anvil-{Path(run_dir).name}" if run_dir else "anvil")
        header = srun_options(opts, layout.nodes, exclude=self.options.exclude, gpus=gpus, warn=True,
                              job_name=job_name, batch=True)
        script = batch.sbatch_script(step, header, run_dir, spec.workdir or os.getcwd())
        path = (Path(run_dir) if run_dir else Path.cwd()) / "slurm" / "job.sbatch"
        if dry_run:
            print(f"# {path}\n{script}", file=out)
            print(shlex.join(["sbatch", "--parsable", str(path)]), file=out)
            return 0
        write_atomic(path, masker.text(script) if masker is not None else script)   # (variables go by name)
        return batch.submit_and_follow(path, child_env, run_dir, f"{layout.nodes} node(s) x {layout.nproc} "
                                       "process(es)", wait=opts.wait, stdout=out)

    # ---- a command on every node
    def _each_node_options(self, count: int, nodes: Sequence[str] = ()) -> list[str]:
        return srun_options(self.options.slurm, count, nodelist=nodes, kill_on_bad_exit=False,
                            job_name=self.options.slurm.job_name or "anvil")

    def each_node(self, command: list[str], env: Mapping[str, str] | None = None, *,
                  hosts_dir: Path | None = None, timeout: float | None = None, progress: Progress | None = None,
                  nodes: Sequence[str] | None = None) -> list[HostResult]:
        base = {**os.environ, **(env or {})}
        count = len(nodes) if nodes else self._count(base, (), inside=in_allocation(base))
        own = hosts_dir is None        # a folder of our own for the results, on the shared file system
        folder = Path(tempfile.mkdtemp(prefix=".anvil-nodes-", dir=os.getcwd())) if own else Path(hosts_dir)
        folder.mkdir(parents=True, exist_ok=True)
        limit = timeout or self.options.command_timeout
        argv = ["srun", *self._each_node_options(count, nodes or ()), sys.executable, "-m", NODE_TASK, str(folder),
                *(["--timeout", str(limit)] if limit else []), "--", *command]
        # srun's own messages only; each node's output goes to its result file.
        proc = subprocess.Popen(argv, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        interrupted = False
        try:
            out, err = proc.communicate()
        except KeyboardInterrupt:
            interrupted = True
            out, err = _stop(proc, folder, base, count)
        try:
            return _results(folder, proc.returncode, out, err, base, interrupted, progress)
        finally:
            if own:
                shutil.rmtree(folder, ignore_errors=True)


def _interrupt_recorded_step(run_dir: Path, env: Mapping[str, str]):
    """Ctrl-C (SIGTERM, SIGHUP) of an `inv` running srun for a training run: the signal to the tasks of
    the step the nodes recorded in RUN/logs/slurm-step (control.interrupt_step), so the ranks checkpoint
    and stop as after that signal here. Passed on to srun, two SIGINTs within a second (the terminal's
    and ours), or one with no terminal on its stdin, ended the step instead, and a SIGTERM or SIGHUP
    killed the ranks: the training since the last checkpoint was lost."""
    def interrupt(proc: subprocess.Popen, signum: int) -> None:
        try:
            step = (Path(run_dir) / STEP_FILE).read_text().strip()
        except OSError:
            step = ""
        if step:
            print(f"{'interrupted' if signum == signal.SIGINT else signal.Signals(signum).name}: the ranks of "
                  f"Slurm step {step} checkpoint and stop", file=sys.stderr, flush=True)
        control.interrupt_step(step, proc, env, signum)
    return interrupt


def _results(folder: Path, code: int, out: str, err: str, env: Mapping[str, str], interrupted: bool,
             progress: Progress | None) -> list[HostResult]:
    records = _read_results(folder)
    srun_said = error_line(err or "") or error_line(out or "")
    if not records and not interrupted:
        raise LaunchError(f"srun ran nothing (exit {code}): {srun_said or 'no message'}")
    step = (records[0].get("step_nodes") or "") if records else ""
    expected = control.hostnames(step, env) if step else []
    found = {r["host"]: r for r in records}
    results = []
    for host in expected + [h for h in found if h not in expected]:
        record = found.get(host)
        if record is None and interrupted:
            results.append(HostResult(host, error="interrupted: no result from this node", interrupted=True))
        elif record is None:
            why = f"srun exit {code}: {srun_said}" if srun_said else f"srun exit {code}"
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


def _stop(proc: subprocess.Popen, folder: Path, env: Mapping[str, str], count: int) -> tuple[str, str]:
    """Ctrl-C: SIGINT to every node's task, as a terminal's Ctrl-C would give it, then wait for their
    results; a second Ctrl-C ends the step. (srun alone forwards SIGINT only at a second Ctrl-C within
    a second, and ends the step on SIGTERM, so it is asked for through scancel.)"""
    print(f"interrupted: stopping the task on {count} node(s) (Ctrl-C again to stop waiting)",
          file=sys.stderr, flush=True)
    control.interrupt_step(_step_of(folder), proc, env)
    try:
        try:
            return proc.communicate()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _step_of(folder: Path) -> str:
    """JOB.STEP of the running step, as nodetask wrote it on starting ('' before any did)."""
    for path in sorted(folder.glob(".*.step")):
        try:
            step = path.read_text().strip()
        except OSError:
            continue
        if step:
            return step
    return ""


def _read_results(folder: Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("host"):
            records.append(record)
    return records

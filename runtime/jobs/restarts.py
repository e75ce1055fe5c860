"""Restart inside the job: a rank that dies, hangs or hits a faulty GPU costs a restart, not a requeue.

train.pretrain's launch (runtime.jobs.training.launch_job) asks `Restarts.after_failure` when an attempt
ends in a failure. A restart, up to health.max_restarts per run:

- every rank of the attempt has already ended (the agents stop a node's ranks when one fails; the
  transport ends the other nodes'), and the allocation or the -H hosts are kept;
- the attempt's agent, hang and fault reports move to logs/attempts/<n>/, so that the next attempt is
  read on its own (the rank logs go on, in the same files);
- all ranks start again from the run's newest complete checkpoint (the trainer's integrity checks
  hold: a damaged one gives way to the one before it), or the one the run was started from;
- the restart is recorded: metadata.json "restarts" (when, why, which host and rank, the checkpoint
  and step, the seconds of work lost since that checkpoint was written), metrics.jsonl kind "restart"
  (train.plot and the report mark it), and a line on the console.

Which node to blame: a faulty GPU's (logs/fault-rank<R>.json), else the rank that hung first, else a
node that left no report (lost), else the first failing rank's. health.spares holds back the last
nodes of the list (the -H hosts, the allocation's nodes); a node blamed twice, or once for a faulty
GPU, is swapped for a spare. Without a spare a node blamed twice ends the run: the world does not
shrink (the global batch would change).

No restart: a user error (exit 2: the same command fails the same way), no checkpoint to start from
(checkpoint.interval 0, or a fault before the first save), no restarts left, or a batch job (sbatch:
Slurm requeues it; the restart runs where inv runs the srun step, inside an allocation).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from core import names
from core.errors import UserError
from runtime.launch.spec import LaunchSpec

#: The reports one attempt leaves in logs/ that the next attempt's would be mixed with.
ATTEMPT_REPORTS = ("agent-*.json", names.HANG_REPORTS, names.FAULT_REPORTS)


@dataclass
class Restarts:
    limit: int                                   # health.max_restarts
    nodes: list[str]                             # every node the launch may use, in node-rank order
    spares: int = 0                              # held back, from the end of `nodes`
    find: Callable[[Path], str | None] | None = None   # run dir -> its newest checkpoint (None: the trainer's)
    respec: Callable[[LaunchSpec], LaunchSpec] | None = None   # the spec of a restart (None: the same)
    shrink: Callable[[int, int], list[str] | None] | None = None   # (nodes, fewer) -> the trainer arguments that
    #                                   keep the global batch on fewer nodes, or None where the config cannot
    shrunk: list[str] = field(default_factory=list)   # those arguments, once the world shrank
    done: list[dict] = field(default_factory=list)
    blamed: Counter = field(default_factory=Counter)
    left_out: list[str] = field(default_factory=list)
    why_not: str = ""                            # why the last failure did not restart ("" : no restarts set)

    @classmethod
    def of(cls, cfg, nodes: list[str]) -> "Restarts":
        """Our trainer's, from a training config's health: and checkpoint: sections: the run's checkpoint.dir,
        and --resume auto for a restart (its own newer checkpoints come first)."""
        folder = cfg.checkpoint.dir
        return cls(limit=int(cfg.health.max_restarts), nodes=list(nodes), spares=int(cfg.health.spares),
                   find=lambda run_dir: newest_checkpoint(Path(run_dir) / folder),
                   respec=lambda spec: dataclasses.replace(spec, args=with_resume(spec.args)),
                   shrink=lambda before, after: same_global_batch(cfg, before, after))

    def restart_spec(self, spec: LaunchSpec) -> LaunchSpec:
        spec = self.respec(spec) if self.respec is not None else spec
        if self.shrunk:   # the arguments of the last shrink replace any earlier ones
            keys = {arg.split("=")[0] for arg in self.shrunk if "=" in arg}
            args, kept = list(spec.args), []
            while args:
                arg = args.pop(0)
                if arg == "--set" and args and args[0].split("=")[0] in keys:
                    args.pop(0)
                    continue
                kept.append(arg)
            spec = dataclasses.replace(spec, args=kept + self.shrunk)
        return spec

    def active(self) -> list[str] | None:
        """The nodes the next attempt runs on; None: the transport's own (nothing held back or left out)."""
        if not self.spares and not self.left_out:
            return None
        usable = [n for n in self.nodes if n not in self.left_out]
        return usable[:len(self.nodes) - self.spares]

    def after_failure(self, run_dir: Path, code: int, report, resume_from: str | None, attempt_started: float,
                      cause: str | None) -> dict | None:
        """The restart record when this failed attempt restarts (its reports set aside), else None and
        `self.why_not` says why (for the failure line)."""
        self.why_not = ""
        if code == UserError.exit_code:
            return None
        if len(self.done) >= self.limit:
            self.why_not = f"no restarts left (health.max_restarts={self.limit})" if self.limit else ""
            return None
        checkpoint = (self.find(Path(run_dir)) if self.find is not None else None) or resume_from
        if not checkpoint:   # (checkpoint.interval 0, or a fault before the first save: said nowhere, as before)
            return None
        host, rank, how = blame(run_dir, report, self.active() or self.nodes)
        left_out = None
        if host is not None:
            self.blamed[host] += 2 if how == "faulty GPU" else 1
            if self.blamed[host] >= 2:
                training = self.active() or self.nodes
                fewer = self.shrink(len(training), len(training) - 1) if self.shrink is not None else None
                if len([n for n in self.nodes if n not in self.left_out]) > len(self.nodes) - self.spares:
                    self.left_out.append(host)
                    left_out = host
                elif host in training and fewer is not None:   # no spare: train on without it, same batch
                    self.left_out.append(host)
                    self.shrunk, left_out = fewer, host
                else:
                    why = "for a faulty GPU" if how == "faulty GPU" else "twice"
                    self.why_not = (f"{host} failed {why} and there is no spare node to take its place "
                                    "(health.spares), nor a layout without it that keeps the global batch")
                    return None
        attempt = len(self.done) + 1
        set_aside(run_dir, attempt)
        step = checkpoint_step(checkpoint)
        record = {"attempt": attempt, "time": time.time(), "why": cause or f"exit status {code}",
                  "exit_code": code, "host": host, "rank": rank, "blamed_for": how, "checkpoint": str(checkpoint),
                  "step": step, "lost_s": round(max(0.0, time.time() - _written(checkpoint, attempt_started)), 1),
                  **({"left_out": left_out} if left_out else {}),
                  **({"shrunk_to": {"nodes": len(self.active() or []), "args": self.shrunk}}
                     if left_out and self.shrunk else {})}
        self.done.append(record)
        _append_metrics(run_dir, {"kind": "restart", **{k: record[k] for k in ("attempt", "time", "step", "host",
                                                                               "rank", "why")}})
        return record

    def line(self, record: dict) -> str:
        """What the console says before a restart."""
        where = f" (rank {record['rank']} on {record['host']}, {record['blamed_for']})" if record["host"] else ""
        swap = f"; {record['left_out']} is left out, a spare takes its place" if record.get("left_out") else ""
        if record.get("shrunk_to"):
            swap = (f"; {record['left_out']} is left out: {record['shrunk_to']['nodes']} node(s) train on with the "
                    f"same global batch ({' '.join(a for a in record['shrunk_to']['args'] if a != '--set')})")
        return (f"restart {record['attempt']} of {self.limit}{where}: {record['why']}; every rank starts again "
                f"from {record['checkpoint']} (step {record['step']}), {record['lost_s']:.0f} s of work "
                f"lost{swap}")


def same_global_batch(cfg, nodes: int, fewer: int) -> list[str] | None:
    """Our trainer's arguments that keep the global batch (and so the data each step reads, and the
    learning-rate schedule) when `nodes` nodes become `fewer`: more gradient accumulation; None where the
    micro-batches of a step do not divide over the nodes left, or experts are split over ranks (parallel.ep:
    their placement follows the world size)."""
    if fewer < 1 or nodes <= fewer:
        return None
    accum = cfg.data.grad_accum * nodes
    if accum % fewer or cfg.parallel.ep > 1:
        return None
    return ["--set", f"data.grad_accum={accum // fewer}"]


def launch_nodes(transport, environ) -> list[str] | None:
    """The nodes a launch runs on, or None where inv does not run the launch (a batch job: Slurm requeues
    it instead)."""
    from core.errors import AnvilError

    try:
        return transport.nodes(environ)
    except AnvilError:
        return None


def blame(run_dir: Path, report, nodes: list[str]) -> tuple[str | None, int | None, str]:
    """(host, rank, how) of the failure to count against a node (the module doc's order)."""
    from runtime.runs import outcome

    faulty = outcome.faulty_gpu(run_dir)
    if faulty is not None:
        return str(faulty["host"]), faulty["rank"], "faulty GPU"
    hung = outcome.hang_reports(run_dir)
    if hung:
        first = outcome.first_hung(hung)
        return str(first.get("host")), first.get("rank"), "hung"
    seen = {n.node_rank for n in report.nodes}
    missing = [rank for rank in range(len(nodes)) if rank not in seen]
    if report.nodes and missing:
        return nodes[missing[0]], None, "lost"
    first = report.first_failure()
    if first is not None:
        return str(first.get("host")), first.get("rank"), "failed"
    return None, None, "failed"


def newest_checkpoint(folder: Path) -> str | None:
    """The newest complete checkpoint in a run's checkpoint folder that looks intact, or None."""
    from trainer.checkpoint import find_latest

    found = find_latest(folder) if Path(folder).is_dir() else None
    return str(found) if found is not None else None


def checkpoint_step(checkpoint: str) -> int | None:
    """The step a checkpoint was saved at: its step_N folder's name (ours, torchtitan's, the tests'), else
    what our trainer's metadata says."""
    import re

    from trainer.checkpoint import read_meta

    named = re.fullmatch(r"step[-_](\d+)", Path(checkpoint).name)
    if named:
        return int(named.group(1))
    try:
        return int(read_meta(Path(checkpoint)).get("step"))
    except Exception:   # (the ranks' reader says what is wrong with it, if anything)
        return None


def _written(checkpoint: str, fallback: float) -> float:
    try:
        return max(os.stat(checkpoint).st_mtime, fallback)
    except OSError:
        return fallback


def set_aside(run_dir: Path, attempt: int) -> Path:
    """Move the attempt's reports to logs/attempts/<attempt>/."""
    logs = Path(run_dir) / names.LOGS_DIR
    target = logs / names.ATTEMPTS_DIR / str(attempt)
    target.mkdir(parents=True, exist_ok=True)
    for pattern in ATTEMPT_REPORTS:
        for path in logs.glob(pattern):
            shutil.move(str(path), target / path.name)
    return target


def _append_metrics(run_dir: Path, record: dict) -> None:
    from core.runfiles import MetricsWriter

    writer = MetricsWriter(run_dir)
    try:
        writer.write(record)
    finally:
        writer.close()


def with_resume(args: list[str]) -> list[str]:
    """The trainer's arguments for a restart: its --resume as given (its own newer checkpoints come first),
    or --resume auto (the run's own newest)."""
    return list(args) if "--resume" in args else [*args, "--resume", "auto"]

"""A Slurm batch job that nobody follows records its own end in the run directory.

`inv train.pretrain --runtime slurm --no-wait` submits and returns: the run ends as
"submitted" with the job id, and the job runs later. Ctrl-C while following, without
cancelling, leaves it "detached". In both cases no inv is left to write the outcome, so
the batch script (runtime.launch.commands.sbatch_script) calls

    python -m runtime.runs.jobend RUN_DIR STATUS [--requeued | --on-term]

after each attempt's step (and, as a requeued job's next attempt starts, `RUN_DIR --resumed N`:
status "resumed"). It writes what inv would have: status (ok, failed, interrupted,
"requeued" when the job checkpointed and Slurm took it back, "preempted" when it checkpointed
and was not taken back: after SIGTERM, from scancel or the time limit), exit code, end time,
the failing rank's line, hosts and world size, result.json with the summary (train.launch's made here from
its metrics.jsonl, as inv makes it when it follows the job). A run that inv
is still following ("running") is left to inv, so there is one writer at a time.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from core import names
from runtime.runs import diagnose, metrics, outcome, rundir
from runtime.runs.run import end_entries
from core.secrets import Masker
from core.signals import EXIT_INTERRUPTED, EXIT_REQUEUE

UNFOLLOWED = ("submitted", "detached", "requeued", "resumed")


def status_of(code: int, requeued: bool = False) -> str:
    """3 is "requeued" when Slurm took the job back, else "preempted" (as inv says: resume by hand)."""
    if code == EXIT_REQUEUE:
        return "requeued" if requeued else "preempted"
    return {0: "ok", EXIT_INTERRUPTED: "interrupted"}.get(code, "failed")


def record(run_dir: Path, code: int, requeued: bool = False, environ: dict[str, str] | None = None,
           status: str | None = None, why: str | None = None, ended: float | None = None,
           on_term: bool = False, settled_by: str = "slurm", waiting: tuple[str, ...] = UNFOLLOWED) -> bool:
    """Write the attempt's end into RUN_DIR/metadata.json when no inv follows the job; whether it did.
    `status` and `why` come from runtime.jobs.settle, which records a job that ended without
    getting here: its status when exit codes do not say it (cancelled, lost), what Slurm said,
    and when the job ended. settle also records a run whose inv died ("running" in `waiting`,
    settled_by "pid"). Only a run whose status is in `waiting` is written."""
    run_dir = Path(run_dir)
    metadata = rundir.metadata(run_dir)
    # settle's verdict is Slurm's view from outside: the batch script's own record replaces it.
    from_script = status is None
    if metadata.get("status") not in waiting and not (from_script and metadata.get("settled_by") == "slurm"):
        return False
    masker = Masker.from_environ(dict(os.environ if environ is None else environ))
    if on_term and code == EXIT_REQUEUE:
        why = "stopped by SIGTERM (scancel, or the time limit) after checkpointing; not requeued"
    status = status or status_of(code, requeued)
    if from_script:
        metadata.pop("settled_by", None)
    else:
        metadata["settled_by"] = settled_by
    error, findings = None, []
    if status == "failed" or (why and status != "ok"):
        ranks = outcome.failure_summary(run_dir)
        error = "; ".join(filter(None, (why, ranks))) or f"the job's step exited with status {code}"
        findings = diagnose.scan(diagnose.log_files(run_dir), extra_text=error)
    report = outcome.read(run_dir)
    if report.nodes:
        metadata.update(hosts=report.hosts, world_size=report.world_size, nodes=len(report.nodes))
    failed_nodes = outcome.node_failures(run_dir)
    if failed_nodes:   # a node failure, not a preemption, whatever the ranks' exit said
        metadata["node_failures"] = failed_nodes
        if status == "requeued":
            error = f"Slurm declared node(s) {', '.join(failed_nodes)} failed; the job was requeued"
    metadata.update(end_entries(metadata, status, error, code, masker, findings, ended))
    if metadata.get("task") == "train.launch":   # its summary is the runner's, from the metrics the agents parsed
        made = metrics.summary(run_dir, wall_s=metadata.get("duration_s"))
        if made is not None:
            rundir.write_text(run_dir / names.SUMMARY, rundir.to_json(masker.mapping(made)))
    summary = rundir.read_json(run_dir / names.SUMMARY)
    if status == "ok":
        rundir.write_text(run_dir / names.RESULT, rundir.to_json({"run_dir": str(run_dir), "summary": summary}))
    rundir.write_record(run_dir / rundir.METADATA, masker.mapping(metadata))
    return True


def resumed(run_dir: Path, restart: int) -> bool:
    """A requeued job's next attempt starts: an unfollowed run is "resumed" (running again) instead
    of showing the last attempt's "requeued" while it trains; whether it was written."""
    run_dir = Path(run_dir)
    metadata = rundir.metadata(run_dir)
    if metadata.get("status") not in UNFOLLOWED:
        return False
    metadata.update(status="resumed", requeues=restart, end=None, duration_s=None, exit_code=None, error=None)
    rundir.write_record(run_dir / rundir.METADATA, metadata)
    return True


def main(argv: list[str] | None = None) -> int:
    """python -m runtime.runs.jobend RUN_DIR STATUS [--requeued | --on-term]: record the attempt's end;
    python -m runtime.runs.jobend RUN_DIR --resumed RESTART: a requeued job's next attempt started
    (exit 0; 2 on bad arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[1] == "--resumed" and args[2].isdigit():
        try:
            resumed(Path(args[0]), int(args[2]))
        except (OSError, ValueError, rundir.RunDirError) as exc:
            print(f"anvil: could not record the job's new attempt in {args[0]}: {exc}", file=sys.stderr)
        return 0
    requeued, on_term = "--requeued" in args, "--on-term" in args
    args = [a for a in args if a not in ("--requeued", "--on-term")]
    if len(args) != 2 or not args[1].lstrip("-").isdigit():
        print(main.__doc__, file=sys.stderr)
        return 2
    try:
        record(Path(args[0]), int(args[1]), requeued, on_term=on_term)
    except (OSError, ValueError, rundir.RunDirError) as exc:
        # The job's own status matters more than its bookkeeping: say why and let the script go on.
        print(f"anvil: could not record the job's end in {args[0]}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

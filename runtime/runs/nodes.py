"""Passing and failing node lists in a run directory: what preflight writes, what launches read.

    nodes/pass.txt     one host per line
    nodes/fail.txt     one host per line
    nodes/fail.json    {host: [reason, ...]}, sealed with its own checksum (rundir.write_record)

`inv preflight.all` (over -H or a Slurm allocation) and preflight.comm write
them, and end their report with node_lists_footer; `inv train.pretrain
--exclude-from RUN` reads fail.json and leaves those nodes out of the hosts or
the srun/sbatch line, recording which and why in its own metadata.json. Hosts
are in Slurm form (results.slurm_name: `user@node1:22` is `node1`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from core import names
from runtime.cluster.results import slurm_name
from runtime.runs import rundir
from core.errors import UserError

FOLDER = names.NODES_DIR


def write(run_dir: Path, passing: list[str], failing: Mapping[str, list[str]]) -> None:
    folder = Path(run_dir) / FOLDER
    rundir.write_text(folder / names.PASSING_HOSTS, "".join(f"{h}\n" for h in passing))
    rundir.write_text(folder / names.FAILING_HOSTS, "".join(f"{h}\n" for h in failing))
    rundir.write_record(folder / names.FAILURES, {h: list(r) for h, r in failing.items()})


def failing(run: str | Path) -> dict[str, list[str]]:
    """{host: reasons} from a run directory (or its nodes/fail.json); UserError if none is there."""
    path = Path(run)
    candidates = [path] if path.is_file() else [path / FOLDER / names.FAILURES]
    for candidate in candidates:
        if not candidate.is_file():
            continue
        try:
            data = rundir.read_record(candidate)
        except rundir.RunDirError as exc:      # not JSON, or edited since it was written (its seal)
            raise UserError(f"--exclude-from {run}: {exc}") from None
        except OSError as exc:
            raise UserError(f"--exclude-from {run}: cannot read {candidate}: {exc.strerror or exc}") from None
        if not isinstance(data, dict):
            raise UserError(f"--exclude-from {run}: {candidate} is not a {{host: reasons}} mapping")
        return {str(h): [str(r) for r in (v if isinstance(v, list) else [v])] for h, v in data.items()}
    raise UserError(f"--exclude-from {run}: no node lists there (expected {FOLDER}/{names.FAILURES} from a "
                    "`inv preflight.all` run over several nodes)")


def node_lists_footer(passing: list[str], failing: list[str], run_dir=None) -> list[str]:
    """The lines every multi-node report ends with: who passed, who failed, how to leave them out."""
    out = [f"passing hosts: {','.join(passing) or '(none)'}", f"failing hosts: {','.join(failing) or '(none)'}"]
    if failing:
        out.append(f"exclude them:  srun --exclude={','.join(slurm_name(h) for h in failing)} ...")
        if run_dir:
            out.append(f"               inv train.pretrain --exclude-from {run_dir} ...")
    if run_dir:
        out.append(f"run directory: {run_dir}")
    return out

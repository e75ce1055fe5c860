"""A training run's metrics over every segment it took.

    curves = read(run_dir)     # Curves: train/val records by step, events, resume marks, notes
    sources(curves, blend)     # a blend's share of the tokens and val loss per source, from its records

`inv train.pretrain --resume RUN` (and `--resume auto`) makes a new run directory whose
metrics.jsonl starts at the checkpoint's step; its metadata.json names what it resumed from
("resume": a checkpoint, a run directory or its checkpoints folder). The curve of such a run is
the earlier segments' records up to that checkpoint, then its own. A requeued Slurm job resumes
into its own directory and its one metrics.jsonl already holds both (core.runfiles keeps
each step's last record). A segment that cannot be found or read is a note, never an error.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from core import names
from runtime.runs import rundir
from core import runfiles

MAX_SEGMENTS = 1000   # a resume chain that loops (hand-edited metadata) ends here


@dataclass
class Curves:
    train: dict[int, dict] = field(default_factory=dict)
    val: dict[int, dict] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)      # straggler, rank_times, ... in step order
    resumes: list[int] = field(default_factory=list)      # each resume's checkpoint step: the curve goes on from there
    segments: list[Path] = field(default_factory=list)    # run directories, oldest first
    notes: list[str] = field(default_factory=list)        # what could not be read, in words


def _checkpoint_step(value: str) -> int | None:
    match = re.search(r"(?:^|/)step_(\d+)/?$", value)
    return int(match.group(1)) if match else None


def resumed_from(run_dir: Path) -> tuple[Path | None, int | None, str]:
    """(the run directory this run resumed from, the checkpoint's step when named, a note when
    it names one that is not there). (None, None, "") for a run that started fresh."""
    try:
        metadata = rundir.read_json(Path(run_dir) / rundir.METADATA, {}) or {}
    except (rundir.RunDirError, OSError):
        return None, None, ""
    value = metadata.get("resume") if isinstance(metadata, dict) else None
    if not isinstance(value, str) or value in ("", "auto", "none"):
        return None, None, ""
    step = _checkpoint_step(value)
    path = Path(value)
    # A run directory beside this one first (the runs folder may have moved since), then the path
    # as recorded (absolute, or relative to where inv ran).
    candidates = [Path(run_dir).parent / part for part in path.parts if part not in ("", "/", ".", "..")]
    candidates += [path] + list(path.parents)
    for candidate in candidates:
        if (candidate / rundir.METADATA).is_file() and candidate.resolve() != Path(run_dir).resolve():
            return candidate, step, ""
    return None, None, f"resumed from {value}, which is not here: its steps are not drawn"


def chain(run_dir: Path) -> tuple[list[tuple[Path, int | None]], list[str]]:
    """[(run directory, the step its successor resumed from or None)], oldest first, and notes."""
    found: list[tuple[Path, int | None]] = [(Path(run_dir), None)]
    notes: list[str] = []
    seen = {Path(run_dir).resolve()}
    current = Path(run_dir)
    while len(found) < MAX_SEGMENTS:
        earlier, step, note = resumed_from(current)
        if note:
            notes.append(note)
        if earlier is None or earlier.resolve() in seen:
            break
        seen.add(earlier.resolve())
        found.append((earlier, step))
        current = earlier
    return list(reversed(found)), notes


def read(run_dir: str | Path) -> Curves:
    """Every segment's records, each step once (the latest segment's), with the resume marks."""
    run_dir = Path(run_dir)
    segments, notes = chain(run_dir)
    logs = []
    for path, _ in segments:
        file = path / names.METRICS
        if not file.is_file():
            logs.append(runfiles.MetricsLog())
            if path == run_dir:
                notes.append("no metrics.jsonl: the run logged no step" + (" of its own" if len(segments) > 1
                                                                           else ""))
            else:
                notes.append(f"{path.name}: no metrics.jsonl")
            continue
        try:
            log = runfiles.read_metrics(file)
        except OSError as exc:
            notes.append(f"{file}: cannot read it ({exc.strerror or exc})")
            log = runfiles.MetricsLog()
        prefix = names.METRICS if path == run_dir else f"{path.name}/{names.METRICS}"
        notes += log.problems(prefix)
        logs.append(log)
    curves = Curves(segments=[path for path, _ in segments], notes=notes)
    for index, ((path, upto), log) in enumerate(zip(segments, logs)):
        later = next((lg for lg in logs[index + 1:] if lg.train), None)
        if later is not None:   # where the next segment went on from: its resume record, what it named, or
            #                     (neither: a log from before the record, --resume RUN) its first step logged
            limit = next((s for s in (later.resumed_at, upto) if s is not None), min(later.train) - 1)
        else:
            limit = None
        keep = (lambda step: step <= limit) if limit is not None else (lambda step: True)
        curves.train.update({s: r for s, r in log.train.items() if keep(s)})
        curves.val.update({s: r for s, r in log.val.items() if keep(s)})
        curves.events += [e for e in log.events if keep(_step(e))]
        curves.resumes += [s for s in log.restarts if keep(s)]   # its resume record's step among them
        if index and log.train and log.resumed_at is None:
            named = segments[index - 1][1]      # the checkpoint step this segment's --resume named
            curves.resumes.append(named if named is not None else min(log.train))
    curves.train = dict(sorted(curves.train.items()))
    curves.val = dict(sorted(curves.val.items()))
    curves.events.sort(key=_step)
    curves.resumes = sorted(set(curves.resumes))
    return curves


def sources(curves: Curves, blend: list | None = None) -> dict[str, dict]:
    """A blend's figures for each source from the run's metrics (trainer.metrics_log.source_text says them):
    the share of the tokens it gave so far (the last train record's tokens/<name>), its last val loss
    (val_loss/<name>), and with the config's data.blend its weight as a share. {} for one dataset."""
    last = curves.train[max(curves.train)] if curves.train else {}
    tokens = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("tokens/") and _is_number(v)}
    val = next((r for _, r in sorted(curves.val.items(), reverse=True) if any(k.startswith("val_loss/") for k in r)),
               {})
    losses = {k.split("/", 1)[1]: v for k, v in val.items() if k.startswith("val_loss/") and _is_number(v)}
    weights = {str(s.get("name")): s["weight"] for s in blend or []
               if isinstance(s, dict) and s.get("name") and _is_number(s.get("weight"))}
    if not (tokens or losses):
        return {}
    total_tokens, total_weight = sum(tokens.values()), sum(weights.values())
    out = {}
    for name in dict.fromkeys([*weights, *tokens, *losses]):
        figures = {}
        if name in tokens and total_tokens > 0:
            figures["token_share"] = tokens[name] / total_tokens
        if name in weights and total_weight > 0:
            figures["weight"] = weights[name] / total_weight
        if name in losses:
            figures["val_loss"] = losses[name]
        out[name] = figures
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _step(record: dict) -> int:
    try:
        return int(record.get("step", 0))
    except (TypeError, ValueError):
        return 0


def summary(run_dir: str | Path, wall_s: float | None = None) -> dict | None:
    """A train.launch run's summary.json, made by the runner from the records its node agents parsed out of
    another trainer's log lines (runtime.launch.output), over every segment as the report draws them:
    steps, final loss and val loss, tokens/s, MFU and TFLOP/s (medians after the first record, which holds
    start-up), peak memory, the backend, the checkpoint the run's last attempt resumed from, and how many
    metric lines could not be read (and where they are). None when there is no train record."""
    from runtime.runs import outcome

    curves = read(run_dir)
    if not curves.train:
        return None
    train = [curves.train[s] for s in sorted(curves.train)]
    steady = train[1:] or train

    def median(key: str):
        values = [r[key] for r in steady if _is_number(r.get(key))]
        return statistics.median(values) if values else None

    memory = [r.get(k) for r in train for k in ("gpu_mem_gib", "gpu_mem_reserved_gib") if _is_number(r.get(k))]
    last = train[-1]
    out = {"steps": last["step"], "final_loss": last.get("loss"),
           "val_loss": curves.val[max(curves.val)].get("val_loss") if curves.val else None,
           "tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_device": median("tokens_per_s_per_device"),
           "step_time_s": median("step_time_s"), "mfu": median("mfu"), "tflops": median("tflops"),
           "peak_mem_gib": max(memory) if memory else None, "wall_s": wall_s}
    try:
        resumes = [r for r in runfiles.metrics_records(run_dir) if r.get("kind") == "resume" and r.get("checkpoint")]
    except OSError:
        resumes = []
    programs = [n.program for n in outcome.read(Path(run_dir)).nodes if n.program]
    if programs:
        out["backend"] = programs[0].get("backend")
    if resumes:
        out["resumed_from"] = str(resumes[-1]["checkpoint"])
        out["resumed_step"] = resumes[-1].get("step")
    counted = [p for p in programs if "unreadable_lines" in p]
    if counted:
        out["metric_lines"] = sum(int(p.get("metric_lines") or 0) for p in counted)
        out["unreadable_lines"] = sum(int(p.get("unreadable_lines") or 0) for p in counted)
        if out["unreadable_lines"]:
            out["unreadable_in"] = f"{names.LOGS_DIR}/{names.rank_log(int(counted[0].get('metrics_rank') or 0))}"
            out["unreadable_examples"] = [e for p in counted for e in p.get("unreadable_examples") or []][:5]
    return {k: v for k, v in out.items() if v is not None or k in ("steps", "final_loss")}

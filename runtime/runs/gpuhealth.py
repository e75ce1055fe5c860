"""A training run's bad hosts: the GPUs its node agents saw in trouble, the step time it cost, and the
node lists a next launch reads with --exclude-from.

The agents' GPU watch (runtime.launch.gpuwatch) reports gpu_events (an Xid, new uncorrected ECC
errors, clocks held down) in logs/agent-<node>.json, and an in-job restart sets each attempt's
reports aside in logs/attempts/<n>/ (runtime.jobs.restarts): both are read. An event's cost is the
median step time of the train records logged while it lasted (from its first sighting to one watch
interval after its last) against the median of the others.

`record(run)` puts the events (with their cost) into metadata.json, says them on the console, and
writes nodes/ (runtime.runs.nodes) for the hosts with events and those a restart left out, so that
`inv train.pretrain --exclude-from RUN` leaves them out next time, as after a preflight run.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from core import names
from core.runfiles import metrics_records


def events(run_dir: Path) -> list[dict]:
    """Every GPU event the run's agents reported, over all its attempts, oldest first."""
    logs = Path(run_dir) / names.LOGS_DIR
    found = []
    for path in [*sorted(logs.glob(f"{names.ATTEMPTS_DIR}/*/agent-*.json")), *sorted(logs.glob("agent-*.json"))]:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found += [e for e in report.get("gpu_events") or [] if isinstance(e, dict)]
    return sorted(found, key=lambda e: e.get("first", 0))


def cost(event: dict, train: list[dict], interval: float = 10.0) -> dict | None:
    """{"during_s", "otherwise_s", "slower"}: the median step time while the event lasted and otherwise;
    None where either side has no step."""
    start, end = float(event.get("first", 0)), float(event.get("last", 0)) + interval
    during = [r["step_time_s"] for r in train if start <= r.get("time", 0) <= end and r.get("step_time_s")]
    other = [r["step_time_s"] for r in train if not start <= r.get("time", 0) <= end and r.get("step_time_s")]
    if not during or not other:
        return None
    slow, normal = statistics.median(during), statistics.median(other)
    return {"during_s": round(slow, 6), "otherwise_s": round(normal, 6),
            "slower": round(slow / normal - 1, 4) if normal > 0 else None}


def describe(event: dict) -> str:
    """One line for an event: which GPU, where, what, and its cost."""
    line = f"GPU {event.get('gpu')} (rank {event.get('rank')}) on {event.get('host')}: {event.get('what')}, " \
           f"{event.get('samples', 1)} reading(s)"
    paid = event.get("cost")
    if paid and paid.get("slower") is not None:
        line += f"; steps took {paid['during_s'] * 1000:.0f} ms while it lasted, {paid['otherwise_s'] * 1000:.0f} " \
                f"ms otherwise ({paid['slower']:+.0%})"
    return line


def record(run, left_out: list[str] = ()) -> list[dict]:
    """The run's GPU events, with their cost, into its metadata and on the console; nodes/ for the hosts
    with events and those left out. Returns the events."""
    from runtime.runs import nodes

    found = events(run.path)
    if found:
        train = [r for r in metrics_records(run.path) if r.get("kind", "train") == "train"]
        for event in found:
            event["cost"] = cost(event, train)
        run.update_metadata(gpu_events=found)
        for event in found:
            print(f"gpu watch: {describe(event)}", file=sys.stderr)
    bad: dict[str, list[str]] = {}
    for event in found:
        bad.setdefault(str(event.get("host")), []).append(f"GPU {event.get('gpu')}: {event.get('what')}")
    for host in left_out:
        bad.setdefault(host, []).append("failed twice during the run (left out by a restart)")
    if bad:
        hosts = (run.metadata.get("hosts") or []) + list(left_out)
        nodes.write(run.path, [h for h in dict.fromkeys(hosts) if h not in bad], bad)
        print(f"the hosts in trouble are listed in {run.path}/{names.NODES_DIR}/: `inv train.pretrain "
              f"--exclude-from {run.path}` leaves them out", file=sys.stderr)
    return found

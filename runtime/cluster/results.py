"""One node's result of a command run on every node (Transport.each_node), and the two payload shapes
a fan-out's merge understands.

Whatever carried the command there (SSH for `inv -H`, srun for a Slurm
allocation), each node ends as a HostResult: exit status, output, the JSON
document the command printed, or the error that kept it from running.

Payload shapes (what a task prints with --json):
    {"checks": [{"name", "status": PASS|WARN|FAIL, "value", "reason", "fix"}, ...]}   preflight
    {"measurements": [{"name", "value": number, "unit"}, ...]}                        benchmarks
Measurements become rows too (status PASS, the value with its unit, the
number kept as "measured"), so both merge into one table host by host.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class HostResult:
    host: str
    exit_code: int | None = None         # None: never ran (unreachable, SSH error, no result from srun)
    stdout: str = ""
    stderr: str = ""
    error: str | None = None             # why it never ran, in one line
    payload: Any = None                  # parsed JSON output, if any
    seconds: float = 0.0
    interrupted: bool = False            # it ended after a Ctrl-C told it to stop

    @property
    def reachable(self) -> bool:
        return self.error is None

    @property
    def failed_checks(self) -> list[str]:
        return [c.get("name", "?") for c in checks_of(self.payload) if c.get("status") == "FAIL"]

    @property
    def ok(self) -> bool:
        return self.reachable and self.exit_code == 0 and not self.failed_checks

    def failure_reasons(self, task: str = "") -> list[str]:
        """Why this host failed, one line each (what nodes/fail.json records); [] if it passed."""
        if self.ok:
            return []
        if self.error:
            return [self.error]
        reasons = [f"{c.get('name', '?')}: {c.get('reason') or 'FAIL'}"
                   + (f" ({c['value']})" if c.get("value") not in (None, "") else "")
                   for c in checks_of(self.payload) if c.get("status") == "FAIL"]
        return reasons or [error_line(self.stderr, task) or f"exit status {self.exit_code}"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a fan-out, raised once the nodes were told to stop: what each host ended with
    (a host still stopping when the wait was cut short has its error say so)."""

    def __init__(self, results: list[HostResult]):
        super().__init__()
        self.results = results


def slurm_name(host: str) -> str:
    """node1 from user@node1:22 (what srun --exclude wants)."""
    host = host.rsplit("@", 1)[-1]
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def parse_json_output(text: str) -> Any:
    """The JSON document a task printed (whole stdout, else from its last '{' line)."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    lines = text.splitlines()
    for i in range(len(lines)):
        if lines[i].startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
    return None


def checks_of(payload: Any) -> list[dict]:
    """The payload's rows: its checks, or its measurements as rows."""
    if not isinstance(payload, dict):
        return []
    if isinstance(payload.get("checks"), list):
        return [c for c in payload["checks"] if isinstance(c, dict)]
    if isinstance(payload.get("measurements"), list):
        rows = []
        for m in payload["measurements"]:
            if isinstance(m, dict) and isinstance(m.get("value"), (int, float)):
                unit = f" {m['unit']}" if m.get("unit") else ""
                rows.append({"name": str(m.get("name", "?")), "status": "PASS",
                             "value": f"{m['value']:.4g}{unit}", "measured": float(m["value"]), "reason": ""})
        return rows
    return []


def error_line(stderr: str, task: str = "") -> str:
    """The line that says what went wrong: a run's failure message names its task
    ("preflight.all failed: ...") and is followed by the run directory, so the last
    line alone would hide it."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if task and line.startswith(f"{task} "):
            return line
    return lines[-1] if lines else ""

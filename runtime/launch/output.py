"""A program other than Anvil's trainer under the node agent (train.launch): where it resumes from, its
ranks' output, its metrics, its silence.

    program = Program.start(backend, command, env, run_dir, host, node_rank, nproc, world_size, ...)
    program.command, program.env       # the ranks' command line and environment, resuming where it should
    program.follow(local_rank, proc)   # its output: rank log, console, metrics
    program.silent()                   # seconds without progress once past --hang-timeout, else None

Resuming (every attempt decides on its own, on every node, from the shared run directory): the run's own
checkpoint folder first (the backend's checkpoint_dir: a requeued job, a retried one), else the checkpoint
the runner found for --resume (names.RESUME_FROM), else none. The ranks then get names.RESUME=1 and
names.RESUME_FROM, the backend's resume flags on their command line (Megatron-LM's --load), and
names.CHECKPOINT_DIR; the metrics rank's agent writes a "resume" record at the checkpoint's step into
metrics.jsonl, where the report marks it and the summary reads which checkpoint it was.

Output: each rank's stdout and stderr, line by line, go to RUN/logs/rank<R>.log as
`[time][host rR/lL][OUT] line` ([ERR] for stderr, masked: core.secrets), and the console ranks' lines
(rank 0 and the metrics rank; names.LOG_RANK names others, or all) to the agent's own stdout and stderr as
they are. The metrics rank's lines go through --metrics-regex, then the backend's parser: a record gets its
time and is appended to RUN/metrics.jsonl; a line that looked like a metric and could not be read is
counted (with the first few, in the agent's report), never fatal.

Silence: with --hang-timeout, once metrics.jsonl has a record of this attempt, no new one for that long
makes the agent write a hang report for each of its ranks (logs/hang-rank<R>.json: the last step, how
long each rank has printed nothing, its last line) and end them, exit 4: runtime.runs.outcome names the
silent ranks and hosts.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Mapping

from core import names, runfiles
from core.files import write_json_atomic
from core.secrets import Masker
from core.signals import STOP_SIGNALS
from runtime import backends
from runtime.backends import UNREADABLE, Backend, Checkpoint

DATEFMT = "%Y-%m-%d %H:%M:%S"
EXAMPLES = 5             # unreadable metric lines kept in the agent's report
SILENCE_CHECK_S = 2.0    # how often the agent looks at metrics.jsonl's age


@dataclass
class RankState:
    rank: int
    local_rank: int
    last_output: float = field(default_factory=time.time)   # wall time of its last line
    last_line: str = ""


class Program:
    """One node's ranks of a backend's program (the agent holds one when started with --backend)."""

    def __init__(self, backend: Backend, command: list[str], env: dict[str, str], run_dir: Path | None,
                 host: str, node_rank: int, nproc: int, world_size: int, resume: Checkpoint | None,
                 metrics_regex: str = "", hang_timeout: float = 0.0):
        self.backend, self.command, self.env, self.run_dir = backend, command, env, run_dir
        self.host, self.node_rank, self.nproc, self.world_size = host, node_rank, nproc, world_size
        self.resume, self.hang_timeout = resume, float(hang_timeout or 0)
        self.masker = Masker.from_environ(env)
        self.metrics_rank = backend.metrics_rank(command, world_size)
        self.ranks = {lr: RankState(node_rank * nproc + lr, lr) for lr in range(nproc)}
        self.console = _console_ranks(env.get(names.LOG_RANK, ""), self.metrics_rank)
        self.lock = threading.Lock()
        self.lines = self.records = self.unreadable = 0
        self.examples: list[str] = []
        self.last_step: int | None = None
        self.threads: list[threading.Thread] = []
        self._last_check = 0.0
        self.parse: Callable | None = None
        self.writer = None
        if self.hosts_metrics_rank and run_dir is not None:
            own = backend.parser(command, world_size, _peak(env))
            extra = backends.regex_parser(metrics_regex) if metrics_regex else None
            self.parse = (lambda line: _first(extra, own, line)) if extra else own
            self.writer = runfiles.MetricsWriter(run_dir)
            if resume is not None:
                self.writer.write({"kind": "resume", "step": resume.step, "time": time.time(),
                                   "checkpoint": str(resume.path)})
        self.started = time.time()      # (after the resume record: it is no progress of this attempt)

    @classmethod
    def start(cls, backend_name: str, command: list[str], env: dict[str, str], run_dir: Path | None, host: str,
              node_rank: int, nproc: int, world_size: int, metrics_regex: str = "",
              hang_timeout: float = 0.0) -> "Program":
        """Where to resume from, the command and environment that resume there, and the output's followers."""
        backend = backends.get(backend_name)
        env = dict(env)
        resume = None
        if run_dir is not None:
            own = backend.checkpoint_dir(command, Path(run_dir))
            resume = backend.latest(own)
            given = env.get(names.RESUME_FROM)
            if resume is None and given:
                resume = backend.at(Path(given)) or backend.find(command, Path(given))
            env[names.CHECKPOINT_DIR] = str(own)
            command = backend.command(command, Path(run_dir), resume)
        env.pop(names.RESUME, None)
        env.pop(names.RESUME_FROM, None)
        if resume is not None:
            env.update({names.RESUME: "1", names.RESUME_FROM: str(resume.path)})
        return cls(backend, command, env, run_dir, host, node_rank, nproc, world_size, resume, metrics_regex,
                   hang_timeout)

    @property
    def hosts_metrics_rank(self) -> bool:
        return any(state.rank == self.metrics_rank for state in self.ranks.values())

    # ---- signals
    def forwarded(self, signum: int) -> int:
        """The signal the ranks get for `signum` reaching the agent."""
        own = self.backend.stop_signal_of(self.command)
        return own if own is not None and signum in STOP_SIGNALS else signum

    def ignored(self) -> list[int]:
        """The stop signals a rank ignores when they reach it straight (the scheduler's or the terminal's to
        the whole group): all but its own, which the agent sends it (none for a backend without one)."""
        own = self.backend.stop_signal_of(self.command)
        return [] if own is None else [s for s in STOP_SIGNALS if s != own]

    def preexec(self) -> Callable[[], None] | None:
        ignored = self.ignored()
        if not ignored:
            return None

        def ignore() -> None:
            for signum in ignored:
                signal.signal(signum, signal.SIG_IGN)
        return ignore

    # ---- output
    def follow(self, local_rank: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        state = self.ranks[local_rank]
        log = self._log(state)
        for stream, tag, console in ((stdout, "OUT", "stdout"), (stderr, "ERR", "stderr")):
            thread = threading.Thread(target=self._pump, args=(state, stream, tag, log, console), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _log(self, state: RankState) -> IO[str] | None:
        if self.run_dir is None:
            return None
        path = Path(self.run_dir) / names.LOGS_DIR / names.rank_log(state.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8")

    def _pump(self, state: RankState, stream: IO[bytes], tag: str, log: IO[str] | None, console: str) -> None:
        import sys

        out = sys.stdout if console == "stdout" else sys.stderr
        shown = self.console is None or state.rank in self.console
        prefix = f"[{{}}][{self.host} r{state.rank}/l{state.local_rank}][{tag}] "
        traceback = Traceback(f"{names.LOGS_DIR}/{names.rank_log(state.rank)}")
        for raw in iter(stream.readline, b""):
            line = self.masker.text(raw.decode("utf-8", "replace").rstrip("\n"))
            state.last_output, state.last_line = time.time(), line
            with self.lock:
                if log is not None:
                    try:
                        log.write(prefix.format(time.strftime(DATEFMT)) + line + "\n")
                        log.flush()
                    except (OSError, ValueError):
                        pass
                said = traceback.console(line)
                if shown and said is not None:
                    try:
                        out.write(said + "\n")
                        out.flush()
                    except (OSError, ValueError):
                        pass
                if self.parse is not None and state.rank == self.metrics_rank:
                    self._metric(line)
        stream.close()

    def _metric(self, line: str) -> None:
        self.lines += 1
        try:
            record = self.parse(line)
        except Exception:   # a parser's bug is an unreadable line, never the end of the run  # noqa: BLE001
            record = UNREADABLE
        if record is None:
            return
        if record == UNREADABLE or not isinstance(record, dict):
            self.unreadable += 1
            if len(self.examples) < EXAMPLES:
                self.examples.append(line[:300])
            return
        self.records += 1
        if record.get("kind") == "train":
            self.last_step = record["step"]
        try:
            self.writer.write({**record, "time": time.time()})
        except (OSError, ValueError):
            self.unreadable += 1

    def error(self, local_rank: int, message: str) -> None:
        """A line of the agent's own in a rank's log, as the trainer logs an error (outcome.rank_error reads it)."""
        state = self.ranks[local_rank]
        if self.run_dir is None:
            return
        path = Path(self.run_dir) / names.LOGS_DIR / names.rank_log(state.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock, open(path, "a", encoding="utf-8") as handle:
            handle.write(f"[{time.strftime(DATEFMT)}][{self.host} r{state.rank}/l{local_rank}][ERROR] {message}\n")

    def close(self) -> None:
        for thread in self.threads:
            thread.join(timeout=5)
        if self.writer is not None:
            self.writer.close()

    # ---- silence
    def silent(self) -> float | None:
        """Seconds since the last progress (a record in metrics.jsonl) when past the hang timeout; None before
        this attempt's first record, between checks and within the timeout."""
        now = time.time()
        if not self.hang_timeout or self.run_dir is None or now - self._last_check < SILENCE_CHECK_S:
            return None
        self._last_check = now
        try:
            progress = os.stat(Path(self.run_dir) / names.METRICS).st_mtime
        except OSError:
            return None
        if progress <= self.started:
            return None
        quiet = now - progress
        return quiet if quiet > self.hang_timeout else None

    def hang_reports(self, quiet: float) -> None:
        """logs/hang-rank<R>.json for each rank of this node: no progress for `quiet` seconds."""
        if self.run_dir is None:
            return
        now = time.time()
        step = self.last_step if self.last_step is not None else _last_step(Path(self.run_dir) / names.METRICS)
        for state in self.ranks.values():
            record = {"rank": state.rank, "host": self.host, "step": step, "where": "no progress line",
                      "stalled_s": round(quiet, 1), "last_progress_time": now - quiet, "time": now,
                      "silent_s": round(now - state.last_output, 1), "last_line": state.last_line[:300],
                      "hang_timeout_s": self.hang_timeout, "source": "agent",
                      "log": f"{names.LOGS_DIR}/{names.rank_log(state.rank)}"}
            try:
                write_json_atomic(Path(self.run_dir) / names.LOGS_DIR / names.hang_report(state.rank), record)
            except OSError:
                pass

    def report(self) -> dict:
        """What the agent's report says of the program."""
        out = {"backend": self.backend.name, "metrics_rank": self.metrics_rank, "command": self.masker.argv(self.command)}
        if self.resume is not None:
            out.update(resumed_from=str(self.resume.path), resumed_step=self.resume.step)
        if self.hosts_metrics_rank:
            out.update(metric_lines=self.records, unreadable_lines=self.unreadable,
                       unreadable_examples=list(self.examples))
        return out


class Traceback:
    """A Python traceback on a rank's stream reaches the console as its last line only, with where the rest
    is (as the trainer's own console lines do): `console(line)` is what to show, or None."""
    _RANK = re.compile(r"^\[rank\d+\]:\s?")      # torch's prefix on a rank's exception
    _HEAD = "Traceback (most recent call last):"

    def __init__(self, log: str):
        self.log, self.inside = log, False

    def console(self, line: str) -> str | None:
        text = self._RANK.sub("", line)
        if text.startswith(self._HEAD):
            self.inside = True
            return None
        if not self.inside:
            return line
        if not text.strip() or text[:1].isspace() or text.startswith(("During handling", "The above exception")):
            return None
        self.inside = False
        return f"{line} (traceback in {self.log})"


def _first(*parsers_and_line):
    *parsers, line = parsers_and_line
    for parse in parsers:
        record = parse(line) if parse is not None else None
        if record is not None:
            return record
    return None


def _console_ranks(wanted: str, metrics_rank: int) -> set[int] | None:
    """The ranks whose lines reach the console: names.LOG_RANK's (a number, or all: None), else rank 0 and the
    metrics rank."""
    wanted = wanted.strip().lower()
    if wanted == "all":
        return None
    if wanted.isdigit():
        return {int(wanted)}
    return {0, metrics_rank}


def _peak(env: Mapping[str, str]) -> float | None:
    try:
        peak = float(env.get(names.GPU_PEAK_TFLOPS, ""))
    except ValueError:
        return None
    return peak if peak > 0 else None


def _last_step(path: Path) -> int | None:
    """The last train record's step in metrics.jsonl (its tail read), or None."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 65536))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "train" and isinstance(record.get("step"), int):
            return record["step"]
    return None

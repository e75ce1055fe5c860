"""The interface every backend implements (runtime/backends/__init__.py says what each part is for), and
what their log parsers share: colours stripped, numbers as printed ('12,345', '1.0E-04', '0.12%'),
records for metrics.jsonl, a JSON metric line, --metrics-regex.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from core import names
from core.errors import UserError

#: A line that looked like a metric line but could not be read (the agent counts it).
UNREADABLE = "unreadable"
#: The fields a train record may carry besides step (what the report, train.plot and snapshot.diff draw).
FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "tflops", "mfu",
          "gpu_mem_gib", "gpu_mem_reserved_gib")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class BackendError(UserError):
    """What the user gave a backend cannot start (no program, a missing checkout, script or config)."""


class UnknownBackend(BackendError):
    """--backend names no backend."""


@dataclass
class Options:
    """What train.launch's options give a backend."""
    config: str = ""            # --config (torchtitan: its TOML file)
    megatron: str = ""          # --megatron, or the anvil.megatron_path setting: a Megatron-LM checkout
    cwd: Path = field(default_factory=Path.cwd)


@dataclass
class Plan:
    """What the ranks start, checked before any run directory exists."""
    argv: list[str]                                        # after the Python: ["-m", "torchtitan.train", ...],
    #                                                        ["/x/pretrain_gpt.py", ...], or a program of its own
    configs: dict[str, Path] = field(default_factory=dict)  # files kept in RUN/configs/ (name -> file)
    config_option: str = ""                                # the option that takes the config (a replay swaps in the copy)
    mounts: list[str] = field(default_factory=list)         # folders a container must see
    notes: list[str] = field(default_factory=list)          # said before the launch


@dataclass
class Checkpoint:
    path: Path
    step: int


Parse = Callable[[str], "dict | str | None"]


class Backend:
    name = ""
    summary = ""                         # one line for --help and the docs
    stop_signal: int | None = None       # what its ranks get for a stop signal (None: the one that came)
    stops_with_zero = False              # exits 0 after checkpointing on stop_signal
    on_signal = "every rank gets the signal; a program that saves and exits 3 asks for a requeue"

    # ---- how to start it
    def plan(self, argv: list[str], options: Options) -> Plan:
        raise NotImplementedError

    def command(self, argv: list[str], run_dir: Path, resume: Checkpoint | None) -> list[str]:
        """The rank's command line in this run directory, resuming from `resume` (None: fresh)."""
        return list(argv)

    # ---- how it takes a preemption signal
    def stop_signal_of(self, argv: list[str]) -> int | None:
        """The signal its ranks get for a stop signal, for this command line (None: the one that came)."""
        return self.stop_signal

    # ---- how it resumes
    def checkpoint_dir(self, argv: list[str], run_dir: Path) -> Path:
        return Path(run_dir) / names.CHECKPOINTS_DIR

    def latest(self, folder: Path) -> Checkpoint | None:
        """The newest complete checkpoint in `folder`, or None."""
        return None

    def at(self, path: Path) -> Checkpoint | None:
        """`path` itself, when it is one complete checkpoint."""
        return None

    def find(self, argv: list[str], path: Path) -> Checkpoint | None:
        """--resume PATH: the checkpoint PATH is, else the newest in its run's checkpoint folder or in it."""
        path = Path(path)
        return self.at(path) or self.latest(self.checkpoint_dir(argv, path)) or self.latest(path)

    # ---- how to read its logs
    def metrics_rank(self, argv: list[str], world_size: int) -> int:
        """The rank whose output has the metric lines."""
        return 0

    def parser(self, argv: list[str], world_size: int, peak_tflops: float | None = None) -> Parse:
        return lambda line: None


def option_value(argv: list[str], name: str) -> str | None:
    """The value of --name VALUE or --name=VALUE in a backend's arguments (the last one given), else None."""
    found = None
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith(name + "="):
            found = token.split("=", 1)[1]
    return found


# ---- what the parsers share
def plain(line: str) -> str:
    """The line without terminal colours and its line end."""
    return _ANSI.sub("", line).rstrip("\r\n")


def number(text: str) -> float | None:
    """'12,345' -> 12345.0, '1.0E-04' -> 0.0001, '0.12%' -> 0.12; None for anything else (nan and inf too)."""
    try:
        value = float(str(text).strip().rstrip("%").replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def train_record(step, **fields) -> dict | str:
    """{"kind": "train", "step": N, ...} of the fields that are numbers; UNREADABLE without a step or loss."""
    try:
        step = int(step)
    except (TypeError, ValueError):
        return UNREADABLE
    record = {"kind": "train", "step": step}
    record.update({k: v for k, v in fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v)})
    return record if "loss" in record else UNREADABLE


def regex_parser(pattern: str) -> Parse:
    """--metrics-regex: a line the pattern finds is a metric line, its named groups the fields (step and loss
    at least; tokens_per_s, mfu, mem_gib, lr, val_loss, ...)."""
    compiled = compile_metrics_regex(pattern)

    def parse(line: str) -> dict | str | None:
        found = compiled.search(plain(line))
        if found is None:
            return None
        groups = {k: v for k, v in found.groupdict().items() if v is not None}
        return record_of(groups)
    return parse


def compile_metrics_regex(pattern: str) -> re.Pattern:
    """The pattern, with named groups step and loss (or val_loss); BackendError otherwise."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise BackendError(f"--metrics-regex {pattern!r}: not a regular expression ({exc})") from None
    groups = set(compiled.groupindex)
    if "step" not in groups or not groups & {"loss", "val_loss"}:
        raise BackendError(f"--metrics-regex {pattern!r}: needs the named groups (?P<step>...) and (?P<loss>...) "
                           "(and may have tokens_per_s, mfu, mem_gib, lr)")
    return compiled


#: The names a program's own record may give its fields (a JSON line, a regex's groups) -> the record's.
_ALIASES = {"mem_gib": "gpu_mem_gib", "memory_gib": "gpu_mem_gib", "tokens_per_sec": "tokens_per_s",
            "tps": "tokens_per_s"}


def record_of(values: dict) -> dict | str:
    """A train (or, with val_loss and no loss, val) record from a program's own fields; UNREADABLE when its
    step or loss is not a number."""
    values = {_ALIASES.get(k, k): v for k, v in values.items()}
    numbers = {k: number(v) if isinstance(v, str) else v for k, v in values.items()}
    if "loss" not in values and "val_loss" in values:
        try:
            step = int(numbers["step"])
        except (KeyError, TypeError, ValueError):
            return UNREADABLE
        loss = numbers["val_loss"]
        return {"kind": "val", "step": step, "val_loss": loss} if isinstance(loss, (int, float)) else UNREADABLE
    return train_record(numbers.get("step"), **{k: numbers[k] for k in FIELDS if k in numbers})


def json_line(line: str) -> dict | str | None:
    """A line that is a JSON object with "step" and "loss" (or "val_loss") is a metric; one that mentions them but
    is no such object is UNREADABLE (a line cut short, a loss of "nan"); anything else is none."""
    text = plain(line).strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return UNREADABLE if '"step"' in text else None
    if not isinstance(obj, dict) or "step" not in obj or not ({"loss", "val_loss"} & set(obj)):
        return UNREADABLE if isinstance(obj, dict) and "step" in obj and "loss" in text else None
    return record_of(obj)

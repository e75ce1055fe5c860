"""Rank-aware logging (stdlib only: the trainer imports this too).

Line format::

    [2026-11-22 10:31:05][node1 r3/l3][INFO] message

Every rank writes RUN_DIR/logs/rank{R}.log; the console (stderr, so a task's
``--json`` stdout stays parseable) shows only ``console_rank``, or the rank in
env names.LOG_RANK ("all" shows every rank). Rank, local rank and host default
to env RANK, LOCAL_RANK and names.HOST (else the host name).

Secret values found in the environment are masked in every line written
(core.secrets, also stdlib only).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from core import names
from core.host import this_host
from core.secrets import Masker

FORMAT = "[%(asctime)s][%(rank_tag)s][%(levelname)s] %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"


class _RankFilter(logging.Filter):
    """Stamps host/rank onto records and masks secrets in the message."""

    def __init__(self, tag: str, masker: Masker):
        super().__init__()
        self.tag = tag
        self.masker = masker

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_tag = self.tag
        message = record.getMessage()
        masked = self.masker.text(message)
        if masked != message or record.args:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.masker.text(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def console_shows(rank: int, console_rank: int | str = 0) -> bool:
    wanted = os.environ.get(names.LOG_RANK, str(console_rank)).strip().lower()
    if wanted == "all":
        return True
    try:
        return int(wanted) == rank
    except ValueError:
        return rank == 0


class _ConsoleFormatter(logging.Formatter):
    """One line per record on the console: tracebacks go to the rank's log file only."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            text = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        return text + (" (traceback in the rank's log file)" if saved[0] else "")


class _LogFile(logging.FileHandler):
    """The rank's log file. A record it cannot write (a full disk) is dropped there, not answered with the
    traceback logging prints by default ("--- Logging error ---"): the console still shows the record,
    and the run's own error says what filled up."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def setup(run_dir: Path | str | None, rank: int | None = None, local_rank: int | None = None,
          host: str | None = None, console_rank: int | str = 0, name: str = "anvil",
          file_name: str | None = None, level: int = logging.INFO) -> logging.Logger:
    """Configure and return logger ``name`` for this rank (idempotent).

    ``file_name`` (default ``rank{R}.log``) lets the runner process, which is
    not a training rank, keep its own file beside the ranks' files.
    """
    rank = _env_int("RANK", 0) if rank is None else int(rank)
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else int(local_rank)
    host = host or this_host()
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    for old in list(logger.filters):
        logger.removeFilter(old)
    logger.setLevel(level)
    logger.propagate = False
    logger.addFilter(_RankFilter(f"{host} r{rank}/l{local_rank}", Masker.from_environ()))
    formatter = logging.Formatter(FORMAT, DATEFMT)
    if run_dir is not None:
        log_dir = Path(run_dir) / names.LOGS_DIR
        log_dir.mkdir(parents=True, exist_ok=True)
        file_handler = _LogFile(log_dir / (file_name or names.rank_log(rank)), encoding="utf-8")
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    if console_shows(rank, console_rank):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(_ConsoleFormatter(FORMAT, DATEFMT))
        logger.addHandler(console)
    return logger


#: Set by the launcher when `inv` itself runs on a terminal: rank 0 draws its bar there.
PROGRESS_TTY_VAR = names.PROGRESS_TTY


def terminal():
    """Where the bar may go: our own stderr if it is a terminal, else the terminal `inv` runs on
    (/dev/tty, when the launcher said there is one): never a pipe, so never a log file."""
    if sys.stderr.isatty():
        return sys.stderr
    if os.environ.get(PROGRESS_TTY_VAR) == "1":
        try:
            return open("/dev/tty", "w", encoding="utf-8")
        except OSError:
            return None
    return None

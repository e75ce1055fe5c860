"""Values that reach a line another program reads: a batch script, an srun line, an SSH command, a
container line. They come from the command line, invoke.yaml, INVOKE_ANVIL_*, a replayed argv or a
node list; a newline in one of them would be a line of its own in job.sbatch, and a word where an
option belongs would be a command. Each builder (slurm/srun.py, slurm/batch.py, ssh/session.py,
container.py) checks what it puts on its line here, and a refusal is one BadValue (exit 2).

    word("Slurm partition (--partition, anvil.slurm_partition)", "gpu")      # one word: no space, no -x
    options("anvil.slurm_extra", ["--qos=high"])                             # every token an option
    line("the run directory", "/runs/x")                                      # no control character
"""
from __future__ import annotations

from typing import Sequence

from core.errors import UserError


class BadValue(UserError):
    """A value that cannot go onto the line it is meant for."""


def _control(value: str) -> str:
    """The first control (non-printable) character of value, as Python writes it; "" when none."""
    for ch in value:
        if not ch.isprintable():
            return repr(ch)[1:-1]
    return ""


def line(what: str, value: str) -> str:
    """value, which may hold spaces but no control character (a newline ends a line of a script)."""
    bad = _control(str(value))
    if bad:
        raise BadValue(f"{what} {str(value)!r}: has a control character ({bad}); it would break the line it "
                       f"goes on")
    return value


def word(what: str, value: str) -> str:
    """value as one word: no control character, no whitespace, and not an option (a leading -)."""
    line(what, value)
    if any(ch.isspace() for ch in value):
        raise BadValue(f"{what} {value!r}: has whitespace; expected one word")
    if value.startswith("-"):
        raise BadValue(f"{what} {value!r}: starts with '-', so it would be read as an option; expected a name")
    return value


def options(what: str, tokens: Sequence[str]) -> list[str]:
    """Tokens that are each an option (-x, --name, --name=value): a word that is not one would be an
    argument of its own, or the command srun runs."""
    for token in tokens:
        line(what, token)
        if not token.startswith("-") or token in ("-", "--"):
            raise BadValue(f"{what}: {token!r} is not an option; give options only, a value joined to its "
                           f"option (--qos=high, not --qos high)")
        if any(ch.isspace() for ch in token):
            raise BadValue(f"{what}: {token!r} has whitespace; give a value joined to its option without "
                           f"spaces (--qos=high)")
    return list(tokens)

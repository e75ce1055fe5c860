"""The comm check's errors: CommError (bad input, exit status 2) and CommFailed (the screen ran and a node
failed, exit status 1)."""
from __future__ import annotations

from core.errors import AnvilError, UserError


class CommError(UserError):
    """Bad input for the comm check (too few hosts, a bad size, no allocation)."""


class CommFailed(AnvilError):
    """The screen ran and a node (or the all-reduce across all of them) failed: exit status 1."""

    exit_code = 1

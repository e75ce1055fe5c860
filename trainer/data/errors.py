"""The exception types the data package raises: DataError for problems a user can fix
(exit 2), Interrupted for a Ctrl-C (or a stop signal) that stopped a build cleanly (exit 130, or the
signal's: core.signals.exit_status)."""
from core.errors import AnvilError, UserError
from core.signals import EXIT_INTERRUPTED


class DataError(UserError):
    """Bad input, a missing dataset, a full disk: the message says what and where."""


class Interrupted(AnvilError):
    """Ctrl-C or a stop signal stopped a data task; the message says what was (not) left behind."""

    exit_code = EXIT_INTERRUPTED

"""The one error of the Hugging Face package: a directory that cannot be started from."""
from core.errors import UserError


class InitError(UserError):
    """A Hugging Face directory Anvil cannot start from, or one that does not fit the config
    (exit 2); the message names the file and what was expected."""

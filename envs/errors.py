"""The one exception type envs raises for things a user got wrong."""


class EnvError(ValueError):
    """Bad user input to envs: unknown --gpu/--site name, malformed --env, unreadable config."""

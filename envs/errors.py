"""The one exception type envs raises for things a user got wrong."""
from core.errors import UserError



class EnvError(UserError):
    """Bad user input to envs: unknown --gpu/--site name, malformed --env, unreadable config."""

"""The one exception type the data package raises for problems a user can fix."""
from trainer.errors import UserError



class DataError(UserError):
    """Bad input, a missing dataset, a full disk: the message says what and where."""

"""The one exception type the data package raises for problems a user can fix."""


class DataError(ValueError):
    """Bad input, a missing dataset, a full disk: the message says what and where."""

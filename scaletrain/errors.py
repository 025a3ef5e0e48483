"""The one exception type for mistakes a user can fix.

The command line prints a `UserError` as its single sentence on stderr and
exits with code 2, without a traceback. Everything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """Bad input: the message says what to change."""

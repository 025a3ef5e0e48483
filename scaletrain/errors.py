"""The two exceptions that are not bugs: a user's mistake, and a job's failure.

The command line prints a `UserError` as its single sentence on stderr and
exits with code 2, and a `JobFailed` likewise with code 1, both without a
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message says what to change."""


class JobFailed(Exception):
    """The job cannot go on, for a reason its message gives: another rank died
    or failed, or training diverged. Not a bug of this process and not the
    user's mistake: the command line prints the sentence and exits with code 1,
    without a traceback."""

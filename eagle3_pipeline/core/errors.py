"""The one exception type that means "the user can fix this": stage scripts print it as one line."""


class UserError(Exception):
    """A mistake in the input, the flags or the files, with the fix in the message.

    Stage scripts catch it, log `error: <message>` and exit with status 2; anything else is a bug
    and keeps its traceback.
    """


class DiskFull(UserError):
    """A write failed for lack of space (ENOSPC/EDQUOT); the message names the file and the bytes."""

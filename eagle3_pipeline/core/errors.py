"""The one exception type that means "the user can fix this": stage scripts print it as one line."""


class UserError(Exception):
    """A mistake in the input, the flags or the files, with the fix in the message.

    Stage scripts catch it, log `error: <message>` and exit with status 2; anything else is a bug
    and keeps its traceback.
    """


class DiskFull(UserError):
    """A write failed for lack of space (ENOSPC/EDQUOT); the message names the file and the bytes."""


def unwritable(where: object, e: OSError) -> UserError:
    """The error of an output folder that cannot be made or written: `where` (a folder, or the flag that
    names it), the reason and the path the OS named."""
    why = f"{e.filename} is a file" if isinstance(e, FileExistsError) else f"{e.strerror}: {e.filename}"
    return UserError(f"{where}: cannot write there ({why}); give an output folder this user can write")

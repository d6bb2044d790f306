"""The errors a user can cause and mend: a bad config value, missing or damaged data, a
checkpoint or log that does not fit, a machine that cannot hold the run. Each module's own
error class derives from UserError, and every command ends on one with a single line that says
what to do (the message), never a traceback; an entry point catches the one class."""


class UserError(Exception):
    """An error the user can mend; its message is the line the command ends with."""

"""The one error of a GSM8K evaluation a user can fix: the command lines print it in one `error: ...` line."""


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line."""

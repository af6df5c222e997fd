"""User-facing errors.

Anything a user can cause (a typo in a model name, θ outside [0, 1], an empty prompt, a
corrupt download) raises :class:`NSDError` with a message that says what to fix. The CLI
prints the message and exits with status 2; it never shows a traceback for these.
"""


class NSDError(Exception):
    """A problem with the user's input or environment, explained in the message."""

    exit_code = 2

"""Errors that tellkit reports to a person as one line (the CLI turns them into exit code 2)."""


class TellkitError(Exception):
    """A user-facing error: bad input, bad config, missing file. Shown without a traceback."""


class MissingExtraError(TellkitError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

"""Errors that tellkit reports to a person as one line.

The contract, for every part of the package:

* Anything a user can get wrong (a missing or unreadable file, a bad recipe key or value, an
  image that does not decode, a checkpoint of the wrong family, an unknown model or task name)
  raises :class:`TellkitError` with a message that names the input and says what was expected,
  e.g. ``TellkitError(f"{path}: holds a 'bttr' model, not a captioner")``. Chain the cause
  (``raise ... from exc``) when there is one.
* The ``tellkit`` command prints it as ``tellkit <command>: error: <message>`` on stderr and
  exits with status 2, never with a traceback (``tellkit.cli.main``). The web server answers a
  request that raises it with HTTP 422 and the message as JSON (``tellkit.server``).
* A missing optional dependency is a :class:`MissingExtraError`, raised by
  :func:`tellkit.utils.optional.require`, whose message names the ``pip install 'tellkit[extra]'``
  that fixes it.
* Everything else (a bug, an internal shape mismatch) is an ordinary exception and keeps its
  traceback: do not wrap internal failures in ``TellkitError`` to hide them.
"""


class TellkitError(Exception):
    """A user-facing error: bad input, bad config, missing file. Shown as one line, no traceback."""


class MissingExtraError(TellkitError, ImportError):
    """An optional dependency is not installed; the message names the extra to install.

    Also an ``ImportError``, so code that probes for an optional module with ``except ImportError``
    keeps working.
    """

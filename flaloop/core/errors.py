"""Errors with a user-facing message; only the CLI maps them to exit codes.

Exit codes (documented in the README):
  0  verdict delivered / gate green
  1  gate red or guard blocked
  2  usage or setup error (bad op, bad ref, no contract, not a git repo, ...)
  3  measurement failed (a worker crashed or hung, no cell could be measured)
  4  internal error (a bug in flaloop: mapped by the CLI from any unexpected exception)
  130 interrupted (Ctrl-C or SIGTERM)
"""

from __future__ import annotations


class FlaloopError(Exception):
    """Base class: `message` says what was wrong, `hint` what to do next; `detail` (a traceback
    from a worker, a long log) is shown only with --debug."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.detail = detail

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(FlaloopError):
    """The user asked for something that cannot be done as asked (exit 2)."""

    exit_code = 2


class GateRed(FlaloopError):
    """The correctness gate or a guard said no (exit 1)."""

    exit_code = 1


class MeasurementError(FlaloopError):
    """A measurement could not be made (exit 3)."""

    exit_code = 3


class StorageError(FlaloopError):
    """A file or directory flaloop needs could not be written: read-only, full disk (exit 2)."""

    exit_code = 2


class Busy(FlaloopError):
    """Another flaloop process holds the op's workspace and --no-wait was given (exit 2)."""

    exit_code = 2


class RuleRefused(FlaloopError):
    """A rule of the optimization loop says no: stalled, a stop bar not met, a hand-edited log row (exit 1)."""

    exit_code = 1

"""Errors raised on bad input. Each message names what was wrong, the value, and what was expected."""

import sys


class ReferenceEngineError(ValueError):
    """Base class: command-line entry points print these without a traceback."""


class ConfigError(ReferenceEngineError):
    """A config.json field is missing, unknown or out of range."""


class CheckpointError(ReferenceEngineError):
    """A checkpoint on disk is incomplete or does not match its config."""


class RequestError(ReferenceEngineError):
    """A prompt or generation request cannot be served as given."""


def exit_with(exc: Exception) -> int:
    """What a command-line entry point does with bad input: one `error:` line on stderr, no
    traceback, and the exit status 2 to return."""
    print(f"error: {exc}", file=sys.stderr)
    return 2

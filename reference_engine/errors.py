"""Errors raised on bad input. Each message names what was wrong, the value, and what was expected."""


class ReferenceEngineError(ValueError):
    """Base class: command-line entry points print these without a traceback."""


class ConfigError(ReferenceEngineError):
    """A config.json field is missing, unknown or out of range."""


class CheckpointError(ReferenceEngineError):
    """A checkpoint on disk is incomplete or does not match its config."""


class RequestError(ReferenceEngineError):
    """A prompt or generation request cannot be served as given."""

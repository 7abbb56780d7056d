"""Error types that carry one actionable line for the user."""


class LongctxError(Exception):
    """Base class: the message says what is wrong and what to do."""


class ConfigError(LongctxError, ValueError):
    """A config key, value or combination is not allowed."""


class DataError(LongctxError, OSError):
    """A dataset file is missing, wrong or corrupt."""


class CheckpointError(LongctxError, FileNotFoundError):
    """A checkpoint is missing or unreadable."""


class NonFiniteError(LongctxError, FloatingPointError):
    """Training produced a non-finite loss or gradient."""


class WorkdirError(LongctxError, OSError):
    """The workdir cannot be used: not a writable folder, or another training holds it."""

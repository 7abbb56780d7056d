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


def capacity_message(exc: BaseException) -> str | None:
    """The message when ``exc`` says a state with a static capacity was given more than it holds
    (``longctx.attention.base.CapacityError`` raised on the host, or from inside a compiled program through a
    host callback, where it arrives wrapped in the runtime's multi-line error); else None."""
    if any(c.__name__ == "CapacityError" for c in type(exc).__mro__):
        return str(exc)
    text = str(exc)
    if "CapacityError" in text:
        lines = [ln for ln in text.splitlines() if "CapacityError" in ln]
        return lines[-1].split("CapacityError:", 1)[-1].strip() if lines else text
    return None

"""The converter's error: one line saying what is wrong with the input and what to do."""

from longctx.errors import LongctxError


class ConvertError(LongctxError, ValueError):
    """A Hugging Face folder or a run that cannot be converted (exit status 2 on the command line)."""

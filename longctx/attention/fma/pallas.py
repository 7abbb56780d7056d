"""The implementation ``pallas``: the blocked path (:func:`longctx.attention.fma.xla.fma_forward`) with the
Pallas block kernel ``pallas_kernels/fma_blocks.py`` (docs/methods/fma.md §8) as its block function. The kernel
serves full passes of FMA (packed coarse slots, no dropout); streaming steps run the kernel's reference."""

from __future__ import annotations

import functools

from longctx.attention.fma import xla
from pallas_kernels import fma_blocks

unsupported_reasons = fma_blocks.unsupported_reasons


def attend(choice):
    """The block function for a ``dispatch.Choice`` of this implementation (interpret mode on a CPU)."""
    return fma_blocks.make_attend(interpret=choice.interpret,
                                  platform="interpret" if choice.interpret else choice.platform)


def forward(choice):
    """``forward(q, k, v, ds, opts, drop_key=None)`` running the kernel."""
    return functools.partial(xla.fma_forward, attend=attend(choice))


__all__ = ["attend", "forward", "unsupported_reasons"]

"""The implementation ``pallas``: the blocked path (:func:`longctx.attention.fma.xla.fma_forward`) with the
Pallas block kernel ``pallas_kernels/fma_blocks.py`` (docs/methods/fma.md §8) as its block function. The kernel
serves full passes of FMA (packed coarse slots, no dropout); streaming steps run the kernel's reference.

FMA's only: the kernel computes FMA's packed coarse slots, not FMA-linear's statistics, so the declaration names
the one method it serves (``methods``); ``impl='auto'`` tries it first on GPU and TPU, before ``xla``."""

from __future__ import annotations

import dataclasses
import functools

from longctx.attention.dispatch import Implementation
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


def bind(choice):
    """``(forward, attend)`` of this implementation for ``choice``: the full pass and the streamed steps' block
    function."""
    return forward(choice), attend(choice)


def _reasons(platform, *, release_zero_slots=False, **shapes):
    out = list(unsupported_reasons(platform, **shapes))
    if release_zero_slots:
        out.append("release_zero_slots (the release's unmasked zero slots) is served by the reference "
                   "and the XLA paths; the kernel is not tested with the extra slot")
    return out


@dataclasses.dataclass(frozen=True)
class MethodImplementation(Implementation):
    """An implementation of this folder that serves only some of its methods: ``methods`` names them (the
    layer lists a declaration for a method only where its ``methods`` include the method's name; empty: all)."""

    methods: tuple[str, ...] = ()


IMPLEMENTATIONS = (
    MethodImplementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=_reasons,
                         config={"impl": "pallas"}, auto={"cuda": 0, "rocm": 0, "tpu": 0}, code=bind,
                         methods=("fma",)),
)

__all__ = ["IMPLEMENTATIONS", "MethodImplementation", "attend", "bind", "forward", "unsupported_reasons"]

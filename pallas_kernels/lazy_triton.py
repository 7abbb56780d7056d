"""JAX's Pallas Triton backend (``jax.experimental.pallas.triton``) for the Triton kernels, imported when a kernel
first reads it (traced, lowered), not when its module is imported: JAX deprecated the backend, and the path
``impl='auto'`` takes on Hopper (the Mosaic GPU kernels) must hold without it. A Triton kernel module imports this
module as ``pltriton`` and reads its names (``pltriton.atomic_add``, ``pltriton.CompilerParams``) as before."""

from __future__ import annotations

import functools
import importlib


def __getattr__(name: str):
    return getattr(importlib.import_module("jax.experimental.pallas.triton"), name)


@functools.cache
def missing() -> list[str]:
    """The refusal of a Triton kernel on a GPU when this JAX has no Pallas Triton backend (a JAX that removed it):
    one line, or none where the backend imports. The kernels' ``unsupported_reasons`` add it for cuda and rocm, so
    ``impl='auto'`` goes on to XLA there instead of failing when the kernel is traced."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError as err:
        import jax

        return [f"this JAX ({jax.__version__}) has no Pallas Triton backend ({err})"]
    return []

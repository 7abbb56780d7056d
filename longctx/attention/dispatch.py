"""One implementation-selection rule for ``impl = 'xla' | 'pallas' | 'auto'`` (DESIGN.md §3, STYLE rule 4).

Every kernel module in ``pallas_kernels/`` declares what it supports with a function
``unsupported_reasons(platform, **shapes) -> list[str]`` (empty: supported), in the style of xformers'
``not_supported_reasons``; ``platform`` is ``'tpu'``, ``'cuda'``, ``'rocm'`` or ``'interpret'`` (CPU, Pallas
interpret mode: only what the kernel computes is checked, not its hardware limits). :func:`resolve` is the
only place that turns a method's ``impl`` into a choice:

* ``'xla'``: the method's XLA path.
* ``'auto'``: the kernel where it has no reasons on the current platform; otherwise the XLA path and one
  log line (INFO, logger ``longctx.attention.dispatch``, once per distinct message) naming why. On CPU
  ``'auto'`` is always XLA (no compiled Pallas there).
* ``'pallas'``: the kernel, or :class:`KernelUnsupportedError` listing every reason. On CPU it runs the
  kernel in interpret mode with a warning (slow; for tests), after checking the interpret-mode reasons.

A method may add its own reasons (``extra_reasons``) for configurations its kernel does not compute
(e.g. a reduction other than the kernel's); they count like the kernel's.

Exact attention's fused kernels from outside the project (cuDNN on GPUs, splash on TPUs) follow the same rule
under ``attention.dense.impl`` names of their own: ``longctx/attention/dense_platform.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence

import jax

IMPLS = ("xla", "pallas", "auto")
logger = logging.getLogger(__name__)
_logged: set[str] = set()


class KernelUnsupportedError(ValueError):
    """impl='pallas' was asked for where the kernel cannot run; the message lists every reason."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """The resolved implementation: ``use_kernel`` (else XLA), ``interpret`` (Pallas interpret mode),
    the ``platform`` name given to the kernel, and the ``reasons`` the kernel was not taken (if any)."""

    use_kernel: bool
    interpret: bool = False
    platform: str = "cpu"
    reasons: tuple[str, ...] = ()


def current_platform() -> str:
    """The default backend as a kernel platform name: 'cpu' | 'tpu' | 'cuda' | 'rocm'."""
    backend = jax.default_backend()
    if backend == "gpu":
        devs = jax.devices()
        return "rocm" if devs and "rocm" in getattr(devs[0].client, "platform_version", "").lower() else "cuda"
    return backend


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def resolve(impl: str, *, method: str, kernel: str, reasons_fn: Callable[..., list[str]],
            platform: str | None = None, extra_reasons: Sequence[str] = (), **shapes) -> Choice:
    """Pick the implementation of ``method`` (a name for messages) whose Pallas kernel is ``kernel`` (a name)
    and declares its limits through ``reasons_fn(platform, **shapes)``. See the module docstring."""
    if impl not in IMPLS:
        raise ValueError(f"{method}: impl={impl!r}; allowed: {', '.join(IMPLS)}")
    plat = platform or current_platform()
    if impl == "xla":
        return Choice(False, platform=plat)
    if plat == "cpu":
        if impl == "auto":
            why = ("no compiled Pallas on cpu (the kernel runs there only in interpret mode, "
                   "asked for with impl='pallas')",)
            _log_once(f"{method}: impl='auto' uses XLA instead of the Pallas kernel {kernel}: {why[0]}")
            return Choice(False, platform=plat, reasons=why)
        reasons = list(extra_reasons) + list(reasons_fn("interpret", **shapes))
        if reasons:
            raise KernelUnsupportedError(f"{method}: impl='pallas' cannot run the Pallas kernel {kernel} (interpret "
                                         f"mode on cpu): " + "; ".join(reasons) + ". Use impl='xla'.")
        warnings.warn(f"{method}: impl='pallas' on cpu runs the Pallas kernel {kernel} in interpret mode (slow)",
                      stacklevel=3)
        return Choice(True, interpret=True, platform=plat)
    reasons = list(extra_reasons) + list(reasons_fn(plat, **shapes))
    if not reasons:
        return Choice(True, platform=plat)
    if impl == "auto":
        _log_once(f"{method}: impl='auto' uses XLA instead of the Pallas kernel {kernel} on {plat}: "
                  + "; ".join(reasons))
        return Choice(False, platform=plat, reasons=tuple(reasons))
    raise KernelUnsupportedError(f"{method}: impl='pallas' cannot use the Pallas kernel {kernel} on {plat}: "
                                 + "; ".join(reasons) + ". Use impl='auto' (falls back to XLA) or impl='xla'.")


__all__ = ["IMPLS", "Choice", "KernelUnsupportedError", "current_platform", "resolve"]

"""Host (CPU) memory allocation settings for a longctx process.

XLA:CPU allocates the buffers of every call with the C library's ``malloc``. With glibc's defaults
an allocation above the mmap threshold (at most 32 MiB, adjusted at run time), or one that does not
fit a thread arena's 64 MiB heap, gets a fresh ``mmap`` and is unmapped when freed, and free memory
at the heap top beyond the trim threshold goes back to the kernel. A long-sequence call allocates and
frees buffers of tens of MiB to several GiB every time, so every call faults its memory in again
page by page, and the fault count grows faster than the length as more buffers cross the threshold:
- a causal fma_linear forward at 64k tokens (4 heads of 64) took hundreds of thousands of minor faults
  per call, and the settings below made it markedly faster;
- a whole-model training step of transformer_vq at the official release's shape, 16k tokens: its one
  5.9 GB temporary buffer was mapped and faulted in on every step (millions of faults, a quarter of
  the CPU time in the kernel); with the settings below it is mapped once.
The settings keep freed memory in the process: one arena for all threads, no mmap at any size, no
trimming.

The console entry points also restart themselves once, before anything else runs, with glibc's
``glibc.malloc.hugetlb=1`` tunable (:func:`restart_with_huge_pages`; glibc reads tunables only at process
start): malloc then asks the kernel for transparent huge pages (``madvise``) on the heap it grows, so the
multi-GiB buffers of a long-sequence call are backed by 2 MiB pages (fewer TLB misses: a transformer_vq
training step at the release's shape, 16k tokens, got faster).

The price: the process's resident memory stays at its peak instead of shrinking when buffers are
freed. The entry points (``longctx-train``, ``-eval``, ``-sample``, ``-bench``, ...) apply the settings
first thing; in a notebook call :func:`keep_freed_memory` before JAX runs anything.

Only XLA:CPU runs its arrays out of ``malloc``, so by default (``LONGCTX_HOST_MALLOC=auto``) the settings and
the restart apply on CPU hosts only: a host that JAX will run on a GPU or TPU (``JAX_PLATFORMS`` names one,
or a CUDA, ROCm or TPU plugin for JAX is installed and ``JAX_PLATFORMS`` does not ask for the CPU) keeps the
C library's defaults. ``LONGCTX_HOST_MALLOC=keep`` applies them everywhere, ``system`` nowhere."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

from longctx.errors import ConfigError

ENV = "LONGCTX_HOST_MALLOC"
# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8
# mallopt takes an int, which glibc widens to size_t: -1 is the largest threshold (a positive int would stop
# at 2 GiB, below the one temporary buffer of a long-sequence train step, which was then returned and faulted
# in again on every step); M_MMAP_MAX = 0 sends every allocation to the heap whatever its size
MMAP_THRESHOLD = -1
TRIM_THRESHOLD = -1

_applied: dict | None = None
MODES = ("auto", "keep", "system")
# modules installed by jax's accelerator extras (jax[cuda12], jax[cuda13], jax[rocm], jax[tpu])
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")

TUNABLES = "GLIBC_TUNABLES"
HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def settings() -> dict[int, int]:
    """The mallopt settings :func:`keep_freed_memory` applies (parameter -> value)."""
    return {M_ARENA_MAX: 1, M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD}


def accelerator_host(environ=None) -> str | None:
    """The accelerator JAX will use on this host, judged without importing JAX (the settings must come before
    JAX starts its threads): the first non-CPU platform of ``JAX_PLATFORMS``, else an installed accelerator
    plugin's module name unless ``JAX_PLATFORMS`` asks for the CPU; None for a CPU host."""
    import importlib.util

    environ = os.environ if environ is None else environ
    platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return None if platforms[0] == "cpu" else platforms[0]
    for name in ACCELERATOR_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def mode(environ=None) -> tuple[str, str]:
    """``('keep' | 'system', why)``: what :func:`keep_freed_memory` and :func:`huge_pages_env` do here."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(ENV, "auto").strip().lower()
    if chosen not in MODES:
        raise ConfigError(f"{ENV}={chosen!r}: allowed values are {', '.join(MODES)}")
    if chosen != "auto":
        return chosen, f"{ENV}={chosen}"
    accelerator = accelerator_host(environ)
    if accelerator is not None:
        return "system", f"an accelerator host ({accelerator}); {ENV}=keep applies the settings anyway"
    return "keep", "a CPU host"


def keep_freed_memory() -> dict:
    """Apply the settings once per process; returns what happened (``{'mode': ..., ...}``).

    Does nothing (and says why) off Linux/glibc or when ``LONGCTX_HOST_MALLOC=system``. Calling it
    after threads have allocated still helps: those threads keep their arenas, new ones share one."""
    global _applied
    if _applied is not None:
        return _applied
    chosen, why = mode()
    if chosen == "system":
        _applied = {"mode": "system", "reason": why}
        return _applied
    if not sys.platform.startswith("linux"):
        _applied = {"mode": "system", "reason": f"not Linux ({sys.platform})"}
        return _applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        _applied = {"mode": "system", "reason": f"no glibc mallopt ({e})"}
        return _applied
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    refused = [k for k, v in settings().items() if mallopt(k, v) != 1]
    if refused:
        warnings.warn(f"glibc refused mallopt parameters {refused} (see longctx/host_memory.py); freed memory may "
                      "still be returned to the kernel and faulted in again", RuntimeWarning, stacklevel=2)
    _applied = {"mode": "keep", "refused": refused}
    return _applied


def huge_pages_env(environ) -> dict | None:
    """``environ`` with glibc's huge-page tunable added to GLIBC_TUNABLES, or None when there is nothing
    to add (already there, ``LONGCTX_HOST_MALLOC=system``, not Linux/glibc >= 2.35, or the kernel's
    transparent huge pages are off)."""
    try:
        if mode(environ)[0] != "keep" or not sys.platform.startswith("linux"):
            return None
    except ConfigError:
        return None
    tunables = environ.get(TUNABLES, "")
    if "glibc.malloc.hugetlb" in tunables:
        return None
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        if name != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
        with open(THP_SETTING) as f:
            if "[never]" in f.read():
                return None
    except (ValueError, OSError):
        return None
    return {**environ, TUNABLES: f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def restart_with_huge_pages() -> None:
    """For console entry points only, first thing: replace this process by the same command line with
    :func:`huge_pages_env` (once: the new process already has the tunable). Does nothing when there is
    nothing to add or the command line is unknown."""
    env = huge_pages_env(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or "ipykernel" in sys.modules:  # never restart a notebook's kernel
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)


__all__ = ["ENV", "accelerator_host", "huge_pages_env", "keep_freed_memory", "mode", "restart_with_huge_pages",
           "settings"]

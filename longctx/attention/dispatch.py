"""Named implementations and the one rule that picks among them (DESIGN.md "Implementations and the execution
section", STYLE §3, rule 4).

Each attention core declares its implementations in order (``AttentionCore.implementations()``): an
:class:`Implementation` names one way of computing the method (``'reference'``, ``'xla'``, ``'pallas'``, ...),
the platforms and dtypes it serves, and a function ``reasons(platform, **shapes) -> list[str]`` for everything
else it refuses (empty: it serves the call), in the style of xformers' ``not_supported_reasons``. A declaration
also says where ``'auto'`` tries it and in which rank (``auto``: platform -> rank, lower first), optionally only
for the calls it is preferred for (``prefer(platform, **shapes) -> bool``, e.g. a tiled form for long rows), and
carries what computes it (``code``: the implementation's module or function). Each implementation module of a
method's folder declares its own (a module-level ``IMPLEMENTATIONS`` tuple) and :func:`declared` collects them, so
the platform knowledge of an implementation lives in its file and the layer names none but the reference. ``platform`` is
``'cpu'``, ``'tpu'``, ``'cuda'``, ``'rocm'``, or ``'interpret'`` (a Pallas kernel run in interpret mode on a CPU:
only what the kernel computes is checked, not hardware limits).

A method's ``impl`` execution setting is a name, an ordered list of names (a tuple, or a comma string
``'pallas,xla'``), or ``'auto'`` (the platform's ordered list). :func:`select` is the only place that turns it into
a choice: the first candidate with no reasons wins; an explicitly named candidate that refuses, when nothing after
it serves, raises :class:`KernelUnsupportedError` listing each candidate's reasons; a candidate that ``'auto'`` or
a list skips is logged once (INFO, logger ``longctx.attention.dispatch``) with its reasons. A Pallas kernel on a
CPU runs only where named (interpret mode, slow, for tests; a warning says so); ``'auto'`` never takes it there.

Determinism: where ``XLA_FLAGS`` asks XLA for deterministic GPU results (``--xla_gpu_deterministic_ops=true`` or
``--xla_gpu_exclude_nondeterministic_ops=true``, JAX's switch, which also makes cuDNN's attention backward
deterministic), an implementation that sums with atomic adds on the platform (``atomics``: their float32 order
varies from run to run) refuses the call: ``'auto'`` takes the next one, a named one raises with the reason.

Exact attention's fused kernels from outside the project (cuDNN on GPUs, splash on TPUs) are dense's
implementations ``cudnn`` and ``splash``: ``longctx/attention/dense/platform.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

ALL_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
PLATFORM_DEFAULT = 0  # an execution knob set to this takes its implementation's default for the platform
logger = logging.getLogger(__name__)
_logged: set[str] = set()
# what select chose since the last forget_chosen(): method -> {implementation name: (platform, Pallas kernel)}
_chosen: dict[str, dict[str, tuple[str, bool]]] = {}


class KernelUnsupportedError(ValueError):
    """An explicitly named implementation cannot serve the call; the message lists every reason."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One named way of computing a method.

    name:      what ``impl`` (or the method's own setting, ``config``) calls it.
    platforms: where it runs compiled. A ``kernel`` (Pallas) also runs on a CPU in interpret mode when named.
    dtypes:    input dtypes it takes (names, e.g. ``'float32'``); None: any.
    reasons:   ``reasons(platform, **shapes) -> list[str]``: anything else it refuses (shapes, budgets, options).
    kernel:    a Pallas kernel (interpret mode on a CPU, never chosen there by 'auto').
    config:    the execution settings that select it (tests and benchmarks build the core with them).
    test_config: settings that make it exercise its own structure at test lengths (e.g. small tiles).
    auto:      platform -> rank: where ``'auto'`` tries it, lower ranks first (absent platform: never by 'auto').
    prefer:    ``prefer(platform, **shapes) -> bool``: 'auto' tries it only for calls where this holds (None:
               always). Unlike ``reasons`` this is a preference: a named implementation ignores it.
    code:      the :class:`Runner` subclass that computes it (the one calling convention: ``code.build(...)(core,
               call) -> Result``).
    directions: the attention directions it computes ('causal', 'bidirectional').
    defaults:  execution key -> {platform: value}: the per-platform defaults of the knobs this implementation reads
               (tiles, budgets, chunks). A knob configured as ``0`` (:data:`PLATFORM_DEFAULT`) takes the value for
               the platform it runs on (:meth:`setting`), so a checkpoint trained on one platform runs with the other
               platform's tuning and a knob tuned for XLA:CPU never drives a GPU path. ``'interpret'`` (a kernel
               on a CPU) takes the ``'cpu'`` value; a platform not listed takes ``'default'``.
    atomics:   platforms where it adds results with atomic adds (a gradient summed over programs that run
               concurrently: bitwise results vary from run to run); it refuses there when XLA is asked for
               deterministic results (:func:`deterministic_requested`).
    slow_in_interpret: a kernel whose interpret mode on a CPU takes a minute or more per test case (Mosaic GPU's
               simulates shared memory and barriers): the shared test suites run it with ``-m slow`` only.
    """

    name: str
    platforms: tuple[str, ...] = ALL_PLATFORMS
    dtypes: tuple[str, ...] | None = None
    reasons: Callable[..., list[str]] | None = None
    kernel: bool = False
    config: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    test_config: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    auto: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    prefer: Callable[..., bool] | None = dataclasses.field(default=None, hash=False, compare=False)
    code: Any = dataclasses.field(default=None, hash=False, compare=False)
    directions: tuple[str, ...] = ("causal", "bidirectional")
    defaults: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    slow_in_interpret: bool = False
    atomics: tuple[str, ...] = ()

    def setting(self, key: str, value, platform: str):
        """The value execution setting ``key`` runs with on ``platform``: ``value`` as configured, or, when it is
        :data:`PLATFORM_DEFAULT` and this implementation declares a default for ``key``, that platform's."""
        if key not in self.defaults or isinstance(value, bool) or value != PLATFORM_DEFAULT:
            return value
        table = self.defaults[key]
        plat = "cpu" if platform == "interpret" else platform
        if plat in table:
            return table[plat]
        if "default" in table:
            return table["default"]
        raise KeyError(f"{self.name}: no default of {key!r} for {plat} (declared: {', '.join(table)})")

    def settings(self, cfg, platform: str) -> dict:
        """The knobs of :attr:`defaults` that ``cfg`` (the method's config, or the settings a call was given)
        holds, as they run on ``platform``."""
        return {key: self.setting(key, cfg[key], platform) for key in self.defaults if key in cfg}

    def unsupported_reasons(self, platform: str, **shapes) -> list[str]:
        """Why this implementation cannot serve a call with ``shapes`` on ``platform`` (empty: it can)."""
        out = []
        if platform == "interpret":
            if not self.kernel:
                out.append(f"{self.name} is not a Pallas kernel (no interpret mode)")
        elif platform not in self.platforms:
            out.append(f"{self.name} runs on {', '.join(self.platforms)}, not {platform}"
                       + (" (a Pallas kernel runs on cpu only in interpret mode, when named)"
                          if self.kernel and platform == "cpu" else ""))
        dtype = shapes.get("dtype")
        if self.dtypes is not None and dtype is not None:
            import numpy as np

            if np.dtype(dtype).name not in self.dtypes:
                out.append(f"dtype {np.dtype(dtype).name}: {self.name} takes {', '.join(self.dtypes)}")
        if platform in self.atomics and deterministic_requested():
            out.append(f"{self.name} adds its gradients with atomic adds on {platform} (their order varies from run "
                       f"to run) and XLA_FLAGS asks for deterministic results ({deterministic_requested()})")
        if self.reasons is not None:
            out.extend(self.reasons(platform, **shapes))
        return out


DETERMINISM_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def deterministic_requested(flags: str | None = None) -> str | None:
    """The flag of ``flags`` (default: the ``XLA_FLAGS`` environment variable JAX passes to XLA) that asks XLA for
    deterministic GPU results (``--xla_gpu_deterministic_ops``, ``--xla_gpu_exclude_nondeterministic_ops``, set
    true or bare), as written; None where none does (the last setting of a flag wins, as in XLA)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    on: dict[str, str | None] = {}
    for word in flags.split():
        name, _, value = word.lstrip("-").partition("=")
        if name in DETERMINISM_FLAGS:
            on[name] = word if value.lower() in ("", "true", "1") else None
    return next((w for w in on.values() if w), None)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The resolved implementation: ``name``, ``use_kernel`` (a Pallas kernel, else an XLA path),
    ``interpret`` (Pallas interpret mode), the ``platform`` name given to the kernel, and the ``reasons``
    the candidates before it were skipped (if any; the log line names each candidate)."""

    use_kernel: bool
    interpret: bool = False
    platform: str = "cpu"
    reasons: tuple[str, ...] = ()
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a core as every implementation of its method receives it (the one calling convention).

    inputs:    the method's prepared arrays and per-call values (a dict; the method's ``AttentionCore.prepare``
               documents its keys), the same for every implementation of the method.
    state:     the carried state (None: a pass from the row's start, or a direction without one).
    platform:  the platform the selection ran on (``'cpu'``, ``'cuda'``, ``'rocm'``, ``'tpu'``): a kernel lowers
               for it.
    interpret: a Pallas kernel run in interpret mode (named on a CPU).
    key:       the call's randomness (None: deterministic).
    """

    inputs: dict
    state: Any = None
    platform: str = "cpu"
    interpret: bool = False
    key: Any = None


@dataclasses.dataclass(frozen=True)
class Result:
    """What an implementation returns: the output, the new state (None where the direction has none, or where the
    method's ``finish`` builds it from ``extras``), and ``extras`` (a dict: what the core's ``finish`` needs
    beyond the output, e.g. codes and statistics)."""

    out: Any
    state: Any = None
    extras: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Runner:
    """An implementation as it runs: a frozen object whose fields are the execution settings it reads (tiles,
    budgets, routes), built from the method's execution section for the platform the selection ran on
    (:meth:`build`: a knob at :data:`PLATFORM_DEFAULT` takes its declaration's value there), and one call
    signature for every implementation of every method: ``runner(core, call) -> Result``. A declaration's
    ``code`` is a Runner subclass; the core runs prepare -> select -> call -> finish
    (``AttentionCore.__call__``)."""

    @classmethod
    def build(cls, declaration: "Implementation", cfg, platform: str) -> "Runner":
        """The runner with each field read from ``cfg`` (the method's config) as it runs on ``platform``
        (``declaration.setting``); a field ``cfg`` lacks keeps its default."""
        kw = {f.name: declaration.setting(f.name, cfg[f.name], platform)
              for f in dataclasses.fields(cls) if f.name in cfg}
        return cls(**kw)

    def __call__(self, core, call: Call) -> Result:
        raise NotImplementedError


def built(implementations: Sequence["Implementation"], choice: "Choice", cfg) -> Runner:
    """The runner of the implementation ``choice`` names, built from ``cfg`` (the method's execution settings) for
    the platform the selection ran on."""
    decl = by_name(implementations)[choice.name]
    return decl.code.build(decl, cfg, choice.platform)


def run_selected(impl, implementations: Sequence["Implementation"], cfg, core, call: Call, *, method: str,
                 **shapes) -> Result:
    """:func:`select` over ``implementations`` for ``impl`` on ``call.platform``, then the chosen declaration's
    runner built from ``cfg`` and called: the path of a method's function-level entry (one used without a core's
    ``__call__``, e.g. exact attention inside another method's layer)."""
    choice = select(impl, implementations, method=method, platform=call.platform, **shapes)
    return built(implementations, choice, cfg)(core, dataclasses.replace(call, platform=choice.platform, interpret=choice.interpret))


def current_platform() -> str:
    """The default backend as a kernel platform name: 'cpu' | 'tpu' | 'cuda' | 'rocm'."""
    backend = jax.default_backend()
    if backend == "gpu":
        devs = jax.devices()
        return "rocm" if devs and "rocm" in getattr(devs[0].client, "platform_version", "").lower() else "cuda"
    return backend


def cuda_compute_capability() -> str | None:
    """The first local CUDA device's compute capability (a string like ``"9.0"``), None where there is none (a
    Hopper-only kernel's reasons ask it where the call does not say)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return getattr(devices[0], "compute_capability", None) if devices else None


def hopper(platform: str) -> bool:
    """Whether ``platform`` is a Hopper GPU (cuda, compute capability 9.x), where ``'auto'`` takes the Mosaic GPU
    kernels and never a Triton one (JAX deprecated its Pallas Triton backend; a kernel without a Mosaic GPU form
    leaves the call to XLA there). A cuda call with no device to ask (an export for cuda from a CPU host) counts as
    Hopper: the GPUs the project's kernels are written for."""
    if platform != "cuda":
        return False
    cc = cuda_compute_capability()
    return cc is None or str(cc[0] if isinstance(cc, tuple) else cc).split(".")[0] == "9"


def not_on_hopper(prefer: Callable[..., bool] | None = None) -> Callable[..., bool]:
    """A Triton kernel's ``prefer``: never on Hopper (:func:`hopper`; named, it still runs there), elsewhere
    ``prefer`` (None: always)."""

    def run(platform, **shapes) -> bool:
        return not hopper(platform) and (prefer is None or prefer(platform, **shapes))

    return run


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def chosen() -> dict[str, dict[str, tuple[str, bool]]]:
    """What :func:`select` chose since :func:`forget_chosen` (selection runs when a program is traced): method ->
    {implementation: (platform, whether it is a Pallas kernel)}. The trainer names them after compiling its step,
    and names the kernels among them when the step fails to compile."""
    return {m: dict(v) for m, v in _chosen.items()}


def forget_chosen() -> None:
    _chosen.clear()


def kernels_line(choices: dict[str, dict[str, tuple[str, bool]]], others: dict[str, tuple[str, ...]]) -> str | None:
    """A line naming the Pallas kernels among ``choices`` (:func:`chosen`) compiled for an accelerator and, per
    method, ``others``: the implementations its ``impl`` can name instead; None where there are none (XLA paths
    only, or interpret mode)."""
    named = [(m, n) for m, v in sorted(choices.items()) for n, (plat, kernel) in v.items()
             if kernel and plat not in ("cpu", "interpret")]
    if not named:
        return None
    ways = "; ".join(f"{m}: {', '.join(others.get(m, ())) or 'none'}" for m in dict.fromkeys(m for m, _ in named))
    return ("note: the step compiles our Pallas kernels (" + ", ".join(f"{m}: {n}" for m, n in named)
            + "); --config.execution.attention.<method>.impl names another implementation (" + ways + ")")


def parse_impl(impl) -> tuple[str, ...]:
    """``impl`` as an ordered tuple of names: a name, a comma string ``'a,b'`` or a tuple/list of names."""
    if isinstance(impl, str):
        names = tuple(s.strip() for s in impl.split(","))
    elif isinstance(impl, (tuple, list)):
        names = tuple(str(s).strip() for s in impl)
    else:
        raise ValueError(f"impl={impl!r}: a name, a comma-separated string or a list of names")
    if not names or any(not n for n in names):
        raise ValueError(f"impl={impl!r}: an empty name")
    if "auto" in names and len(names) > 1:
        raise ValueError(f"impl={impl!r}: 'auto' stands alone (it is the platform's whole ordered list)")
    return names


def impl_problem(impl, allowed: Sequence[str]) -> str | None:
    """None when ``impl`` is 'auto' or names only ``allowed`` implementations; else what is wrong."""
    try:
        names = parse_impl(impl)
    except ValueError as e:
        return str(e)
    bad = [n for n in names if n != "auto" and n not in allowed]
    if bad:
        return f"impl={impl!r}: unknown {', '.join(map(repr, bad))}; allowed: {', '.join(allowed)}, auto, or a list"
    return None


def by_name(implementations: Sequence[Implementation]) -> dict[str, Implementation]:
    return {i.name: i for i in implementations}


def auto_order(implementations: Sequence[Implementation], platform: str, **shapes) -> tuple[str, ...]:
    """The 'auto' list on ``platform`` from the declarations: the implementations whose ``auto`` names the platform
    and whose ``prefer`` (if any) holds for ``shapes``, by rank (ties in declared order); never a kernel on a CPU."""
    ranked = [(i.auto[platform], n, i.name) for n, i in enumerate(implementations)
              if platform in i.auto and not (i.kernel and platform == "cpu")
              and (i.prefer is None or i.prefer(platform, **shapes))]
    return tuple(name for _, _, name in sorted(ranked))


@functools.lru_cache(maxsize=None)
def _module_declarations(package: str) -> tuple[Implementation, ...]:
    """Every ``IMPLEMENTATIONS`` entry of ``package``'s modules, modules in name order, the kernels last (scanned
    once)."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    out: list[Implementation] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        out.extend(getattr(importlib.import_module(f"{package}.{info.name}"), "IMPLEMENTATIONS", ()))
    return tuple(sorted(out, key=lambda i: i.kernel))


def declared(package: str, *, first: Sequence[Implementation] = (), causal: bool | None = None
             ) -> tuple[Implementation, ...]:
    """The implementations declared by the modules of ``package`` (each module's ``IMPLEMENTATIONS`` tuple, the
    modules in name order, the Pallas kernels last), after ``first`` (the reference); with ``causal`` given, those
    of that direction only.
    Names must be unique."""
    out = list(first) + list(_module_declarations(package))
    if causal is not None:
        out = [i for i in out if ("causal" if causal else "bidirectional") in i.directions]
    names = [i.name for i in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{package}: implementation names declared twice: {', '.join(dup)}")
    return tuple(out)


def select(impl, implementations: Sequence[Implementation], *, method: str, platform: str, **shapes) -> Choice:
    """Pick one of ``implementations`` for ``impl`` (a name, a list or 'auto'; module docstring) on ``platform``
    (given by the caller: a core selects for the platform it was built for, ``AttentionCore.platform``). 'auto'
    is :func:`auto_order` of the declarations. ``shapes`` go to every candidate's ``unsupported_reasons`` and
    ``prefer``."""
    plat = platform
    table = by_name(implementations)
    names = parse_impl(impl)
    explicit = names != ("auto",)
    if not explicit:
        names = auto_order(implementations, plat, **shapes)
        if not names:
            raise KernelUnsupportedError(f"{method}: impl='auto' has no implementation declared for {plat}")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"{method}: impl={impl!r}: unknown {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(table)}, auto, or a list")
    skipped: list[str] = []
    flat: list[str] = []
    for n in names:
        cand = table[n]
        interpret = cand.kernel and plat == "cpu"
        if interpret and not explicit:
            why = ["no compiled Pallas on cpu (the kernel runs there only in interpret mode, when named)"]
        else:
            why = cand.unsupported_reasons("interpret" if interpret else plat, **shapes)
        if why:
            skipped.append(f"{n}: " + "; ".join(why))
            flat.extend(why)
            continue
        if skipped:
            _log_once(f"{method}: impl={impl!r} uses {n} on {plat}; skipped " + " | ".join(skipped))
        if interpret:
            warnings.warn(f"{method}: impl={impl!r} on cpu runs the Pallas kernel {n} in interpret mode (slow)",
                          stacklevel=3)
        _chosen.setdefault(method, {})[n] = (plat, cand.kernel)
        return Choice(cand.kernel, interpret=interpret, platform=plat, reasons=tuple(flat), name=n)
    raise KernelUnsupportedError(f"{method}: impl={impl!r}: no implementation serves this call on {plat}: "
                                 + " | ".join(skipped))


__all__ = ["ALL_PLATFORMS", "PLATFORM_DEFAULT", "Call", "Choice", "Implementation", "Result", "Runner", "built", "run_selected", "KernelUnsupportedError", "auto_order", "by_name", "chosen", "forget_chosen", "kernels_line",
           "current_platform", "declared", "deterministic_requested", "hopper", "not_on_hopper", "impl_problem", "parse_impl", "select"]

"""KDEformer's XLA:CPU implementations: the tiled estimator of ``xla.py`` with the softmax's division and the
band's rescaling as ``longctx.xla_cpu.scale_rows`` (an einsum whose gradient over batch-1 rows is a dot, where
the broadcasting multiply's is a slow multiply-and-reduce on XLA:CPU; docs/DESIGN.md, "Where the time goes").

Bidirectional: ``xla_cpu``. Causal: one implementation per heavy route (xla.py's docstring: the routes are
portable, these are the same routes with XLA:CPU's products), ``gather``, ``scores`` and ``band`` (a call with a
state gathers); on a CPU ``auto`` takes ``scores`` while the cache holds at most ``heavy_scores_max_len`` tokens,
else ``band`` for a full pass and ``gather`` for a call with a state (:func:`auto_route`, the ``prefer`` of each
declaration below: the layer's selection shapes give ``cache_len``, ``full_pass`` and the configured
``heavy_scores_max_len``). Each is a runner whose fields are the knobs it reads (:class:`Gather`, :class:`Scores`,
:class:`Band`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from longctx.attention import dispatch
from longctx.attention.dispatch import Implementation
from longctx.attention.kdeformer import xla
from longctx.xla_cpu import scale_rows


@dataclasses.dataclass(frozen=True)
class Bidirectional(dispatch.Runner):
    """``xla_cpu``: the bidirectional tiled estimator with XLA:CPU's row scaling; no execution knob."""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        return dispatch.Result(xla.bidirectional(x["q"], x["k"], x["v"], x["W"], call.key, core.bidir_opts,
                                                 row_scale=scale_rows, segment_ids=x["segment_ids"]))


@dataclasses.dataclass(frozen=True)
class Gather(dispatch.Runner):
    """The causal estimator (§4), heavy logits by the 'gather' route. Every route reads ``tile_budget``; 'auto'
    picks among the routes by ``heavy_scores_max_len`` (the declarations' ``prefer``)."""

    route: ClassVar[str] = "gather"
    tile_budget: int
    heavy_scores_max_len: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        opts = dataclasses.replace(xla.with_knobs(core.causal_opts, self), heavy_impl=self.route)
        return xla.run_causal(call, opts, row_scale=scale_rows)


@dataclasses.dataclass(frozen=True)
class Scores(Gather):
    """The causal estimator (§4), heavy logits by the 'scores' route."""

    route: ClassVar[str] = "scores"


@dataclasses.dataclass(frozen=True)
class Band(Gather):
    """The causal estimator (§4), heavy logits by the 'band' route (a call with a state gathers), tiles of
    ``heavy_band_block`` sorted queries."""

    route: ClassVar[str] = "band"
    heavy_band_block: int


def auto_route(cache_len: int, full_pass: bool, heavy_scores_max_len: int) -> str:
    """The route ``auto`` takes on a CPU for a cache of ``cache_len`` tokens (xla.py's 'auto' rule)."""
    return xla.route_for("auto", heavy_scores_max_len, cache_len, full_pass)


def _prefers(name: str):
    """'auto' on a CPU tries the route ``name`` only for the calls whose cache length makes it :func:`auto_route`'s
    (``heavy_scores_max_len`` at the value the implementation runs with there, as its runner is built)."""
    def prefer(platform, *, cache_len: int, full_pass: bool, heavy_scores_max_len: int, **_) -> bool:
        max_len = _DECLARED[name].setting("heavy_scores_max_len", heavy_scores_max_len, platform)
        return auto_route(cache_len, full_pass, max_len) == name

    return prefer


def _defaults(*keys):
    """The CPU values (xla.DEFAULTS['cpu']) of the knobs an implementation reads. These implementations run only on
    a CPU; 'default' is the same value, the answer for any other platform name asked (never run there)."""
    return {k: {"cpu": xla.DEFAULTS[k]["cpu"], "default": xla.DEFAULTS[k]["cpu"]} for k in keys}


_CPU = ("cpu",)
IMPLEMENTATIONS = (
    Implementation("xla_cpu", platforms=_CPU, config={"impl": "xla_cpu"}, auto={"cpu": 0}, code=Bidirectional,
                   directions=("bidirectional",)),
    Implementation("gather", platforms=_CPU, config={"impl": "gather"}, auto={"cpu": 0}, prefer=_prefers("gather"),
                   code=Gather, directions=("causal",), defaults=_defaults("tile_budget", "heavy_scores_max_len")),
    Implementation("scores", platforms=_CPU, config={"impl": "scores"}, auto={"cpu": 0}, prefer=_prefers("scores"),
                   code=Scores, directions=("causal",), defaults=_defaults("tile_budget", "heavy_scores_max_len")),
    Implementation("band", platforms=_CPU, config={"impl": "band"}, auto={"cpu": 0}, prefer=_prefers("band"),
                   code=Band, directions=("causal",), test_config={"heavy_band_block": 8},
                   defaults=_defaults("tile_budget", "heavy_scores_max_len", "heavy_band_block")),
)
_DECLARED = {i.name: i for i in IMPLEMENTATIONS}

__all__ = ["IMPLEMENTATIONS", "Band", "Bidirectional", "Gather", "Scores", "auto_route"]

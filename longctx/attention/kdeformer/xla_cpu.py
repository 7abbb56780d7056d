"""KDEformer's XLA:CPU implementations: the tiled estimator of ``xla.py`` with the softmax's division and the
band's rescaling as ``longctx.xla_cpu.scale_rows`` (an einsum whose gradient over batch-1 rows is a dot, where
the broadcasting multiply's is a slow multiply-and-reduce on XLA:CPU; docs/DESIGN.md, "Where the time goes").

Bidirectional: ``xla_cpu``. Causal: one implementation per heavy route (xla.py's docstring: the routes are
portable, these are the same routes with XLA:CPU's products), ``gather``, ``scores`` and ``band`` (a call with a
state gathers); on a CPU ``auto`` takes ``scores`` while the cache holds at most ``heavy_scores_max_len`` tokens,
else ``band`` for a full pass and ``gather`` for a call with a state (:func:`auto_route`, the ``prefer`` of each
declaration below: the layer passes ``cache_len``, ``full_pass`` and ``opts`` to ``dispatch.select``).
"""

from __future__ import annotations

import dataclasses

from longctx.attention.dispatch import Implementation
from longctx.attention.kdeformer import xla
from longctx.attention.kdeformer.common import BidirOptions, CausalOptions, platform_options
from longctx.xla_cpu import scale_rows


def bidirectional(q, k, v, W, key_s, opts: BidirOptions):
    return xla.bidirectional(q, k, v, W, key_s, opts, row_scale=scale_rows)


def _route(name: str):
    def causal(q, k, v, W, key_s, opts: CausalOptions, state=None):
        return xla.causal(q, k, v, W, key_s, dataclasses.replace(opts, heavy_impl=name), state, row_scale=scale_rows)

    causal.__name__ = causal.__qualname__ = name
    causal.__doc__ = f"The causal estimator (§4), heavy logits by the '{name}' route."
    return causal


gather, scores, band = _route("gather"), _route("scores"), _route("band")


def auto_route(cache_len: int, full_pass: bool, opts: CausalOptions) -> str:
    """The route ``auto`` takes on a CPU for a cache of ``cache_len`` tokens (xla.py's 'auto' rule)."""
    return xla.heavy_route_of(dataclasses.replace(opts, heavy_impl="auto"), cache_len, full_pass)


def _prefers(name: str):
    """'auto' on a CPU tries the route ``name`` only for the calls whose cache length makes it :func:`auto_route`'s
    (``heavy_scores_max_len`` at the value the implementation runs with there)."""
    def prefer(platform, *, cache_len: int, full_pass: bool, opts: CausalOptions, **_) -> bool:
        return auto_route(cache_len, full_pass, platform_options(opts, _DECLARED[name], platform)) == name

    return prefer


def _defaults(*keys):
    """The CPU values (xla.DEFAULTS['cpu']) of the knobs an implementation reads. These implementations run only on
    a CPU; 'default' is the same value, the answer for any other platform name asked (never run there)."""
    return {k: {"cpu": xla.DEFAULTS[k]["cpu"], "default": xla.DEFAULTS[k]["cpu"]} for k in keys}


_CPU = ("cpu",)
# every route reads tile_budget, and 'auto' picks among them by heavy_scores_max_len; 'band' tiles by heavy_band_block
IMPLEMENTATIONS = (
    Implementation("xla_cpu", platforms=_CPU, config={"impl": "xla_cpu"}, auto={"cpu": 0}, code=bidirectional,
                   directions=("bidirectional",)),
    Implementation("gather", platforms=_CPU, config={"impl": "gather"}, auto={"cpu": 0}, prefer=_prefers("gather"),
                   code=gather, directions=("causal",), defaults=_defaults("tile_budget", "heavy_scores_max_len")),
    Implementation("scores", platforms=_CPU, config={"impl": "scores"}, auto={"cpu": 0}, prefer=_prefers("scores"),
                   code=scores, directions=("causal",), defaults=_defaults("tile_budget", "heavy_scores_max_len")),
    Implementation("band", platforms=_CPU, config={"impl": "band"}, auto={"cpu": 0}, prefer=_prefers("band"),
                   code=band, directions=("causal",), test_config={"heavy_band_block": 8},
                   defaults=_defaults("tile_budget", "heavy_scores_max_len", "heavy_band_block")),
)
_DECLARED = {i.name: i for i in IMPLEMENTATIONS}

__all__ = ["IMPLEMENTATIONS", "auto_route", "band", "bidirectional", "gather", "scores"]

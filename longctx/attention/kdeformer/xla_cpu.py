"""KDEformer's XLA:CPU implementations: the tiled estimator of ``xla.py`` with the softmax's division and the
band's rescaling as ``longctx.xla_cpu.scale_rows`` (an einsum whose gradient over batch-1 rows is a dot, where
the broadcasting multiply's is a slow multiply-and-reduce on XLA:CPU; docs/DESIGN.md, "Where the time goes").

Bidirectional: ``xla_cpu``. Causal: one implementation per heavy route (xla.py's docstring), ``gather``,
``scores`` and ``band`` (a call with a state gathers); on a CPU ``auto`` takes ``scores`` while the cache holds
at most ``heavy_scores_max_len`` tokens, else ``band`` for a full pass and ``gather`` for a call with a state.
"""

from __future__ import annotations

import dataclasses

from longctx.attention.kdeformer import xla
from longctx.attention.kdeformer.common import BidirOptions, CausalOptions
from longctx.xla_cpu import scale_rows


def bidirectional(q, k, v, W, key_s, opts: BidirOptions):
    return xla.bidirectional(q, k, v, W, key_s, opts, rescale_rows=scale_rows)


def _route(name: str):
    def causal(q, k, v, W, key_s, opts: CausalOptions, state=None):
        return xla.causal(q, k, v, W, key_s, dataclasses.replace(opts, heavy_impl=name), state, rescale_rows=scale_rows)

    causal.__name__ = causal.__qualname__ = name
    causal.__doc__ = f"The causal estimator (§4), heavy logits by the '{name}' route."
    return causal


gather, scores, band = _route("gather"), _route("scores"), _route("band")


def auto_route(cache_len: int, full_pass: bool, opts: CausalOptions) -> str:
    """The route ``auto`` takes on a CPU for a cache of ``cache_len`` tokens (xla.py's 'auto' rule)."""
    return xla.heavy_route_of(dataclasses.replace(opts, heavy_impl="auto"), cache_len, full_pass)


__all__ = ["auto_route", "band", "bidirectional", "gather", "scores"]

"""FMA-linear's coarse statistics (docs/methods/fma.md §2.5): the softmax statistics of one level's coarse scores
(:func:`row_stats`) and their fold into the running coarse part (:func:`combine`, joint or per-level
normalisation), shared by the full pass (``xla.py``) and the streamed step (``state.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.fma.options import FMAOptions
from pallas_kernels.fma_blocks_ref import NEG


def combine(acc, stats, opts: FMAOptions):
    """Fold one level's per-query stats (M, num, den) into the running coarse part."""
    M, num, den = stats
    if opts.normalization == "per_level":
        out = num / jnp.where(den > 0, den, 1.0)[..., None]
        return ("normed", out) if acc is None else ("normed", acc[1] + out)
    if acc is None:
        return ("stats", M, num, den)
    _, Ma, na, da = acc
    Mn = jnp.maximum(Ma, M)
    sa, sb = jnp.exp(Ma - Mn), jnp.exp(M - Mn)
    return ("stats", Mn, na * sa[..., None] + num * sb[..., None], da * sa + den * sb)


def row_stats(s, valid, vc, drop_key, opts: FMAOptions):
    """Softmax statistics of coarse scores s [..., C] with values vc [..., C, f] (valid: bool mask)."""
    s = jnp.where(valid, s, NEG)
    M = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    e = jnp.where(valid, jnp.exp(s - M[..., None]), 0.0)
    den = jnp.sum(e, axis=-1)
    if drop_key is not None and opts.attn_dropout > 0.0:
        keep = 1.0 - opts.attn_dropout
        e = jnp.where(jax.random.bernoulli(drop_key, keep, e.shape), e / keep, 0.0)
    return M, e, den


__all__ = ["combine", "row_stats"]

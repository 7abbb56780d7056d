"""The decoding state of a causal Transformer-VQ core (docs/methods/transformer_vq.md §2.7), shared by every
implementation (each returns it in this layout)::

    {"pos": int32[],                       # tokens seen
     "band_k": [B, H, M, Dk], "band_v": [B, H, M, Dv], "band_z": int32[B, H, M],
     "agg_mu": [B, H, S, Dv], "agg_n": [B, H, S]}

band = the newest M tokens (right-aligned; slot j holds position pos - M + j, invalid if < 0), agg = the running
mean of the values per code and the count of every older token (float32 or wider: statistics). The per-code
summaries and their merge are the kernel's reference's (``pallas_kernels.vq_cache_ref``: ``code_summary``,
``merge``), which the kernel's final state is tested against.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.vq_cache_ref import code_summary, merge


def empty_state(B, H, M, S, Dk, Dv, dtype=jnp.float32):
    """The state of an empty prefix: no tokens, an invalid band, an empty cache."""
    return {
        "pos": jnp.zeros((), jnp.int32),
        "band_k": jnp.zeros((B, H, M, Dk), dtype),
        "band_v": jnp.zeros((B, H, M, Dv), dtype),
        "band_z": jnp.zeros((B, H, M), jnp.int32),
        "agg_mu": jnp.zeros((B, H, S, Dv), dtype),
        "agg_n": jnp.zeros((B, H, S), dtype),
    }


def compose(a, b, *, M: int, S: int):
    """The state after ``a``'s tokens then ``b``'s, ``b`` run from the empty state with at least M tokens: ``a``'s
    band leaves the band when ``b``'s tokens arrive and joins the cache, merged count-weighted (associative)."""
    valid = a["pos"] - M + jnp.arange(M) >= 0
    band = code_summary(a["band_z"], a["band_v"], valid, S)
    agg_mu, agg_n = merge(merge((a["agg_mu"], a["agg_n"]), band), (b["agg_mu"], b["agg_n"]))
    return {**b, "pos": a["pos"] + b["pos"], "agg_mu": agg_mu, "agg_n": agg_n}


__all__ = ["compose", "empty_state"]

"""The ``chunked`` implementation: the reference's biased softmax over query chunks (portable JAX, plain einsums).

Queries run in chunks of ``query_chunk`` rows under ``lax.map``, each chunk rematerialized in the backward pass,
so the [R, R] logits are never held whole: peak memory O(query_chunk * R) per head instead of O(R^2). Each chunk
is :func:`reference.biased_attention` on fp32 keys and values cast once outside the loop (their gradients
accumulate across chunks in fp32).

Declares ``chunked`` (:data:`IMPLEMENTATIONS`, the encoder's direction): ``impl='auto'`` takes it first on every
platform when ``query_chunk`` > 0 (then the reference), so configs written before ``impl`` existed (only
``query_chunk``) select what they computed then.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.dispatch import ALL_PLATFORMS, Implementation
from longctx.attention.vcc.reference import biased_attention


def chunked_attention(q, k, v, key_bias, *, query_chunk: int):
    """:func:`biased_attention` of q, k: [B, H, R, D], v: [B, H, R, Dv], key_bias: [B, R] in query chunks of
    ``query_chunk`` (> 0) rows; rows that fit one chunk run as one call."""
    B, H, R, D = q.shape
    if R <= query_chunk:
        return biased_attention(q, k, v, key_bias)
    kf, vf, bias = k.astype(jnp.float32), v.astype(jnp.float32), key_bias.astype(jnp.float32)

    def one(qc):
        return biased_attention(qc, kf, vf, bias)

    pad = (-R) % query_chunk
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    n = qp.shape[2] // query_chunk
    qb = qp.reshape(B, H, n, query_chunk, D).transpose(2, 0, 1, 3, 4)
    out = jax.lax.map(jax.checkpoint(one), qb)  # [n, B, H, c, Dv]
    out = out.transpose(1, 2, 0, 3, 4).reshape(B, H, n * query_chunk, -1)[:, :, :R]
    return out.astype(v.dtype)


def _chunked_reasons(platform, *, query_chunk: int = 0, **_):
    if query_chunk <= 0:
        return [f"chunked needs query_chunk > 0 (query_chunk={query_chunk}: all queries at once is the reference)"]
    return []


def _chunks_set(platform, *, query_chunk: int = 0, **_) -> bool:
    """'auto' takes chunked where ``query_chunk`` > 0 (0: all queries at once, the reference)."""
    return query_chunk > 0


IMPLEMENTATIONS = (
    Implementation("chunked", reasons=_chunked_reasons, config={"impl": "chunked"}, test_config={"query_chunk": 16},
                   auto={p: 0 for p in ALL_PLATFORMS}, prefer=_chunks_set, code=chunked_attention,
                   directions=("bidirectional",)),
)


__all__ = ["IMPLEMENTATIONS", "chunked_attention"]

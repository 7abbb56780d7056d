"""Exact softmax attention, the reference: one masked softmax over the whole score matrix.

Vaswani et al., *Attention Is All You Need* (arXiv:1706.03762), eq. (1), ``softmax(q kᵀ / √d) v``, as
docs/methods/dense.md "What it computes" states it: for query i, ``o_i = Σ_{j∈V(i)} softmax_j(s_ij) v_j`` with
``s_ij = q_i·k_j / √d`` and ``V(i)`` the valid keys (causal: those at a position not after i's; with a sliding
``window`` W > 0 only those fewer than W positions away: causal ``i - W < j <= i``, bidirectional ``|i - j| < W``, as
Longformer's and Mistral's local attention). Visibility comes from
explicit absolute positions, so a slice attended with its KV cache sees exactly what the full pass would. Scores and
the normaliser are float32 whatever the inputs' dtype; masked scores are a finite ``NEG_INF``, and a query that sees
no key outputs 0. Every other implementation of ``dense`` equals this one (tests/attention/test_implementations.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.models.precision import einsum_f32

NEG_INF = -1e30


def positions_mask(q_pos, k_pos, k_valid, causal: bool, window: int = 0):
    """[Tq, Tk] boolean: key visible to query (``V(i)``; ``window`` > 0: only keys fewer than ``window`` positions
    away)."""
    mask = k_valid[None, :]
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    if window:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
        if not causal:
            mask = mask & (k_pos[None, :] - q_pos[:, None] < window)
    return mask


def naive_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, window: int = 0):
    """Exact attention of q, k [B, H, T, D], v [B, H, T, Dv] with explicit positions (``q_pos`` [Tq], ``k_pos`` and
    ``k_valid`` [Tk]; ``window``: the sliding window, 0 for none); the max subtracted inside the exponent is only for
    range (its gradient is zero)."""
    scale = q.shape[-1] ** -0.5
    s = einsum_f32("bhqd,bhkd->bhqk", q, k.astype(q.dtype)) * scale  # compute-dtype operands, fp32 statistics
    mask = positions_mask(q_pos, k_pos, k_valid, causal, window)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(m)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = einsum_f32("bhqk,bhkd->bhqd", p.astype(v.dtype), v) / jnp.maximum(den, 1e-30)
    return out.astype(v.dtype)


__all__ = ["NEG_INF", "naive_attention", "positions_mask"]

"""Exact softmax attention, the reference: one masked softmax over the whole score matrix.

Vaswani et al., *Attention Is All You Need* (arXiv:1706.03762), eq. (1), ``softmax(q kᵀ / √d) v``, as
docs/methods/dense.md "What it computes" states it: for query i, ``o_i = Σ_{j∈V(i)} softmax_j(s_ij) v_j`` with
``s_ij = q_i·k_j / √d`` and ``V(i)`` the valid keys (causal: those at a position not after i's; with a sliding
``window`` W > 0 only those fewer than W positions away: causal ``i - W < j <= i``, bidirectional ``|i - j| < W``, as
Longformer's and Mistral's local attention), and for packed rows (``segment_ids``) only the keys of the query's own
document: ``seg(j) = seg(i)``, so each document of a row is attended exactly as if it were run alone (its positions
shifted by a constant, which the causal and window offsets do not see). Visibility comes from
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


def segments_mask(q_segment_ids, k_segment_ids):
    """[B, 1, Tq, Tk] boolean: key j in query i's document (``q_segment_ids`` [B, Tq], ``k_segment_ids`` [B, Tk])."""
    return q_segment_ids[:, None, :, None] == k_segment_ids[:, None, None, :]


def visible(q_pos, k_pos, k_valid, causal: bool, window: int = 0, q_segment_ids=None, k_segment_ids=None):
    """:func:`positions_mask` ([Tq, Tk]), and with segment ids also :func:`segments_mask` ([B, 1, Tq, Tk])."""
    mask = positions_mask(q_pos, k_pos, k_valid, causal, window)
    if q_segment_ids is not None:
        mask = mask & segments_mask(q_segment_ids, k_segment_ids)
    return mask


def naive_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, window: int = 0, q_segment_ids=None,
                    k_segment_ids=None):
    """Exact attention of q, k [B, H, T, D], v [B, H, T, Dv] with explicit positions (``q_pos`` [Tq], ``k_pos`` and
    ``k_valid`` [Tk]; ``window``: the sliding window, 0 for none; ``q_segment_ids`` [B, Tq] / ``k_segment_ids``
    [B, Tk]: a packed row's documents, None for one document); the max subtracted inside the exponent is only for
    range (its gradient is zero)."""
    scale = q.shape[-1] ** -0.5
    s = einsum_f32("bhqd,bhkd->bhqk", q, k.astype(q.dtype)) * scale  # compute-dtype operands, fp32 statistics
    mask = visible(q_pos, k_pos, k_valid, causal, window, q_segment_ids, k_segment_ids)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(m)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = einsum_f32("bhqk,bhkd->bhqd", p.astype(v.dtype), v) / jnp.maximum(den, 1e-30)
    return out.astype(v.dtype)


__all__ = ["NEG_INF", "naive_attention", "positions_mask", "segments_mask", "visible"]

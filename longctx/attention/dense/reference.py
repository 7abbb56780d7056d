"""Exact softmax attention, the reference: one masked softmax over the whole score matrix.

Vaswani et al., *Attention Is All You Need* (arXiv:1706.03762), eq. (1), ``softmax(q kᵀ / √d) v``, as
docs/methods/dense.md "What it computes" states it: for query i, ``o_i = Σ_{j∈V(i)} softmax_j(s_ij) v_j`` with
``s_ij = q_i·k_j / √d`` and ``V(i)`` the valid keys (causal: those at a position not after i's; with a sliding
``window`` W > 0 only those fewer than W positions away: causal ``i - W < j <= i``, bidirectional ``|i - j| < W``, as
Longformer's and Mistral's local attention), and for packed rows (``segment_ids``) only the keys of the query's own
document: ``doc(j) = doc(i)``, a document being a maximal run of equal segment ids
(``longctx.attention.base.document_starts``: an id that comes back after another is a new document, as in cuDNN's
packed layout), so each document of a row is attended exactly as if it were run alone (its positions shifted by a
constant, which the causal and window offsets do not see). Visibility comes from
explicit absolute positions, so a slice attended with its KV cache sees exactly what the full pass would. Scores and
the normaliser are float32 whatever the inputs' dtype; masked scores are a finite ``NEG_INF``, and a query that sees
no key outputs 0. Every other implementation of ``dense`` equals this one (tests/attention/test_implementations.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.base import document_starts
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


def document_ids(q_segment_ids, k_segment_ids):
    """(q [B, Tq], k [B, Tk]) int32: each token's document in the row of keys, numbered 1, 2, ... by a cumulative count
    of document starts (a document is a maximal run of equal ids, :func:`document_starts`), so two tokens share a
    document exactly when their numbers are equal. The queries are the last Tq keys (a full pass, or a KV cache's keys
    then the call's): their numbers are the keys'; ``q_segment_ids`` only gives Tq."""
    Tq, Tk = q_segment_ids.shape[1], k_segment_ids.shape[1]
    if Tq > Tk:
        raise ValueError(f"dense: {Tq} queries but {Tk} keys; packed queries are the last of the keys")
    k_segment_ids = k_segment_ids.astype(jnp.int32)
    opens = document_starts(k_segment_ids) == jnp.arange(Tk, dtype=jnp.int32)
    k_docs = jnp.cumsum(opens, axis=1, dtype=jnp.int32)
    return k_docs[:, Tk - Tq:], k_docs


def same_document(q_documents, k_documents):
    """[B, 1, Tq, Tk] boolean: equal document numbers (:func:`document_ids`)."""
    return q_documents[:, None, :, None] == k_documents[:, None, None, :]


def segments_mask(q_segment_ids, k_segment_ids):
    """[B, 1, Tq, Tk] boolean: key j in query i's document (``q_segment_ids`` [B, Tq], ``k_segment_ids`` [B, Tk]; a
    document is a maximal run of equal ids, :func:`document_ids`)."""
    return same_document(*document_ids(q_segment_ids, k_segment_ids))


def visible(q_pos, k_pos, k_valid, causal: bool, window: int = 0, q_documents=None, k_documents=None):
    """:func:`positions_mask` ([Tq, Tk]), and with document numbers (:func:`document_ids`, of the whole row: the
    tiles pass a block of them) also :func:`same_document` ([B, 1, Tq, Tk])."""
    mask = positions_mask(q_pos, k_pos, k_valid, causal, window)
    if q_documents is not None:
        mask = mask & same_document(q_documents, k_documents)
    return mask


def naive_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, window: int = 0, q_segment_ids=None,
                    k_segment_ids=None):
    """Exact attention of q, k [B, H, T, D], v [B, H, T, Dv] with explicit positions (``q_pos`` [Tq], ``k_pos`` and
    ``k_valid`` [Tk]; ``window``: the sliding window, 0 for none; ``q_segment_ids`` [B, Tq] / ``k_segment_ids``
    [B, Tk]: a packed row's documents, None for one document); the max subtracted inside the exponent is only for
    range (its gradient is zero). The products take q's dtype (the compute dtype: a KV cache stored wider is cast
    to it)."""
    scale = q.shape[-1] ** -0.5
    s = einsum_f32("bhqd,bhkd->bhqk", q, k.astype(q.dtype)) * scale  # compute-dtype operands, fp32 statistics
    docs = (None, None) if q_segment_ids is None else document_ids(q_segment_ids, k_segment_ids)
    mask = visible(q_pos, k_pos, k_valid, causal, window, *docs)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(m)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = einsum_f32("bhqk,bhkd->bhqd", p.astype(q.dtype), v.astype(q.dtype)) / jnp.maximum(den, 1e-30)
    return out.astype(v.dtype)


__all__ = ["NEG_INF", "document_ids", "naive_attention", "positions_mask", "same_document", "segments_mask",
           "visible"]

"""EVA's computation as the paper states it, over the whole sequence (docs/methods/eva.md; the spec's §2.3 and
§2.4, paper eq. 16 and App. D): the implementation ``reference`` every other EVA implementation must equal.

Phase A (§2.3): per chunk ``P_c`` of ``P`` contiguous tokens, the representative key
``k̂_c = LN_k(Linear(mean_{P_c} k))`` and the control-variate coefficient ``β_c = Σ_{m∈P_c} softmax_m(ℓ_{c,m}) v_m``,
``ℓ_{c,m} = s(ω_c·k_m − ½‖k_m‖²)``, one sample ``ω_c = µ_c + ε_c`` per chunk (``ω_c = µ_c`` when deterministic).
Phase B (§2.4, eq. 16): query ``n`` takes one softmax over its local logits ``s q_n·k_m + r(m − n)`` (``m`` in its
block's window ``E_n``; causal: ``m <= n``) and its chunk logits ``s q_n·k̂_c`` (causal: ``c < ⌊n/P⌋``; eq. 13's
``logsumexp_{m∈P_c} s q_n·k_m`` with ``chunk_logit='exact_lse'``), applied to ``[v_m ; β_c]``.

Plain autodiff, O(L²) logits: for tests and for reading beside the paper. The geometry, masks, bias, noise and
dropout draws are the shared definitions of ``common.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention.base import document_starts
from longctx.attention.eva.common import (
    NEG,
    EVAOptions,
    chunk_mask,
    chunk_noise,
    chunk_summaries,
    dropout_multipliers,
    dropout_seeds,
    geometry,
    local_mask,
    rpe_bias,
)


def eva_reference(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                  num_chunks: int):
    """q, k [B,H,L,d], v [B,H,L,dv] -> (out [B,H,L,dv] fp32, extras for ``common.state_from_forward``)."""
    B, H, L, d = q.shape
    s = d**-0.5
    L_pad, P, C, _ = geometry(opts, L, chunk_size, num_chunks)  # padded to whole blocks (§2.1)
    q, k, v = (jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, L_pad - L), (0, 0))) for x in (q, k, v))
    pos = np.arange(L_pad)
    valid = pos < L
    chunk_valid = valid.reshape(C, P)

    # Phase A (§2.3)
    per_chunk = lambda x: x.reshape(B, H, C, P, x.shape[-1])  # noqa: E731
    noise = None if noise_key is None else chunk_noise(noise_key, jnp.arange(C), B, H, d)
    k_hat, beta = chunk_summaries(per_chunk(q), per_chunk(k), per_chunk(v), chunk_valid, params, noise, opts, s)

    # Phase B (§2.4, eq. 16)
    qk = s * jnp.einsum("bhnd,bhmd->bhnm", q, k)
    a_loc = qk + rpe_bias(rpe_table, pos, pos, opts, s)[None] if opts.use_rpe else qk
    if opts.chunk_logit == "rep":
        a_ch = s * jnp.einsum("bhnd,bhcd->bhnc", q, k_hat)
    else:  # eq. 13: the chunk's exact log-mass
        a_ch = jax.nn.logsumexp(jnp.where(chunk_valid, qk.reshape(B, H, L_pad, C, P), NEG), axis=-1)
    mask = jnp.concatenate([local_mask(pos, pos, valid, opts),
                            chunk_mask(pos, jnp.arange(C), chunk_valid.any(-1), P, opts)], axis=-1)
    logits = jnp.where(mask, jnp.concatenate([a_loc, a_ch], axis=-1), NEG)
    p = jnp.where(mask, jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))), 0.0)
    den = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)  # empty rows (only if W = 0) give 0
    seeds = dropout_seeds(drop_key, opts, B, H)
    if seeds is not None:  # on the normalised weights, normaliser kept (§9.12)
        p = p * jnp.concatenate(dropout_multipliers(seeds, opts.attn_dropout, pos, pos, jnp.arange(C)), axis=-1)
    out = jnp.einsum("bhnm,bhmd->bhnd", p, jnp.concatenate([v, beta], axis=2)) / den
    return out[:, :, :L], {"k_hat": k_hat, "beta": beta, "P": P, "padded": (q, k, v)}


def document_positions(segment_ids):
    """(start, rel) int32 [B, T] of a packed row: the first position of each token's document (a maximal run of
    equal segment ids) and the token's position inside it. EVA's blocks, chunks, bias, noise and dropout draws
    of a packed row are those of its documents alone: all indexed by ``rel``."""
    start = document_starts(segment_ids)
    return start, jnp.arange(segment_ids.shape[1], dtype=jnp.int32) - start


def eva_reference_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                         segment_ids):
    """:func:`eva_reference` of a packed row (``segment_ids`` [B, T]): each document computed as if alone, its
    blocks and chunks on its own grid from its first token (docs/methods/eva.md, "Packed rows").

    A document's chunk ``j`` (positions ``rel`` in [jP, (j+1)P), cut by the document's end) sits in the slot of its
    first position: T slots of P members each, most of them empty (not a chunk start), masked like padded chunks.
    O(L²) like the unpacked reference, plus O(L·P) for the slots' members."""
    B, H, T, d = q.shape
    s = d**-0.5
    P = chunk_size
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    start, rel = document_positions(segment_ids.astype(jnp.int32))
    pos = np.arange(T)

    # Phase A (§2.3) per slot: members p + j of the same document, the slot a chunk start
    member = np.minimum(pos[:, None] + np.arange(P)[None, :], T - 1)  # [T, P]
    is_start = rel % P == 0  # [B, T]
    valid = (is_start[:, :, None] & (pos[:, None] + np.arange(P)[None, :] < T)[None]
             & (start[:, member] == start[:, :, None]))  # [B, T, P]
    members = [jnp.where(valid[:, None, :, :, None], x[:, :, member], 0.0) for x in (q, k, v)]
    cid = rel // P  # the slot's chunk index inside its document (a chunk start's)
    noise = None
    if noise_key is not None:
        drawn = chunk_noise(noise_key, jnp.arange(-(-T // P)), B, H, d)  # the draws of chunks 0.. of a document
        noise = jnp.take_along_axis(drawn, cid[:, None, :, None], axis=2)
    k_hat, beta = chunk_summaries(*members, valid[:, None], params, noise, opts, s)

    # Phase B (§2.4, eq. 16)
    qk = s * jnp.einsum("bhnd,bhmd->bhnm", q, k)
    a_loc = qk + rpe_bias(rpe_table, pos, pos, opts, s)[None] if opts.use_rpe else qk  # offsets: as alone
    if opts.chunk_logit == "rep":
        a_ch = s * jnp.einsum("bhnd,bhcd->bhnc", q, k_hat)
    else:  # eq. 13
        lse = s * jnp.einsum("bhnd,bhcpd->bhncp", q, members[1])
        a_ch = jax.nn.logsumexp(jnp.where(valid[:, None, None], lse, NEG), axis=-1)
    same = start[:, :, None] == start[:, None, :]  # [B, T(query), T(key or slot)]
    all_keys = jnp.ones((T,), bool)
    loc = jax.vmap(lambda r: local_mask(r, r, all_keys, opts))(rel) & same
    ch = jax.vmap(lambda r, c, ok: chunk_mask(r, c, ok, P, opts))(rel, cid, is_start) & same
    mask = jnp.concatenate([loc, ch], axis=-1)[:, None]
    logits = jnp.where(mask, jnp.concatenate([a_loc, a_ch], axis=-1), NEG)
    p = jnp.where(mask, jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))), 0.0)
    den = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    seeds = dropout_seeds(drop_key, opts, B, H)
    if seeds is not None:  # the draws of the documents alone: positions and chunk indices inside each document
        mult = jax.vmap(lambda sd, r, c: jnp.concatenate(dropout_multipliers(sd, opts.attn_dropout, r, r, c), -1))
        p = p * mult(seeds, rel, cid)
    out = jnp.einsum("bhnm,bhmd->bhnd", p, jnp.concatenate([v, beta], axis=2)) / den
    return out, None

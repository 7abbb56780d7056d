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

from longctx.attention.base import continues_state, document_starts
from longctx.attention.eva.common import (
    NEG,
    EVAOptions,
    check_state_capacity,
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


def _take(x, idx, ok):
    """x [B,H,N,...] at idx [B,M] (clipped) along axis 2 -> [B,H,M,...], zero where ok [B,M] is False."""
    got = jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=1))(x, jnp.clip(idx, 0, x.shape[2] - 1))
    return jnp.where(ok.reshape(ok.shape[:1] + (1,) + ok.shape[1:] + (1,) * (x.ndim - 3)), got, 0.0)


def _gather(old, new, from_old, old_idx, new_idx, ok):
    """Entries of ``old`` (the carried state's, None: nothing carried) where ``from_old``, else of ``new`` (the
    call's), along axis 2; zero where not ``ok``."""
    if old is None:
        return _take(new, new_idx, ok)
    return _take(jnp.concatenate([old, new], axis=2), jnp.where(from_old, old_idx, old.shape[2] + new_idx), ok)


def eva_reference_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                         segment_ids, state=None):
    """:func:`eva_reference` of a packed row (``segment_ids`` [B, T]): each document computed as if alone, its
    blocks and chunks on its own grid from its first token (docs/methods/eva.md, "Packed rows").

    A document's chunk ``j`` (positions ``rel`` in [jP, (j+1)P), cut by the document's end) sits in the slot of its
    first position: T slots of P members each, most of them empty (not a chunk start), masked like padded chunks.
    O(L²) like the unpacked reference, plus O(L·P) for the slots' members.

    ``state`` (causal): a carried state (``EVAAttention.init_state`` or a causal call's). The call's tokens that
    ``base.continues_state`` marks continue its document (``state["segment"]``, ``state["doc_len"]`` tokens so
    far): their positions count on from ``doc_len``, and they see its ring of keys, its finished chunks and the
    chunk its unfinished members open (one more slot, summarized here with the call's members); every other
    document starts from the empty state. Returns (out [B,H,T,dv] fp32, the state of each row's last document
    (causal; its id as ``segment``) or None)."""
    B, H, T, d = q.shape
    s = d**-0.5
    P = chunk_size
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    seg = segment_ids.astype(jnp.int32)
    start, rel = document_positions(seg)
    pos = np.arange(T)
    carried = state is not None
    if carried:
        R, C_max = state["win_k"].shape[2], state["mem_khat"].shape[2]
        cont = continues_state(state["segment"], seg)  # the call's leading tokens of the carried document
        n0 = jnp.where(cont[:, 0], state["doc_len"], 0)  # [B] its tokens so far (0: none continues)
        check_state_capacity(jnp.max(n0), T, P, C_max)
        rel = rel + jnp.where(cont, n0[:, None], 0)
        c0, r0 = n0 // P, n0 % P  # its unfinished chunk, and how many members the state holds

    # Phase A (§2.3) per slot: members p + j of the same document, the slot a chunk start
    member = np.minimum(pos[:, None] + np.arange(P)[None, :], T - 1)  # [T, P]
    is_start = rel % P == 0  # [B, T]
    valid = (is_start[:, :, None] & (pos[:, None] + np.arange(P)[None, :] < T)[None]
             & (start[:, member] == start[:, :, None]))  # [B, T, P]
    members = [jnp.where(valid[:, None, :, :, None], x[:, :, member], 0.0) for x in (q, k, v)]
    cid = rel // P  # the slot's chunk index inside its document (a chunk start's)
    n_ids = -(-T // P) + (C_max + 1 if carried else 0)  # the chunk indices a document reaches in this call
    drawn = None if noise_key is None else chunk_noise(noise_key, jnp.arange(n_ids), B, H, d)
    noise_of = lambda ids: None if drawn is None else jnp.take_along_axis(  # noqa: E731
        drawn, jnp.clip(ids, 0, n_ids - 1)[:, None, :, None], axis=2)
    k_hat, beta = chunk_summaries(*members, valid[:, None], params, noise_of(cid), opts, s)

    # the keys and chunk slots a query may see: the call's, after the carried document's (its ring, its finished
    # chunks, the chunk its unfinished members open), each with its document (start position; -1: none)
    keys, values, key_rel, key_doc, key_ok = k, v, rel, start, jnp.ones((B, T), bool)
    slots = [(k_hat, beta, members[1], valid, cid, start, is_start)]
    key_x = pos  # positions for the bias: differences inside a document are its own
    if carried:
        doc0 = jnp.where(cont[:, 0], 0, -1)[:, None]  # the carried document continues as the call's first
        ring_rel = n0[:, None] - R + np.arange(R)[None, :]
        keys, values = (jnp.concatenate([state[n], x], axis=2) for n, x in (("win_k", k), ("win_v", v)))
        key_rel = jnp.concatenate([ring_rel, rel], axis=1)
        key_doc = jnp.concatenate([jnp.broadcast_to(doc0, (B, R)), start], axis=1)
        key_ok = jnp.concatenate([ring_rel >= 0, key_ok], axis=1)
        key_x = np.concatenate([np.arange(R) - R, pos])
        # chunk c0: its first r0 members from the state, then the call's first tokens while they continue it
        t = np.arange(P)[None, :] - r0[:, None]  # [B, P]: the call position of member j (< 0: in the state)
        from_cur = t < 0
        ok = ((r0 > 0)[:, None] & (from_cur | ((t < T) & jnp.take_along_axis(cont, jnp.clip(t, 0, T - 1), axis=1))))
        opened = [jnp.where(from_cur[:, None, :, None], state[n], _take(x, t, ok))[:, :, None]
                  for n, x in (("cur_q", q), ("cur_k", k), ("cur_v", v))]
        o_hat, o_beta = chunk_summaries(*opened, ok[:, None, None], params, noise_of(c0[:, None]), opts, s)
        mem_ids = jnp.broadcast_to(np.arange(C_max), (B, C_max))
        kraw = state.get("mem_kraw", jnp.zeros((B, H, C_max, P, d)))
        slots = [(state["mem_khat"], state["mem_beta"], kraw, jnp.ones((B, C_max, P), bool), mem_ids,
                  jnp.broadcast_to(doc0, (B, C_max)), mem_ids < c0[:, None]),
                 (o_hat, o_beta, opened[1], ok[:, None], c0[:, None], doc0, (r0 > 0)[:, None])] + slots
    ch_hat, ch_beta, ch_kraw, ch_kraw_ok, ch_ids, ch_doc, ch_ok = (jnp.concatenate(x, axis=1 if x[0].ndim < 4 else 2)
                                                                    if len(slots) > 1 else x[0] for x in zip(*slots))

    # Phase B (§2.4, eq. 16)
    qk = s * jnp.einsum("bhnd,bhmd->bhnm", q, keys)
    a_loc = qk + rpe_bias(rpe_table, pos, key_x, opts, s)[None] if opts.use_rpe else qk  # offsets: as alone
    if opts.chunk_logit == "rep":
        a_ch = s * jnp.einsum("bhnd,bhcd->bhnc", q, ch_hat)
    else:  # eq. 13
        lse = s * jnp.einsum("bhnd,bhcpd->bhncp", q, ch_kraw)
        a_ch = jax.nn.logsumexp(jnp.where(ch_kraw_ok[:, None, None], lse, NEG), axis=-1)
    loc = jax.vmap(lambda r, kr, ok: local_mask(r, kr, ok, opts))(rel, key_rel, key_ok)
    ch = jax.vmap(lambda r, c, ok: chunk_mask(r, c, ok, P, opts))(rel, ch_ids, ch_ok)
    mask = jnp.concatenate([loc & (start[:, :, None] == key_doc[:, None, :]),
                            ch & (start[:, :, None] == ch_doc[:, None, :])], axis=-1)[:, None]
    logits = jnp.where(mask, jnp.concatenate([a_loc, a_ch], axis=-1), NEG)
    p = jnp.where(mask, jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))), 0.0)
    den = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    seeds = dropout_seeds(drop_key, opts, B, H)
    if seeds is not None:  # the draws of the documents alone: positions and chunk indices inside each document
        mult = jax.vmap(lambda sd, r, kr, c: jnp.concatenate(dropout_multipliers(sd, opts.attn_dropout, r, kr, c), -1))
        p = p * mult(seeds, rel, key_rel, ch_ids)
    out = jnp.einsum("bhnm,bhmd->bhnd", p, jnp.concatenate([values, ch_beta], axis=2)) / den
    if not opts.causal:
        return out, None

    # the state of each row's last document (including the carried prefix where it continues)
    last, n1 = start[:, -1:], rel[:, -1:] + 1  # [B, 1]: its first call position, its length after the call
    if carried:
        n_old = jnp.where(cont[:, -1:], n0[:, None], 0)  # its tokens before the call
        old = lambda name: state[name]  # noqa: E731
    else:
        R, C_max = opts.W + opts.e_l, geometry(opts, T, P, 0)[2]  # a full pass's capacity (common.state_from_forward)
        n_old, old = jnp.zeros_like(n1), lambda name: None  # noqa: E731
    at = lambda x: last + x - n_old  # noqa: E731  (the call position of its position x >= n_old)
    new = {"pos": (state["pos"] if carried else 0) + jnp.asarray(T, jnp.int32), "segment": seg[:, -1],
           "doc_len": n1[:, 0]}
    x = n1 - R + np.arange(R)  # the ring: its last R positions
    for name, src in (("win_k", k), ("win_v", v)):
        new[name] = _gather(old(name), src, x < n_old, x - n_old + R, at(x), x >= 0)
    x = n1 // P * P + np.arange(P)  # the unfinished chunk's members
    for name, src in (("cur_q", q), ("cur_k", k), ("cur_v", v)):
        new[name] = _gather(old(name), src, x < n_old, x - n_old // P * P, at(x), x < n1)
    c = np.arange(C_max)[None, :]  # finished chunks c < n1 // P: carried, the opened one, or a slot of the call
    done, kept = c < n1 // P, c < n_old // P
    opened_here = (c == n_old // P) & (n_old % P > 0)
    sources = [("mem_khat", k_hat, o_hat if carried else None), ("mem_beta", beta, o_beta if carried else None)]
    if opts.chunk_logit == "exact_lse":
        sources.append(("mem_kraw", members[1], opened[1] if carried else None))
    for name, slot, opened_one in sources:
        if carried:
            new[name] = _gather(jnp.concatenate([old(name), opened_one], axis=2), slot, kept | opened_here,
                                jnp.where(kept, c, C_max), at(c * P), done)
        else:
            new[name] = _gather(None, slot, None, None, at(c * P), done)
    return out, new

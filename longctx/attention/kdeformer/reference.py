"""KDEformer's estimator as written in the method notes (docs/methods/kdeformer.md; § as there): every
(query, key) pair at once in the [B, H, T, d] layout, O(T²) memory. The implementation every other one equals.

Both directions estimate ``D⁻¹AV`` (``A = exp(σQKᵀ)``) by one weighting of the pairs (§2.2, Eq. 10–11):

    o_i = Σ_j w_ij e^{s_ij} v_j / Σ_j w_ij e^{s_ij},   s_ij = σ⟨q_i, k_j⟩,
    w_ij = 1 on the exact entries (A_spar's support), (ΠᵀΠ)_jj on the residual ones, 0 elsewhere,

where ``(ΠᵀΠ)_jj = Σ_r 1[ℓ_r = j] / (m p_{ℓ_r})`` counts the sampled columns with their importance weights, so
the numerator is ``(A_spar + A_res ΠᵀΠ) V`` and the denominator the same estimator of ``D`` (the released code's
ones column appended to ``V``, §2.3h). The weights are the draws and are frozen in the gradient (§6: ``p`` too).

Bidirectional (§2.3): the exact entries are the pairs whose sorted positions fall in the same block of ``b``
(queries and keys each sorted stably by the Gray rank of their hash code); the residual is every other key,
sampled with :func:`common.bidir_samples` (or all of them with weight 1 for ``residual='exact'``).

Causal (§4.1): query ``i`` in chunk ``g`` with prefix end ``L_g``; exact entries: the local keys ``[L_g, i]`` and
``Hv(i)``, the ≤ ``b_h`` most recent keys ``j < L_g`` whose code equals ``h(q_i)``; residual: the other keys
before ``L_g``, sampled per chunk from ``fold_in(k_S, g)`` (§4.3). The keys are the decoding state's cache
(:func:`common.next_state`: the sequence itself for a full pass), so a call with a state computes the same
entries as the full pass.

Packed rows (``segment_ids``, §4.6): the same weights restricted to each query's document, with its blocks,
chunks, prefix ends and draws counted from the document's first token.

The hash, the Gray order and the samplers are :mod:`common`'s, the ones the tiled implementations use: the same
key gives the same draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.kdeformer.common import (
    BidirOptions,
    CausalOptions,
    augmented_gram,
    bidir_samples,
    causal_starts,
    document_lengths,
    draw_rows,
    draw_samples,
    gray_rank,
    inverse_permutation,
    lsh_codes,
    next_state,
    norm_weights,
    packed_bidir_samples,
    power_lambda,
    prefix_end,
    weight_prefix_sums,
)


def estimate(q, k, v, w, scale: float):
    """o = D̃⁻¹ (A ⊙ w) V, D̃ = diag((A ⊙ w) 1), A = exp(σ q kᵀ): a softmax of σ q kᵀ + log w (§2.3h).
    q, k [B,H,T,d] / [B,H,M,d], v [B,H,M,dv], w [B,H,T,M] (≥ 0, frozen)."""
    s = scale * jnp.einsum("bhid,bhjd->bhij", q, k) + jnp.log(jax.lax.stop_gradient(w))
    return jnp.einsum("bhij,bhjd->bhid", jax.nn.softmax(s, axis=-1), v)


def column_weights(idx, omega, n: int):
    """(ΠᵀΠ)_jj = Σ_r 1[ℓ_r = j] e^{ω_r} with ω_r = −log(m p_{ℓ_r}) (duplicates add): [..., m] -> [..., n]."""
    one = lambda i, x: jnp.zeros((n,), jnp.float32).at[i].add(x)  # noqa: E731
    w = jax.vmap(one)(idx.reshape(-1, idx.shape[-1]), jnp.exp(omega).reshape(-1, idx.shape[-1]))
    return w.reshape(idx.shape[:-1] + (n,))


def _f32(*xs):
    return tuple(x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in xs)


def bidirectional(q, k, v, W, key_s, opts: BidirOptions, segment_ids=None):
    """§2.3. q, k [B,H,N,d], v [B,H,N,dv]; W [B,H,d,r] the projections; key_s the samples' key. ``segment_ids``
    [B,N] (a packed row, §4.6): every document as if alone: sorted and cut into blocks from its first token, its
    samples drawn among its own tokens as it draws them alone."""
    q, k, v = _f32(q, k, v)
    N = q.shape[2]
    if segment_ids is not None:
        start, n = document_lengths(segment_ids)
        st = jnp.broadcast_to(start[:, None, :], q.shape[:3])

    def block(x):  # §2.3a–c: hash, Gray rank, stable sort, cut into blocks of b
        rank = gray_rank(lsh_codes(x, W), opts.num_projs, opts.gray_order)
        order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
        if segment_ids is None:
            return inverse_permutation(order) // opts.bucket_size
        # documents in row order, each sorted by rank as alone: slot − its document's start is the slot alone
        order = jnp.take_along_axis(order, jnp.argsort(jnp.take_along_axis(st, order, axis=-1), axis=-1,
                                                       stable=True).astype(jnp.int32), axis=-1)
        return (inverse_permutation(order) - st) // opts.bucket_size

    exact = block(q)[..., :, None] == block(k)[..., None, :]  # [B,H,N,N]: same block (§2.3d)
    if segment_ids is not None:
        same_doc = (start[:, :, None] == start[:, None, :])[:, None]
        exact = exact & same_doc
    else:
        same_doc = jnp.ones((), bool)
    if opts.residual == "exact":
        residual = jnp.ones((), jnp.float32)
    elif opts.num_samples > 0 and segment_ids is not None:  # each query its document's columns
        residual = column_weights(*packed_bidir_samples(key_s, v, start, n, opts), N)
    elif opts.num_samples > 0:
        residual = column_weights(*bidir_samples(key_s, v, N, opts), N)[:, :, None, :]  # §2.3e–g
    else:
        residual = jnp.zeros((), jnp.float32)
    return estimate(q, k, v, jnp.where(exact, 1.0, jnp.where(same_doc, residual, 0.0)), opts.scale)


def causal(q, k, v, W, key_s, opts: CausalOptions, state=None, segment_ids=None):
    """§4.1 for the T new tokens q, k [B,H,T,d], v [B,H,T,dv] after ``state`` (None: none). W: the stream's
    projections; key_s the samples' key. ``segment_ids`` [B,T] (a packed row, §4.6): a query attends within its
    document only, with its chunk, prefix end and samples counted from the document's first token (its start:
    :func:`common.causal_starts`; the state's document continues across calls)."""
    B, T = q.shape[0], q.shape[2]
    st = next_state(state, k, v, W, q.dtype, segment_ids)
    (q,), (K, V), HK = _f32(q), _f32(st["k"], st["v"]), st["codes"]
    M, c = K.shape[2], opts.chunk_size
    P0 = 0 if state is None else state["length"]
    i = P0 + jnp.arange(T, dtype=jnp.int32)  # query positions
    j = jnp.arange(M, dtype=jnp.int32)  # key positions
    start = causal_starts(state, segment_ids, T, B)  # [B,T]: the first token of each query's document
    g = (i[None, :] - start) // c  # [B,T]: the query's chunk in its document
    L = start + prefix_end(g, opts)  # [B,T]: its prefix end, a cache position
    # each key's document start: the call's tokens their own; the earlier calls' keys the carried document's from
    # its start (older keys belong to finished documents: -1, never a query's)
    s0 = jnp.zeros((B,), jnp.int32) if state is None or segment_ids is None else state["start"]
    kstart = jnp.where(j[None, :] < P0, jnp.where(j[None, :] >= s0[:, None], s0[:, None], -1),
                       jax.lax.dynamic_update_slice(jnp.full((B, M), -1, jnp.int32), start, (0, P0)))
    doc = (kstart[:, None, :] == start[:, :, None])[:, None]  # [B,1,T,M]
    before = doc & (j < L[..., None])[:, None]  # keys before the local window
    local = doc & ~before & (j[None, :] <= i[:, None])
    same = (HK[:, :, None, :] == lsh_codes(q, W)[..., None]) & before  # [B,H,T,M]
    later = jnp.cumsum(same[..., ::-1], axis=-1)[..., ::-1] - same  # same-code keys after j, before L
    heavy = same & (later < opts.heavy_capacity)  # Hv(i)
    rest = before & ~heavy
    w = (local | heavy).astype(jnp.float32)
    if opts.residual == "exact":
        w = w + rest
    elif opts.num_samples > 0:
        m = opts.num_samples

        def chunk_samples(g, s):  # §4.3: m draws in [0, L_g) from fold_in(k_S, g), from s -> (ΠᵀΠ)_jj [B,H,M]
            Lg = prefix_end(g, opts)
            n = jnp.full(K.shape[:2], jnp.maximum(Lg, 1), jnp.int32)
            first = jnp.full(K.shape[:2], s, jnp.int32)
            if opts.sampling == "uniform":
                idx, p = draw_samples(jax.random.fold_in(key_s, g), m, n, "uniform", first=first)
            else:  # the document's keys from s (its own cache alone): the prefix [s, s + L_g)
                Vs = jnp.take(V, jnp.clip(s + j, 0, M - 1), axis=2)
                u = norm_weights(Vs, True)
                lam = power_lambda(augmented_gram(Vs, (j < Lg)[None, None]), opts.power_iters)
                idx, p = draw_samples(jax.random.fold_in(key_s, g), m, n, "ref", cum=weight_prefix_sums(u), u=u,
                                      lam=lam)
                idx = idx + s
            return column_weights(idx, -jnp.log(m * p), M)

        if segment_ids is None and state is None:
            sampled = jax.vmap(chunk_samples, in_axes=(0, None))(i // c, 0)
        else:  # every row at its own document's chunk and start
            sampled = jax.vmap(lambda gq, sq: draw_rows(lambda b: chunk_samples(gq[b], sq[b]), B), in_axes=1)(g, start)
        w = w + jnp.where(rest, jnp.moveaxis(sampled, 0, 2), 0.0)
    return estimate(q, K, V, w, opts.scale)


__all__ = ["bidirectional", "causal", "column_weights", "estimate"]

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
    draw_samples,
    gray_rank,
    inverse_permutation,
    lsh_codes,
    next_state,
    norm_weights,
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


def bidirectional(q, k, v, W, key_s, opts: BidirOptions):
    """§2.3. q, k [B,H,N,d], v [B,H,N,dv]; W [B,H,d,r] the projections; key_s the samples' key."""
    q, k, v = _f32(q, k, v)
    N = q.shape[2]

    def block(x):  # §2.3a–c: hash, Gray rank, stable sort, cut into blocks of b
        rank = gray_rank(lsh_codes(x, W), opts.num_projs, opts.gray_order)
        return inverse_permutation(jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)) // opts.bucket_size

    exact = block(q)[..., :, None] == block(k)[..., None, :]  # [B,H,N,N]: same block (§2.3d)
    if opts.residual == "exact":
        residual = jnp.ones((), jnp.float32)
    elif opts.num_samples > 0:
        residual = column_weights(*bidir_samples(key_s, v, N, opts), N)[:, :, None, :]  # §2.3e–g
    else:
        residual = jnp.zeros((), jnp.float32)
    return estimate(q, k, v, jnp.where(exact, 1.0, residual), opts.scale)


def causal(q, k, v, W, key_s, opts: CausalOptions, state=None):
    """§4.1 for the T new tokens q, k [B,H,T,d], v [B,H,T,dv] after ``state`` (None: none). W: the stream's
    projections; key_s the samples' key."""
    st = next_state(state, k, v, W, q.dtype)
    (q,), (K, V), HK = _f32(q), _f32(st["k"], st["v"]), st["codes"]
    M, T, c = K.shape[2], q.shape[2], opts.chunk_size
    i = (0 if state is None else state["length"]) + jnp.arange(T, dtype=jnp.int32)  # query positions
    j = jnp.arange(M, dtype=jnp.int32)  # key positions
    L = prefix_end(i // c, opts)  # [T]
    before = j[None, :] < L[:, None]  # [T, M]: keys before the local window
    local = ~before & (j[None, :] <= i[:, None])
    same = (HK[:, :, None, :] == lsh_codes(q, W)[..., None]) & before  # [B,H,T,M]
    later = jnp.cumsum(same[..., ::-1], axis=-1)[..., ::-1] - same  # same-code keys after j, before L
    heavy = same & (later < opts.heavy_capacity)  # Hv(i)
    rest = before & ~heavy
    w = (local | heavy).astype(jnp.float32)
    if opts.residual == "exact":
        w = w + rest
    elif opts.num_samples > 0:
        m = opts.num_samples

        def chunk_samples(g):  # §4.3: m draws in [0, L_g) from fold_in(k_S, g) -> (ΠᵀΠ)_jj [B,H,M]
            Lg = prefix_end(g, opts)
            n = jnp.full(K.shape[:2], jnp.maximum(Lg, 1), jnp.int32)
            if opts.sampling == "uniform":
                idx, p = draw_samples(jax.random.fold_in(key_s, g), m, n, "uniform")
            else:
                u = norm_weights(V, True)
                lam = power_lambda(augmented_gram(V, (j < Lg)[None, None]), opts.power_iters)
                idx, p = draw_samples(jax.random.fold_in(key_s, g), m, n, "ref", cum=weight_prefix_sums(u), u=u,
                                      lam=lam)
            return column_weights(idx, -jnp.log(m * p), M)

        w = w + jnp.where(rest, jnp.moveaxis(jax.vmap(chunk_samples)(i // c), 0, 2), 0.0)
    return estimate(q, K, V, w, opts.scale)


__all__ = ["bidirectional", "causal", "column_weights", "estimate"]

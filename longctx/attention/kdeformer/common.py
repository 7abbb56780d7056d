"""What every KDEformer implementation shares: the options, the hash, the Gray order, the samplers and the
prefix ends (docs/methods/kdeformer.md; § as there). The reference and the tiled paths import these, so the
same key gives them the same projections, codes and samples, and they differ only in how the estimator's
entries are computed.

Nothing here is tuned for a platform: products take the compute dtype with float32 accumulation
(``einsum_f32``), and the one float32 product, the hash projections, is a declared statistic (:func:`lsh_codes`).
The hash codes of a full pass and of decoding come from the same function on the same vectors.

The execution knobs the tiled implementations read (``tile_budget``, ``heavy_scores_max_len``,
``heavy_band_block`` as ``band_block``, the route ``heavy_impl``) are fields of :class:`CausalOptions`; the core's
options leave them at ``dispatch.PLATFORM_DEFAULT`` and the runner of the chosen implementation puts in its own
fields, built for the platform it runs on (``xla.with_knobs``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from longctx.attention.base import continues_state, document_starts
from longctx.models.precision import einsum_f32
from pallas_kernels.precision import statistic

NEG = -1e30  # masked logits (finite: a row without any entry then outputs 0)
NORM_SHIFT = 6  # integer norm weights u = ⌊‖ṽ‖·2^6⌋ + 1 (§4.3)
U_MAX = 1 << 13
INT_MAX = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class BidirOptions:
    bucket_size: int
    num_samples: int
    num_projs: int
    gray_order: str  # 'inverse' | 'forward'
    sampling: str  # 'ref' | 'uniform'
    residual: str  # 'sampled' | 'exact'
    power_iters: int
    scale: float


@dataclasses.dataclass(frozen=True)
class CausalOptions:
    chunk_size: int
    local_chunks: int
    heavy_capacity: int
    num_projs: int
    num_samples: int
    sampling: str  # 'uniform' | 'ref'
    residual: str  # 'sampled' | 'exact'
    power_iters: int
    scale: float
    tile_budget: int  # tiled paths: logits per lax.map step
    heavy_impl: str = "auto"  # tiled paths' heavy route: 'gather' | 'scores' | 'band' | 'auto'
    heavy_scores_max_len: int = 1024
    band_block: int = 64  # 'band': sorted queries per tile = sorted keys per block


# ---------------------------------------------------------------------------
# hashing (§2.3a, b)
# ---------------------------------------------------------------------------


def draw_projections(key, batch: int, heads: int, dim: int, num_projs: int):
    """W [B,H,d,r], i.i.d. N(0,1), fp32."""
    return jax.random.normal(key, (batch, heads, dim, num_projs), jnp.float32)


def lsh_codes(x, W):
    """Sign-random-projection code h(x) = Σ_t 1[⟨w_t,x⟩ > 0] 2^t. x [B,H,N,d], W [B,H,d,r] -> int32 [B,H,N].

    The projections are float32 whatever the compute dtype (§2.3a), a declared statistic: only their signs are
    used, and a sign near 0 flips with W rounded to bfloat16, so float32 keeps the codes of every implementation,
    of the reference and of the decoding state the same function of the (exactly upcast) inputs; r ≤ 16 columns,
    O(N·d·r) work."""
    r = W.shape[-1]
    W = jnp.broadcast_to(W, x.shape[:2] + W.shape[2:])
    with statistic("kdeformer LSH projections: float32 sign decisions (spec 2.3a)"):
        proj = jnp.einsum("bhnd,bhdr->bhnr", x.astype(jnp.float32), W.astype(jnp.float32))
    bits = (proj > 0).astype(jnp.int32)
    return jnp.sum(bits << jnp.arange(r, dtype=jnp.int32), axis=-1).astype(jnp.int32)


def gray_rank(z, num_projs: int, order: str = "inverse"):
    """Sort key of code z. 'inverse': position of z in the reflected Gray sequence, G⁻¹(z) =
    z ⊕ (z>>1) ⊕ … ⊕ (z>>(r−1)) (paper; consecutive ranks differ in one bit). 'forward': G(z) =
    z ⊕ (z>>1) (the released code's table lookup)."""
    if order == "forward":
        return z ^ (z >> 1)
    out = z
    for s in range(1, max(num_projs, 1)):
        out = out ^ (z >> s)
    return out


def inverse_permutation(perm):
    """perm [..., N] -> inv with inv[..., perm[..., t]] = t."""
    idx = jnp.broadcast_to(jnp.arange(perm.shape[-1], dtype=perm.dtype), perm.shape)
    return jnp.put_along_axis(jnp.zeros_like(perm), perm, idx, axis=-1, inplace=False)


def prefix_end(g, opts: CausalOptions):
    """L_g = max(0, (g − nl + 1)·c): the keys before the local window of chunk g (§4.1)."""
    return jnp.maximum(0, (g - opts.local_chunks + 1) * opts.chunk_size).astype(jnp.int32)


# ---------------------------------------------------------------------------
# the samplers (§2.3e, f; §4.3)
# ---------------------------------------------------------------------------

_ssorted_right = jax.vmap(jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="right")))


def norm_weights(v, valid):
    """Integer weights u_j = min(⌊‖[v_j;1]‖·2^6⌋ + 1, 2^13) (0 where not valid). v [B,H,N,dv]."""
    nrm = jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32)), axis=-1) + 1.0)
    u = jnp.minimum(jnp.floor(nrm * (1 << NORM_SHIFT)) + 1, U_MAX).astype(jnp.int32)
    return jnp.where(valid, u, 0)


def augmented_gram(v, valid):
    """Σ_j [v_j;1][v_j;1]ᵀ over valid rows, accumulated and returned in float32 (operands in v's dtype, the compute
    dtype: products of bfloat16 values are exact in float32; float32 or wider values: float32, the plain einsum).
    v [..., N, dv], valid broadcastable to [..., N]."""
    v = v if jnp.dtype(v.dtype).itemsize < 4 else v.astype(jnp.float32)
    va = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)
    va = jnp.where(valid[..., None], va, jnp.zeros((), v.dtype))
    return einsum_f32("...ne,...nf->...ef", va, va)


def power_lambda(gram, iters: int):
    """‖Ṽ‖²_op from ``iters`` power iterations on the Gram (start 1/√e; deterministic)."""
    e = gram.shape[-1]
    x = jnp.full(gram.shape[:-1], e**-0.5, jnp.float32)

    def body(_, x):
        y = jnp.einsum("...ef,...f->...e", gram, x)
        return y / jnp.maximum(jnp.linalg.norm(y, axis=-1, keepdims=True), 1e-30)

    x = jax.lax.fori_loop(0, iters, body, x)
    return jnp.einsum("...e,...ef,...f->...", x, gram, x)


CUM_SHIFT = 30  # prefix sums of the integer weights as two int32 words: C = hi·2^30 + lo, 0 ≤ lo < 2^30


def _carry(hi, lo):
    """Normalise (hi, lo) words so that 0 ≤ lo < 2^30."""
    return hi + (lo >> CUM_SHIFT), lo & ((1 << CUM_SHIFT) - 1)


def weight_prefix_sums(u, block: int | None = None):
    """Exact inclusive prefix sums of the integer weights u [..., N] (0 ≤ u ≤ U_MAX) as (hi, lo) int32 words,
    C = hi·2^30 + lo with 0 ≤ lo < 2^30.

    A single int32 cumsum overflows once Σu reaches 2^31 (u ≤ 2^13: from N = 2^18 tokens). Here plain cumsums
    run inside blocks of ``block`` keys (default 2^30 / U_MAX, so a block's sum is ≤ 2^30; a caller passing
    ``block`` keeps each block's sum ≤ 2^30), and the blocks' offsets are carried as two 15-bit halves (fewer than
    2^15 blocks): exact for any int32 length at the default block."""
    N = u.shape[-1]
    bk = max(1, min(N, block or (1 << CUM_SHIFT) // U_MAX))
    nb = -(-N // bk)
    if nb >= 1 << 15:  # the blocks' offsets in 15-bit halves: their sums stay below 2^30
        raise ValueError(f"kdeformer: weight_prefix_sums over {nb} blocks of {bk}; at most 2^15 - 1 blocks")
    ub = jnp.pad(u.astype(jnp.int32), [(0, 0)] * (u.ndim - 1) + [(0, nb * bk - N)])
    within = jnp.cumsum(ub.reshape(u.shape[:-1] + (nb, bk)), axis=-1)  # ≤ 2^30 per block
    tot = within[..., -1]  # [..., nb]
    excl = lambda x: jnp.cumsum(x, axis=-1) - x  # noqa: E731  (≤ nb·2^15 < 2^30)
    a, b = excl(tot >> 15), excl(tot & 0x7FFF)  # offset of block t = a·2^15 + b
    hi, lo = _carry(a >> 15, ((a & 0x7FFF) << 15) + b)
    hi, lo = _carry(hi[..., None], lo[..., None] + within)  # lo < 2^30, within ≤ 2^30: no overflow
    flat = lambda x: x.reshape(u.shape[:-1] + (nb * bk,))[..., :N]  # noqa: E731
    return flat(hi), flat(lo)


def _words_le(a, t):
    """a ≤ t for (hi, lo) words."""
    return (a[0] < t[0]) | ((a[0] == t[0]) & (a[1] <= t[1]))


@jax.jit
def _search_words_right(cum, t):
    """searchsorted(C, t, side='right') along the last axis for (hi, lo) words: cum ([..., N] each),
    t ([..., m] each) -> int32 [..., m] (a binary search; C non-decreasing)."""
    hi_w, lo_w = cum
    n = hi_w.shape[-1]
    lo = jnp.zeros(t[0].shape, jnp.int32)
    hi = jnp.full(t[0].shape, n, jnp.int32)

    def body(_, lh):
        lo, hi = lh
        mid = (lo + hi) // 2
        at = jnp.minimum(mid, n - 1)
        c = (jnp.take_along_axis(hi_w, at, axis=-1), jnp.take_along_axis(lo_w, at, axis=-1))
        go_right = (lo < hi) & _words_le(c, t)
        return jnp.where(go_right, mid + 1, lo), jnp.where((lo < hi) & ~go_right, mid, hi)

    lo, _ = jax.lax.fori_loop(0, max(n, 1).bit_length() + 1, body, (lo, hi))
    return lo


@functools.partial(jax.jit, static_argnums=2)  # traced once per shape (eager callers too)
def _uniform_below(key, tot, shape):
    """Exact uniform integers t in [0, T) for T = tot (hi, lo words, [B,H,1] each; T ≥ 1), as words [shape].

    T < 2^30: one randint (the draw of a single int32 cumsum). Otherwise rejection: hi uniform in [0, T_hi],
    lo uniform in [0, 2^30), kept when (hi, lo) < T (probability ≥ 1/2); redrawn until every entry is kept."""
    th, tl = tot
    small = th == 0
    t_small = jax.random.randint(key, shape, 0, jnp.maximum(tl, 1), dtype=jnp.int32)  # the draws of before
    k1 = jax.random.fold_in(key, 1)

    def draw(k):
        ka, kb = jax.random.split(k)
        h = jax.random.randint(ka, shape, 0, th + 1, dtype=jnp.int32)
        lo = jax.random.randint(kb, shape, 0, 1 << CUM_SHIFT, dtype=jnp.int32)
        return h, lo

    def cond(c):
        return ~jnp.all(c[3])

    def body(c):
        k, h, lo, done = c
        k, kd = jax.random.split(k)
        h2, lo2 = draw(kd)
        ok = (h2 < th) | (lo2 < tl)
        return k, jnp.where(done, h, h2), jnp.where(done, lo, lo2), done | ok

    zero = jnp.zeros(shape, jnp.int32)
    _, h, lo, _ = jax.lax.while_loop(cond, body, (k1, zero, zero, jnp.broadcast_to(small, shape)))
    return jnp.where(small, 0, h), jnp.where(small, t_small, lo)


def draw_samples(key, m: int, n_prefix, sampling: str, *, cum=None, u=None, lam=None, first=None, before=None,
                 tot=None):
    """m i.i.d. indices per (b,h) in [0, n_prefix) and their probabilities p.

    n_prefix: int32 [B,H] (≥ 1). 'uniform': p = 1/n. 'ref' (needs cum = :func:`weight_prefix_sums` of the
    integer weights u [B,H,M], lam [B,H] = λ): mixture of uniform (prob. π_u = 1/(1 + T 2^-6/λ)) and ∝ u, with
    T = C[n−1] (exact at any length); p = π_u/n + (1−π_u) u_ℓ/T exactly the law of the draw.

    A document of a packed row (§4.6): ``first`` [B,H] the position of its index 0 in the row, ``before`` the
    words of C just before it and ``tot`` its total (words, [B,H,1] each; ``cum`` and ``u`` the row's). The draws
    are the document's alone, shifted by ``first`` (the random bits are the same: only the bounds move)."""
    B, H = n_prefix.shape
    nf = n_prefix.astype(jnp.float32)[..., None]
    shift = (lambda i: i) if first is None else (lambda i: i + first[..., None])
    if sampling == "uniform":
        idx = jax.random.randint(key, (B, H, m), 0, n_prefix[..., None], dtype=jnp.int32)
        return shift(idx), jnp.broadcast_to(1.0 / nf, (B, H, m))
    k1, k2, k3 = jax.random.split(key, 3)
    if tot is None:
        tot = tuple(jnp.take_along_axis(w, (n_prefix - 1)[..., None], axis=-1) for w in cum)  # [B,H,1] each
    totf = tot[0].astype(jnp.float32) * float(1 << CUM_SHIFT) + tot[1].astype(jnp.float32)
    pi_u = 1.0 / (1.0 + totf * 2.0**-NORM_SHIFT / jnp.maximum(lam[..., None], 1e-30))
    bit = jax.random.bernoulli(k1, pi_u, (B, H, m))
    uni = shift(jax.random.randint(k2, (B, H, m), 0, n_prefix[..., None], dtype=jnp.int32))
    t = _uniform_below(k3, tot, (B, H, m))
    if before is not None:  # the document's C[x] − C[first − 1] ≤ t  ⇔  C[x] ≤ t + C[first − 1]
        t = _carry(t[0] + before[0], t[1] + before[1])
    nidx = _search_words_right(cum, t)
    idx = jnp.where(bit, uni, nidx)
    p = pi_u / nf + (1.0 - pi_u) * jnp.take_along_axis(u, idx, axis=-1).astype(jnp.float32) / totf
    return idx, p


def words_at(cum, i):
    """C[i] as words ([..., K] each) for positions i [..., K]; 0 where i < 0."""
    return tuple(jnp.where(i >= 0, jnp.take_along_axis(w, jnp.maximum(i, 0), axis=-1), 0) for w in cum)


def words_sub(a, b):
    """a − b for (hi, lo) words with a ≥ b (normalised: 0 ≤ lo < 2^30)."""
    lo = a[1] - b[1]
    return a[0] - b[0] - (lo < 0), jnp.where(lo < 0, lo + (1 << CUM_SHIFT), lo)


def document_lambda(v, valid, doc, iters: int):
    """λ = ‖Ṽ_doc‖²_op of every token's document (§4.6), [B,H,T]: :func:`power_lambda` run on all documents of
    each row at once, the Gram never formed (x ← Ṽᵀ(Ṽx) as two segment sums over the document's rows; the same
    start and iterations as :func:`power_lambda`, whose rounding it shares only up to the order of the sums).
    v [B,H,T,dv]; valid [B,H,T] or broadcastable; doc [B,T] the document index of each token (< T)."""
    B, H, T, _ = v.shape
    va = jnp.concatenate([v.astype(jnp.float32), jnp.ones(v.shape[:-1] + (1,), jnp.float32)], axis=-1)
    va = jnp.where(jnp.broadcast_to(valid, (B, H, T))[..., None], va, 0.0)
    e = va.shape[-1]
    seg = jax.vmap(lambda a, d: jax.vmap(lambda x: jax.ops.segment_sum(x, d, num_segments=T))(a))  # [B,H,T,·]
    at = jax.vmap(lambda a, d: a[:, d])  # per-document rows back to their tokens
    gram_x = lambda x: seg(va * jnp.sum(va * at(x, doc), axis=-1, keepdims=True), doc)  # noqa: E731

    def body(_, x):
        y = gram_x(x)
        return y / jnp.maximum(jnp.linalg.norm(y, axis=-1, keepdims=True), 1e-30)

    with statistic("kdeformer ref sampler: lambda of every packed document (float32 power iteration, §4.6)"):
        x = jax.lax.fori_loop(0, iters, body, jnp.full((B, H, T, e), e**-0.5, jnp.float32))
        lam = seg(jnp.square(jnp.sum(va * at(x, doc), axis=-1)), doc)  # xᵀ G x = Σ_rows (ṽ·x)²
    return at(lam, doc)


def packed_bidir_samples(key_s, v, start, n, opts: BidirOptions):
    """:func:`bidir_samples` of every token's document in a packed row (§4.6): the ``m`` columns that document
    draws alone, as row positions, and their log-weights, [B,H,T,m] each. v [B,H,T,dv] (rows ≥ the row's real
    length are padding: ``n`` 0 there is never asked); start, n [B,T] (:func:`document_lengths`)."""
    B, H, T = v.shape[:3]
    m = opts.num_samples
    tok = lambda x: jnp.broadcast_to(x[:, None], (B, H, T))  # noqa: E731
    st, nn = tok(start), tok(jnp.maximum(n, 1))
    if opts.sampling == "uniform":
        def one(s, k):
            return draw_samples(key_s, m, k, "uniform", first=s)
        idx, p = jax.vmap(one, in_axes=2, out_axes=2)(st, nn)
    else:
        valid = tok(n > 0)
        u = norm_weights(v, valid)
        cum = weight_prefix_sums(u)
        doc = jnp.cumsum(start == jnp.arange(T, dtype=jnp.int32), axis=1) - 1
        lam = document_lambda(v, valid, doc, opts.power_iters)
        before = words_at(cum, st - 1)
        tot = words_sub(words_at(cum, st + nn - 1), before)

        def one(s, k, lm, b0, b1, t0, t1):
            return draw_samples(key_s, m, k, "ref", cum=cum, u=u, lam=lm, first=s, before=(b0[..., None], b1[..., None]),
                                tot=(t0[..., None], t1[..., None]))
        idx, p = jax.vmap(one, in_axes=2, out_axes=2)(st, nn, lam, *before, *tot)
    return idx, -jnp.log(m * p)


def bidir_samples(key_s, v, n_valid: int, opts: BidirOptions):
    """The bidirectional estimator's ``m`` columns (§2.3e, f): (indices [B,H,m], log-weights ω = −log(m p)).
    v [B,H,N,dv]; rows ≥ n_valid are padding (never drawn)."""
    B, H, N = v.shape[:3]
    m = opts.num_samples
    valid = jnp.arange(N) < n_valid
    n = jnp.full((B, H), n_valid, jnp.int32)
    if opts.sampling == "uniform":
        idx, p = draw_samples(key_s, m, n, "uniform")
    else:
        u = norm_weights(v, valid)
        lam = power_lambda(augmented_gram(v, valid[None, None]), opts.power_iters)
        idx, p = draw_samples(key_s, m, n, "ref", cum=weight_prefix_sums(u), u=u, lam=lam)
    return idx, -jnp.log(m * p)


# ---------------------------------------------------------------------------
# packed rows (§4.6): every index and draw of a document counted from its first token
# ---------------------------------------------------------------------------


def document_lengths(segment_ids):
    """A packed row's documents (bidirectional): (start [B,T], n [B,T]) int32, the row position of the first token
    of each token's document and that document's length."""
    B, T = segment_ids.shape
    start = document_starts(segment_ids.astype(jnp.int32))
    doc = jnp.cumsum(start == jnp.arange(T, dtype=jnp.int32), axis=1) - 1  # the document's index in its row
    count = jax.vmap(lambda d: jax.ops.segment_sum(jnp.ones((T,), jnp.int32), d, num_segments=T))(doc)
    return start, jnp.take_along_axis(count, doc, axis=1)


def causal_starts(state, segment_ids, T: int, batch: int):
    """int32 [B,T]: the cache position of the first token of each new token's document (§4.6). Without segment ids
    0: the whole cache is one stream, as before packed rows. With them, the call's leading tokens that continue
    the state's document (``base.continues_state``) keep its start (``state['start']``), every other document
    starts at its first token."""
    if segment_ids is None:
        return jnp.zeros((batch, T), jnp.int32)
    own = document_starts(segment_ids.astype(jnp.int32))
    if state is None:
        return own
    cont = continues_state(state["segment"], segment_ids.astype(jnp.int32))
    return jnp.where(cont, state["start"][:, None], state["length"] + own)


def draw_rows(draw, batch: int):
    """Row b of ``draw(b)`` for every row b (``draw(b) -> [B, ...]``, a pytree): a draw made for each row at its own
    document's chunk and start keeps the bits of the full ``[B, ...]`` draw that row takes alone, whichever chunk
    the other rows are in (B draws of the full shape: a row's key cannot be split from the others')."""
    return jax.vmap(lambda b: jax.tree.map(lambda x: x[b], draw(b)))(jnp.arange(batch, dtype=jnp.int32))


# ---------------------------------------------------------------------------
# the decoding state (§4.4)
# ---------------------------------------------------------------------------


def one_token_applies(T: int, opts: CausalOptions) -> bool:
    """Whether a call of ``T`` tokens after a state takes ``xla.one_token`` (§4.4's decoding step): one token (with
    segment ids or without), the sampled residual drawn 'uniform' (or no samples). The 'ref' sampler's draw reads
    the whole prefix's weight sums and Gram, and the 'exact' residual every key: those calls keep the tiled form."""
    return T == 1 and opts.residual == "sampled" and (opts.sampling == "uniform" or opts.num_samples == 0)


def next_state(state, k, v, W, compute_dtype, segment_ids=None, layer=None, cache_dtype=None):
    """The causal state after a call's keys k [B,H,T,d] and values v [B,H,T,dv] (``state`` None: the first call):
    the KV cache, the code cache h(k) (the keys in the compute dtype, as every implementation hashes them), the
    stream's projections W, the token count, and the document the state continues (§4.6): ``segment`` [B] its id
    and ``start`` [B] the cache position of its first token (keys before it belong to finished documents and are
    never attended again); a call without segment ids leaves 0 in both (the cache is one stream). A full pass's cache
    is the sequence itself, in ``cache_dtype`` (the core's, ``AttentionCore.cache_dtype``; None: float32 or wider);
    a decoding cache keeps its dtype and writes the tokens at ``state['length']``. ``layer`` (int32): ``state`` is a
    scanned stack's states (leaves [L, ...]) and the tokens go into that layer's slot of it (a decoding step in the
    stack: the rest is left where it lies)."""
    k, v = k.astype(compute_dtype), v.astype(compute_dtype)
    codes, (B, _, T) = lsh_codes(k, W), k.shape[:3]
    mine = state if layer is None else {n: jax.lax.dynamic_index_in_dim(state[n], layer, keepdims=False)
                                        for n in ("length", "segment", "start")}  # the layer's document
    start = causal_starts(mine, segment_ids, T, B)[:, -1]
    segment = jnp.zeros((B,), jnp.int32) if segment_ids is None else segment_ids[:, -1].astype(jnp.int32)
    if state is None:
        sdt = jnp.promote_types(compute_dtype, jnp.float32) if cache_dtype is None else cache_dtype
        return {"k": k.astype(sdt), "v": v.astype(sdt), "codes": codes, "proj": W, "length": jnp.asarray(T, jnp.int32),
                "segment": segment, "start": start}
    if layer is not None:
        P0 = state["length"][layer]
        put = lambda a, x: jax.lax.dynamic_update_slice(  # noqa: E731
            a, x.astype(a.dtype)[None], (layer, 0, 0, P0) + (0,) * (a.ndim - 4))
        at = lambda a, x: jax.lax.dynamic_update_index_in_dim(a, jnp.asarray(x, a.dtype), layer, 0)  # noqa: E731
        return {"k": put(state["k"], k), "v": put(state["v"], v), "codes": put(state["codes"], codes),
                "proj": at(state["proj"], W), "length": at(state["length"], P0 + T),
                "segment": at(state["segment"], segment), "start": at(state["start"], start)}
    P0 = state["length"]
    put = lambda a, x: jax.lax.dynamic_update_slice(a, x.astype(a.dtype), (0, 0, P0) + (0,) * (a.ndim - 3))  # noqa: E731
    return {"k": put(state["k"], k), "v": put(state["v"], v), "codes": put(state["codes"], codes), "proj": W,
            "length": jnp.asarray(P0 + T, jnp.int32), "segment": segment, "start": start}


__all__ = ["CUM_SHIFT", "INT_MAX", "NEG", "NORM_SHIFT", "U_MAX", "BidirOptions", "CausalOptions",
           "augmented_gram", "bidir_samples", "document_lambda", "packed_bidir_samples", "words_at", "words_sub", "causal_starts", "document_lengths", "draw_projections", "draw_rows", "draw_samples", "gray_rank", "inverse_permutation", "lsh_codes",
           "next_state", "one_token_applies", "norm_weights", "power_lambda", "prefix_end", "weight_prefix_sums"]

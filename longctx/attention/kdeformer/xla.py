"""The tiled KDEformer estimator (docs/methods/kdeformer.md; § as there): the same entries as
``reference.py``, computed with static shapes in bounded memory, for long sequences and decoding.

Bidirectional (§2.3): keys and queries sorted by Gray rank and cut into equal blocks; the heavy part is the
block-diagonal product ``[B,H,nb,b,b]``, the sampled columns one ``[b, m]`` product per block.

Causal (§4.2): query tiles of one chunk each, in groups under ``lax.map`` (``tile_budget`` logits per step,
recomputed in the backward pass); keys sorted once by ``κ_j = h(k_j)·M + j`` so that a query's heavy set
``Hv(i)`` is a run of sorted slots found by two ``searchsorted``. Its heavy logits take one of three routes
(``CausalOptions.heavy_impl``), same entries: 'gather' the ≤ b_h keys of every query (§4.2; memory-bound),
'scores' one ``[c, M]`` product per chunk kept only on the heavy set (short caches), 'band'
(:func:`heavy_band`, full passes; a call with a state gathers): tiles of code-sorted queries against the blocks
of code-sorted keys their runs touch, as products. 'auto': 'scores' while the cache holds ≤
``heavy_scores_max_len`` tokens, else 'band' for a full pass and 'gather' for a call with a state.

Packed rows (§4.6, ``segment_ids``): :func:`bidir_packed` (documents sorted apart, each query block against the
three key blocks around it) and :func:`causal_forward` with ``starts`` (per-query prefix ends, a local window of
one more chunk, per-query samples: 'uniform' from a table of every chunk's draws, 'ref' from one draw per
document chunk, :func:`_packed_ref_draws`).

Gradient policy (§6): the plans (:func:`bidir_plan`, :func:`causal_plan`: hashes, permutations, samples,
log-weights, masks) are ``stop_gradient``; :func:`bidir_apply` / :func:`causal_apply` are differentiable.

The three heavy routes are portable: the implementation ``xla`` runs any of them on any platform (the
``heavy_impl`` setting picks it), and the CPU implementations ``gather``, ``scores`` and ``band`` are the same routes
with XLA:CPU's products. The one op the tiled algorithm takes as an argument is ``row_scale(x, s) = x * s[..., None]``
(the softmax's division and the band's rescaling): this module's plain multiply is the portable implementation
``xla``; the CPU-tuned implementations (their own file) pass the XLA:CPU form of the same product.

Declared here (``IMPLEMENTATIONS``): ``xla``, both directions; 'auto' takes it on GPUs and TPUs (on cuda after
``pallas``, ``pallas.py``, for the full causal passes whose route is 'band'). On a CPU 'auto'
takes the CPU-tuned implementations instead (``xla`` runs there when named). The causal one declares the per-platform
defaults of ``tile_budget``, ``heavy_scores_max_len`` and ``heavy_band_block`` (:data:`DEFAULTS`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longctx.attention import dispatch
from longctx.attention.base import LayerOfStack
from longctx.attention.dispatch import Implementation
from longctx.attention.kdeformer.common import (
    INT_MAX,
    NEG,
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
    one_token_applies,
    packed_bidir_samples,
    power_lambda,
    prefix_end,
    weight_prefix_sums,
    words_at,
    words_sub,
)
from longctx.models.precision import einsum_f32
from pallas_kernels.precision import statistic


def row_scale(x, s):
    """``x [..., d] * s[..., None]``."""
    return x * s[..., None]


def _ftype(x):
    """Compute dtype: fp32, or fp64 for fp64 inputs (reference tests under jax_enable_x64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _take(x, idx):
    """x [B,H,N,...], idx [B,H,K] -> [B,H,K,...] (row gather along axis 2; slices of whole rows)."""
    return jax.vmap(jax.vmap(lambda a, i: jnp.take(a, i, axis=0, mode="clip")))(x, idx)


_ssorted = jax.vmap(jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="left")))


def _combine(parts, row_scale=row_scale):
    """One log-space softmax over the union of entry groups (§2.3h).

    parts: list of (logits [..., n_i], mask (broadcastable), value_fn) where value_fn(p) gives
    Σ_t p_t value_t [..., dv]. Returns (out [..., dv], lse [...]); rows without a valid entry
    give out 0 and lse −1e30."""
    ss = [jnp.where(mk, s, NEG) for s, mk, _ in parts]
    mx = ss[0].max(axis=-1)
    for s in ss[1:]:
        mx = jnp.maximum(mx, s.max(axis=-1))
    mx = jax.lax.stop_gradient(mx)
    den, num = 0.0, 0.0
    for s, (_, mk, vf) in zip(ss, parts):
        p = jnp.where(mk, jnp.exp(s - mx[..., None]), 0.0)
        den = den + jnp.sum(p, axis=-1)
        num = num + vf(p)
    out = row_scale(num, 1.0 / jnp.maximum(den, 1e-30))
    lse = mx + jnp.log(jnp.maximum(den, 1e-30))
    return out, lse


# ---------------------------------------------------------------------------
# bidirectional (§2.3)
# ---------------------------------------------------------------------------


def bidir_plan(q, k, v, W, key_s, n_valid: int, opts: BidirOptions):
    """Hashes, permutations, samples and log-weights (all stop_gradient).

    q, k, v: [B,H,Np,·] padded to a multiple of the bucket size; rows ≥ n_valid are padding."""
    Np = q.shape[2]
    b, r, m = opts.bucket_size, opts.num_projs, opts.num_samples
    q, k, v = (jax.lax.stop_gradient(x) for x in (q, k, v))
    valid = jnp.arange(Np) < n_valid
    sentinel = 1 << r
    rq = jnp.where(valid, gray_rank(lsh_codes(q, W), r, opts.gray_order), sentinel)
    rk = jnp.where(valid, gray_rank(lsh_codes(k, W), r, opts.gray_order), sentinel)
    perm_q = jnp.argsort(rq, axis=-1, stable=True).astype(jnp.int32)
    perm_k = jnp.argsort(rk, axis=-1, stable=True).astype(jnp.int32)
    kblk = inverse_permutation(perm_k) // b  # block id of every key [B,H,Np]
    plan = {"perm_q": perm_q, "perm_k": perm_k, "kblk": kblk}
    if m > 0 and opts.residual == "sampled":
        idx, plan["omega"] = bidir_samples(key_s, v, n_valid, opts)
        plan["idx"] = idx
        plan["sblk"] = jnp.take_along_axis(kblk, idx, axis=-1)
    return jax.tree.map(jax.lax.stop_gradient, plan)


def bidir_apply(q, k, v, plan, n_valid: int, opts: BidirOptions, row_scale=row_scale):
    """Differentiable part. Returns (out [B,H,Np,dv] in original order, lse [B,H,Np] = log D̃)."""
    B, H, Np, d = q.shape
    dv = v.shape[-1]
    b, m = opts.bucket_size, opts.num_samples
    nb = Np // b
    sig = opts.scale
    q, k, v = (x.astype(q.dtype) for x in (q, k, v))  # the compute dtype; scores and softmax in float32
    valid = jnp.arange(Np) < n_valid
    perm_q, perm_k = plan["perm_q"], plan["perm_k"]
    Qs = _take(q, perm_q).reshape(B, H, nb, b, d)
    Ks = _take(k, perm_k).reshape(B, H, nb, b, d)
    Vs = _take(v, perm_k).reshape(B, H, nb, b, dv)
    kval_s = valid[perm_k].reshape(B, H, nb, 1, b)
    s_h = sig * einsum_f32("bhnqd,bhnkd->bhnqk", Qs, Ks)
    parts = [(s_h, kval_s, lambda p: einsum_f32("bhnqk,bhnkd->bhnqd", p.astype(Vs.dtype), Vs))]
    blk = jnp.arange(nb, dtype=jnp.int32)[None, None, :, None, None]
    if opts.residual == "exact":
        s_r = sig * einsum_f32("bhnqd,bhkd->bhnqk", Qs, k)
        mask = (plan["kblk"][:, :, None, None, :] != blk) & valid[None, None, None, None, :]
        parts.append((s_r, mask, lambda p: einsum_f32("bhnqk,bhkd->bhnqd", p.astype(v.dtype), v)))
    elif m > 0:
        Kl, Vl = _take(k, plan["idx"]), _take(v, plan["idx"])
        s_s = sig * einsum_f32("bhnqd,bhmd->bhnqm", Qs, Kl)
        s_s = s_s + plan["omega"][:, :, None, None, :]
        mask = plan["sblk"][:, :, None, None, :] != blk
        parts.append((s_s, mask, lambda p: einsum_f32("bhnqm,bhmd->bhnqd", p.astype(Vl.dtype), Vl)))
    out_s, lse_s = _combine(parts, row_scale)
    inv_q = inverse_permutation(perm_q)
    out = _take(out_s.reshape(B, H, Np, dv), inv_q)
    lse = jnp.take_along_axis(lse_s.reshape(B, H, Np), inv_q, axis=-1)
    return out, lse


def bidir_forward(q, k, v, W, key_s, opts: BidirOptions, *, return_lse: bool = False, row_scale=row_scale):
    """Full bidirectional estimator. q,k [B,H,N,d], v [B,H,N,dv] -> out [B,H,N,dv] (fp32)."""
    N = q.shape[2]
    b = opts.bucket_size
    Np = -(-N // b) * b
    pad = ((0, 0), (0, 0), (0, Np - N), (0, 0))
    qp, kp, vp = (jnp.pad(x.astype(q.dtype), pad) for x in (q, k, v))  # compute dtype (statistics: float32)
    plan = bidir_plan(qp, kp, vp, W, key_s, N, opts)
    out, lse = bidir_apply(qp, kp, vp, plan, N, opts, row_scale)
    if return_lse:
        return out[:, :, :N], lse[:, :, :N], plan
    return out[:, :, :N]


def _doc_sort(rank, start, pos):
    """Slots ordered by (document start, rank, position): every document's tokens together, in row order, each
    sorted stably by rank as alone (§4.6). rank [B,H,N]; start [B,N]."""
    by_rank = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    st = jnp.broadcast_to(start[:, None, :], rank.shape)
    by_doc = jnp.argsort(jnp.take_along_axis(st, by_rank, axis=-1), axis=-1, stable=True).astype(jnp.int32)
    return jnp.take_along_axis(by_rank, by_doc, axis=-1)


def bidir_packed(q, k, v, W, key_s, segment_ids, opts: BidirOptions, row_scale=row_scale):
    """The bidirectional estimator of a packed row (§4.6): every document as if alone. out [B,H,N,dv].

    Queries and keys are sorted by (document, rank, position), so each document fills the slots [s, s + n) of
    both orders (s its first token, n its length) sorted as alone, and its blocks of b are cut from s: a query at
    sorted slot t has the document block (t − s) // b, whose keys are the slots [s + b·⌊(t−s)/b⌋, …) (≤ b of them,
    the document's last block shorter: the padding alone holds no key). Those lie within b − 1 slots of t, so each
    row block of b sorted queries is scored against the 3 row blocks of sorted keys around it, masked to each
    query's document block (3x the heavy products of one stream). The samples are every query's own document's
    (:func:`common.packed_bidir_samples`: the draws that document makes alone), gathered per query."""
    B, H, N, d = q.shape
    dv = v.shape[-1]
    b, r, m = opts.bucket_size, opts.num_projs, opts.num_samples
    nb = -(-N // b)
    Np = nb * b
    pad = ((0, 0), (0, 0), (0, Np - N), (0, 0))
    q, k, v = (jnp.pad(x.astype(q.dtype), pad) for x in (q, k, v))  # the compute dtype
    start, n = document_lengths(segment_ids)
    start = jnp.pad(start, ((0, 0), (0, Np - N)), constant_values=N)  # the padding: a document of its own, last
    n = jnp.pad(n, ((0, 0), (0, Np - N)))  # ... that draws nothing and is never drawn
    pos = jnp.arange(Np, dtype=jnp.int32)
    valid = pos < N
    stb, nbh = (jnp.broadcast_to(x[:, None, :], (B, H, Np)) for x in (start, n))

    def plan_fn(q, k, v):
        rank = lambda x: jnp.where(valid, gray_rank(lsh_codes(x, W), r, opts.gray_order), 1 << r)  # noqa: E731
        perm_q, perm_k = _doc_sort(rank(q), start, pos), _doc_sort(rank(k), start, pos)
        kblk = (inverse_permutation(perm_k) - stb) // b  # every key's block in its document
        sq, nq = (jnp.take_along_axis(x, perm_q, axis=-1) for x in (stb, nbh))  # sorted queries' documents
        lo = sq + (pos - sq) // b * b
        plan = {"perm_q": perm_q, "perm_k": perm_k, "kblk": kblk, "lo": lo,
                "hi": jnp.minimum(lo + b, sq + nq), "qblk": (pos - sq) // b, "sq": sq}
        if m > 0 and opts.residual == "sampled":
            idx, omega = packed_bidir_samples(key_s, v, start, n, opts)  # [B,H,Np,m], token order
            plan["idx"] = jnp.take_along_axis(idx, perm_q[..., None], axis=2)
            plan["omega"] = jnp.take_along_axis(omega, perm_q[..., None], axis=2)
        return jax.tree.map(jax.lax.stop_gradient, plan)

    plan = plan_fn(*(jax.lax.stop_gradient(x) for x in (q, k, v)))
    Qs = _take(q, plan["perm_q"]).reshape(B, H, nb, b, d)
    ext = lambda x: jnp.pad(_take(x, plan["perm_k"]), ((0, 0), (0, 0), (b, b), (0, 0)))  # noqa: E731
    band = lambda x: jnp.concatenate([x[:, :, o:o + Np].reshape(B, H, nb, b, -1) for o in (0, b, 2 * b)], 3)  # noqa: E731
    K3, V3 = band(ext(k)), band(ext(v))  # [B,H,nb,3b,·]: the row blocks before, at and after each query block
    slot = (jnp.arange(nb, dtype=jnp.int32)[:, None] - 1) * b + jnp.arange(3 * b, dtype=jnp.int32)  # [nb,3b]
    lo, hi = (plan[x].reshape(B, H, nb, b, 1) for x in ("lo", "hi"))
    hmask = (slot[:, None, :] >= lo) & (slot[:, None, :] < hi)
    sig = opts.scale
    s_h = (sig * einsum_f32("bhnqd,bhnkd->bhnqk", Qs, K3)).reshape(B, H, Np, 3 * b)  # rows: sorted queries
    heavy_v = lambda p: einsum_f32("bhnqk,bhnkd->bhnqd", p.reshape(B, H, nb, b, 3 * b).astype(V3.dtype),  # noqa: E731
                                   V3).reshape(B, H, Np, dv)
    parts = [(s_h, hmask.reshape(B, H, Np, 3 * b), heavy_v)]
    Qf = Qs.reshape(B, H, Np, d)
    if opts.residual == "exact":  # every other key of the query's document (debug, O(N²))
        s_r = sig * einsum_f32("bhqd,bhkd->bhqk", Qf, k)
        mask = ((stb[:, :, None, :] == plan["sq"][..., None]) & (plan["kblk"][:, :, None, :] != plan["qblk"][..., None])
                & valid)
        parts.append((s_r, mask, lambda p: einsum_f32("bhqk,bhkd->bhqd", p.astype(v.dtype), v)))
    elif "idx" in plan:
        flat = plan["idx"].reshape(B, H, -1)
        Kl, Vl = (_take(x, flat).reshape(B, H, Np, m, -1) for x in (k, v))
        s_s = sig * jnp.sum((Qf[:, :, :, None, :] * Kl).astype(_ftype(Qf)), axis=-1) + plan["omega"]
        smask = jnp.take_along_axis(plan["kblk"], flat, axis=-1).reshape(B, H, Np, m) != plan["qblk"][..., None]
        parts.append((s_s, smask, lambda p: jnp.sum(p[..., None] * Vl, axis=-2)))
    out_s, _ = _combine(parts, row_scale)
    out_s = out_s.reshape(B, H, Np, dv)
    return _take(out_s, inverse_permutation(plan["perm_q"]))[:, :, :N]


# ---------------------------------------------------------------------------
# causal (§4)
# ---------------------------------------------------------------------------


def route_for(heavy_impl: str, heavy_scores_max_len: int, M: int, full_pass: bool) -> str:
    """The causal heavy logits' route for the setting ``heavy_impl`` and a cache of ``M`` keys: 'band' (full passes
    only), 'scores' or 'gather' (§4.2)."""
    route = heavy_impl
    if route == "auto":
        route = "scores" if M <= heavy_scores_max_len else ("band" if full_pass else "gather")
    if route == "band" and not full_pass:  # with a cache the band's blocks span the whole cache per query
        route = "gather"
    return route


def heavy_route_of(opts: CausalOptions, M: int, full_pass: bool) -> str:
    """:func:`route_for` of the options' ``heavy_impl`` and ``heavy_scores_max_len``."""
    return route_for(opts.heavy_impl, opts.heavy_scores_max_len, M, full_pass)


def code_sort(HKc, n_valid):
    """Keys sorted by κ_j = h(k_j)·M + j (positions ≥ n_valid last): (order, κ_s, spos = order⁻¹), [B,H,M]."""
    M = HKc.shape[-1]
    pos = jnp.arange(M, dtype=jnp.int32)
    kappa = jnp.where(pos < n_valid, HKc * M + pos, INT_MAX)
    order = jnp.argsort(kappa, axis=-1).astype(jnp.int32)
    return order, jnp.take_along_axis(kappa, order, axis=-1), inverse_permutation(order)


def heavy_bounds(kappa_s, hq, L, bh: int, start=None):
    """Hv(i) as a range of sorted slots [lo, hi): the ≤ b_h last keys of code hq_i before L_i (§4.2 step 2), from
    the query's document's first key ``start`` on (a packed row, §4.6; None: 0). kappa_s [B,H,M]; hq [B,H,N] query
    codes; L [N] or [B,H,N] prefix ends (or broadcastable, as ``start``). Empty when hi ≤ lo."""
    M = kappa_s.shape[-1]
    hi = _ssorted(kappa_s, hq * M + L).astype(jnp.int32)
    st = _ssorted(kappa_s, hq * M if start is None else hq * M + start).astype(jnp.int32)
    return jnp.maximum(hi - bh, st), hi


def band_pairs(lo, hi, tq: int, kb: int, n_keys: int):
    """The key blocks each query tile needs: (first block b0, block count cnt, inclusive cumsum of cnt), [n_t] each,
    for queries sorted by their band ends (lo, hi [Np], Np a multiple of tq; empty rows last) and keys in blocks
    of kb.

    Tile j needs the blocks of the sorted slots [min lo, max hi) of its non-empty rows. With F_j, H_j the first
    and last hi of tile j, that span is at most H_j − F_j + b_h long (lo ≥ hi − b_h), and the tiles' [F_j, H_j]
    do not overlap (the rows are sorted by hi), so Σ_j span_j ≤ n_keys + n_t·b_h; a span of s slots touches fewer
    than s/kb + 2 blocks. ceil((n_keys + n_t·b_h) / kb) + 2·n_t is therefore a static bound on the pairs any
    input needs (:func:`heavy_band` computes that many): no heavy key is ever dropped."""
    n_t = lo.shape[0] // tq
    lo_t, hi_t = lo.reshape(n_t, tq), hi.reshape(n_t, tq)
    ok = hi_t > lo_t
    tlo = jnp.min(jnp.where(ok, lo_t, n_keys), axis=1)
    thi = jnp.max(jnp.where(ok, hi_t, 0), axis=1)
    b0 = tlo // kb
    cnt = jnp.where(thi > tlo, (thi - 1) // kb - b0 + 1, 0)
    ends = jnp.cumsum(cnt)
    return b0, cnt, ends


def band_sizes(N: int, M: int, block: int, bh: int):
    """The band's static sizes for N queries, M code-sorted keys, tiles of ``block`` sorted queries against blocks
    of ``block`` sorted keys and heavy sets of ≤ ``bh`` keys: (query tiles n_t, padded rows Np, key blocks Mb, the
    static pair count n_pairs of :func:`band_pairs`)."""
    n_t = -(-N // block)
    return n_t, n_t * block, -(-M // block), -(-(M + n_t * bh) // block) + 2 * n_t


def band_order(lo, hi, Np: int):
    """One (batch, head)'s queries sorted by their band ends hi (empty rows last), [N] -> (order qord [N], lo_s,
    hi_s [Np]: the sorted rows' bands, padded rows empty)."""
    ok = hi > lo
    qord = jnp.argsort(jnp.where(ok, hi, INT_MAX)).astype(jnp.int32)
    pad = (0, Np - lo.shape[0])
    return qord, jnp.pad(lo[qord], pad), jnp.pad(hi[qord], pad)


def pair_list(b0, cnt, ends, n_pairs: int):
    """:func:`band_pairs`' per-tile blocks as a list of n_pairs (tile, block, valid) entries, tile-major (the
    entries past the pairs needed, ``ends[-1]``, are invalid)."""
    n_t = b0.shape[0]
    p = jnp.arange(n_pairs, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(ends, p, side="right"), n_t - 1).astype(jnp.int32)
    return tile, b0[tile] + p - (ends - cnt)[tile], p < ends[-1]


def heavy_band(q, Ks, Vs, lo, hi, scale: float, bh: int, block: int, budget: int, row_scale=row_scale):
    """The heavy part of a full causal pass (§4.1 'Heavy') as dense blocks of the code-sorted keys.

    q [B,H,N,d]; Ks, Vs [B,H,M,·] the keys and values in code-sorted order (κ_s); query i's heavy set is the
    sorted slots [lo_i, hi_i) (:func:`heavy_bounds`, ≤ b_h of them). Every row's heavy keys are contiguous in
    that order, and sorting the queries by hi makes neighbouring queries' bands overlap: tiles of ``block``
    sorted queries are scored against the blocks of ``block`` sorted keys their bands touch (σ q kᵀ matmuls;
    entries outside a row's band are masked), a static number of (tile, block) pairs (:func:`band_pairs`).
    The same logits as gathering each query's keys (memory-bound on CPU: ~N·b_h·d gathered rows), about
    4x as many scored, as matmuls. Returns (out [B,H,N,dv], lse [B,H,N]) of the softmax over each row's heavy
    set (rows without one: out 0, lse NEG), to be merged with the other parts by :func:`_combine`.
    The Pallas kernel ``pallas_kernels/kde_band.py`` computes the same (implementation ``pallas``,
    :func:`longctx.attention.kdeformer.pallas.heavy_band_kernel`)."""
    B, H, N, d = q.shape
    M, dv = Ks.shape[2], Vs.shape[-1]
    tq = kb = block
    n_t, Np, Mb, n_pairs = band_sizes(N, M, block, bh)

    def one(q, Ks, Vs, lo, hi):  # one (batch, head)
        qord, lo_s, hi_s = band_order(lo, hi, Np)
        q_s = jnp.pad(q[qord], ((0, Np - N), (0, 0))).reshape(n_t, tq, d)
        K_b = jnp.pad(Ks, ((0, Mb * kb - M), (0, 0))).reshape(Mb, kb, d)
        V_b = jnp.pad(Vs, ((0, Mb * kb - M), (0, 0))).reshape(Mb, kb, dv)
        tile, blk, valid = pair_list(*band_pairs(lo_s, hi_s, tq, kb, M), n_pairs)
        lo_t, hi_t = lo_s.reshape(n_t, tq), hi_s.reshape(n_t, tq)

        def pair(t, b, v):  # one (tile, block): [tq, kb] logits, their max, exp-sums and exp-weighted values
            slot = b * kb + jnp.arange(kb, dtype=jnp.int32)
            mask = v & (slot[None, :] >= lo_t[t][:, None]) & (slot[None, :] < hi_t[t][:, None])
            bc = jnp.clip(b, 0, Mb - 1)
            s = scale * einsum_f32("qd,kd->qk", q_s[t], K_b[bc])
            s = jnp.where(mask, s, NEG)
            m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
            e = jnp.where(mask, jnp.exp(s - m[:, None]), 0.0)
            return m, jnp.sum(e, axis=-1), einsum_f32("qk,kd->qd", e.astype(V_b[bc].dtype), V_b[bc])

        bs = max(1, budget // (B * H * tq * kb))
        if bs >= n_pairs:
            m, den, num = jax.vmap(pair)(tile, blk, valid)
        else:  # long sequences: pairs in batches, each batch's logits recomputed in the backward pass
            m, den, num = jax.lax.map(jax.checkpoint(lambda a: pair(*a)), (tile, blk, valid), batch_size=bs)
        # merge each tile's pairs (flash-style: rescale every pair to the tile's max)
        mt = jnp.maximum(jax.ops.segment_max(m, tile, n_t, indices_are_sorted=True), NEG)  # empty: -inf
        w = jnp.exp(m - mt[tile])
        den = jax.ops.segment_sum(w * den, tile, n_t, indices_are_sorted=True).reshape(Np)
        num = jax.ops.segment_sum(row_scale(num, w), tile, n_t, indices_are_sorted=True).reshape(Np, dv)
        out_s = row_scale(num, 1.0 / jnp.maximum(den, 1e-30))
        lse_s = jnp.where(den > 0, mt.reshape(Np) + jnp.log(jnp.maximum(den, 1e-30)), NEG)
        back = inverse_permutation(qord)  # sorted row of every query
        return out_s[back], lse_s[back]

    return jax.vmap(jax.vmap(one))(q, Ks, Vs, lo, hi)


def causal_plan(hq_tiles, tile_ids, Kc, Vc, HKc, n_valid, key_s, opts: CausalOptions, heavy_sets: bool = True,
                sorted_keys=None, start_tiles=None):
    """Heavy sets and samples of query tiles (all stop_gradient).

    hq_tiles: int32 [n_t,B,H,c] query codes; tile_ids: int32 [n_t] absolute chunk indices.
    Kc, Vc, HKc: the sequence so far [B,H,M,·] (positions ≥ n_valid are not keys yet).
    Returns a dict of [n_t, ...] arrays: hidx/hvalid [B,H,c,b_h] (``heavy_sets``; the 'band' route scores
    the heavy sets from :func:`heavy_bounds` instead), sidx/omega [B,H,m], smask [B,H,c,m].
    ``sorted_keys``: :func:`code_sort`'s result when the caller has it.
    ``start_tiles`` (a packed row, §4.6): int32 [n_t,B,c] the cache position of each query's document's first
    token; every index is then counted from it (:func:`packed_query`) and the samples are the query's own,
    sidx/omega [B,H,c,m] (a tile's queries may belong to several documents and chunks)."""
    B, H, M = HKc.shape
    c, bh, m = opts.chunk_size, opts.heavy_capacity, opts.num_samples
    if (1 << opts.num_projs) * M >= 2**31:
        raise ValueError(f"kdeformer: 2^num_projs * length = {(1 << opts.num_projs) * M} overflows int32; "
                         "lower causal.num_projs or the length")
    pos = jnp.arange(M, dtype=jnp.int32)
    order, kappa_s, spos = sorted_keys if sorted_keys is not None else code_sort(HKc, n_valid)
    ref = opts.sampling == "ref" and m > 0 and opts.residual == "sampled"
    if ref:
        vvalid = pos < n_valid
        u = norm_weights(Vc, vvalid)
        cum = weight_prefix_sums(u)  # exact at any length (two int32 words)
        Mc = -(-M // c) * c
        vpad = jnp.pad(Vc.astype(jnp.float32), ((0, 0), (0, 0), (0, Mc - M), (0, 0)))
        vval = jnp.pad(vvalid, (0, Mc - M)).reshape(Mc // c, c)
        grams = augmented_gram(vpad.reshape(B, H, Mc // c, c, -1), vval[None, None])
        gram_cum = jnp.cumsum(grams, axis=2)  # [B,H,Gm,e,e]

    if start_tiles is not None:
        ref_draws = None
        if ref:
            ref_draws = _packed_ref_draws(tile_ids, start_tiles, Vc, n_valid, key_s, opts)
        return _packed_plan(hq_tiles, tile_ids, start_tiles, HKc, key_s, opts, heavy_sets, (order, kappa_s, spos),
                            ref_draws)

    def one(hq, g):
        L = prefix_end(g, opts)
        out = {}
        if heavy_sets:  # heavy: up to b_h most recent keys j < L with the query's code
            lo, e = heavy_bounds(kappa_s, hq, L, bh)
            t = e[..., None] - bh + jnp.arange(bh, dtype=jnp.int32)
            out["hvalid"] = t >= lo[..., None]
            out["hidx"] = jnp.take_along_axis(order, jnp.clip(t, 0, M - 1).reshape(B, H, -1),
                                              axis=-1).reshape(t.shape)
        if m > 0 and opts.residual == "sampled":
            kg = jax.random.fold_in(key_s, g)
            n = jnp.full((B, H), jnp.maximum(L, 1), jnp.int32)
            if ref:
                gi = jnp.maximum(L // c - 1, 0)
                lam = power_lambda(jax.lax.dynamic_index_in_dim(gram_cum, gi, axis=2, keepdims=False),
                                   opts.power_iters)
                idx, p = draw_samples(kg, m, n, "ref", cum=cum, u=u, lam=lam)
            else:
                idx, p = draw_samples(kg, m, n, "uniform")
            hk_l = jnp.take_along_axis(HKc, idx, axis=-1)
            cnt = _ssorted(kappa_s, hk_l * M + L) - jnp.take_along_axis(spos, idx, axis=-1) - 1
            x = jnp.where(cnt < bh, hk_l, -1)  # code of the heavy sets the sample belongs to
            out["sidx"] = idx
            out["omega"] = -jnp.log(m * p)
            out["smask"] = (L > 0) & (x[:, :, None, :] != hq[..., None])
        elif opts.residual == "exact":
            # every prefix key j < L not in Hv(i), weight 1 (debug only, O(N²))
            cnt = _ssorted(kappa_s, HKc * M + L) - spos - 1
            x = jnp.where(cnt < bh, HKc, -1)
            out["rmask"] = (pos < L)[None, None, None, :] & (x[:, :, None, :] != hq[..., None])
        return out

    plan = jax.vmap(one)(hq_tiles, tile_ids)
    return jax.tree.map(jax.lax.stop_gradient, plan)


def packed_query(g, start, opts: CausalOptions):
    """A packed row's query tile (§4.6): (positions [c], the query's chunk in its document [B,c], its prefix end L
    as a cache position [B,c]) for the tile at absolute chunk g and the queries' document starts [B,c]."""
    qpos = g * opts.chunk_size + jnp.arange(opts.chunk_size, dtype=jnp.int32)
    gd = (qpos[None, :] - start) // opts.chunk_size
    return qpos, gd, start + prefix_end(gd, opts)


def _packed_ref_draws(tile_ids, start_tiles, Vc, n_valid, key_s, opts: CausalOptions):
    """The ``ref`` sampler's draws of every query of a packed row (§4.6): (sidx, p) [n_t,B,H,c,m], those its
    document draws alone at its chunk gd (``fold_in(k_S, gd)``), shifted to the document's first key.

    The draws are made once per (document, chunk) with a prefix, an *entry*: such chunks hold c queries apart from
    the call's first and a document's last, and documents with a prefix are more than c tokens apart, so a row has
    at most ceil(Q/c) + 1 of them (Q query slots), a static table. Each row draws with its own chunk's key
    (``common.draw_rows``). An entry's prefix [s, s + L) has the exact integer weight sums of the row's less those
    before s, and the Gram of its rows: the row grid's chunk Grams inside it (a masked sum over the chunks, no
    differences of running sums) plus the two partial chunks at its ends; λ is that Gram's power iteration, equal to
    the document's alone up to the order of the sums (§4.6)."""
    n_t, B, c = start_tiles.shape
    H, M = Vc.shape[1], Vc.shape[2]
    m, Q, E = opts.num_samples, n_t * c, n_t + 1
    qpos = (tile_ids[:, None] * c + jnp.arange(c, dtype=jnp.int32)).reshape(Q)
    start = jnp.moveaxis(start_tiles, 1, 0).reshape(B, Q)
    gd = (qpos - start) // c
    Lrel = prefix_end(gd, opts)
    new = jnp.concatenate([jnp.ones((B, 1), bool), (start[:, 1:] != start[:, :-1]) | (gd[:, 1:] != gd[:, :-1])], 1)
    head = new & (Lrel > 0)
    ent = jnp.maximum(jnp.cumsum(head, axis=1) - 1, 0)  # [B,Q]: each query's entry (queries with L = 0: unused)
    hp = jax.vmap(lambda h: jnp.nonzero(h, size=E, fill_value=0)[0])(head).astype(jnp.int32)  # [B,E]
    s_e, gd_e = (jnp.take_along_axis(x, hp, axis=1) for x in (start, gd))
    n_e = jnp.maximum(prefix_end(gd_e, opts), 1)  # [B,E]
    pos = jnp.arange(M, dtype=jnp.int32)
    u = norm_weights(Vc, pos < n_valid)
    cum = weight_prefix_sums(u)
    # the prefixes' Grams: full chunks of the row grid inside [s, s + n), and the partial chunks at both ends
    Mc = -(-M // c) * c
    va = jnp.pad(Vc.astype(jnp.float32), ((0, 0), (0, 0), (0, Mc - M + c), (0, 0)))
    vval = jnp.pad(pos < n_valid, (0, Mc - M)).reshape(Mc // c, c)
    grams = augmented_gram(va[:, :, :Mc].reshape(B, H, Mc // c, c, -1), vval[None, None])  # [B,H,Gm,e,e]
    a, z = s_e, s_e + n_e  # [B,E]
    ka, kz = -(-a // c), z // c
    k = jnp.arange(Mc // c, dtype=jnp.int32)
    inside = ((k >= ka[..., None]) & (k < kz[..., None])).astype(jnp.float32)  # [B,E,Gm]
    with statistic("kdeformer ref sampler: a packed document's prefix Gram (a statistic of lambda, §4.6)"):
        full = jnp.einsum("bek,bhkxy->bhexy", inside, grams)

    def part(first, upto):  # the Gram of the rows [first, upto) within c rows of first: [B,H,E,e,e]
        rows = first[..., None] + jnp.arange(c, dtype=jnp.int32)  # [B,E,c]
        ok = (rows < upto[..., None]) & (rows < n_valid)
        return augmented_gram(jax.vmap(lambda x, r: x[:, r])(va, rows), ok[:, None])

    gram = full + part(a, jnp.minimum(ka * c, z)) + part(kz * c, z)
    lam = power_lambda(gram, opts.power_iters)  # [B,H,E]
    bh = lambda x: jnp.broadcast_to(x[:, None], (B, H) + x.shape[1:])  # noqa: E731
    before = words_at(cum, bh(s_e - 1))
    tot = words_sub(words_at(cum, bh(s_e + n_e - 1)), before)

    def entry(e):
        col = lambda x: x[:, :, e]  # noqa: E731
        draw = lambda b: draw_samples(jax.random.fold_in(key_s, gd_e[b, e]), m, bh(n_e)[:, :, e], "ref", cum=cum,  # noqa: E731
                                      u=u, lam=col(lam), first=bh(s_e)[:, :, e],
                                      before=tuple(col(x)[..., None] for x in before),
                                      tot=tuple(col(x)[..., None] for x in tot))
        return draw_rows(draw, B)

    idx, p = jax.vmap(entry, out_axes=2)(jnp.arange(E))  # [B,H,E,m]
    per_query = lambda x: jnp.moveaxis(  # noqa: E731
        jnp.take_along_axis(x, bh(ent)[..., None], axis=2).reshape(B, H, n_t, c, m), 2, 0)
    return per_query(idx), per_query(p)


def _packed_plan(hq_tiles, tile_ids, start_tiles, HKc, key_s, opts: CausalOptions, heavy_sets, sorted_keys,
                 ref_draws=None):
    """:func:`causal_plan` of a packed row (§4.6): every query's heavy set, samples and masks those of its document
    alone. 'uniform': its chunk gd in its document picks the draws of ``fold_in(k_S, gd)`` (one table of every
    chunk's draws, ``[G,B,H,m]``, the draws a full pass of the document alone makes), shifted to the document's
    first key; 'ref': ``ref_draws`` (:func:`_packed_ref_draws`)."""
    B, H, M = HKc.shape
    c, bh, m = opts.chunk_size, opts.heavy_capacity, opts.num_samples
    order, kappa_s, spos = sorted_keys
    pos = jnp.arange(M, dtype=jnp.int32)
    G = -(-M // c)
    if m > 0 and opts.residual == "sampled" and ref_draws is None:
        def chunk_draws(g):
            n = jnp.full((B, H), jnp.maximum(prefix_end(g, opts), 1), jnp.int32)
            return draw_samples(jax.random.fold_in(key_s, g), m, n, "uniform")[0]

        table = jnp.moveaxis(jax.vmap(chunk_draws)(jnp.arange(G, dtype=jnp.int32)), 0, 2)  # [B,H,G,m]

    def one(hq, g, st, drawn):
        _, gd, L = packed_query(g, st, opts)
        Lh, sth = L[:, None, :], st[:, None, :]  # [B,1,c]
        out = {}
        if heavy_sets:
            lo, e = heavy_bounds(kappa_s, hq, Lh, bh, sth)
            t = e[..., None] - bh + jnp.arange(bh, dtype=jnp.int32)
            out["hvalid"] = t >= lo[..., None]
            out["hidx"] = jnp.take_along_axis(order, jnp.clip(t, 0, M - 1).reshape(B, H, -1),
                                              axis=-1).reshape(t.shape)
        if m > 0 and opts.residual == "sampled":
            if drawn is None:
                local = jnp.take_along_axis(table, jnp.minimum(gd, G - 1)[:, None, :, None], axis=2)  # [B,H,c,m]
                idx = sth[..., None] + local
                nf = jnp.maximum(prefix_end(gd, opts), 1).astype(jnp.float32)[:, None, :, None]
                p = 1.0 / nf
            else:
                idx, p = drawn
            flat = idx.reshape(B, H, -1)
            hk_l = jnp.take_along_axis(HKc, flat, axis=-1)
            cnt = (_ssorted(kappa_s, hk_l * M + jnp.broadcast_to(L[:, None, :, None], idx.shape).reshape(B, H, -1))
                   - jnp.take_along_axis(spos, flat, axis=-1) - 1).reshape(idx.shape)
            x = jnp.where(cnt < bh, hk_l.reshape(idx.shape), -1)
            out["sidx"] = idx
            out["omega"] = jnp.broadcast_to(-jnp.log(m * p), idx.shape)
            out["smask"] = (Lh > sth)[..., None] & (x != hq[..., None])
        elif opts.residual == "exact":
            kap = HKc[:, :, None, :] * M + Lh[..., None]  # [B,H,c,M]
            cnt = _ssorted(kappa_s, kap.reshape(B, H, -1)).reshape(kap.shape) - spos[:, :, None, :] - 1
            x = jnp.where(cnt < bh, HKc[:, :, None, :], -1)
            inside = (pos >= sth[..., None]) & (pos < Lh[..., None])
            out["rmask"] = inside & (x != hq[..., None])
        return out

    plan = jax.vmap(one)(hq_tiles, tile_ids, start_tiles, ref_draws)
    return jax.tree.map(jax.lax.stop_gradient, plan)


def causal_apply(q_tiles, tile_ids, Kc, Vc, plan, opts: CausalOptions, heavy=None, full_pass: bool = False,
                 row_scale=row_scale, start_tiles=None):
    """Differentiable part: (outputs [n_t,B,H,c,dv], lse = log D̃ [n_t,B,H,c]) of query tiles
    [n_t,B,H,c,d] at absolute chunks tile_ids. ``heavy``: the tiles' heavy part already merged
    ((out [n_t,B,H,c,dv], lse [n_t,B,H,c]) of :func:`heavy_band`; then the plan has no heavy sets).
    ``start_tiles`` (a packed row, §4.6: [n_t,B,c] each query's document start): a query's local keys
    [L, i] then lie in the nl + 1 chunks up to its tile's (its document's chunks need not be the row's), and its
    samples are its own (``sidx`` [B,H,c,m], gathered per query)."""
    n_t, B, H, c, d = q_tiles.shape
    dv = Vc.shape[-1]
    nl, sig = opts.local_chunks, opts.scale
    nw = nl + (start_tiles is not None)  # chunks of the local window
    w = nw * c
    M = Kc.shape[2]
    heavy_route = "band" if heavy is not None else heavy_route_of(opts, M, full_pass)
    if heavy_route == "band" and heavy is None and opts.heavy_capacity > 0:
        raise ValueError("kdeformer: the 'band' heavy route needs the heavy part (heavy_band) passed in")
    # front pad so tile g's window [(g−nl+1)c, (g+1)c) starts at index g·c; back pad keeps slices in range
    back = -(-M // c) * c - M + 2 * c
    Kf = jnp.pad(Kc, ((0, 0), (0, 0), ((nw - 1) * c, back), (0, 0)))
    Vf = jnp.pad(Vc, ((0, 0), (0, 0), ((nw - 1) * c, back), (0, 0)))

    def one(qt, g, pl, hv, st):
        qpos = g * c + jnp.arange(c, dtype=jnp.int32)
        kpos = (g - nw + 1) * c + jnp.arange(w, dtype=jnp.int32)
        kl = jax.lax.dynamic_slice_in_dim(Kf, g * c, w, axis=2)
        vl = jax.lax.dynamic_slice_in_dim(Vf, g * c, w, axis=2)
        if st is None:
            lmask = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
        else:  # [L_i, i] of the query's document
            L = packed_query(g, st, opts)[2]
            lmask = ((kpos[None, None, :] >= L[..., None]) & (kpos[None, :] <= qpos[:, None]))[:, None]
        s_l = sig * einsum_f32("bhqd,bhkd->bhqk", qt, kl)
        parts = [(s_l, lmask, lambda p: einsum_f32("bhqk,bhkd->bhqd", p.astype(vl.dtype), vl))]
        packed_samples = "sidx" in pl and pl["sidx"].ndim == 4
        # the 'scores' route's [c, M] logits of every key (short caches), also read by a packed row's samples
        s_all = sig * einsum_f32("bhqd,bhkd->bhqk", qt, Kc) if heavy_route == "scores" and (
            opts.heavy_capacity > 0 or packed_samples) else None
        if opts.heavy_capacity > 0 and heavy_route == "scores":
            # same heavy logits, computed as one [c, M] matmul and kept only on Hv(i) (short caches)
            hmask = jax.vmap(jax.vmap(jax.vmap(
                lambda ix, ok: jnp.zeros((M,), bool).at[ix].max(ok))))(pl["hidx"], pl["hvalid"])
            parts.append((s_all, hmask, lambda p: einsum_f32("bhqk,bhkd->bhqd", p.astype(Vc.dtype), Vc)))
        elif opts.heavy_capacity > 0 and heavy_route == "band":
            # each row's heavy softmax as one entry: logit lse_h with value out_h (= Σ_Hv e^{s} v / e^{lse_h})
            h_out, h_lse = hv
            parts.append((h_lse[..., None], (h_lse > 0.5 * NEG)[..., None], lambda p: row_scale(h_out, p[..., 0])))
        elif opts.heavy_capacity > 0:
            hidx = pl["hidx"].reshape(B, H, -1)
            kh = _take(Kc, hidx).reshape(B, H, c, -1, d)
            vh = _take(Vc, hidx).reshape(B, H, c, -1, dv)
            # per-query key sets: elementwise products (batched tiny matvecs are slow on XLA:CPU)
            s_h = sig * jnp.sum((qt[:, :, :, None, :] * kh).astype(_ftype(qt)), axis=-1)
            parts.append((s_h, pl["hvalid"], lambda p: jnp.sum(p[..., None] * vh, axis=-2)))
        if packed_samples and s_all is not None:
            # a packed row's per-query samples on the 'scores' route: their logits read from the [c, M] logits and
            # their weights spread over the M keys for one product with the values (the same entries as gathering
            # c * m keys and values per tile, whose gradient is a scatter of c * m rows of keys and values)
            sidx = pl["sidx"]  # [B,H,c,m]
            s_s = jnp.take_along_axis(s_all, sidx, axis=-1, mode="clip") + pl["omega"]
            spread = jax.vmap(jax.vmap(jax.vmap(lambda ix, p: jnp.zeros((M,), p.dtype).at[ix].add(p, mode="clip"))))
            parts.append((s_s, pl["smask"],
                          lambda p: einsum_f32("bhqk,bhkd->bhqd", spread(sidx, p).astype(Vc.dtype), Vc)))
        elif packed_samples:  # a packed row: every query its own document's samples
            sidx = pl["sidx"].reshape(B, H, -1)
            ks = _take(Kc, sidx).reshape(B, H, c, -1, d)
            vs = _take(Vc, sidx).reshape(B, H, c, -1, dv)
            s_s = sig * jnp.sum((qt[:, :, :, None, :] * ks).astype(_ftype(qt)), axis=-1) + pl["omega"]
            parts.append((s_s, pl["smask"], lambda p: jnp.sum(p[..., None] * vs, axis=-2)))
        elif "sidx" in pl:
            ks, vs = _take(Kc, pl["sidx"]), _take(Vc, pl["sidx"])
            s_s = sig * einsum_f32("bhqd,bhmd->bhqm", qt, ks) + pl["omega"][:, :, None, :]
            parts.append((s_s, pl["smask"], lambda p: einsum_f32("bhqm,bhmd->bhqd", p.astype(vs.dtype), vs)))
        if "rmask" in pl:
            s_r = sig * einsum_f32("bhqd,bhkd->bhqk", qt, Kc)
            parts.append((s_r, pl["rmask"], lambda p: einsum_f32("bhqk,bhkd->bhqd", p.astype(Vc.dtype), Vc)))
        return _combine(parts, row_scale)

    per_tile = B * H * c * (w + (1 if heavy_route == "band" else opts.heavy_capacity) + opts.num_samples
                            + (M if "rmask" in plan or heavy_route == "scores" else 0))
    bs = max(1, opts.tile_budget // max(per_tile, 1))
    if bs >= n_t:
        return jax.vmap(one)(q_tiles, tile_ids, plan, heavy, start_tiles)
    # long sequences: tiles in groups, each group's logits recomputed in the backward pass
    return jax.lax.map(jax.checkpoint(lambda a: one(*a)), (q_tiles, tile_ids, plan, heavy, start_tiles),
                       batch_size=bs)


def _check_resolved(opts: CausalOptions, **fields):
    """Raise if a knob the call reads (``fields``: name -> whether it is read) is still ``dispatch.PLATFORM_DEFAULT``
    (0): the implementation's runner puts in its fields, built for the platform, before calling (:func:`with_knobs`)."""
    unresolved = [f for f, read in fields.items() if read and getattr(opts, f) <= 0]
    if unresolved:
        raise ValueError(f"kdeformer: {', '.join(unresolved)} left at dispatch.PLATFORM_DEFAULT; resolve the options "
                         f"for the platform first (the runner's fields, dispatch.Runner.build): {opts}")


def causal_forward(q, k, v, W, key_s, opts: CausalOptions, cache=None, length=None, row_scale=row_scale,
                   starts=None, band_fn=heavy_band):
    """Causal estimator over T new tokens at positions [length, length+T).

    cache=None: a full pass from position 0 (the sequence itself is the cache). Otherwise
    cache = (K [B,H,M,d], V [B,H,M,dv], HK [B,H,M]) holds positions < length.
    starts (a packed row, §4.6): int32 [B,T] the cache position of each new token's document's first token
    (:func:`common.causal_starts`); None: one stream.
    band_fn: the function computing the 'band' route's heavy part, :func:`heavy_band`'s signature and results (the
    implementation ``pallas`` passes the kernel's, ``pallas.heavy_band_kernel``).
    Returns (out [B,H,T,dv] fp32, (K, V, HK) with the new tokens written, n_valid)."""
    B, H, T, d = q.shape
    c = opts.chunk_size
    _check_resolved(opts, tile_budget=True, heavy_scores_max_len=opts.heavy_impl == "auto")
    qf, kf, vf = (x.astype(q.dtype) for x in (q, k, v))  # the compute dtype (scores, softmax: float32)
    hq, hk = lsh_codes(qf, W), lsh_codes(kf, W)
    if cache is None:
        n_t = -(-T // c)
        Np = n_t * c
        pad = ((0, 0), (0, 0), (0, Np - T))
        Kc, Vc = jnp.pad(kf, pad + ((0, 0),)), jnp.pad(vf, pad + ((0, 0),))
        HKc = jnp.pad(hk, pad)
        q_buf, hq_buf = jnp.pad(qf, pad + ((0, 0),)), jnp.pad(hq, pad)
        # padded query slots start a document of their own there (no prefix: nothing drawn for them)
        st_buf = None if starts is None else jnp.concatenate(
            [starts, jnp.broadcast_to(jnp.arange(T, Np, dtype=jnp.int32), (B, Np - T))], axis=1)
        g0, r0, n_valid = 0, 0, T
    else:
        K0, V0, HK0 = cache
        P0 = length
        Kc = jax.lax.dynamic_update_slice(K0, kf.astype(K0.dtype), (0, 0, P0, 0))
        Vc = jax.lax.dynamic_update_slice(V0, vf.astype(V0.dtype), (0, 0, P0, 0))
        HKc = jax.lax.dynamic_update_slice(HK0, hk, (0, 0, P0))
        n_t = -(-(T + c - 1) // c)
        g0, r0, n_valid = P0 // c, P0 % c, P0 + T
        q_buf = jax.lax.dynamic_update_slice(jnp.zeros((B, H, n_t * c, d), qf.dtype), qf, (0, 0, r0, 0))
        hq_buf = jax.lax.dynamic_update_slice(jnp.zeros((B, H, n_t * c), jnp.int32), hq, (0, 0, r0))
        st_buf = None if starts is None else jax.lax.dynamic_update_slice(
            jnp.broadcast_to(g0 * c + jnp.arange(n_t * c, dtype=jnp.int32), (B, n_t * c)), starts, (0, r0))
    tile_ids = (g0 + jnp.arange(n_t)).astype(jnp.int32)
    q_tiles = jnp.moveaxis(q_buf.reshape(B, H, n_t, c, d), 2, 0)
    hq_tiles = jnp.moveaxis(hq_buf.reshape(B, H, n_t, c), 2, 0)
    st_tiles = None if starts is None else jnp.moveaxis(st_buf.reshape(B, n_t, c), 1, 0)  # [n_t,B,c]
    route = heavy_route_of(opts, Kc.shape[2], full_pass=cache is None)
    _check_resolved(opts, band_block=route == "band")
    sorted_keys = code_sort(HKc, n_valid)
    band = route == "band" and opts.heavy_capacity > 0
    Kc_state, Vc_state = Kc, Vc  # a decoding cache keeps its dtype; the products take the compute dtype
    Kc, Vc = Kc.astype(qf.dtype), Vc.astype(qf.dtype)
    plan = causal_plan(hq_tiles, tile_ids, Kc, Vc, HKc, n_valid, key_s, opts, heavy_sets=not band,
                       sorted_keys=sorted_keys, start_tiles=st_tiles)
    heavy = None
    if band:  # full pass: queries at positions 0..Np-1, prefix ends of their chunks
        order, kappa_s, _ = jax.lax.stop_gradient(sorted_keys)
        if starts is None:
            L = prefix_end(jnp.arange(n_t * c, dtype=jnp.int32) // c, opts)
            lo, hi = heavy_bounds(kappa_s, hq_buf, L, opts.heavy_capacity)
        else:  # a packed row: each query's document's prefix end, from its first key (§4.6)
            L = st_buf + prefix_end((jnp.arange(n_t * c, dtype=jnp.int32) - st_buf) // c, opts)
            lo, hi = heavy_bounds(kappa_s, hq_buf, L[:, None], opts.heavy_capacity, st_buf[:, None])
        hi = jnp.where(jnp.arange(n_t * c) < T, hi, lo)  # padded queries: empty
        Ks, Vs = _take(Kc, order), _take(Vc, order)
        h_out, h_lse = band_fn(q_buf, Ks, Vs, lo, hi, opts.scale, opts.heavy_capacity, opts.band_block,
                               opts.tile_budget, row_scale)
        tiles = lambda x: jnp.moveaxis(x.reshape((B, H, n_t, c) + x.shape[3:]), 2, 0)  # noqa: E731
        heavy = (tiles(h_out), tiles(h_lse))
    out, _ = causal_apply(q_tiles, tile_ids, Kc, Vc, plan, opts, heavy=heavy, full_pass=cache is None,
                          row_scale=row_scale, start_tiles=st_tiles)
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, n_t * c, -1)
    out = jax.lax.dynamic_slice_in_dim(out, r0, T, axis=2)
    return out, (Kc_state, Vc_state, HKc), n_valid



# ---------------------------------------------------------------------------
# the implementation 'xla' (its runners: the calling convention every implementation shares)
# ---------------------------------------------------------------------------


def bidirectional(q, k, v, W, key_s, opts: BidirOptions, row_scale=row_scale, segment_ids=None):
    """The bidirectional estimator (§2.3): out [B,H,N,dv]; ``segment_ids`` [B,N]: a packed row, every document as
    if alone (:func:`bidir_packed`, §4.6)."""
    if segment_ids is not None:
        return bidir_packed(q, k, v, W, key_s, segment_ids, opts, row_scale)
    return bidir_forward(q, k, v, W, key_s, opts, row_scale=row_scale)


def _slots(x, lo, w: int, layer):
    """Slots lo..lo+w of a cache x [B,H,M,.] (``layer``: of that layer's cache in a stack [L,B,H,M,.])."""
    if layer is None:
        return jax.lax.dynamic_slice_in_dim(x, lo, w, axis=2)
    return jax.lax.dynamic_slice(x, (layer, 0, 0, lo, 0), (1, *x.shape[1:3], w, x.shape[4]))[0]


def _take_in(x, idx, layer):
    """:func:`_take` of a cache x [B,H,M,.] at idx [B,H,K] (``layer``: of that layer's cache in a stack
    [L,B,H,M,.], gathered from the stack per row as :func:`_take` does: one advanced index over the stack let
    XLA:CPU's classic emitters fuse the token's write into each gather, which copied the stack)."""
    if layer is None:
        return _take(x, idx)
    rows = lambda a, i: jnp.take(a[layer], i, axis=0, mode="clip")  # noqa: E731  (a [L, M, .], i [K])
    return jax.vmap(jax.vmap(rows, in_axes=(1, 0)), in_axes=(1, 0))(x, idx)


def one_token(q, W, key_s, opts: CausalOptions, written, row_scale=row_scale, layer=None, packed: bool = False):
    """The causal estimator (§4) for one new token i after a state, as the spec's decoding step computes it (§4.4),
    read from ``written``, the state with the token's key, value and code written (:func:`common.next_state`):
    the local keys [L_g, i] as one slice of the cache, Hv(i) as the b_h largest positions j < L_g whose code is
    the query's (a running count over the code cache: O(M) integer work, no sort), the chunk's samples drawn as
    the full pass draws them (``fold_in(k_S, g)``) and masked where they lie in Hv(i). The same entries as
    :func:`causal_forward`'s (the contract's decoding law); no [M, d] array is read whole or copied, where the
    tiled form sorts the whole code cache and pads the query to a chunk. Reading the written caches (the slots
    below i are unchanged, slot i holds the token as the compute dtype rounds it) lets XLA write the token in
    place into a donated state: a read of the state before the write made it copy the whole cache every token.
    ``layer`` (int32): ``written`` is a scanned stack's states (leaves [L, ...]) and the step reads that layer's
    caches where they lie (a slice of the layer's cache first would copy it). ``packed`` (a call with segment ids,
    §4.6): the token's document starts at ``written['start']`` (per row), its chunk, prefix end, heavy keys and
    samples counted from there, the samples those its document draws alone at its chunk (``fold_in(k_S, g_d)``,
    shifted to its first key), as :func:`_packed_plan` has them. out [B,H,1,dv]."""
    B, H, _, d = q.shape
    K, V = written["k"], written["v"]
    # the codes' slot of the layer (1/d of its keys) is read whole by the running count anyway
    at = (lambda a: a) if layer is None else (lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False))
    HK, i = at(written["codes"]), at(written["length"]) - 1
    M = K.shape[-2]
    c, bh, m, sig = opts.chunk_size, opts.heavy_capacity, opts.num_samples, opts.scale
    hq = lsh_codes(q, W)  # [B,H,1]
    w = min(opts.local_chunks * c, M)
    if packed:  # per row: the document's start st, the token's chunk g in it and its prefix end L, [B, 1, 1]
        st = at(written["start"])[:, None, None]
        g = (i - st) // c
        L = st + prefix_end(g, opts)
        lo = jnp.clip(i - w + 1, 0, M - w)  # the slots [lo, lo + w) end at i and hold [L, i] of every row
    else:
        st, g = 0, i // c
        L = prefix_end(g, opts)
        lo = jnp.clip(L, 0, M - w)  # the slots [lo, lo + w) of the cache hold [L, i]
    kpos = lo + jnp.arange(w, dtype=jnp.int32)
    kl = _slots(K, lo, w, layer).astype(q.dtype)
    vl = _slots(V, lo, w, layer).astype(q.dtype)
    s_l = sig * einsum_f32("bhqd,bhkd->bhqk", q, kl)
    rows = (lambda x: x[..., None]) if packed else (lambda x: x)  # [B, 1, 1] -> [B, 1, 1, 1] against [B, H, 1, .]
    parts = [(s_l, (kpos >= rows(L)) & (kpos <= i),
              lambda p: einsum_f32("bhqk,bhkd->bhqd", p.astype(vl.dtype), vl))]
    if bh > 0:  # Hv(i): the most recent keys before L (from the document's start) with the query's code (§4.4)
        # the j-th such key is the first slot where their running count reaches j (a cumsum and b_h binary
        # searches: XLA:CPU's top_k over the cache took 20x longer)
        pos = jnp.arange(M, dtype=jnp.int32)
        count = jnp.cumsum(((HK == hq) & (pos < L) & (pos >= st)).astype(jnp.int32), axis=-1)
        j = count[..., -1:] - jnp.arange(bh, dtype=jnp.int32)  # [B,H,b_h]: the newest first; < 1: none
        hidx = _ssorted(count, j).astype(jnp.int32)
        hvalid = j >= 1
        kh = _take_in(K, hidx, layer).astype(q.dtype)
        vh = _take_in(V, hidx, layer).astype(q.dtype)
        s_h = sig * einsum_f32("bhqd,bhkd->bhqk", q, kh)
        parts.append((s_h, hvalid[:, :, None, :], lambda p: einsum_f32("bhqk,bhkd->bhqd", p.astype(vh.dtype), vh)))
    if m > 0:  # the chunk's samples (§4.3), masked where they lie in Hv(i) (O(m·b_h) comparisons)
        if packed:  # row b: its document's draw at its chunk, shifted to its first key
            n = jnp.maximum(prefix_end(g[:, 0, 0], opts), 1)  # [B]

            def draw(b):
                return draw_samples(jax.random.fold_in(key_s, g[b, 0, 0]), m, jnp.full((B, H), n[b], jnp.int32),
                                    "uniform")

            idx, prob = jax.lax.stop_gradient(draw_rows(draw, B))
            idx = idx + st
        else:
            n = jnp.full((B, H), jnp.maximum(L, 1), jnp.int32)
            idx, prob = jax.lax.stop_gradient(draw_samples(jax.random.fold_in(key_s, g), m, n, "uniform"))
        inside = jnp.any((idx[..., :, None] == hidx[..., None, :]) & hvalid[..., None, :], axis=-1) if bh > 0 \
            else jnp.zeros(idx.shape, bool)
        ks, vs = _take_in(K, idx, layer).astype(q.dtype), _take_in(V, idx, layer).astype(q.dtype)
        s_s = sig * einsum_f32("bhqd,bhmd->bhqm", q, ks) - jnp.log(m * prob)[:, :, None, :]
        parts.append((s_s, ((L > st) & ~inside)[:, :, None, :],
                      lambda p: einsum_f32("bhqm,bhmd->bhqd", p.astype(vs.dtype), vs)))
    return _combine(parts, row_scale)[0]


def causal(q, k, v, W, key_s, opts: CausalOptions, state=None, row_scale=row_scale, segment_ids=None,
           band_fn=heavy_band):
    """The causal estimator (§4) for the T new tokens after ``state`` (None: a full pass), its heavy logits by
    ``opts.heavy_impl`` (the 'band' route's by ``band_fn``, :func:`causal_forward`): out [B,H,T,dv]; ``segment_ids``
    [B,T]: a packed row, every document as if alone (§4.6). (The state after the call is
    :func:`common.next_state`'s; :func:`run_causal` takes one token of one stream after a state to
    :func:`one_token`.)"""
    starts = None if segment_ids is None else causal_starts(state, segment_ids, q.shape[2], q.shape[0])
    if state is None:
        return causal_forward(q, k, v, W, key_s, opts, row_scale=row_scale, starts=starts, band_fn=band_fn)[0]
    cache = (state["k"], state["v"], state["codes"])
    return causal_forward(q, k, v, W, key_s, opts, cache, state["length"], row_scale, starts, band_fn)[0]


def with_knobs(opts: CausalOptions, runner) -> CausalOptions:
    """``opts`` (the core's, knobs unresolved) with the knobs that are fields of ``runner`` (a runner of a tiled
    causal form, built for its platform) at the runner's values; ``heavy_band_block`` is the options'
    ``band_block``."""
    names = {f.name for f in dataclasses.fields(runner)}
    knobs = {("band_block" if n == "heavy_band_block" else n): getattr(runner, n) for n in names}
    return dataclasses.replace(opts, **knobs)


def run_causal(call: dispatch.Call, opts: CausalOptions, row_scale=row_scale, band_fn=heavy_band) -> dispatch.Result:
    """:func:`causal` on ``call`` (inputs q, k, v, W; the samples' key; the carried state) with ``opts`` (the
    'band' route's heavy part by ``band_fn``). One token of one stream after a state is §4.4's decoding step
    (:func:`one_token`, whatever the heavy route), which returns the state it wrote."""
    x = call.inputs
    packed = x["segment_ids"] is not None
    if isinstance(call.state, LayerOfStack):  # a decoding step in a scanned stack's states (steps_in_stack)
        stack, layer = call.state.stack, call.state.layer
        written = next_state(stack, x["k"], x["v"], x["W"], x["q"].dtype, x["segment_ids"], layer=layer)
        out = one_token(x["q"], x["W"], call.key, opts, written, row_scale, layer=layer, packed=packed)
        return dispatch.Result(out, state=LayerOfStack(written, layer))
    if call.state is not None and one_token_applies(x["q"].shape[2], opts):
        written = next_state(call.state, x["k"], x["v"], x["W"], x["q"].dtype, x["segment_ids"])
        return dispatch.Result(one_token(x["q"], x["W"], call.key, opts, written, row_scale, packed=packed),
                               state=written)
    return dispatch.Result(causal(x["q"], x["k"], x["v"], x["W"], call.key, opts, call.state, row_scale,
                                  x["segment_ids"], band_fn))


@dataclasses.dataclass(frozen=True)
class Causal(dispatch.Runner):
    """``xla``, causal: every knob of the tiled form, the heavy route ``heavy_impl`` included."""

    tile_budget: int
    heavy_scores_max_len: int
    heavy_band_block: int
    heavy_impl: str

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        return run_causal(call, with_knobs(core.causal_opts, self))


@dataclasses.dataclass(frozen=True)
class Bidirectional(dispatch.Runner):
    """``xla``, bidirectional: no execution knob (the block size is the method's ``bucket_size``)."""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        return dispatch.Result(bidirectional(x["q"], x["k"], x["v"], x["W"], call.key, core.bidir_opts,
                                             segment_ids=x["segment_ids"]))


# Per-platform defaults of the knobs the tiled causal forms read (``dispatch.Implementation.defaults``; the config
# leaves them at dispatch.PLATFORM_DEFAULT and the runner is built with the values for the platform the call runs on).
# cpu: the values XLA:CPU was tuned with (CPU results are those of before the knobs were per platform).
# cuda / rocm / tpu: sized for an 80 GB accelerator, not yet measured on a GPU:
#   tile_budget 2^29 logits per lax.map step (~2 GiB per float32 logits array; the checkpointed step's backward
#   holds a few): a 32k causal full pass at B8 H8 (c=128, nl=2, m=128) runs its 256 query tiles in 2 groups and
#   the band's 2048 (tile, block) pairs in one fused pass, where the CPU budget 2^22 took 256 + 128 serial steps;
#   heavy_scores_max_len 2048: one [c, M] product per chunk is cheap on a GPU up to a few thousand keys;
#   heavy_band_block 64 (128 on a TPU: the MXU's tile width).
DEFAULTS = {
    "tile_budget": {"cpu": 1 << 22, "cuda": 1 << 29, "rocm": 1 << 29, "tpu": 1 << 29},
    "heavy_scores_max_len": {"cpu": 1024, "cuda": 2048, "rocm": 2048, "tpu": 2048},
    "heavy_band_block": {"cpu": 64, "cuda": 64, "rocm": 64, "tpu": 128},
}

# 'auto' takes the portable implementation off a CPU (on a CPU: the CPU-tuned implementations, their own file)
_AUTO = {"cuda": 0, "rocm": 0, "tpu": 0}
IMPLEMENTATIONS = (
    Implementation("xla", config={"impl": "xla"}, auto=_AUTO, code=Causal, directions=("causal",),
                   test_config={"heavy_impl": "band", "heavy_band_block": 8}, defaults=DEFAULTS),
    Implementation("xla", config={"impl": "xla"}, auto=_AUTO, code=Bidirectional, directions=("bidirectional",)),
)

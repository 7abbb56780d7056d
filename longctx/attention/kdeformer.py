"""KDEformer (Zandieh, Han, Daliri, Karbasi, ICML 2023; arXiv 2302.02451). Method notes:
``docs/methods/kdeformer.md``; the section numbers (§) below are its sections.

Softmax attention ``D⁻¹AV`` (``A = exp(σQKᵀ)``) is estimated as an exact "heavy" part on the
(query, key) pairs an angular LSH puts together, plus an importance-sampled estimate of the
residual ``A − A_spar`` from ``m`` i.i.d. key columns weighted ``1/(m p_j)``. The normaliser
``D̃`` is estimated by the same estimator (the released code's ones column appended to ``V``);
numerator and normaliser share one log-space stabiliser, so the output of every row is
``Σ_t softmax(row)_t · value_t`` over the union of its heavy, local and sampled entries
(§2.3h), with importance weights entering as additive log-weights ``ω = −log(m p)``.

Bidirectional (§2.3, the estimator the released code runs)
    1. ``W ∈ [B,H,d,r]`` i.i.d. N(0,1); code ``h(x) = Σ_t 1[⟨w_t,x⟩>0] 2^t`` (unscaled q, k, fp32).
    2. Sort key = the code's position in the reflected Gray sequence, ``G⁻¹(z)`` (paper, default)
       or ``G(z)`` (``gray_order='forward'``: the released code's table lookup). Stable argsort.
    3. Cut the sorted keys and sorted queries into ``N/b`` equal blocks; the heavy part is the
       exact block-diagonal ``σ Q_s K_sᵀ`` [B,H,nb,b,b].
    4. ``p_j = (1/N + ‖ṽ_j‖/λ)/Z`` with ``ṽ_j = [v_j; 1]``, ``λ = ‖Ṽ‖²_op`` (20 power iterations on
       the Gram, deterministic start), norm not squared ('ref'); drawn as the mixture of a uniform
       index and an index ∝ integer-quantised norms ``u_j = min(⌊‖ṽ_j‖·2⁶⌋+1, 2¹³)`` and ``p`` is
       computed from the same quantised weights, so the importance weights are exact. One set
       of ``m`` samples per (batch, head), with replacement, duplicates kept.
    5. A sample in the query's own block is masked (already counted exactly).
    ``sampling='uniform'``: ``p = 1/N``; ``num_samples=0``: pure sorted-LSH block attention;
    ``residual='exact'`` (debug): every non-block column with weight 1 (= dense attention, O(N²)).

The theoretical estimator (§2.2, paper Alg. 1–3) is documented, not run: ``D̃`` from a
weighted exponential KDE ``WExpKDE(K/d^¼, Q/d^¼, 1, ε/3)``, reduced to a Gaussian KDE by the
augmentation ``x' = [x; w]``, ``w_i = sqrt(2 log(Z_u/(u_i e^{‖x_i‖²/2})))`` (Eq. 7–8), with
Charikar et al.'s hashing-based KDE and the adaptive density-lower-bound loop of Alg. 2; the
sampling probabilities ``p_j ∝ β_j + γ‖v_j‖²`` with ``β_j ≈ ‖(D̃⁻¹A)_{:,j}‖²`` from a second
KDE at ``√2·Q, √2·K`` with weights ``α_i⁻²``; Alg. 3 subtracts the colliding pairs from ``β``.
That machinery has data-dependent control flow and sizes; the released code does not run it
either (§2.3). An O(n²) oracle of ``WExpKDE`` lives in the tests only.

Causal (§4, ours: the paper and code are non-causal)
    Chunks of ``c`` positions; query ``i`` in chunk ``g``, prefix end ``L_g = max(0,(g−nl+1)c)``:
    * local: exact over keys ``[L_g, i]``;
    * heavy: ``Hv(i)`` = the ≤ ``b_h`` most recent keys ``j < L_g`` with ``h(k_j) = h(q_i)``
      (hash equality with a capacity, found by a sort on ``κ_j = h(k_j)·M + j`` and two
      ``searchsorted`` per query: static shapes, §4.2);
    * sampled residual: per chunk ``m`` i.i.d. indices in ``[0, L_g)`` drawn from
      ``fold_in(k_S, g)`` (absolute chunk index, so decoding reproduces them), uniform (default)
      or 'ref' over the prefix (§4.3); a sample in ``Hv(i)`` is masked for query ``i``.
    The decoding state holds the KV cache, the code cache, the projections ``W`` and the token
    count (``init_state(batch, max_len)``). A call with a state treats the cache as the sequence
    so far and runs the same tile function as the full pass, so any split into consecutive
    chunks equals one full pass. Feeding more tokens than ``max_len`` raises (host check when
    the count is concrete, ``jax.debug.callback`` under jit).

Gradient policy (§6): :func:`bidir_plan` / :func:`causal_plan` (hashes, permutations,
sample indices, log-weights, masks) are ``stop_gradient``; :func:`bidir_apply` /
:func:`causal_apply` are differentiable. Gradients are those of the estimator with its draws
frozen (``p`` is frozen too: differentiating through ``ω`` alone adds a biased term).

Randomness (§2.4): only from the explicit ``key``: ``k_W, k_S = split(key)``; ``W`` from
``k_W`` (or from ``PRNGKey(lsh_seed)`` when ``fixed_projections``), samples from ``k_S``.
``deterministic=True`` (evaluation, decoding) uses the fixed key ``PRNGKey(eval_rng_seed)``:
the same estimator with frozen draws, never exact attention.

Departures from the paper, the released code and the method notes, named:
* ``fixed_projections`` derives ``W`` from ``PRNGKey(lsh_seed)`` only (the core does not know its
  layer index, so all layers share it), and likewise the deterministic key is shared by layers.
* A causal state keeps the projections ``W`` of the first call of its stream (the token count is
  0 then); later calls of that stream hash with it whatever their key, so windowed training with
  a fresh key per window keeps the code cache consistent. Samples use the current call's key.
* ``sampling='paper_mc'`` (§2.3i, optional) is not implemented.
* Causal heavy logits (``heavy_impl='auto'``) are the heavy sets of §4.1 computed three ways, same entries:
  for short caches (≤ 1024 tokens) one [c, M] matmul per chunk kept only on the heavy set; for a longer
  full pass as 'band' (:func:`heavy_band`): a query's heavy set is a contiguous run of the code-sorted keys,
  so tiles of code-sorted queries are scored against the blocks of sorted keys their runs touch, as
  matmuls; a call with a state (decoding, chunked prefill) gathers the ≤ b_h keys of every query (the
  gather of §4.2, which would gather in the full pass too: memory-bound on CPU, several times slower there).
* Cross-attention (``Nq ≠ Nk``) is not offered: the contract is self-attention.
* Masked logits use a finite ``-1e30`` and an explicit mask (``where``), and a row without any
  finite entry outputs 0 (only padded rows can be such), instead of ``-inf``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from longctx.attention.base import AttentionCore, CapacityError, ContractCase, check_capacity, check_qkv, require
from longctx.models.precision import einsum_f32
from longctx.xla_cpu import scale_rows

NEG = -1e30
HIGHEST = jax.lax.Precision.HIGHEST
NORM_SHIFT = 6  # integer norm weights u = ⌊‖ṽ‖·2^6⌋ + 1 (§4.3)
U_MAX = 1 << 13
INT_MAX = jnp.iinfo(jnp.int32).max


# ---------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------


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
    tile_budget: int  # logits per lax.map step
    heavy_impl: str = "auto"  # 'gather' | 'scores' | 'band' | 'auto'
    heavy_scores_max_len: int = 1024
    band_block: int = 64  # 'band': sorted queries per tile = sorted keys per block


# ---------------------------------------------------------------------------
# hashing (§2.3a, b)
# ---------------------------------------------------------------------------


def draw_projections(key, batch: int, heads: int, dim: int, num_projs: int):
    """W [B,H,d,r], i.i.d. N(0,1), fp32."""
    return jax.random.normal(key, (batch, heads, dim, num_projs), jnp.float32)


def lsh_codes(x, W):
    """Sign-random-projection code h(x) = Σ_t 1[⟨w_t,x⟩ > 0] 2^t. x [B,H,N,d], W [B,H,d,r] -> int32 [B,H,N]."""
    r = W.shape[-1]
    W = jnp.broadcast_to(W, x.shape[:2] + W.shape[2:])
    # HIGHEST: the codes must agree between the full pass and decoding (a reduced-precision sign flips hashes)
    proj = jnp.einsum("bhnd,bhdr->bhnr", x.astype(jnp.float32), W.astype(jnp.float32), precision=HIGHEST)
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


def _mm(spec: str, a, b):
    """An attention product: operands of float32 or wider as given (the plain einsum), narrower (compute-dtype)
    operands accumulated into a float32 result (``precision.einsum_f32``)."""
    if a.dtype == b.dtype == jnp.promote_types(a.dtype, jnp.float32):
        return jnp.einsum(spec, a, b)
    return einsum_f32(spec, a, b)


def _ftype(x):
    """Compute dtype: fp32, or fp64 for fp64 inputs (reference tests under jax_enable_x64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _take(x, idx):
    """x [B,H,N,...], idx [B,H,K] -> [B,H,K,...] (row gather along axis 2; slices of whole rows)."""
    return jax.vmap(jax.vmap(lambda a, i: jnp.take(a, i, axis=0, mode="clip")))(x, idx)


_ssorted = jax.vmap(jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="left")))
_ssorted_right = jax.vmap(jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="right")))


# ---------------------------------------------------------------------------
# the 'ref' sampler (§2.3e, §4.3)
# ---------------------------------------------------------------------------


def norm_weights(v, valid):
    """Integer weights u_j = min(⌊‖[v_j;1]‖·2^6⌋ + 1, 2^13) (0 where not valid). v [B,H,N,dv]."""
    nrm = jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32)), axis=-1) + 1.0)
    u = jnp.minimum(jnp.floor(nrm * (1 << NORM_SHIFT)) + 1, U_MAX).astype(jnp.int32)
    return jnp.where(valid, u, 0)


def augmented_gram(v, valid):
    """Σ_j [v_j;1][v_j;1]ᵀ over valid rows. v [..., N, dv], valid broadcastable to [..., N]."""
    va = jnp.concatenate([v.astype(jnp.float32), jnp.ones(v.shape[:-1] + (1,), jnp.float32)], axis=-1)
    va = jnp.where(valid[..., None], va, 0.0)
    # HIGHEST: a sampling statistic (probabilities stay float32; TF32 would round them)
    return jnp.einsum("...ne,...nf->...ef", va, va, precision=HIGHEST)


def power_lambda(gram, iters: int):
    """‖Ṽ‖²_op from ``iters`` power iterations on the Gram (start 1/√e; deterministic)."""
    e = gram.shape[-1]
    x = jnp.full(gram.shape[:-1], e**-0.5, jnp.float32)

    def body(_, x):
        y = jnp.einsum("...ef,...f->...e", gram, x, precision=HIGHEST)  # HIGHEST: float32 sampling statistic
        return y / jnp.maximum(jnp.linalg.norm(y, axis=-1, keepdims=True), 1e-30)

    x = jax.lax.fori_loop(0, iters, body, x)
    return jnp.einsum("...e,...ef,...f->...", x, gram, x, precision=HIGHEST)  # HIGHEST: as above


def draw_samples(key, m: int, n_prefix, sampling: str, *, cum=None, u=None, lam=None):
    """m i.i.d. indices per (b,h) in [0, n_prefix) and their probabilities p.

    n_prefix: int32 [B,H] (≥ 1). 'uniform': p = 1/n. 'ref' (needs cum [B,H,M] = inclusive cumsum of
    the integer weights u [B,H,M], lam [B,H] = λ): mixture of uniform (prob. π_u = 1/(1 + T 2^-6/λ))
    and ∝ u, with T = cum[n−1]; p = π_u/n + (1−π_u) u_ℓ/T exactly the law of the draw."""
    B, H = n_prefix.shape
    nf = n_prefix.astype(jnp.float32)[..., None]
    if sampling == "uniform":
        idx = jax.random.randint(key, (B, H, m), 0, n_prefix[..., None], dtype=jnp.int32)
        return idx, jnp.broadcast_to(1.0 / nf, (B, H, m))
    k1, k2, k3 = jax.random.split(key, 3)
    tot = jnp.take_along_axis(cum, (n_prefix - 1)[..., None], axis=-1)  # [B,H,1]
    totf = tot.astype(jnp.float32)
    pi_u = 1.0 / (1.0 + totf * 2.0**-NORM_SHIFT / jnp.maximum(lam[..., None], 1e-30))
    bit = jax.random.bernoulli(k1, pi_u, (B, H, m))
    uni = jax.random.randint(k2, (B, H, m), 0, n_prefix[..., None], dtype=jnp.int32)
    t = jax.random.randint(k3, (B, H, m), 0, tot, dtype=jnp.int32)
    nidx = _ssorted_right(cum, t).astype(jnp.int32)
    idx = jnp.where(bit, uni, nidx)
    p = pi_u / nf + (1.0 - pi_u) * jnp.take_along_axis(u, idx, axis=-1).astype(jnp.float32) / totf
    return idx, p


def _combine(parts):
    """One log-space softmax over the union of entry groups.

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
    out = scale_rows(num, 1.0 / jnp.maximum(den, 1e-30))  # (a dot in the gradient: longctx.xla_cpu)
    lse = mx + jnp.log(jnp.maximum(den, 1e-30))
    return out, lse


# ---------------------------------------------------------------------------
# bidirectional (§2.3)
# ---------------------------------------------------------------------------


def bidir_plan(q, k, v, W, key_s, n_valid: int, opts: BidirOptions):
    """Hashes, permutations, samples and log-weights (all stop_gradient).

    q, k, v: [B,H,Np,·] padded to a multiple of the bucket size; rows ≥ n_valid are padding."""
    B, H, Np, _ = q.shape
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
        n = jnp.full((B, H), n_valid, jnp.int32)
        if opts.sampling == "uniform":
            idx, p = draw_samples(key_s, m, n, "uniform")
        else:
            u = norm_weights(v, valid)
            lam = power_lambda(augmented_gram(v, valid[None, None]), opts.power_iters)
            idx, p = draw_samples(key_s, m, n, "ref", cum=jnp.cumsum(u, axis=-1), u=u, lam=lam)
        plan["idx"] = idx
        plan["omega"] = -jnp.log(m * p)
        plan["sblk"] = jnp.take_along_axis(kblk, idx, axis=-1)
    return jax.tree.map(jax.lax.stop_gradient, plan)


def bidir_apply(q, k, v, plan, n_valid: int, opts: BidirOptions):
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
    s_h = sig * _mm("bhnqd,bhnkd->bhnqk", Qs, Ks)
    parts = [(s_h, kval_s, lambda p: _mm("bhnqk,bhnkd->bhnqd", p.astype(Vs.dtype), Vs))]
    blk = jnp.arange(nb, dtype=jnp.int32)[None, None, :, None, None]
    if opts.residual == "exact":
        s_r = sig * _mm("bhnqd,bhkd->bhnqk", Qs, k)
        mask = (plan["kblk"][:, :, None, None, :] != blk) & valid[None, None, None, None, :]
        parts.append((s_r, mask, lambda p: _mm("bhnqk,bhkd->bhnqd", p.astype(v.dtype), v)))
    elif m > 0:
        Kl, Vl = _take(k, plan["idx"]), _take(v, plan["idx"])
        s_s = sig * _mm("bhnqd,bhmd->bhnqm", Qs, Kl)
        s_s = s_s + plan["omega"][:, :, None, None, :]
        mask = plan["sblk"][:, :, None, None, :] != blk
        parts.append((s_s, mask, lambda p: _mm("bhnqm,bhmd->bhnqd", p.astype(Vl.dtype), Vl)))
    out_s, lse_s = _combine(parts)
    inv_q = inverse_permutation(perm_q)
    out = _take(out_s.reshape(B, H, Np, dv), inv_q)
    lse = jnp.take_along_axis(lse_s.reshape(B, H, Np), inv_q, axis=-1)
    return out, lse


def bidir_forward(q, k, v, W, key_s, opts: BidirOptions, *, return_lse: bool = False):
    """Full bidirectional estimator. q,k [B,H,N,d], v [B,H,N,dv] -> out [B,H,N,dv] (fp32)."""
    N = q.shape[2]
    b = opts.bucket_size
    Np = -(-N // b) * b
    pad = ((0, 0), (0, 0), (0, Np - N), (0, 0))
    qp, kp, vp = (jnp.pad(x.astype(q.dtype), pad) for x in (q, k, v))  # compute dtype (statistics: float32)
    plan = bidir_plan(qp, kp, vp, W, key_s, N, opts)
    out, lse = bidir_apply(qp, kp, vp, plan, N, opts)
    if return_lse:
        return out[:, :, :N], lse[:, :, :N], plan
    return out[:, :, :N]


# ---------------------------------------------------------------------------
# causal (§4)
# ---------------------------------------------------------------------------


def _prefix_end(g, opts: CausalOptions):
    return jnp.maximum(0, (g - opts.local_chunks + 1) * opts.chunk_size).astype(jnp.int32)


def heavy_route_of(opts: CausalOptions, M: int, full_pass: bool) -> str:
    """The causal heavy logits' route: 'band' (full passes only), 'scores' or 'gather' (§4.2)."""
    route = opts.heavy_impl
    if route == "auto":
        route = "scores" if M <= opts.heavy_scores_max_len else ("band" if full_pass else "gather")
    if route == "band" and not full_pass:  # with a cache the band's blocks span the whole cache per query
        route = "gather"
    return route


def code_sort(HKc, n_valid):
    """Keys sorted by κ_j = h(k_j)·M + j (positions ≥ n_valid last): (order, κ_s, spos = order⁻¹), [B,H,M]."""
    M = HKc.shape[-1]
    pos = jnp.arange(M, dtype=jnp.int32)
    kappa = jnp.where(pos < n_valid, HKc * M + pos, INT_MAX)
    order = jnp.argsort(kappa, axis=-1).astype(jnp.int32)
    return order, jnp.take_along_axis(kappa, order, axis=-1), inverse_permutation(order)


def heavy_bounds(kappa_s, hq, L, bh: int):
    """Hv(i) as a range of sorted slots [lo, hi): the ≤ b_h last keys of code hq_i before L_i (§4.2 step 2).
    kappa_s [B,H,M]; hq [B,H,N] query codes; L [N] or [B,H,N] prefix ends. Empty when hi ≤ lo."""
    M = kappa_s.shape[-1]
    hi = _ssorted(kappa_s, hq * M + L).astype(jnp.int32)
    st = _ssorted(kappa_s, hq * M).astype(jnp.int32)
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


def heavy_band(q, Ks, Vs, lo, hi, scale: float, bh: int, block: int, budget: int):
    """The heavy part of a full causal pass (§4.1 'Heavy') as dense blocks of the code-sorted keys.

    q [B,H,N,d]; Ks, Vs [B,H,M,·] the keys and values in code-sorted order (κ_s); query i's heavy set is the
    sorted slots [lo_i, hi_i) (:func:`heavy_bounds`, ≤ b_h of them). Every row's heavy keys are contiguous in
    that order, and sorting the queries by hi makes neighbouring queries' bands overlap: tiles of ``block``
    sorted queries are scored against the blocks of ``block`` sorted keys their bands touch (σ q kᵀ matmuls;
    entries outside a row's band are masked), a static number of (tile, block) pairs (:func:`band_pairs`).
    The same logits as gathering each query's keys (memory-bound on CPU: ~N·b_h·d gathered rows), about
    4x as many scored, as matmuls. Returns (out [B,H,N,dv], lse [B,H,N]) of the softmax over each row's heavy
    set (rows without one: out 0, lse NEG), to be merged with the other parts by :func:`_combine`."""
    B, H, N, d = q.shape
    M, dv = Ks.shape[2], Vs.shape[-1]
    tq = kb = block
    n_t = -(-N // tq)
    Np, Mb = n_t * tq, -(-M // kb)
    n_pairs = -(-(M + n_t * bh) // kb) + 2 * n_t

    def one(q, Ks, Vs, lo, hi):  # one (batch, head)
        ok = hi > lo
        qord = jnp.argsort(jnp.where(ok, hi, INT_MAX)).astype(jnp.int32)  # empty rows last
        pad = (0, Np - N)
        lo_s, hi_s = jnp.pad(lo[qord], pad), jnp.pad(hi[qord], pad)  # padded rows: empty
        q_s = jnp.pad(q[qord], (pad, (0, 0))).reshape(n_t, tq, d)
        K_b = jnp.pad(Ks, ((0, Mb * kb - M), (0, 0))).reshape(Mb, kb, d)
        V_b = jnp.pad(Vs, ((0, Mb * kb - M), (0, 0))).reshape(Mb, kb, dv)
        b0, cnt, ends = band_pairs(lo_s, hi_s, tq, kb, M)
        p = jnp.arange(n_pairs, dtype=jnp.int32)
        tile = jnp.minimum(jnp.searchsorted(ends, p, side="right"), n_t - 1).astype(jnp.int32)
        blk = b0[tile] + p - (ends - cnt)[tile]
        valid = p < ends[-1]
        lo_t, hi_t = lo_s.reshape(n_t, tq), hi_s.reshape(n_t, tq)

        def pair(t, b, v):  # one (tile, block): [tq, kb] logits, their max, exp-sums and exp-weighted values
            slot = b * kb + jnp.arange(kb, dtype=jnp.int32)
            mask = v & (slot[None, :] >= lo_t[t][:, None]) & (slot[None, :] < hi_t[t][:, None])
            bc = jnp.clip(b, 0, Mb - 1)
            s = scale * _mm("qd,kd->qk", q_s[t], K_b[bc])
            s = jnp.where(mask, s, NEG)
            m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
            e = jnp.where(mask, jnp.exp(s - m[:, None]), 0.0)
            return m, jnp.sum(e, axis=-1), _mm("qk,kd->qd", e.astype(V_b[bc].dtype), V_b[bc])

        bs = max(1, budget // (B * H * tq * kb))
        if bs >= n_pairs:
            m, den, num = jax.vmap(pair)(tile, blk, valid)
        else:  # long sequences: pairs in batches, each batch's logits recomputed in the backward pass
            m, den, num = jax.lax.map(jax.checkpoint(lambda a: pair(*a)), (tile, blk, valid), batch_size=bs)
        # merge each tile's pairs (flash-style: rescale every pair to the tile's max)
        mt = jnp.maximum(jax.ops.segment_max(m, tile, n_t, indices_are_sorted=True), NEG)  # empty: -inf
        w = jnp.exp(m - mt[tile])
        den = jax.ops.segment_sum(w * den, tile, n_t, indices_are_sorted=True).reshape(Np)
        num = jax.ops.segment_sum(scale_rows(num, w), tile, n_t, indices_are_sorted=True).reshape(Np, dv)
        out_s = scale_rows(num, 1.0 / jnp.maximum(den, 1e-30))
        lse_s = jnp.where(den > 0, mt.reshape(Np) + jnp.log(jnp.maximum(den, 1e-30)), NEG)
        back = inverse_permutation(qord)  # sorted row of every query
        return out_s[back], lse_s[back]

    return jax.vmap(jax.vmap(one))(q, Ks, Vs, lo, hi)


def causal_plan(hq_tiles, tile_ids, Kc, Vc, HKc, n_valid, key_s, opts: CausalOptions, heavy_sets: bool = True,
                sorted_keys=None):
    """Heavy sets and samples of query tiles (all stop_gradient).

    hq_tiles: int32 [n_t,B,H,c] query codes; tile_ids: int32 [n_t] absolute chunk indices.
    Kc, Vc, HKc: the sequence so far [B,H,M,·] (positions ≥ n_valid are not keys yet).
    Returns a dict of [n_t, ...] arrays: hidx/hvalid [B,H,c,b_h] (``heavy_sets``; the 'band' route scores
    the heavy sets from :func:`heavy_bounds` instead), sidx/omega [B,H,m], smask [B,H,c,m].
    ``sorted_keys``: :func:`code_sort`'s result when the caller has it."""
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
        cum = jnp.cumsum(u, axis=-1)
        Mc = -(-M // c) * c
        vpad = jnp.pad(Vc.astype(jnp.float32), ((0, 0), (0, 0), (0, Mc - M), (0, 0)))
        vval = jnp.pad(vvalid, (0, Mc - M)).reshape(Mc // c, c)
        grams = augmented_gram(vpad.reshape(B, H, Mc // c, c, -1), vval[None, None])
        gram_cum = jnp.cumsum(grams, axis=2)  # [B,H,Gm,e,e]

    def one(hq, g):
        L = _prefix_end(g, opts)
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


def causal_apply(q_tiles, tile_ids, Kc, Vc, plan, opts: CausalOptions, heavy=None, full_pass: bool = False):
    """Differentiable part: (outputs [n_t,B,H,c,dv], lse = log D̃ [n_t,B,H,c]) of query tiles
    [n_t,B,H,c,d] at absolute chunks tile_ids. ``heavy``: the tiles' heavy part already merged
    ((out [n_t,B,H,c,dv], lse [n_t,B,H,c]) of :func:`heavy_band`; then the plan has no heavy sets)."""
    n_t, B, H, c, d = q_tiles.shape
    dv = Vc.shape[-1]
    nl, sig = opts.local_chunks, opts.scale
    w = nl * c
    M = Kc.shape[2]
    heavy_route = "band" if heavy is not None else heavy_route_of(opts, M, full_pass)
    if heavy_route == "band" and heavy is None and opts.heavy_capacity > 0:
        raise ValueError("kdeformer: the 'band' heavy route needs the heavy part (heavy_band) passed in")
    # front pad so tile g's window [(g−nl+1)c, (g+1)c) starts at index g·c; back pad keeps slices in range
    back = -(-M // c) * c - M + 2 * c
    Kf = jnp.pad(Kc, ((0, 0), (0, 0), ((nl - 1) * c, back), (0, 0)))
    Vf = jnp.pad(Vc, ((0, 0), (0, 0), ((nl - 1) * c, back), (0, 0)))

    def one(qt, g, pl, hv):
        qpos = g * c + jnp.arange(c, dtype=jnp.int32)
        kpos = (g - nl + 1) * c + jnp.arange(w, dtype=jnp.int32)
        kl = jax.lax.dynamic_slice_in_dim(Kf, g * c, w, axis=2)
        vl = jax.lax.dynamic_slice_in_dim(Vf, g * c, w, axis=2)
        lmask = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
        s_l = sig * _mm("bhqd,bhkd->bhqk", qt, kl)
        parts = [(s_l, lmask, lambda p: _mm("bhqk,bhkd->bhqd", p.astype(vl.dtype), vl))]
        if opts.heavy_capacity > 0 and heavy_route == "scores":
            # same heavy logits, computed as one [c, M] matmul and kept only on Hv(i) (short caches)
            hmask = jax.vmap(jax.vmap(jax.vmap(
                lambda ix, ok: jnp.zeros((M,), bool).at[ix].max(ok))))(pl["hidx"], pl["hvalid"])
            s_h = sig * _mm("bhqd,bhkd->bhqk", qt, Kc)
            parts.append((s_h, hmask, lambda p: _mm("bhqk,bhkd->bhqd", p.astype(Vc.dtype), Vc)))
        elif opts.heavy_capacity > 0 and heavy_route == "band":
            # each row's heavy softmax as one entry: logit lse_h with value out_h (= Σ_Hv e^{s} v / e^{lse_h})
            h_out, h_lse = hv
            parts.append((h_lse[..., None], (h_lse > 0.5 * NEG)[..., None], lambda p: scale_rows(h_out, p[..., 0])))
        elif opts.heavy_capacity > 0:
            hidx = pl["hidx"].reshape(B, H, -1)
            kh = _take(Kc, hidx).reshape(B, H, c, -1, d)
            vh = _take(Vc, hidx).reshape(B, H, c, -1, dv)
            # per-query key sets: elementwise products (batched tiny matvecs are slow on XLA:CPU)
            s_h = sig * jnp.sum((qt[:, :, :, None, :] * kh).astype(_ftype(qt)), axis=-1)
            parts.append((s_h, pl["hvalid"], lambda p: jnp.sum(p[..., None] * vh, axis=-2)))
        if "sidx" in pl:
            ks, vs = _take(Kc, pl["sidx"]), _take(Vc, pl["sidx"])
            s_s = sig * _mm("bhqd,bhmd->bhqm", qt, ks) + pl["omega"][:, :, None, :]
            parts.append((s_s, pl["smask"], lambda p: _mm("bhqm,bhmd->bhqd", p.astype(vs.dtype), vs)))
        if "rmask" in pl:
            s_r = sig * _mm("bhqd,bhkd->bhqk", qt, Kc)
            parts.append((s_r, pl["rmask"], lambda p: _mm("bhqk,bhkd->bhqd", p.astype(Vc.dtype), Vc)))
        return _combine(parts)

    per_tile = B * H * c * (w + (1 if heavy_route == "band" else opts.heavy_capacity) + opts.num_samples
                            + (M if "rmask" in plan or heavy_route == "scores" else 0))
    bs = max(1, opts.tile_budget // max(per_tile, 1))
    if bs >= n_t:
        return jax.vmap(one)(q_tiles, tile_ids, plan, heavy)
    # long sequences: tiles in groups, each group's logits recomputed in the backward pass
    return jax.lax.map(jax.checkpoint(lambda a: one(*a)), (q_tiles, tile_ids, plan, heavy), batch_size=bs)


CAPACITY_MESSAGE = ("kdeformer: the decoding state holds {capacity} tokens but {needed} were fed; build it with "
                    "core.init_state(batch_size, max_len) with a larger max_len")


def causal_forward(q, k, v, W, key_s, opts: CausalOptions, cache=None, length=None):
    """Causal estimator over T new tokens at positions [length, length+T).

    cache=None: a full pass from position 0 (the sequence itself is the cache). Otherwise
    cache = (K [B,H,M,d], V [B,H,M,dv], HK [B,H,M]) holds positions < length.
    Returns (out [B,H,T,dv] fp32, (K, V, HK) with the new tokens written, n_valid)."""
    B, H, T, d = q.shape
    c = opts.chunk_size
    qf, kf, vf = (x.astype(q.dtype) for x in (q, k, v))  # the compute dtype (scores, softmax: float32)
    hq, hk = lsh_codes(qf, W), lsh_codes(kf, W)
    if cache is None:
        n_t = -(-T // c)
        Np = n_t * c
        pad = ((0, 0), (0, 0), (0, Np - T))
        Kc, Vc = jnp.pad(kf, pad + ((0, 0),)), jnp.pad(vf, pad + ((0, 0),))
        HKc = jnp.pad(hk, pad)
        q_buf, hq_buf = jnp.pad(qf, pad + ((0, 0),)), jnp.pad(hq, pad)
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
    tile_ids = (g0 + jnp.arange(n_t)).astype(jnp.int32)
    q_tiles = jnp.moveaxis(q_buf.reshape(B, H, n_t, c, d), 2, 0)
    hq_tiles = jnp.moveaxis(hq_buf.reshape(B, H, n_t, c), 2, 0)
    route = heavy_route_of(opts, Kc.shape[2], full_pass=cache is None)
    sorted_keys = code_sort(HKc, n_valid)
    band = route == "band" and opts.heavy_capacity > 0
    Kc_state, Vc_state = Kc, Vc  # a decoding cache keeps its dtype; the products take the compute dtype
    Kc, Vc = Kc.astype(qf.dtype), Vc.astype(qf.dtype)
    plan = causal_plan(hq_tiles, tile_ids, Kc, Vc, HKc, n_valid, key_s, opts, heavy_sets=not band,
                       sorted_keys=sorted_keys)
    heavy = None
    if band:  # full pass: queries at positions 0..Np-1, prefix ends of their chunks
        order, kappa_s, _ = jax.lax.stop_gradient(sorted_keys)
        L = _prefix_end(jnp.arange(n_t * c, dtype=jnp.int32) // c, opts)
        lo, hi = heavy_bounds(kappa_s, hq_buf, L, opts.heavy_capacity)
        hi = jnp.where(jnp.arange(n_t * c) < T, hi, lo)  # padded queries: empty
        Ks, Vs = _take(Kc, order), _take(Vc, order)
        h_out, h_lse = heavy_band(q_buf, Ks, Vs, lo, hi, opts.scale, opts.heavy_capacity, opts.band_block,
                                  opts.tile_budget)
        tiles = lambda x: jnp.moveaxis(x.reshape((B, H, n_t, c) + x.shape[3:]), 2, 0)  # noqa: E731
        heavy = (tiles(h_out), tiles(h_lse))
    out, _ = causal_apply(q_tiles, tile_ids, Kc, Vc, plan, opts, heavy=heavy, full_pass=cache is None)
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, n_t * c, -1)
    out = jax.lax.dynamic_slice_in_dim(out, r0, T, axis=2)
    return out, (Kc_state, Vc_state, HKc), n_valid


# ---------------------------------------------------------------------------
# the core
# ---------------------------------------------------------------------------


class KDEformerAttention(AttentionCore):
    """KDEformer attention core (bidirectional: the released estimator; causal: §4)."""

    name = "kdeformer"
    EXECUTION_KEYS = ("heavy_impl", "heavy_scores_max_len", "heavy_band_block", "tile_budget")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """Causal: the heavy logits' routes (``heavy_impl``): gather (the reference), scores and band (full
        passes; calls with a state gather). Bidirectional: one."""
        from longctx.attention.dispatch import Implementation

        if not causal:
            return (Implementation("bidirectional"),)
        return (Implementation("gather", config={"heavy_impl": "gather"}),
                Implementation("scores", config={"heavy_impl": "scores"}),
                Implementation("band", config={"heavy_impl": "band"}, test_config={"heavy_band_block": 8}))
    randomized = True

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                # bidirectional (§2.3; our encoder defaults r=7, b=32, m=96, §3)
                "bucket_size": 32,  # b: keys (and queries) per sorted block
                "num_samples": 96,  # m: sampled key columns per (batch, head); 0 = block attention only
                "num_projs": 7,  # r: hash bits
                "gray_order": "inverse",  # 'inverse' (paper, G⁻¹) | 'forward' (released code, G)
                "sampling": "ref",  # 'ref' (1/N + ‖ṽ‖/‖Ṽ‖²_op) | 'uniform'
                "residual": "sampled",  # 'sampled' | 'exact' (debug: all non-block columns = dense, O(N²))
                "power_iters": 20,
                # shared
                "fixed_projections": False,  # W from PRNGKey(lsh_seed), shared by batch, heads and calls
                "lsh_seed": 0,
                "logit_scale": 0.0,  # σ; 0 -> head_dim^-1/2
                "eval_rng_seed": 0,  # deterministic=True uses PRNGKey(eval_rng_seed)
                "tile_budget": 1 << 22,  # causal: logits materialized per lax.map step (memory knob)
                # causal heavy logits: 'gather' the ≤ b_h keys of every query (O(N b_h d)); 'scores':
                # one [c, M] matmul per chunk kept only on the heavy set (same entries; fast for short
                # caches on CPU, quadratic); 'band' (full passes; calls with a state gather): tiles of
                # code-sorted queries against blocks of code-sorted keys (same entries, as matmuls,
                # O(N (b_h + block) d)); 'auto': 'scores' while the cache has ≤ heavy_scores_max_len,
                # else 'band' for a full pass and 'gather' for a call with a state
                "heavy_impl": "auto",
                "heavy_scores_max_len": 1024,
                "heavy_band_block": 64,  # 'band': sorted queries per tile = sorted keys per block
                # causal (§4)
                "causal": ml_collections.ConfigDict({
                    "chunk_size": 128,  # c
                    "local_chunks": 2,  # nl: exact window = the own chunk and nl-1 before it
                    "heavy_capacity": 64,  # b_h: most recent same-code keys before the window
                    "num_projs": 6,
                    "num_samples": 128,  # m per chunk
                    "sampling": "uniform",  # 'uniform' | 'ref'
                    "residual": "sampled",  # 'sampled' | 'exact' (debug: all non-heavy prefix keys = dense)
                }),
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = "attention.kdeformer"
        require(cfg.bucket_size > 0, f"{p}.bucket_size={cfg.bucket_size}; must be > 0")
        require(cfg.num_samples >= 0, f"{p}.num_samples={cfg.num_samples}; must be >= 0")
        require(0 <= cfg.num_projs <= 16, f"{p}.num_projs={cfg.num_projs}; must be in [0, 16]")
        require(cfg.power_iters >= 1, f"{p}.power_iters must be >= 1")
        require(cfg.logit_scale >= 0.0, f"{p}.logit_scale={cfg.logit_scale}; must be >= 0 (0 = head_dim^-1/2)")
        require(cfg.tile_budget > 0, f"{p}.tile_budget must be positive")
        require(cfg.heavy_impl in ("auto", "gather", "scores", "band"),
                f"{p}.heavy_impl={cfg.heavy_impl!r}; allowed: auto, gather, scores, band")
        require(cfg.heavy_band_block > 0, f"{p}.heavy_band_block={cfg.heavy_band_block}; must be > 0")
        for key, allowed in (("gray_order", ("inverse", "forward")), ("sampling", ("ref", "uniform")),
                             ("residual", ("sampled", "exact"))):
            require(cfg[key] in allowed, f"{p}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
        cc = cfg.causal
        require(cc.chunk_size > 0, f"{p}.causal.chunk_size={cc.chunk_size}; must be > 0")
        require(cc.local_chunks >= 1, f"{p}.causal.local_chunks={cc.local_chunks}; must be >= 1")
        require(cc.heavy_capacity >= 0, f"{p}.causal.heavy_capacity={cc.heavy_capacity}; must be >= 0")
        require(0 <= cc.num_projs <= 12, f"{p}.causal.num_projs={cc.num_projs}; must be in [0, 12]")
        require(cc.num_samples >= 0, f"{p}.causal.num_samples={cc.num_samples}; must be >= 0")
        for key, allowed in (("sampling", ("uniform", "ref")), ("residual", ("sampled", "exact"))):
            require(cc[key] in allowed, f"{p}.causal.{key}={cc[key]!r}; allowed: {', '.join(allowed)}")

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        small = {"chunk_size": 8, "local_chunks": 2, "heavy_capacity": 4, "num_projs": 3, "num_samples": 8}
        return {
            "causal_uniform": ContractCase(cfg={"causal": dict(small)}, length=64, directions=("causal",)),
            # the 'band' heavy route (the default beyond heavy_scores_max_len) at a length the tests can afford
            "causal_band": ContractCase(cfg={"causal": dict(small), "heavy_impl": "band", "heavy_band_block": 8},
                                        length=64, directions=("causal",)),
            "causal_ref": ContractCase(cfg={"causal": dict(small, sampling="ref")}, length=64, directions=("causal",),
                                       slow=True),
            "bidirectional": ContractCase(cfg={"bucket_size": 8, "num_samples": 8, "num_projs": 3}, length=64,
                                          directions=("bidirectional",)),
        }

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim)
        c = self.cfg
        scale = float(c.logit_scale) if c.logit_scale > 0 else head_dim**-0.5
        self.bidir_opts = BidirOptions(
            bucket_size=c.bucket_size, num_samples=c.num_samples, num_projs=c.num_projs, gray_order=c.gray_order,
            sampling=c.sampling, residual=c.residual, power_iters=c.power_iters, scale=scale)
        cc = c.causal
        self.causal_opts = CausalOptions(
            chunk_size=cc.chunk_size, local_chunks=cc.local_chunks, heavy_capacity=cc.heavy_capacity,
            num_projs=cc.num_projs, num_samples=cc.num_samples, sampling=cc.sampling, residual=cc.residual,
            power_iters=c.power_iters, scale=scale, tile_budget=c.tile_budget, heavy_impl=c.heavy_impl,
            heavy_scores_max_len=c.heavy_scores_max_len, band_block=c.heavy_band_block)

    # -- randomness -----------------------------------------------------------------
    def _keys(self, deterministic, key):
        if deterministic:
            key = jax.random.PRNGKey(self.cfg.eval_rng_seed)
        elif key is None:
            raise ValueError("kdeformer: deterministic=False needs a PRNG `key` (hash projections and samples)")
        return jax.random.split(key)

    def _projections(self, k_w, batch):
        r = self.causal_opts.num_projs if self.causal else self.bidir_opts.num_projs
        if self.cfg.fixed_projections:
            W = draw_projections(jax.random.PRNGKey(self.cfg.lsh_seed), 1, 1, self.head_dim, r)
            return jnp.broadcast_to(W, (batch, self.num_heads, self.head_dim, r))
        return draw_projections(k_w, batch, self.num_heads, self.head_dim, r)

    # -- contract -------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("kdeformer: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("kdeformer: init_state needs max_len (the KV / code cache capacity in tokens)")
        B, H, D, Dv = batch_size, self.num_heads, self.head_dim, self.value_dim
        return {
            "k": jnp.zeros((B, H, max_len, D), jnp.float32),
            "v": jnp.zeros((B, H, max_len, Dv), jnp.float32),
            "codes": jnp.zeros((B, H, max_len), jnp.int32),
            "proj": jnp.zeros((B, H, D, self.causal_opts.num_projs), jnp.float32),
            "length": jnp.zeros((), jnp.int32),
        }

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None):
        check_qkv(q, k, v)
        if v.shape[-1] != self.value_dim or q.shape[-1] != self.head_dim or q.shape[1] != self.num_heads:
            raise ValueError(f"kdeformer: expected {self.num_heads} heads, head_dim {self.head_dim}, value_dim "
                             f"{self.value_dim}; got q {q.shape}, v {v.shape}")
        k_w, k_s = self._keys(deterministic, key)
        B = q.shape[0]
        W = self._projections(k_w, B)
        if not self.causal:
            if state is not None:
                raise ValueError("kdeformer: a bidirectional core takes no state")
            return bidir_forward(q, k, v, W, k_s, self.bidir_opts).astype(v.dtype), None
        if state is None:
            out, (Kc, Vc, HKc), n = causal_forward(q, k, v, W, k_s, self.causal_opts)
            T = q.shape[2]
            sdt = _ftype(q)  # the state's dtype (float32 or wider), as init_state's
            new_state = {"k": Kc[:, :, :T].astype(sdt), "v": Vc[:, :, :T].astype(sdt), "codes": HKc[:, :, :T], "proj": W,
                         "length": jnp.asarray(T, jnp.int32)}
            return out.astype(v.dtype), new_state
        length = state["length"]
        M = state["k"].shape[2]
        if q.shape[2] > M:  # static: more new tokens than the whole state holds
            raise CapacityError(CAPACITY_MESSAGE.format(capacity=M, needed=q.shape[2]))
        check_capacity(length + q.shape[2], M, CAPACITY_MESSAGE)  # eager, or a host callback under jit
        W = jnp.where(length > 0, state["proj"], W)  # the stream keeps its first call's projections
        out, (Kc, Vc, HKc), n = causal_forward(q, k, v, W, k_s, self.causal_opts,
                                               cache=(state["k"], state["v"], state["codes"]), length=length)
        new_state = {"k": Kc, "v": Vc, "codes": HKc, "proj": W, "length": jnp.asarray(n, jnp.int32)}
        return out.astype(v.dtype), new_state


__all__ = [
    "BidirOptions",
    "CausalOptions",
    "KDEformerAttention",
    "bidir_apply",
    "bidir_forward",
    "bidir_plan",
    "causal_apply",
    "causal_forward",
    "causal_plan",
    "draw_projections",
    "draw_samples",
    "gray_rank",
    "lsh_codes",
    "power_lambda",
]

"""Transformer-VQ attention (Lingle 2023, arXiv 2309.16354; method notes: docs/methods/transformer_vq.md,
whose sections the numbers below cite).

Keys are vector-quantized per head onto an EMA codebook with a straight-through
estimator (STVQ). Because every quantized key is one of S codewords, softmax
attention over an arbitrary prefix factorizes into S code logits plus per-code
(mean value, count) summaries: a lossless compressed cache *for the quantized keys*.

Pure functions (all shapes [B, H, T, .]; every float computed in
``promote(dtype, float32)`` so fp64 tests run in fp64):

* :func:`stvq`                       -- argmin assignment + straight-through k_hat (§2.2)
* :func:`quadratic_reference`        -- full [T, T] softmax over K_hat with the XL band bias (2.4)
* :func:`causal_parallel`            -- block-wise linear form, lag-2 cache, serial/matmul/assoc/sum
                                        reductions, carried initial state, ragged T (2.6; M <= L)
* :func:`causal_blocks`              -- the same form (serial reduction) one query block at a time, with a
                                        recomputing backward (the XLA training path; 2.6)
* :func:`causal_stream`              -- streaming form over chunks of any L >= 1 and any M (2.7)
* :func:`encoder_parallel`           -- bidirectional form, with or without the symmetric band (2.5)
* :func:`ema_update`                 -- EMA k-means codebook update (3)

Notation inside: ``q_u = q + u'`` (content query), ``bd[..., i, d] = (q_i + v') . r'_d``
(the band/position term for distance d = 0..M, or d = -M..M for the encoder),
``C`` the codebook [H, S, Dk] (always read under stop_gradient).

State of a causal core (constant size, canonical: a function of the prefix only)::

    {"pos": int32[],                       # tokens seen
     "band_k": [B, H, M, Dk], "band_v": [B, H, M, Dv], "band_z": int32[B, H, M],
     "agg_mu": [B, H, S, Dv], "agg_n": [B, H, S]}

band = the newest M tokens (right-aligned; slot j holds position pos - M + j, invalid if < 0),
agg = running mean of values per code and the count of every older token (fp32).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx.attention import dispatch
from longctx.attention.base import (
    AttentionCore,
    ContractCase,
    DropIn,
    KernelBench,
    NonGradState,
    axes,
    check_qkv,
    require,
)
from longctx.layout import rows_apply as flat_last
from longctx.xla_cpu import rowdot, rows_dot, transposed
from pallas_kernels import vq_cache

# The block-parallel causal form (§2.6) and its helpers live beside the Pallas kernel that must match them
# (pallas_kernels/vq_cache_ref.py, DESIGN.md section 3); this file imports them: one copy of the math.
from pallas_kernels.vq_cache_ref import (  # noqa: F401  (re-exported names)
    NEG,
    REDUCTIONS,
    acc_einsum,
    block_inputs,
    causal_parallel,
    code_summary,
    code_sums,
    compute_dtype,
    empty_state,
    float_dtype,
    log_count,
    merge,
    prefix_reduce,
    rel_bias,
    skew_bias,
)
from pallas_kernels.vq_cache_ref import cast_state as _cast_state
from pallas_kernels.vq_cache_ref import final_state as _final_state  # noqa: F401
from pallas_kernels.vq_cache_ref import pad_left as _pad_left  # noqa: F401
from pallas_kernels.vq_cache_ref import pad_to as _pad_to
from pallas_kernels.vq_cache_ref import softmax_mix as _softmax_mix

sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- helpers


def rms_normalize(x, eps: float = 1e-6):
    """x * rsqrt(mean(x^2) + eps), no gain/bias, computed in >= fp32, cast back (rows flattened on CPU: its
    gradient's row sums then meet no size-1 dimension, longctx.xla_cpu)."""
    return flat_last(functools.partial(_rms_rows, eps=eps), x)


def _rms_rows(x, eps: float):
    xf = x.astype(float_dtype(x))
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def sinusoid(d, dim: int, base: float = 1e5, dtype=jnp.float32):
    """e(d) = [sin(d w_k) || cos(d w_k)], w_k = base^(-2k/dim), k = 0..dim/2-1 (halves concatenated)."""
    half = dim // 2
    w = base ** (-jnp.arange(half, dtype=dtype) * 2.0 / dim)
    ang = jnp.asarray(d, dtype)[..., None] * w
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def codebook_from_stats(c_sum, c_count):
    """C = c_sum / max(c_count, 0.01)."""
    return c_sum / jnp.maximum(c_count, 0.01)[..., None]




# ----------------------------------------------------------------------------- STVQ
def stvq(k, C, *, chunk: int = 512):
    """Straight-through VQ. k: [B, H, T, Dk]; C: [H, S, Dk] (read under stop_gradient).

    Returns (k_hat, z, err2, c_z): k_hat = k + sg(c_z - k) (value c_z, Jacobian I),
    z = argmin_s ||k - c_s||^2 in >= fp32 (ties -> lowest index), err2 = relu(min d^2), c_z = sg(C)[z].
    The search runs over ``chunk`` keys at a time (a [chunk, S] distance tile that stays in cache; one
    [T, S] tensor costs more in memory traffic than in arithmetic).
    """
    dt = float_dtype(k, C)
    kf, Cf = k.astype(dt), sg(C).astype(dt)
    B, H, T, Dk = kf.shape
    half_c2 = 0.5 * jnp.sum(Cf * Cf, -1)[:, None, None, :]

    def nearest(kc):  # argmin ||k - c||^2 = argmax (k.c - |c|^2 / 2); d^2 = |k|^2 - 2 max(.)
        # heads-major [H, B, chunk, S], the order of the head-batched matmul's output: in [B, H, ..] order XLA:CPU
        # copied every distance tile into place, twice (several times slower)
        g = jnp.einsum("bhtd,hsd->hbts", kc, Cf) - half_c2
        z, g_max = (jnp.swapaxes(x, 0, 1) for x in (first_argmax(g), jnp.max(g, -1)))
        return z, jnp.sum(kc * kc, -1) - 2.0 * g_max

    if T <= chunk:
        z, d2min = nearest(kf)
    else:
        n = -(-T // chunk)
        kc = jnp.moveaxis(_pad_to(kf, 2, n * chunk).reshape(B, H, n, chunk, Dk), 2, 0)
        z, d2min = jax.lax.map(nearest, kc)
        z, d2min = (jnp.moveaxis(x, 0, 2).reshape(B, H, n * chunk)[:, :, :T] for x in (z, d2min))
    c_z = _gather_codes(Cf, z)
    k_hat = kf + sg(c_z - kf)
    return k_hat, z, jax.nn.relu(d2min), c_z


def first_argmax(g):
    """argmax over the last axis, ties to the lowest index, as two plain reductions (a max, then a min over
    the indices that reach it). Same result as ``lax.argmax`` for finite g; XLA:CPU vectorizes these where
    it runs the (value, index) pair reduction of ``lax.argmax`` element by element (over twice as slow).
    A row with a NaN matches nowhere; it gets the last index, so a code stays in range (the
    per-code scatter-add of ``code_sums`` must never see an index past S - 1)."""
    m = jnp.max(g, axis=-1, keepdims=True)
    n = g.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(g == m, jnp.arange(n, dtype=jnp.int32), n), axis=-1), n - 1)


def _gather_codes(C, z):
    """C [H, S, D], z [B, H, T] -> [B, H, T, D]."""
    return jax.vmap(lambda c, zz: c[zz], in_axes=(0, 1), out_axes=1)(C, z)


# ----------------------------------------------------------------------------- position terms
def rel_table(W_R, M: int, *, signed: bool, base: float, scale, dtype, dropout_key=None, p_drop: float = 0.0):
    """r'_d = scale * Drop(e(d)) W_R for d = 0..M (causal) or d = -M..M (signed); -> [n, H*Dk] in ``dtype`` (the
    compute dtype; the sinusoids are formed in float32 or wider)."""
    d = jnp.arange(-M if signed else 0, M + 1)
    e = sinusoid(d, W_R.shape[0], base, jnp.promote_types(dtype, jnp.float32))  # the angles in >= float32
    if dropout_key is not None and p_drop > 0.0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - p_drop, e.shape)
        e = jnp.where(keep, e / (1.0 - p_drop), 0.0)
    return scale * (e.astype(dtype) @ W_R.astype(dtype))


def band_scores(q_v, r):
    """bd[b, h, t, n] = q_v[b, h, t] . r[n, h]; q_v [B, H, T, Dk], r [n, H, Dk]; float32 (or wider) scores."""
    return acc_einsum("bhtd,nhd->bhtn", q_v, r)


# ----------------------------------------------------------------------------- quadratic reference
def quadratic_reference(q_u, bd, k_hat, v, *, M: int, causal: bool = True, sg_far_block: int | None = None,
                        valid=None):
    """Full [T, T] softmax (§2.4 / dense bidirectional for the encoder).

    s_ij = q_u_i . k_j + [0 <= d <= M] bd[i, d] (causal; d = i - j) or [|d| <= M] bd[i, d + M] (encoder),
    s_ij = -inf for j > i (causal) or invalid j. ``sg_far_block=L``: for the dK reference of §2.7,
    keys j < (n-1)L for a query of block n enter the content logit under stop_gradient.
    """
    T = q_u.shape[2]
    i = jnp.arange(T)[:, None]
    j = jnp.arange(T)[None, :]
    s = jnp.einsum("bhid,bhjd->bhij", q_u, k_hat)
    if sg_far_block is not None:
        far = j < (i // sg_far_block - 1) * sg_far_block
        s = jnp.where(far, jnp.einsum("bhid,bhjd->bhij", q_u, sg(k_hat)), s)
    d = i - j
    if causal:
        s = s + rel_bias(bd, d, M)
        mask = j <= i
    else:
        s = s + rel_bias(bd, d + M, 2 * M)
        mask = jnp.ones((T, T), bool)
    if valid is not None:
        mask = mask & valid[None, :]
    out, _ = _softmax_mix([(s, mask, v)])
    return out


# states (empty_state), cross-block reductions (prefix_reduce) and the causal block-parallel form
# (causal_parallel): pallas_kernels/vq_cache_ref.py, imported above.


# The default of the execution setting tiled_min_scores:
# form='auto' runs the tiled causal_blocks when a call's score tensor B*H*T*(S+2L) has at least this many
# entries (32 MB in fp32): below it the one-shot causal_parallel is as fast or faster (small blocks make the
# tile scan's per-iteration cost dominate: configs/main.py, batch 8, L = S = 64, windows of 256, trains about a
# sixth slower through the tiles), above it autodiff's [T, S+2L] residuals make
# causal_parallel memory-bound. For a whole-model training step at the Transformer-VQ release's shape (one head,
# L = S = 256, 8 GAUs), the two forms are level at 1k-4k tokens and the tiles win at 16k.
TILED_MIN_SCORES = 1 << 23
# causal_blocks keeps each tile's attention weights from the forward for the backward (instead of recomputing the
# scores and their exp from the saved log-sum-exp) when a call's B*H*T*(S+2L) is at most this many entries: the
# default of the config's keep_budget. 2^26 (256 MB in fp32 per attention call, each GAU's held until its
# backward): this keeps the bench's 8k call (4 heads, L = S = 512; 50M entries), whose step it makes faster;
# 2^24 kept only the release's shape up to 16k
KEEP_MAX_SCORES = 1 << 26


# ----------------------------------------------------------------------------- block-parallel form, blocked
def causal_blocks(q_u, q_v, r, k_hat, z, v, C, state, *, L: int, M: int, q_tile: int = 256,
                  keep_budget: int | None = None):
    """``causal_parallel(q_u, band_scores(q_v, r), ..., reduction='serial')`` computed one tile of
    ``q_tile`` queries at a time (nested ``lax.scan`` over blocks and the tiles of a block), with a
    FlashAttention-style backward that recomputes each tile's probabilities from the saved log-sum-exp.

    q_v = q + v' [B,H,T,Dk] and r = r' [M+1, H, Dk]: each tile forms its own band scores q_v r'^T
    [q_tile, M+1] and their relative shift, so the [T, M+1] band tensor is never stored. A tile attends to
    S codes (values = the lag-2 cache), the previous block and the causal present: a [q_tile, S + 2L]
    score tile whose working set stays in cache, instead of [T, S + 2L] scores, probabilities and masks
    held for autodiff (on a CPU that traffic, not the arithmetic, set the time). ``q_tile`` is reduced to
    a divisor of L. Same result and state as ``causal_parallel``. Returns (o [B,H,T,Dv], new_state).
    """
    B, H, T, _ = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    # the tiled form computes its products in float32 or wider (block_inputs' default): its hand-written backward
    # has no compute-dtype path yet
    p = block_inputs(q_u, None, k_hat, z, v, C, state, L=L, M=M, reduction="serial")
    qb = p["qb"]
    qvb = _pad_to(q_v.astype(qb.dtype), 2, qb.shape[2] * L).reshape(qb.shape)
    # [H, M+1, Dk] (then broadcast to [B, H, M+1, Dk]), head-major for the per-tile batched matmuls, and reversed
    # along the lag: the band scores come out as bd[..., ::-1], the order the relative shift wants (no reversal
    # of a score tile, forward or back)
    # r and the codes are broadcast over the batch once, so every per-tile matmul is batched over (B, H) in the
    # order of its output: a head-only batch made XLA:CPU write [H, B, ..] and copy each score tile into place
    rh = jnp.swapaxes(r.astype(qb.dtype), 0, 1)[:, ::-1]
    rh, Cs = (jnp.broadcast_to(x[None], (B,) + x.shape) for x in (rh, p["Cs"]))
    q_tile = math.gcd(L, max(1, min(q_tile, L)))
    keep = B * H * qb.shape[2] * L * (S + 2 * L) <= (KEEP_MAX_SCORES if keep_budget is None else keep_budget)
    o = _vq_blocks(qb, qvb, rh, p["kx"], p["vx"], p["cmu"], log_count(p["cn"]), Cs, p["validx"], q_tile, keep)
    o = o.reshape(B, H, -1, Dv)[:, :, :T]
    return o, _final_state(p["state"], k_hat.astype(qb.dtype), z, v.astype(qb.dtype), T, M, S)


def _tile_bias(bdr, off: int, L: int):
    """Band bias [.., Lq, L + off + Lq] of the queries off..off+Lq-1 of a block (off static): bd[i, L + off + i - j]
    for the previous block and the present keys 0..off+Lq-1 (the later present keys are in every query's
    future and are not scored)."""
    extra = L - bdr.shape[-2]
    wide = skew_bias(bdr, L + extra, 2 * L + extra, reversed_input=True)
    return wide[..., extra - off: extra - off + L + off + bdr.shape[-2]]


def _tile_scores(qt, qvt, off, r, Cs, lcr, K, valid_p, valid_c):
    """Scores of the queries off..off+Lq-1 of a block: against the S codes [B,H,Lq,S] (plus their log counts,
    NEG for empty codes) and against the previous and present blocks [B,H,Lq,2L] (plus the band bias), and
    the band scores [B,H,Lq,M+1]. K = [previous block; present block] [B,H,2L,Dk]; r: [B,H,M+1,Dk]; Cs: [B,H,S,Dk].
    Masked entries get NEG added, so exp(s - max) is exactly 0 there and so is their gradient (an additive mask
    costs no select over the tile); the two parts share one normalizer and are never concatenated."""
    Lq = qt.shape[2]
    L = valid_c.shape[0]
    n_pres = off + Lq  # present keys any query of the tile can see
    s_c = jnp.einsum("bhld,bhsd->bhls", qt, Cs) + lcr[:, :, None, :]
    bdt = jnp.einsum("bhld,bhnd->bhln", qvt, r)
    causal = jnp.arange(n_pres)[None, :] <= (off + jnp.arange(Lq))[:, None]
    keep = jnp.concatenate([jnp.broadcast_to(valid_p[None, :], (Lq, L)), causal & valid_c[None, :n_pres]], axis=-1)
    band = _tile_bias(bdt, off, L) + jnp.where(keep, 0.0, NEG).astype(bdt.dtype)
    return s_c, jnp.einsum("bhld,bhnd->bhln", qt, K[:, :, :L + n_pres]) + band, bdt


def _block_kv(ops, i):
    """Keys and values of the previous and present blocks [B,H,2L,.], cache means [B,H,S,Dv], log counts and
    validities of block i."""
    qb, qvb, kx, vx, cmu, lc, validx = ops
    at = functools.partial(jax.lax.dynamic_index_in_dim, index=i, axis=2, keepdims=False)
    at1 = functools.partial(jax.lax.dynamic_index_in_dim, index=i + 1, axis=2, keepdims=False)
    K = jnp.concatenate([at(kx), at1(kx)], axis=2)
    V = jnp.concatenate([at(vx), at1(vx)], axis=2)
    return K, V, at(cmu), at(lc), validx[i], validx[i + 1]


def _tile_rows(x, i, c, Lq):
    """Rows c*Lq..(c+1)*Lq-1 of block i of x [B,H,R,L,...]."""
    return jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(x, i, axis=2, keepdims=False), c * Lq, Lq, 2)


def _vq_blocks_fwd_impl(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep: bool = False):
    """(o [B,H,R,L,Dv], lse [B,H,R,L], kept): ``keep`` (static): kept holds, per tile of a block, the unnormalized
    weights of the codes and of the keys and the inverse normalizer, stacked over the blocks; else None."""
    B, H, R, L, _ = qb.shape
    ops = (qb, qvb, kx, vx, cmu, lc, validx)

    def block(_, i):
        K, V, cm, lcr, valid_p, valid_c = _block_kv(ops, i)

        def tile(c):  # c static: tile c scores the previous block and present keys 0..(c+1)Lq-1
            s_c, s_l, _ = _tile_scores(_tile_rows(qb, i, c, Lq), _tile_rows(qvb, i, c, Lq), c * Lq, r, Cs, lcr, K,
                                       valid_p, valid_c)
            m = jnp.maximum(jnp.max(s_c, axis=-1, keepdims=True), jnp.max(s_l, axis=-1, keepdims=True))
            p_c, p_l = jnp.exp(s_c - m), jnp.exp(s_l - m)
            den = jnp.sum(p_c, axis=-1, keepdims=True) + jnp.sum(p_l, axis=-1, keepdims=True)
            o = jnp.einsum("bhls,bhsd->bhld", p_c, cm) + jnp.einsum("bhln,bhnd->bhld", p_l, V[:, :, :s_l.shape[-1]])
            return o / den, (m + jnp.log(den))[..., 0], ((p_c, p_l, 1.0 / den) if keep else None)

        outs = [tile(c) for c in range(L // Lq)]
        return None, (jnp.stack([x[0] for x in outs]), jnp.stack([x[1] for x in outs]), tuple(x[2] for x in outs))

    _, (o, lse, kept) = jax.lax.scan(block, None, jnp.arange(R))  # [R, nt, B,H,Lq,.]; kept: per tile, [R, ...]
    o = jnp.moveaxis(o, (0, 1), (2, 3)).reshape(B, H, R, L, -1)
    return o, jnp.moveaxis(lse, (0, 1), (2, 3)).reshape(B, H, R, L), (kept if keep else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _vq_blocks(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep=False):
    return _vq_blocks_fwd_impl(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq)[0]


def _vq_blocks_fwd(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep):
    o, lse, kept = _vq_blocks_fwd_impl(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep)
    return o, (qb, qvb, r, kx, vx, cmu, lc, Cs, validx, o, lse, kept)


def _vq_blocks_bwd(Lq, keep, res, do):
    """FlashAttention-style backward, one block (and tile) at a time: each tile's weights are recomputed from the
    saved log-sum-exp, or, ``keep``, read from the forward's kept unnormalized weights and inverse normalizer
    (no score matmuls and no exp pass; the normalizer is folded into the small [Lq, Dv] operands)."""
    qb, qvb, r, kx, vx, cmu, lc, Cs, validx, o, lse, kept = res
    B, H, R, L, Dk = qb.shape
    delta = rowdot(do, o)  # [B,H,R,L]
    ops = (qb, qvb, kx, vx, cmu, lc, validx)

    def block(dr, xs):
        i, kept_i = xs
        K, V, cm, lcr, valid_p, valid_c = _block_kv(ops, i)

        def tile(carry, c):  # c static, as in the forward: keys beyond the tile's last query are not scored
            dr, dK, dV, dcm = carry
            qt, qvt, dot = _tile_rows(qb, i, c, Lq), _tile_rows(qvb, i, c, Lq), _tile_rows(do, i, c, Lq)
            delta_t = _tile_rows(delta, i, c, Lq)[..., None]
            if keep:  # unnormalized weights and 1/den from the forward; dp's normalizer goes into do
                p_c, p_l, w = kept_i[c]
                nk = p_l.shape[-1]
                bdt_shape = qvt.shape[:3] + (r.shape[2],)
                dow = dot * w
                ds_c = p_c * (jnp.einsum("bhld,bhsd->bhls", dow, cm) - delta_t * w)
                ds_l = p_l * (jnp.einsum("bhld,bhnd->bhln", dow, V[:, :, :nk]) - delta_t * w)
            else:
                s_c, s_l, bdt = _tile_scores(qt, qvt, c * Lq, r, Cs, lcr, K, valid_p, valid_c)
                nk = s_l.shape[-1]
                bdt_shape = bdt.shape
                lse_t = _tile_rows(lse, i, c, Lq)[..., None]
                p_c, p_l = jnp.exp(s_c - lse_t), jnp.exp(s_l - lse_t)  # masked entries: exp(NEG - lse) = 0
                dow = dot
                ds_c = p_c * (jnp.einsum("bhld,bhsd->bhls", dot, cm) - delta_t)
                ds_l = p_l * (jnp.einsum("bhld,bhnd->bhln", dot, V[:, :, :nk]) - delta_t)
            Kt = K[:, :, :nk]
            dq = jnp.einsum("bhls,bhsd->bhld", ds_c, Cs) + jnp.einsum("bhln,bhnd->bhld", ds_l, Kt)
            # key-side gradients accumulate transposed, [.., D, keys] = qᵀ ds: the large query-major ds and p
            # stay as laid out and only small [Lq, D] operands are transposed (XLA:CPU otherwise copies each
            # [Lq, keys] tile into keys-major order, an extra pass over the scores), and transposed
            # first, so that the dots are plain products (longctx.xla_cpu.rows_dot)
            qt_t, dow_t, qvt_t = transposed(qt, dow, qvt)
            dK = dK.at[..., :nk].add(rows_dot(qt_t, ds_l))  # the codebook takes no gradient
            dV = dV.at[..., :nk].add(rows_dot(dow_t, p_l))
            dcm = dcm + rows_dot(dow_t, p_c)
            # the bias is linear in bdt: its transpose needs only bdt's shape
            _, bias_t = jax.vjp(lambda b: _tile_bias(b, c * Lq, L), jnp.zeros(bdt_shape, qvt.dtype))
            (dbd,) = bias_t(ds_l)
            dqv = jnp.einsum("bhln,bhnd->bhld", dbd, r)
            dr = dr + rows_dot(qvt_t, dbd)  # transposed too: [B, H, Dk, M+1]
            return (dr, dK, dV, dcm), (dq, dqv)

        zt = lambda x: jnp.zeros_like(jnp.swapaxes(x, -1, -2))  # noqa: E731
        carry = (dr, zt(K), zt(V), zt(cm))
        grads = []
        for c in range(L // Lq):
            carry, g = tile(carry, c)
            grads.append(g)
        dr, dK, dV, dcm = carry
        dq, dqv = (jnp.stack(x) for x in zip(*grads))
        # the key-side gradients leave the loop as accumulated, [.., D, keys]: each block's swap to keys-major
        # was a transposing write into the stacked outputs (at 16k, 64 blocks, ~7 % of a train step); after
        # the loop one swap per array goes into the pass that adds the blocks' two halves (ext)
        return dr, (dq, dqv, dK[..., :L], dK[..., L:], dcm, dV[..., :L], dV[..., L:])

    drt, (dq, dqv, dkp, dkc, dcmt, dvp, dvc) = jax.lax.scan(block, jnp.zeros_like(jnp.swapaxes(r, -1, -2)),
                                                            (jnp.arange(R), kept))
    dr = jnp.swapaxes(drt, -1, -2)
    dcm = jnp.swapaxes(dcmt, -1, -2)

    def ext(prev, cur):  # [R, B,H,D,L] contributions to extended blocks r (prev) and r+1 (cur) -> [B,H,R+1,L,D]
        z0 = jnp.zeros_like(prev[:1])
        return jnp.swapaxes(jnp.moveaxis(jnp.concatenate([prev, z0], 0) + jnp.concatenate([z0, cur], 0), 0, 2),
                            -1, -2)

    def rows(x):  # [R, nt, B,H,Lq,.] -> [B,H,R,L,.]
        return jnp.moveaxis(x, (0, 1), (2, 3)).reshape(B, H, R, L, -1)

    return (rows(dq), rows(dqv), dr, ext(dkp, dkc), ext(dvp, dvc), jnp.moveaxis(dcm, 0, 2), None, None, None)


_vq_blocks.defvjp(_vq_blocks_fwd, _vq_blocks_bwd)


# ----------------------------------------------------------------------------- streaming form
def _stream_step(state, q_u, bd, k_hat, z, v, Cs, M: int, S: int):
    """One step over Lc new tokens: attend to band (M) + present (Lc) + agg, then fold the oldest Lc into agg."""
    Lc = q_u.shape[2]
    pos = state["pos"]
    K = jnp.concatenate([state["band_k"].astype(k_hat.dtype), k_hat], axis=2)  # compute dtype
    V = jnp.concatenate([state["band_v"].astype(v.dtype), v], axis=2)
    Z = jnp.concatenate([state["band_z"], z], axis=2)
    kpos = pos - M + jnp.arange(M + Lc)
    qi = jnp.arange(Lc)[:, None]
    kj = jnp.arange(M + Lc)[None, :]
    mask = (kpos[None, :] >= 0) & (kj - M <= qi)
    s_l = acc_einsum("bhqd,bhkd->bhqk", q_u, K) + skew_bias(bd, M, M + Lc)
    s_c = acc_einsum("bhqd,hsd->bhqs", q_u, Cs) + log_count(state["agg_n"])[:, :, None, :]
    o, _ = _softmax_mix([(s_c, (state["agg_n"] > 0)[:, :, None, :], state["agg_mu"].astype(V.dtype)),
                         (s_l, mask, V)])
    sdt = state["agg_mu"].dtype  # the state (band, means, counts) stays in the statistics dtype
    mu, n = code_summary(Z[:, :, :Lc], V[:, :, :Lc].astype(sdt), kpos[:Lc] >= 0, S)
    agg_mu, agg_n = merge((state["agg_mu"], state["agg_n"]), (mu, n))
    new = {"pos": pos + Lc, "band_k": K[:, :, Lc:].astype(sdt), "band_v": V[:, :, Lc:].astype(sdt),
           "band_z": Z[:, :, Lc:], "agg_mu": agg_mu, "agg_n": agg_n}
    return new, o


def causal_stream(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int):
    """Streaming form (§2.7): chunks of L (any L >= 1, any M >= 1), scanned; a ragged tail is one
    shorter step. Equals the quadratic reference for every L and M. Returns (o, new_state)."""
    B, H, T, _ = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)  # state and band scores
    cd = compute_dtype(q_u, v)  # the matmul operands
    state = _cast_state(state, dt)
    Cs = sg(C).astype(cd)
    xs = (q_u.astype(cd), bd.astype(dt), k_hat.astype(cd), z, v.astype(cd))
    nfull, rem = divmod(T, L)
    outs = []
    if nfull:
        def chunks(x):
            x = x[:, :, : nfull * L]
            return jnp.moveaxis(x.reshape(x.shape[:2] + (nfull, L) + x.shape[3:]), 2, 0)

        def body(st, c):
            return _stream_step(st, *c, Cs, M, S)

        state, o = jax.lax.scan(body, state, tuple(chunks(x) for x in xs))
        outs.append(jnp.moveaxis(o, 0, 2).reshape(B, H, nfull * L, -1))
    if rem:
        state, o = _stream_step(state, *(x[:, :, nfull * L:] for x in xs), Cs, M, S)
        outs.append(o)
    return jnp.concatenate(outs, axis=2), state


# ----------------------------------------------------------------------------- encoder form
def encoder_parallel(q_u, bd, k_hat, z, v, C, *, L: int, M: int, band: bool, valid=None):
    """Bidirectional form (§2.5). band=False: Thm 3.5 (all keys through the code summaries, no bias).
    band=True (our extension): query block n attends exactly to blocks n-1, n, n+1 with the bias for
    |d| <= M (bd over d = -M..M), and to merge(prefix over blocks <= n-2, suffix over blocks >= n+2)."""
    B, H, T, _ = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    dt = float_dtype(q_u, v)  # per-code means and counts, band scores
    cd = compute_dtype(q_u, v)  # the matmul operands
    Cs = sg(C).astype(cd)
    valid = jnp.ones((T,), bool) if valid is None else valid
    if not band:
        mu, n = code_summary(z, v.astype(dt), valid, S)  # [B,H,S,Dv], [B,H,S]
        s_c = acc_einsum("bhtd,hsd->bhts", q_u.astype(cd), Cs) + log_count(n)[:, :, None, :]
        o, _ = _softmax_mix([(s_c, (n > 0)[:, :, None, :], mu.astype(cd))])
        return o
    if not 1 <= M <= L:
        raise ValueError(f"encoder band needs 1 <= M <= L, got M={M}, L={L}")
    R = -(-T // L)
    Tp = R * L

    def blocks(x, left=0, right=0):
        x = _pad_to(x, 2, Tp)
        widths = [(0, 0)] * x.ndim
        widths[2] = (left * L, right * L)
        x = jnp.pad(x, widths)
        return x.reshape(x.shape[:2] + (x.shape[2] // L, L) + x.shape[3:])

    qb, bdb = blocks(q_u.astype(cd)), blocks(bd.astype(dt))
    kx, vx, zx = blocks(k_hat.astype(cd), 1, 1), blocks(v.astype(cd), 1, 1), blocks(z, 1, 1)  # R+2 blocks
    vpad = jnp.pad(_pad_to(valid, 0, Tp), (L, L)).reshape(R + 2, L)
    bmu, bn = code_summary(zx[:, :, 1:-1], vx[:, :, 1:-1].astype(dt), vpad[1:-1], S)  # [B,H,R,...]
    pm, pn = prefix_reduce(bmu, bn, "serial")
    sm, sn = prefix_reduce(bmu[:, :, ::-1], bn[:, :, ::-1], "serial")
    sm, sn = sm[:, :, ::-1], sn[:, :, ::-1]  # suffix over blocks >= r

    def shift(x, by):  # out[n] = x[n + by] or zeros
        z0 = jnp.zeros_like(x[:, :, : abs(by)])
        n = x.shape[2] - abs(by)
        return jnp.concatenate([z0, x[:, :, :n]], 2) if by < 0 else jnp.concatenate([x[:, :, by:], z0], 2)

    if R > 2:
        fmu, fn = merge((shift(pm, -2), shift(pn, -2)), (shift(sm, 2), shift(sn, 2)))
    else:
        fmu, fn = jnp.zeros_like(bmu), jnp.zeros_like(bn)
    local_k = jnp.concatenate([kx[:, :, :R], kx[:, :, 1:R + 1], kx[:, :, 2:]], axis=3)  # [B,H,R,3L,Dk]
    local_v = jnp.concatenate([vx[:, :, :R], vx[:, :, 1:R + 1], vx[:, :, 2:]], axis=3)
    local_valid = jnp.concatenate([vpad[:R], vpad[1:R + 1], vpad[2:]], axis=1)  # [R, 3L]
    s_l = acc_einsum("bhrld,bhrjd->bhrlj", qb, local_k) + skew_bias(bdb, L + M, 3 * L)  # bd[i, L+M+i-j]
    s_c = acc_einsum("bhrld,hsd->bhrls", qb, Cs) + log_count(fn)[:, :, :, None, :]
    o, _ = _softmax_mix([(s_c, (fn > 0)[:, :, :, None, :], fmu.astype(cd)),
                         (s_l, local_valid[:, None, :], local_v)])
    return o.reshape(B, H, Tp, Dv)[:, :, :T]


# ----------------------------------------------------------------------------- codebook learning
def vq_stats(k, z, S: int, mask=None):
    """EMA statistics of one call: per-code counts [H, S] and key sums [H, S, Dk] (pre-quantization keys,
    fp32 or wider, masked tokens excluded), summed over batch and time, under stop_gradient."""
    kf = sg(k).astype(float_dtype(k))
    valid = jnp.ones(z.shape, bool) if mask is None else mask[:, None, :]
    tot, cnt = code_sums(z, kf, valid, S)  # [B,H,S,Dk], [B,H,S]
    return {"count": jnp.sum(cnt, axis=0), "sum": jnp.sum(tot, axis=0)}


def ema_update(c_sum, c_count, stats, gamma: float):
    """c_sum <- g c_sum + (1-g) sum_k ; c_count <- g c_count + (1-g) count (stats summed globally)."""
    c_sum = gamma * c_sum + (1.0 - gamma) * stats["sum"].astype(c_sum.dtype)
    c_count = gamma * c_count + (1.0 - gamma) * stats["count"].astype(c_count.dtype)
    return c_sum, c_count


def commit_loss(k, c_z, mask=None):
    """mean_{b,t}(mask * sum_heads ||k - sg(c_z)||^2), divided by the number of unmasked tokens."""
    dt = float_dtype(k)
    e = jnp.sum(jnp.square(k.astype(dt) - sg(c_z).astype(dt)), axis=(1, 3))  # [B, T]
    if mask is None:
        return jnp.mean(e)
    m = mask.astype(dt)
    return jnp.sum(e * m) / jnp.maximum(jnp.sum(m), 1.0)


# ----------------------------------------------------------------------------- the core
class TransformerVQAttention(AttentionCore):
    """Transformer-VQ core. Inside the standard multi-head ``TransformerBlock`` it is the release's
    throughput variant (MHA, one codebook per head); inside ``GAUBlock`` the paper's single-head GAU.

    Owns: the codebook statistics (``c_sum`` [H,S,Dk], ``c_count`` [H,S]; :class:`NonGradState`), and the
    Transformer-XL relative-bias parameters ``u``, ``v`` ([H, Dk], zero-init) and ``W_R`` [rel_dim, H*Dk].
    """

    takes_token_mask = True  # mask=[B, T]: tokens that count in the commit loss and codebook statistics

    name = "transformer_vq"
    EXECUTION_KEYS = ("impl", "form", "reduction", "keep_budget", "tiled_min_scores")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """Causal: parallel (the block-parallel quadratic form under autodiff; the reference), blocks (its tiled
        form with a recomputing backward), stream (block by block, as decoding runs), pallas (the §9 kernel;
        interpret mode on CPU). ``form='auto'`` picks stream for calls shorter than a block, else blocks when a
        call has at least ``tiled_min_scores`` scores B*H*T*(S+2L), else parallel; ``impl`` picks the kernel
        for the block-parallel forms. Bidirectional: one (the encoder form)."""
        from longctx.attention.dispatch import Implementation

        if not causal:
            return (Implementation("encoder"),)
        return (Implementation("parallel", config={"form": "parallel", "impl": "xla"}),
                Implementation("blocks", config={"form": "blocks", "impl": "xla", "reduction": "serial"}),
                Implementation("stream", config={"form": "stream", "impl": "xla"}),
                Implementation("pallas", platforms=("tpu", "cuda"), kernel=True,
                               config={"form": "parallel", "impl": "pallas", "reduction": "serial"}))
    # Rotary embeddings would rotate keys before quantization (not the paper's model); the position
    # signal is the XL relative bias inside the core, optionally with absolute embeddings.
    allowed_positions = ("none", "learned", "sinusoidal")

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                "codebook_size": 512,  # S
                "block_len": 512,  # L
                "mem_len": 0,  # M, the exact band carrying the bias; 0 means M = block_len
                "reduction": "serial",  # 'serial' | 'matmul' | 'assoc' (cross-block cache reduction)
                "form": "auto",  # 'auto' | 'parallel' | 'blocks' | 'stream' (causal only; see __call__)
                "beta": 1e-4,  # commit-loss weight (reported already multiplied)
                "gamma": 0.99,  # EMA decay of the codebook statistics
                "qk_norm": True,  # RMS-normalize q, k and scale each by Dk^-1/4 (False: caller did it)
                "rel_dim": 0,  # width of the sinusoid table e(d) (d_model); 0 means num_heads*head_dim
                "rel_base": 1e5,  # lambda of the sinusoids
                "p_dropsin": 0.0,  # dropout on the sinusoid table (training only)
                "encoder_band": True,  # bidirectional: keep the exact symmetric band (False: Thm 3.5)
                "impl": "xla",  # 'xla' | 'pallas' | 'auto'
                # the tiled causal form keeps its attention weights for the backward when a call has at most this
                # many scores B*H*T*(S+2L) (fp32 entries, held from each layer's forward to its backward unless
                # model.remat recomputes the block); larger calls recompute them; 0 always recomputes
                "keep_budget": KEEP_MAX_SCORES,
                # form='auto' takes the tiled form (blocks) for calls with at least this many scores B*H*T*(S+2L)
                "tiled_min_scores": TILED_MIN_SCORES,
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = "attention.transformer_vq"
        require(cfg.codebook_size >= 1, f"{p}.codebook_size={cfg.codebook_size}; must be >= 1")
        require(cfg.block_len >= 1, f"{p}.block_len={cfg.block_len}; must be >= 1")
        require(cfg.mem_len >= 0, f"{p}.mem_len={cfg.mem_len}; must be >= 0 (0 means mem_len = block_len)")
        M = cfg.mem_len or cfg.block_len
        allowed = ("serial", "matmul", "assoc")
        require(cfg.reduction in allowed, f"{p}.reduction={cfg.reduction!r}; allowed: {', '.join(allowed)}")
        forms = ("auto", "parallel", "blocks", "stream")
        require(cfg.form in forms, f"{p}.form={cfg.form!r}; allowed: {', '.join(forms)}")
        require(cfg.form != "blocks" or cfg.reduction == "serial",
                f"{p}.form='blocks' computes the serial reduction; set {p}.reduction='serial'")
        if cfg.form in ("parallel", "blocks") or not causal:
            require(M <= cfg.block_len, f"{p}: the block-parallel{'' if causal else ' encoder'} form needs "
                    f"mem_len <= block_len (got {M} > {cfg.block_len}); use form='stream' or a smaller mem_len")
        require(0.0 <= cfg.gamma < 1.0, f"{p}.gamma={cfg.gamma}; allowed: 0 <= gamma < 1")
        require(cfg.beta >= 0.0, f"{p}.beta={cfg.beta}; must be >= 0")
        require(0.0 <= cfg.p_dropsin < 1.0, f"{p}.p_dropsin={cfg.p_dropsin}; allowed: 0 <= p < 1")
        require(cfg.rel_dim >= 0 and cfg.rel_dim % 2 == 0, f"{p}.rel_dim={cfg.rel_dim}; must be even and >= 0")
        require(cfg.keep_budget >= 0, f"{p}.keep_budget={cfg.keep_budget}; must be >= 0 (0: always recompute)")
        require(cfg.tiled_min_scores >= 0, f"{p}.tiled_min_scores={cfg.tiled_min_scores}; must be >= 0")
        require(cfg.rel_base > 1.0, f"{p}.rel_base={cfg.rel_base}; must be > 1")
        why = dispatch.impl_problem(cfg.impl, ("xla", "pallas"))
        require(why is None, f"{p}.{why}")
        # impl='pallas' runs the §9 Pallas kernel (pallas_kernels/vq_cache.py), which computes the serial
        # reduction; 'auto' picks it or XLA by the shared rule of longctx/attention/dispatch.py.
        require(cfg.impl != "pallas" or cfg.reduction == "serial",
                f"{p}.impl='pallas' runs the serial reduction; set {p}.reduction='serial'")

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim)
        self.cfg = ml_collections.FrozenConfigDict(self.cfg)  # hashable, so the module's graphdef is a jit key
        c = self.cfg
        H, Dk, S = num_heads, head_dim, c.codebook_size
        self.S, self.L = S, c.block_len
        self.M = c.mem_len or c.block_len
        rel_dim = c.rel_dim or H * Dk
        require(rel_dim % 2 == 0, f"attention.transformer_vq.rel_dim={rel_dim} must be even")
        self.rel_dim = rel_dim
        # Flax variance scaling, fan-in, on [H, S, Dk]: fan_in = S*H, so var = 1/(S*H).
        self.c_sum = NonGradState(jax.random.normal(rngs.params(), (H, S, Dk), jnp.float32) / math.sqrt(S * H),
                                  **axes("heads", "codebook", "head_dim"))
        self.c_count = NonGradState(jnp.ones((H, S), jnp.float32), **axes("heads", "codebook"))
        self.u = nnx.Param(jnp.zeros((H, Dk), jnp.float32), **axes("heads", "head_dim"))
        self.v = nnx.Param(jnp.zeros((H, Dk), jnp.float32), **axes("heads", "head_dim"))
        self.W_R = nnx.Param(jax.random.normal(rngs.params(), (rel_dim, H * Dk), jnp.float32) / math.sqrt(rel_dim),
                             **axes(None, "qkv"))

    @classmethod
    def configure_for_block(cls, cfg, *, normalizes_qk, d_model):
        cfg = ml_collections.ConfigDict(cfg.to_dict())
        if normalizes_qk:  # the GAU normalizes q and k itself (§2.1)
            cfg.qk_norm = False
        if not cfg.rel_dim:  # the sinusoid table has width d_model
            cfg.rel_dim = d_model
        return cfg

    @classmethod
    def kernel_benches(cls):
        # the kernel computes causal_parallel's serial reduction: time it against that XLA form
        return {"vq_cache": KernelBench(xla={"impl": "xla", "form": "parallel"},
                                        pallas={"impl": "pallas", "form": "parallel"}, directions=("causal",))}

    @classmethod
    def drop_in(cls):
        return DropIn(
            "qk_norm=False with q·Dk^-1/2, Transformer-XL bias off (W_R=u=v=0), codebook = per-head k-means "
            "(10 iterations) of held-out keys",
            {"qk_norm": False},
            _drop_in_setup,
        )

    @classmethod
    def contract_cases(cls):
        # block 8, codebook 16, 48 tokens = 6 blocks: the compressive cache holds 4 blocks when the last is read
        small = {"codebook_size": 16, "block_len": 8, "impl": "xla"}
        return {
            "serial": ContractCase(cfg=small, length=48, atol=5e-5, rtol=5e-5),
            # the tiled form with its recomputing backward (form='auto' picks it for large calls only)
            "blocks": ContractCase(cfg={**small, "form": "blocks"}, length=48, atol=5e-5, rtol=5e-5,
                                   directions=("causal",)),
            "matmul": ContractCase(cfg={**small, "reduction": "matmul"}, length=48, atol=5e-5, rtol=5e-5,
                                   directions=("causal",)),
            "assoc": ContractCase(cfg={**small, "reduction": "assoc"}, length=48, atol=5e-5, rtol=5e-5,
                                  directions=("causal",), slow=True),
            "stream_short_band": ContractCase(cfg={**small, "mem_len": 3, "form": "stream"}, length=48,
                                              atol=5e-5, rtol=5e-5, directions=("causal",), slow=True),
            # the Pallas kernel (interpret mode on CPU) serves the causal block-parallel form; the encoder is XLA
            "pallas": ContractCase(cfg={**small, "impl": "pallas"}, length=48, atol=5e-5, rtol=5e-5,
                                   directions=("causal",), slow=True),  # interpret mode: minutes on CPU
        }

    # -- state ---------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("transformer_vq: a bidirectional core has no prefix state")
        return empty_state(batch_size, self.num_heads, self.M, self.S, self.head_dim, self.value_dim)

    # -- sequence parallelism: the band is the newest M tokens, the cache a count-weighted merge --
    def sequence_refusal(self, slice_len: int) -> str | None:
        if slice_len < self.M:
            return f"a slice of {slice_len} tokens is shorter than the band of mem_len={self.M} tokens"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return self.init_state(batch_size, max_len)  # the cache is position-free: a true empty state

    def compose_states(self, a, b):
        # b started empty; a's band leaves the band when b's (>= M) tokens arrive and joins the cache
        M = self.M
        valid = a["pos"] - M + jnp.arange(M) >= 0
        band = code_summary(a["band_z"], a["band_v"], valid, self.S)
        agg_mu, agg_n = merge(merge((a["agg_mu"], a["agg_n"]), band), (b["agg_mu"], b["agg_n"]))
        return {**b, "pos": a["pos"] + b["pos"], "agg_mu": agg_mu, "agg_n": agg_n}

    def codebook(self):
        return codebook_from_stats(self.c_sum[...], self.c_count[...])

    def apply_stats(self, stats) -> None:
        st = stats.get("codebook", stats) if isinstance(stats, dict) else stats
        c_sum, c_count = ema_update(self.c_sum[...], self.c_count[...], st, self.cfg.gamma)
        self.c_sum[...] = c_sum
        self.c_count[...] = c_count

    # -- forward -------------------------------------------------------------
    def prepare(self, q, k, *, deterministic=True, key=None):
        """Normalized q, k, (u', v') and the projected sinusoid table r'. Returns a dict."""
        H, Dk = self.num_heads, self.head_dim
        dt = compute_dtype(q, k)  # the matmul operands (the norms' statistics are float32 inside rms_normalize)
        tau_m14 = Dk ** -0.25  # tau^-1/2 with tau = sqrt(Dk)
        q, k = q.astype(dt), k.astype(dt)
        if self.cfg.qk_norm:
            q, k = tau_m14 * rms_normalize(q), tau_m14 * rms_normalize(k)
        drop_key = None if (deterministic or key is None) else key
        r = rel_table(self.W_R[...], self.M, signed=not self.causal, base=self.cfg.rel_base, scale=tau_m14,
                      dtype=dt, dropout_key=drop_key, p_drop=self.cfg.p_dropsin).reshape(-1, H, Dk)
        u = tau_m14 * self.u[...].astype(dt)
        vb = tau_m14 * self.v[...].astype(dt)
        return {"q": q, "k": k, "q_u": q + u[None, :, None], "q_v": q + vb[None, :, None], "r": r}

    def _kernel_choice(self, dtype) -> dispatch.Choice:
        """The block-parallel causal form runs the Pallas kernel of pallas_kernels/vq_cache.py (§9, forward
        and backward) or the XLA ``causal_parallel``, by the shared rule of ``longctx.attention.dispatch``:
        the kernel declares its platforms, shapes and VMEM budget (``vq_cache.unsupported_reasons``). The
        streaming form (short calls, decoding) and the encoder always run XLA. Either way the same method is
        computed."""
        extra = [] if self.cfg.reduction == "serial" else [
            f"reduction={self.cfg.reduction!r} (the kernel computes the serial reduction)"]
        return dispatch.resolve(self.cfg.impl, method="transformer_vq", kernel="vq_cache",
                                reasons_fn=vq_cache.unsupported_reasons, extra_reasons=extra, L=self.L, M=self.M,
                                S=self.S, Dk=self.head_dim, Dv=self.value_dim, dtype=dtype)

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None, mask=None):
        """mask: optional [B, T] bool; False tokens are excluded from the commit loss and EMA statistics
        (they still take part in attention, as in the release)."""
        check_qkv(q, k, v)
        B, H, T, _ = q.shape
        S, L, M = self.S, self.L, self.M
        pre = self.prepare(q, k, deterministic=deterministic, key=key)
        C = self.codebook()
        k_hat, z, err2, c_z = stvq(pre["k"], C)
        bd = lambda: band_scores(pre["q_v"], pre["r"])  # noqa: E731 -- [B,H,T,n]: formed only where needed
        vv = v.astype(compute_dtype(v, pre["q"]))
        if self.causal:
            state = self.init_state(B) if state is None else state
            form = self.cfg.form
            if form == "auto":
                form = "parallel" if (M <= L and T >= L) else "stream"
                big = B * H * T * (S + 2 * L) >= self.cfg.tiled_min_scores
                if form == "parallel" and self.cfg.reduction == "serial" and big:
                    form = "blocks"
            choice = self._kernel_choice(vv.dtype) if form in ("parallel", "blocks") else None
            if choice is not None and choice.use_kernel:
                o, new_state = vq_cache.vq_cache_attention(pre["q_u"], bd(), k_hat, z, vv, C, state, L=L,
                                                           M=M, interpret=choice.interpret, platform=choice.platform)
            elif form == "blocks":
                o, new_state = causal_blocks(pre["q_u"], pre["q_v"], pre["r"], k_hat, z, vv, C, state, L=L, M=M,
                                             keep_budget=self.cfg.keep_budget)
            elif form == "parallel":
                o, new_state = causal_parallel(pre["q_u"], bd(), k_hat, z, vv, C, state, L=L, M=M,
                                               reduction=self.cfg.reduction, compute=vv.dtype)
            else:
                o, new_state = causal_stream(pre["q_u"], bd(), k_hat, z, vv, C, state,
                                             L=min(L, T) if self.cfg.form == "auto" else L, M=M)
        else:
            if state is not None:
                raise ValueError("transformer_vq: a bidirectional core takes no state")
            o = encoder_parallel(pre["q_u"], bd(), k_hat, z, vv, C, L=L, M=M, band=self.cfg.encoder_band)
            new_state = None
        if aux is not None:
            aux.add_loss("commit", self.cfg.beta * commit_loss(pre["k"], c_z, mask))
            aux.add_stats("codebook", vq_stats(pre["k"], z, S, mask))
            aux.add_metric("vq_rel_err", jnp.mean(jnp.sqrt(err2)) / jnp.maximum(
                jnp.mean(jnp.linalg.norm(sg(pre["k"]), axis=-1)), 1e-12))
        return o.astype(v.dtype), new_state


def kmeans(x, S: int, *, iters: int = 10, seed: int = 0):
    """Per-head Lloyd k-means. x [H, N, D] -> centroids [H, S, D] (init: S points sampled from x)."""
    H, N, D = x.shape
    idx = jax.random.choice(jax.random.key(seed), N, (S,), replace=N < S)
    c = x[:, idx]

    @jax.jit
    def step(c):
        d = jnp.sum(x * x, -1)[..., None] - 2 * jnp.einsum("hnd,hsd->hns", x, c) + jnp.sum(c * c, -1)[:, None]
        z = jnp.argmin(d, axis=-1)
        onehot = jax.nn.one_hot(z, S, dtype=x.dtype)
        cnt = jnp.sum(onehot, axis=1)
        sums = jnp.einsum("hns,hnd->hsd", onehot, x)
        return jnp.where(cnt[..., None] > 0, sums / jnp.maximum(cnt, 1.0)[..., None], c)

    for _ in range(iters):
        c = step(c)
    return c


def _drop_in_setup(core, q, k, v, k_fit, seed):
    """Training-free setting: no learned position bias (W_R = u = v = 0), qk_norm off with q pre-scaled
    by Dk^-1/2 (logits q·k/sqrt(Dk) as in exact attention), codebook = per-head k-means (10 Lloyd
    iterations) of held-out keys ``k_fit`` (same distribution, different sample)."""
    D = q.shape[-1]
    for name in ("W_R", "u", "v"):
        var = getattr(core, name)
        var[...] = jnp.zeros_like(var[...])
    H = k_fit.shape[1]
    x = jnp.moveaxis(k_fit.astype(jnp.float32), 1, 0).reshape(H, -1, D)
    cents = kmeans(x, int(core.cfg.codebook_size), seed=seed)
    core.c_sum[...] = cents.astype(core.c_sum[...].dtype)
    core.c_count[...] = jnp.ones_like(core.c_count[...])
    return q * D**-0.5, k, v


__all__ = [
    "TransformerVQAttention",
    "kmeans",
    "causal_parallel",
    "causal_stream",
    "code_summary",
    "code_sums",
    "first_argmax",
    "codebook_from_stats",
    "commit_loss",
    "ema_update",
    "encoder_parallel",
    "merge",
    "prefix_reduce",
    "quadratic_reference",
    "rel_table",
    "stvq",
    "vq_stats",
]

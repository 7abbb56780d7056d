"""Transformer-VQ attention (Lingle 2023; spec `specs/transformer-vq.md`).

Keys are vector-quantized per head onto an EMA codebook with a straight-through
estimator (STVQ). Because every quantized key is one of S codewords, softmax
attention over an arbitrary prefix factorizes into S code logits plus per-code
(mean value, count) summaries: a lossless compressed cache *for the quantized keys*.

Pure functions (all shapes [B, H, T, .]; every float computed in
``promote(dtype, float32)`` so fp64 tests run in fp64):

* :func:`stvq`                       -- argmin assignment + straight-through k_hat (spec 2.2)
* :func:`quadratic_reference`        -- full [T, T] softmax over K_hat with the XL band bias (2.4)
* :func:`causal_parallel`            -- block-wise linear form, lag-2 cache, serial/matmul/assoc/sum
                                        reductions, carried initial state, ragged T (2.6; M <= L)
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

import math
import warnings

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx.attention.base import AttentionCore, NonGradState, check_qkv, require

NEG = -1e30
sg = jax.lax.stop_gradient

REDUCTIONS = ("serial", "matmul", "assoc", "sum")  # "sum" = unstable U/L cumsum, a test oracle only


# ----------------------------------------------------------------------------- helpers
def float_dtype(*xs):
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def rms_normalize(x, eps: float = 1e-6):
    """x * rsqrt(mean(x^2) + eps), no gain/bias, computed in >= fp32, cast back."""
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


def merge(a, b):
    """Count-weighted mean merge of (mean [..., S, Dv], count [..., S]); associative."""
    (mu_a, n_a), (mu_b, n_b) = a, b
    n = n_a + n_b
    mu = (n_a[..., None] * mu_a + n_b[..., None] * mu_b) / jnp.maximum(n, 1.0)[..., None]
    return mu, n


def code_summary(z, v, valid, S: int):
    """Per-code (mean, count) of values v [..., L, Dv] with codes z [..., L] and validity [..., L]."""
    onehot = jax.nn.one_hot(z, S, dtype=v.dtype) * valid[..., None].astype(v.dtype)  # [..., L, S]
    cnt = jnp.sum(onehot, axis=-2)
    tot = jnp.einsum("...ls,...ld->...sd", onehot, v)
    return tot / jnp.maximum(cnt, 1.0)[..., None], cnt


def log_count(n):
    """l = log N where N > 0, else -1e30 (via where + clip: no log(0), no NaN gradient)."""
    return jnp.where(n > 0, jnp.log(jnp.maximum(n, 1.0)), NEG)


def rel_bias(bd, idx, max_index: int):
    """bias[..., i, j] = bd[..., i, idx[i, j]] if 0 <= idx <= max_index else 0. bd: [..., Lq, D]."""
    ok = (idx >= 0) & (idx <= max_index)
    full = jnp.broadcast_to(jnp.clip(idx, 0, max_index), bd.shape[:-1] + idx.shape[-1:])
    return jnp.where(ok, jnp.take_along_axis(bd, full, axis=-1), 0.0)


def _pad_to(x, axis: int, n: int, value=0):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _pad_left(x, axis: int, n: int, value=0):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (pad, 0)
    return jnp.pad(x, widths, constant_values=value)


def _softmax_mix(groups):
    """groups: list of (scores [..., Lq, n], mask broadcastable, values [..., n, Dv]).
    One shared normalizer with a stop-gradient row max; a divided by den before the value matmuls."""
    m = None
    for s, mask, _ in groups:
        gm = jnp.max(jnp.where(mask, s, NEG), axis=-1)
        m = gm if m is None else jnp.maximum(m, gm)
    m = sg(m)[..., None]
    probs = [jnp.where(mask, jnp.exp(jnp.where(mask, s, NEG) - m), 0.0) for s, mask, _ in groups]
    den = sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    den = jnp.maximum(den, 1e-30)
    out = sum(jnp.einsum("...qn,...nd->...qd", p / den, vals) for p, (_, _, vals) in zip(probs, groups))
    lse = (m + jnp.log(den))[..., 0]
    return out, lse


# ----------------------------------------------------------------------------- STVQ
def stvq(k, C):
    """Straight-through VQ. k: [B, H, T, Dk]; C: [H, S, Dk] (read under stop_gradient).

    Returns (k_hat, z, err2, c_z): k_hat = k + sg(c_z - k) (value c_z, Jacobian I),
    z = argmin_s ||k - c_s||^2 in >= fp32 (ties -> lowest index), err2 = relu(min d^2), c_z = sg(C)[z].
    """
    dt = float_dtype(k, C)
    kf, Cf = k.astype(dt), sg(C).astype(dt)
    d2 = (
        jnp.sum(kf * kf, -1)[..., None]
        - 2.0 * jnp.einsum("bhtd,hsd->bhts", kf, Cf)
        + jnp.sum(Cf * Cf, -1)[None, :, None, :]
    )
    z = jnp.argmin(d2, axis=-1).astype(jnp.int32)
    c_z = _gather_codes(Cf, z)
    k_hat = kf + sg(c_z - kf)
    err2 = jax.nn.relu(jnp.min(d2, axis=-1))
    return k_hat, z, err2, c_z


def _gather_codes(C, z):
    """C [H, S, D], z [B, H, T] -> [B, H, T, D]."""
    return jax.vmap(lambda c, zz: c[zz], in_axes=(0, 1), out_axes=1)(C, z)


# ----------------------------------------------------------------------------- position terms
def rel_table(W_R, M: int, *, signed: bool, base: float, scale, dtype, dropout_key=None, p_drop: float = 0.0):
    """r'_d = scale * Drop(e(d)) W_R for d = 0..M (causal) or d = -M..M (signed); -> [n, H*Dk]."""
    d = jnp.arange(-M if signed else 0, M + 1)
    e = sinusoid(d, W_R.shape[0], base, dtype)
    if dropout_key is not None and p_drop > 0.0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - p_drop, e.shape)
        e = jnp.where(keep, e / (1.0 - p_drop), 0.0)
    return scale * (e @ W_R.astype(dtype))


def band_scores(q_v, r):
    """bd[b, h, t, n] = q_v[b, h, t] . r[n, h]; q_v [B, H, T, Dk], r [n, H, Dk]."""
    return jnp.einsum("bhtd,nhd->bhtn", q_v, r)


# ----------------------------------------------------------------------------- quadratic reference
def quadratic_reference(q_u, bd, k_hat, v, *, M: int, causal: bool = True, sg_far_block: int | None = None,
                        valid=None):
    """Full [T, T] softmax (spec 2.4 / dense bidirectional for the encoder).

    s_ij = q_u_i . k_j + [0 <= d <= M] bd[i, d] (causal; d = i - j) or [|d| <= M] bd[i, d + M] (encoder),
    s_ij = -inf for j > i (causal) or invalid j. ``sg_far_block=L``: for the dK reference of spec 2.7,
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


# ----------------------------------------------------------------------------- states
def empty_state(B, H, M, S, Dk, Dv, dtype=jnp.float32):
    return {
        "pos": jnp.zeros((), jnp.int32),
        "band_k": jnp.zeros((B, H, M, Dk), dtype),
        "band_v": jnp.zeros((B, H, M, Dv), dtype),
        "band_z": jnp.zeros((B, H, M), jnp.int32),
        "agg_mu": jnp.zeros((B, H, S, Dv), dtype),
        "agg_n": jnp.zeros((B, H, S), dtype),
    }


def _cast_state(state, dt):
    return {k: (x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x) for k, x in state.items()}


def _final_state(state, k_hat, z, v, T: int, M: int, S: int):
    """New canonical state after T real tokens: band = newest M of [band; x], agg += everything older."""
    pos = state["pos"]
    ek = jnp.concatenate([state["band_k"], k_hat[:, :, :T]], axis=2)
    ev = jnp.concatenate([state["band_v"], v[:, :, :T]], axis=2)
    ez = jnp.concatenate([state["band_z"], z[:, :, :T]], axis=2)
    epos = pos - M + jnp.arange(M + T)
    n_old = T  # entries [0, T) leave the band
    mu, n = code_summary(ez[:, :, :n_old], ev[:, :, :n_old], epos[:n_old] >= 0, S)
    agg_mu, agg_n = merge((state["agg_mu"], state["agg_n"]), (mu, n))
    return {
        "pos": pos + T,
        "band_k": ek[:, :, n_old:],
        "band_v": ev[:, :, n_old:],
        "band_z": ez[:, :, n_old:],
        "agg_mu": agg_mu,
        "agg_n": agg_n,
    }


# ----------------------------------------------------------------------------- cross-block reductions
def prefix_reduce(mu, n, reduction: str):
    """Inclusive prefix merge along axis 2 of (mu [B,H,R,S,Dv], n [B,H,R,S]) -> same shapes.
    Computed in the wider of the two dtypes (the core always passes fp32 or fp64)."""
    dt = jnp.result_type(mu, n)
    mu, n = mu.astype(dt), n.astype(dt)
    if reduction == "serial":
        def step(carry, x):
            carry = merge(carry, x)
            return carry, carry

        init = (jnp.zeros_like(mu[:, :, 0]), jnp.zeros_like(n[:, :, 0]))
        _, (pm, pn) = jax.lax.scan(step, init, (jnp.moveaxis(mu, 2, 0), jnp.moveaxis(n, 2, 0)))
        return jnp.moveaxis(pm, 0, 2), jnp.moveaxis(pn, 0, 2)
    if reduction == "assoc":
        return jax.lax.associative_scan(merge, (mu, n), axis=2)
    if reduction == "matmul":
        R = n.shape[2]
        tri = jnp.tril(jnp.ones((R, R), mu.dtype))  # [n, g]: g <= n
        N = jnp.einsum("ng,bhgs->bhns", tri, n)
        w = tri[None, None, :, :, None] * n[:, :, None, :, :] / jnp.maximum(N, 1.0)[:, :, :, None, :]
        return jnp.einsum("bhngs,bhgsd->bhnsd", w, mu), N
    if reduction == "sum":  # U/L form (raw sums): unstable in low precision, test oracle only
        U = jnp.cumsum(n[..., None] * mu, axis=2)
        N = jnp.cumsum(n, axis=2)
        return U / jnp.maximum(N, 1.0)[..., None], N
    raise ValueError(f"unknown reduction {reduction!r}; allowed: {', '.join(REDUCTIONS)}")


# ----------------------------------------------------------------------------- causal block-parallel form
def causal_parallel(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, reduction: str = "serial",
                    return_lse: bool = False):
    """Linear-time causal form (spec 2.6) from a carried state; requires 1 <= M <= L.

    The carried band (M keys, left-padded with invalid slots to L) acts as block -1 and the carried agg as the
    summary of everything before it, so query block n uses agg (+) blocks -1..n-2 (lag 2), attends exactly to
    block n-1 and (causally) to block n, with the band bias for d <= M. T need not be a multiple of L.
    Returns (o [B,H,T,Dv], new_state) (+ lse [B,H,T] if return_lse).
    """
    if not 1 <= M <= L:
        raise ValueError(f"causal_parallel needs 1 <= M <= L, got M={M}, L={L}")
    B, H, T, Dk = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    dt = float_dtype(q_u, v)
    state = _cast_state(state, dt)
    R = -(-T // L)
    Tp = R * L
    Cs = sg(C).astype(dt)

    def blocks(x):  # [B, H, Tp, ...] -> [B, H, R, L, ...]
        return x.reshape(x.shape[:2] + (R, L) + x.shape[3:])

    qb = blocks(_pad_to(q_u.astype(dt), 2, Tp))
    bdb = blocks(_pad_to(bd.astype(dt), 2, Tp))
    # extended blocks: index 0 = carried band (block -1), index e = block e-1
    kx = jnp.concatenate([_pad_left(state["band_k"], 2, L), _pad_to(k_hat.astype(dt), 2, Tp)], axis=2)
    vx = jnp.concatenate([_pad_left(state["band_v"], 2, L), _pad_to(v.astype(dt), 2, Tp)], axis=2)
    zx = jnp.concatenate([_pad_left(state["band_z"], 2, L), _pad_to(z, 2, Tp)], axis=2)
    band_pos = state["pos"] - L + jnp.arange(L)
    band_valid = (band_pos >= 0) & (jnp.arange(L) >= L - M)  # left padding of the M-slot band is invalid
    validx = jnp.concatenate([band_valid, jnp.arange(Tp) < T])  # [(R+1) L]
    kx, vx, zx = (x.reshape(x.shape[:2] + (R + 1, L) + x.shape[3:]) for x in (kx, vx, zx))
    validx = validx.reshape(R + 1, L)

    # cache for block n = agg (+) ext blocks 0..n-1  (= blocks -1..n-2): lag 2
    bmu, bn = code_summary(zx[:, :, : R], vx[:, :, : R], validx[:R], S)  # ext 0..R-1
    items_mu = jnp.concatenate([state["agg_mu"][:, :, None], bmu[:, :, : R - 1]], axis=2)
    items_n = jnp.concatenate([state["agg_n"][:, :, None], bn[:, :, : R - 1]], axis=2)
    cmu, cn = prefix_reduce(items_mu, items_n, reduction)  # [B,H,R,S,Dv], [B,H,R,S]

    i = jnp.arange(L)[:, None]
    jj = jnp.arange(2 * L)[None, :]
    bias = rel_bias(bdb, L + i - jj, M)  # [B,H,R,L,2L]
    s_c = jnp.einsum("bhrld,hsd->bhrls", qb, Cs) + log_count(cn)[:, :, :, None, :]
    s_p = jnp.einsum("bhrld,bhrjd->bhrlj", qb, kx[:, :, :R]) + bias[..., :L]
    s_r = jnp.einsum("bhrld,bhrjd->bhrlj", qb, kx[:, :, 1:]) + bias[..., L:]
    mask_c = (cn > 0)[:, :, :, None, :]
    mask_p = validx[:R][:, None, :]
    mask_r = (jnp.arange(L)[None, :] <= jnp.arange(L)[:, None])[None] & validx[1:][:, None, :]
    o, lse = _softmax_mix([(s_c, mask_c, cmu), (s_p, mask_p, vx[:, :, :R]), (s_r, mask_r, vx[:, :, 1:])])
    o = o.reshape(B, H, Tp, Dv)[:, :, :T]
    new_state = _final_state(state, k_hat.astype(dt), z, v.astype(dt), T, M, S)
    if return_lse:
        return o, new_state, lse.reshape(B, H, Tp)[:, :, :T]
    return o, new_state


# ----------------------------------------------------------------------------- streaming form
def _stream_step(state, q_u, bd, k_hat, z, v, Cs, M: int, S: int):
    """One step over Lc new tokens: attend to band (M) + present (Lc) + agg, then fold the oldest Lc into agg."""
    Lc = q_u.shape[2]
    pos = state["pos"]
    K = jnp.concatenate([state["band_k"], k_hat], axis=2)
    V = jnp.concatenate([state["band_v"], v], axis=2)
    Z = jnp.concatenate([state["band_z"], z], axis=2)
    kpos = pos - M + jnp.arange(M + Lc)
    qi = jnp.arange(Lc)[:, None]
    kj = jnp.arange(M + Lc)[None, :]
    mask = (kpos[None, :] >= 0) & (kj - M <= qi)
    s_l = jnp.einsum("bhqd,bhkd->bhqk", q_u, K) + rel_bias(bd, qi + M - kj, M)
    s_c = jnp.einsum("bhqd,hsd->bhqs", q_u, Cs) + log_count(state["agg_n"])[:, :, None, :]
    o, _ = _softmax_mix([(s_c, (state["agg_n"] > 0)[:, :, None, :], state["agg_mu"]), (s_l, mask, V)])
    mu, n = code_summary(Z[:, :, :Lc], V[:, :, :Lc], kpos[:Lc] >= 0, S)
    agg_mu, agg_n = merge((state["agg_mu"], state["agg_n"]), (mu, n))
    new = {"pos": pos + Lc, "band_k": K[:, :, Lc:], "band_v": V[:, :, Lc:], "band_z": Z[:, :, Lc:],
           "agg_mu": agg_mu, "agg_n": agg_n}
    return new, o


def causal_stream(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int):
    """Streaming form (spec 2.7): chunks of L (any L >= 1, any M >= 1), scanned; a ragged tail is one
    shorter step. Equals the quadratic reference for every L and M. Returns (o, new_state)."""
    B, H, T, _ = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)
    state = _cast_state(state, dt)
    Cs = sg(C).astype(dt)
    xs = (q_u.astype(dt), bd.astype(dt), k_hat.astype(dt), z, v.astype(dt))
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
    """Bidirectional form (spec 2.5). band=False: Thm 3.5 (all keys through the code summaries, no bias).
    band=True (our extension): query block n attends exactly to blocks n-1, n, n+1 with the bias for
    |d| <= M (bd over d = -M..M), and to merge(prefix over blocks <= n-2, suffix over blocks >= n+2)."""
    B, H, T, _ = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    dt = float_dtype(q_u, v)
    Cs = sg(C).astype(dt)
    valid = jnp.ones((T,), bool) if valid is None else valid
    if not band:
        mu, n = code_summary(z, v.astype(dt), valid, S)  # [B,H,S,Dv], [B,H,S]
        s_c = jnp.einsum("bhtd,hsd->bhts", q_u.astype(dt), Cs) + log_count(n)[:, :, None, :]
        o, _ = _softmax_mix([(s_c, (n > 0)[:, :, None, :], mu)])
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

    qb, bdb = blocks(q_u.astype(dt)), blocks(bd.astype(dt))
    kx, vx, zx = blocks(k_hat.astype(dt), 1, 1), blocks(v.astype(dt), 1, 1), blocks(z, 1, 1)  # R+2 blocks
    vpad = jnp.pad(_pad_to(valid, 0, Tp), (L, L)).reshape(R + 2, L)
    bmu, bn = code_summary(zx[:, :, 1:-1], vx[:, :, 1:-1], vpad[1:-1], S)  # [B,H,R,...]
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
    i = jnp.arange(L)[:, None]
    jj = jnp.arange(3 * L)[None, :]
    s_l = jnp.einsum("bhrld,bhrjd->bhrlj", qb, local_k) + rel_bias(bdb, L + i - jj + M, 2 * M)
    s_c = jnp.einsum("bhrld,hsd->bhrls", qb, Cs) + log_count(fn)[:, :, :, None, :]
    o, _ = _softmax_mix([(s_c, (fn > 0)[:, :, :, None, :], fmu), (s_l, local_valid[:, None, :], local_v)])
    return o.reshape(B, H, Tp, Dv)[:, :, :T]


# ----------------------------------------------------------------------------- codebook learning
def vq_stats(k, z, S: int, mask=None):
    """EMA statistics of one call: per-code counts [H, S] and key sums [H, S, Dk] (pre-quantization keys,
    fp32 or wider, masked tokens excluded), summed over batch and time, under stop_gradient."""
    kf = sg(k).astype(float_dtype(k))
    onehot = jax.nn.one_hot(z, S, dtype=kf.dtype)  # [B,H,T,S]
    if mask is not None:
        onehot = onehot * mask[:, None, :, None].astype(kf.dtype)
    return {"count": jnp.sum(onehot, axis=(0, 2)), "sum": jnp.einsum("bhts,bhtd->hsd", onehot, kf)}


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
def _warn_interpret():
    warnings.warn("transformer_vq: impl='pallas' off TPU runs the Pallas kernel in interpret mode (slow)",
                  stacklevel=3)


class TransformerVQAttention(AttentionCore):
    """Transformer-VQ core. Inside the standard multi-head ``TransformerBlock`` it is the release's
    throughput variant (MHA, one codebook per head); inside ``GAUBlock`` the paper's single-head GAU.

    Owns: the codebook statistics (``c_sum`` [H,S,Dk], ``c_count`` [H,S]; :class:`NonGradState`), and the
    Transformer-XL relative-bias parameters ``u``, ``v`` ([H, Dk], zero-init) and ``W_R`` [rel_dim, H*Dk].
    """

    name = "transformer_vq"
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
                "form": "auto",  # 'auto' | 'parallel' | 'stream' (causal only; see __call__)
                "beta": 1e-4,  # commit-loss weight (reported already multiplied)
                "gamma": 0.99,  # EMA decay of the codebook statistics
                "qk_norm": True,  # RMS-normalize q, k and scale each by Dk^-1/4 (False: caller did it)
                "rel_dim": 0,  # width of the sinusoid table e(d) (d_model); 0 means num_heads*head_dim
                "rel_base": 1e5,  # lambda of the sinusoids
                "p_dropsin": 0.0,  # dropout on the sinusoid table (training only)
                "encoder_band": True,  # bidirectional: keep the exact symmetric band (False: Thm 3.5)
                "impl": "xla",  # 'xla' | 'pallas' | 'auto'
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
        require(cfg.form in ("auto", "parallel", "stream"), f"{p}.form={cfg.form!r}; allowed: auto, parallel, stream")
        if cfg.form == "parallel" or not causal:
            require(M <= cfg.block_len, f"{p}: the block-parallel{'' if causal else ' encoder'} form needs "
                    f"mem_len <= block_len (got {M} > {cfg.block_len}); use form='stream' or a smaller mem_len")
        require(0.0 <= cfg.gamma < 1.0, f"{p}.gamma={cfg.gamma}; allowed: 0 <= gamma < 1")
        require(cfg.beta >= 0.0, f"{p}.beta={cfg.beta}; must be >= 0")
        require(0.0 <= cfg.p_dropsin < 1.0, f"{p}.p_dropsin={cfg.p_dropsin}; allowed: 0 <= p < 1")
        require(cfg.rel_dim >= 0 and cfg.rel_dim % 2 == 0, f"{p}.rel_dim={cfg.rel_dim}; must be even and >= 0")
        require(cfg.rel_base > 1.0, f"{p}.rel_base={cfg.rel_base}; must be > 1")
        require(cfg.impl in ("xla", "pallas", "auto"), f"{p}.impl={cfg.impl!r}; allowed: xla, pallas, auto")
        # The spec-9 Pallas kernel (pallas_kernels/vq_cache.py) is not written yet: 'pallas' is refused here
        # rather than silently running XLA; 'auto' resolves to the XLA path on every backend until it exists.
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
        self.c_sum = NonGradState(jax.random.normal(rngs.params(), (H, S, Dk), jnp.float32) / math.sqrt(S * H))
        self.c_count = NonGradState(jnp.ones((H, S), jnp.float32))
        self.u = nnx.Param(jnp.zeros((H, Dk), jnp.float32))
        self.v = nnx.Param(jnp.zeros((H, Dk), jnp.float32))
        self.W_R = nnx.Param(jax.random.normal(rngs.params(), (rel_dim, H * Dk), jnp.float32) / math.sqrt(rel_dim))

    # -- state ---------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("transformer_vq: a bidirectional core has no prefix state")
        return empty_state(batch_size, self.num_heads, self.M, self.S, self.head_dim, self.value_dim)

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
        dt = float_dtype(q, k)
        tau_m14 = Dk ** -0.25  # tau^-1/2 with tau = sqrt(Dk)
        q, k = q.astype(dt), k.astype(dt)
        if self.cfg.qk_norm:
            q, k = tau_m14 * rms_normalize(q), tau_m14 * rms_normalize(k)
        drop_key = None if (deterministic or key is None) else key
        r = rel_table(self.W_R[...], self.M, signed=not self.causal, base=self.cfg.rel_base, scale=tau_m14,
                      dtype=dt, dropout_key=drop_key, p_drop=self.cfg.p_dropsin).reshape(-1, H, Dk)
        u = tau_m14 * self.u[...].astype(dt)
        vb = tau_m14 * self.v[...].astype(dt)
        return {"q": q, "k": k, "q_u": q + u[None, :, None], "bd": band_scores(q + vb[None, :, None], r)}

    def _use_pallas(self) -> bool:
        """impl='pallas': the kernel of pallas_kernels/vq_cache.py (interpret mode off TPU, with a warning);
        'auto': the kernel on TPU, where it exists, and the XLA block-parallel form elsewhere (the kernel
        has no GPU lowering yet). Either way the same method is computed."""
        backend = jax.default_backend()
        if self.cfg.impl == "pallas":
            if backend != "tpu":
                _warn_interpret()
            return True
        return self.cfg.impl == "auto" and backend == "tpu"

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None, mask=None):
        """mask: optional [B, T] bool; False tokens are excluded from the commit loss and EMA statistics
        (they still take part in attention, as in the release)."""
        check_qkv(q, k, v)
        B, H, T, _ = q.shape
        S, L, M = self.S, self.L, self.M
        pre = self.prepare(q, k, deterministic=deterministic, key=key)
        C = self.codebook()
        k_hat, z, err2, c_z = stvq(pre["k"], C)
        vv = v.astype(float_dtype(v, pre["q"]))
        if self.causal:
            state = self.init_state(B) if state is None else state
            form = self.cfg.form
            if form == "auto":
                form = "parallel" if (M <= L and T >= L) else "stream"
            if form == "parallel" and self._use_pallas() and self.cfg.reduction == "serial":
                from pallas_kernels.vq_cache import vq_cache_attention

                o, new_state = vq_cache_attention(pre["q_u"], pre["bd"], k_hat, z, vv, C, state, L=L, M=M,
                                                  interpret=jax.default_backend() != "tpu")
            elif form == "parallel":
                o, new_state = causal_parallel(pre["q_u"], pre["bd"], k_hat, z, vv, C, state, L=L, M=M,
                                               reduction=self.cfg.reduction)
            else:
                o, new_state = causal_stream(pre["q_u"], pre["bd"], k_hat, z, vv, C, state,
                                             L=min(L, T) if self.cfg.form == "auto" else L, M=M)
        else:
            if state is not None:
                raise ValueError("transformer_vq: a bidirectional core takes no state")
            o = encoder_parallel(pre["q_u"], pre["bd"], k_hat, z, vv, C, L=L, M=M, band=self.cfg.encoder_band)
            new_state = None
        if aux is not None:
            aux.add_loss("commit", self.cfg.beta * commit_loss(pre["k"], c_z, mask))
            aux.add_stats("codebook", vq_stats(pre["k"], z, S, mask))
            aux.add_metric("vq_rel_err", jnp.mean(jnp.sqrt(err2)) / jnp.maximum(
                jnp.mean(jnp.linalg.norm(sg(pre["k"]), axis=-1)), 1e-12))
        return o.astype(v.dtype), new_state


__all__ = [
    "TransformerVQAttention",
    "causal_parallel",
    "causal_stream",
    "code_summary",
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

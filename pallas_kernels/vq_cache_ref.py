"""Pure-JAX reference of the compressive VQ-cache attention (docs/methods/transformer_vq.md §2.6, §9).

This is the computation :mod:`pallas_kernels.vq_cache` must match; the transformer_vq method's block-parallel
implementation (``parallel``) runs it too (one copy of the math). It imports only JAX.

* :func:`causal_parallel` -- block-wise linear form, lag-2 per-code cache, serial/matmul/assoc/sum
  reductions, carried initial state, ragged T (requires 1 <= M <= L);
* :func:`vq_cache_attention_reference` -- ``causal_parallel`` with ``reduction='serial'``: what the kernel computes.

Its products are plain einsums, by default: :class:`Ops` names the four a method's implementation may compute
another way with the same result (``ops=``), e.g. with a backward laid out for one backend.

Notation: ``q_u = q + u'`` (content query), ``bd[..., i, d] = (q_i + v')·r'_d`` for d = 0..M, ``C`` the codebook
[H, S, Dk] (always read under stop_gradient). State (constant size)::

    {"pos": int32[], "band_k": [B,H,M,Dk], "band_v": [B,H,M,Dv], "band_z": int32[B,H,M],
     "agg_mu": [B,H,S,Dv], "agg_n": [B,H,S]}
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.precision import acc_einsum, compute_dtype, float_dtype, statistic  # noqa: F401 (re-exported)

NEG = -1e30
sg = jax.lax.stop_gradient

REDUCTIONS = ("serial", "matmul", "assoc", "sum")  # "sum" = unstable U/L cumsum, a test oracle only


def score_dot(q, k):
    """``q kᵀ`` over the last axis (same batch axes), accumulated in float32 or wider."""
    return acc_einsum("...id,...jd->...ij", q, k)


def mix_dot(p, v):
    """``p v`` (same batch axes): p cast to the values' dtype, accumulated in float32 or wider."""
    return acc_einsum("...ij,...jd->...id", p.astype(v.dtype), v)


def normalize(num, den):
    """``num [..., q, d] / den [..., q]``."""
    return num / den[..., None]


# the per-code sums are statistics (the compressive cache's means and counts, carried as state; the codebook's
# EMA sums of the keys): kept in the dtype the caller gives them, float32 or wider in every caller
CODE_SUMS = "per-code sums: the cache's means and counts (state) and the codebook's EMA statistics"


def code_sums(z, v, valid, S: int):
    """Per-code (sum [..., S, Dv], count [..., S]) of values v [..., L, Dv] with codes z [..., L] and validity
    ``valid`` (broadcastable to z): a code-major one-hot [..., S, L] and a matmul (a declared statistic)."""
    w = jnp.broadcast_to(valid, z.shape).astype(v.dtype)
    onehot = (z[..., None, :] == jnp.arange(S, dtype=z.dtype)[:, None]).astype(v.dtype) * w[..., None, :]
    with statistic(CODE_SUMS):
        return jnp.einsum("...sl,...ld->...sd", onehot, v), jnp.sum(onehot, axis=-1)


class Ops(NamedTuple):
    """The products the forms below are written with (same signatures and results as the defaults here)."""

    qk_dot: Callable = score_dot  # (q [..., i, d], k [..., j, d]) -> [..., i, j]
    pv_dot: Callable = mix_dot  # (p [..., i, j], v [..., j, d]) -> [..., i, d]
    normalize: Callable = normalize  # (num [..., q, d], den [..., q]) -> num / den
    code_sums: Callable = code_sums  # (z, v, valid, S) -> (sum, count)


PLAIN = Ops()


def merge(a, b):
    """Count-weighted mean merge of (mean [..., S, Dv], count [..., S]); associative."""
    (mu_a, n_a), (mu_b, n_b) = a, b
    n = n_a + n_b
    mu = (n_a[..., None] * mu_a + n_b[..., None] * mu_b) / jnp.maximum(n, 1.0)[..., None]
    return mu, n


def code_summary(z, v, valid, S: int, ops: Ops = PLAIN):
    """Per-code (mean, count) of values v [..., L, Dv] with codes z [..., L] and validity [..., L]."""
    tot, cnt = ops.code_sums(z, v, valid, S)
    return tot / jnp.maximum(cnt, 1.0)[..., None], cnt


def log_count(n):
    """l = log N where N > 0, else -1e30 (via where + clip: no log(0), no NaN gradient)."""
    return jnp.where(n > 0, jnp.log(jnp.maximum(n, 1.0)), NEG)


def skew_bias(bd, offset: int, width: int, *, reversed_input: bool = False):
    """The banded bias bias[..., i, j] = bd[..., i, offset + i - j] where 0 <= offset + i - j <= D - 1, else 0, for
    j < width, built without a gather.
    ``reversed_input``: bd is given as bd[..., ::-1] (a caller that forms it from a reversed table saves the
    reversal here and its transpose in the backward).

    bd [..., Lq, D]. Row i of the result holds bd[i, ::-1] starting at column offset - (D - 1) + i and zeros
    elsewhere: pad each row, flatten, drop Lq trailing entries and reshape with one more column per row (the
    Transformer-XL relative shift). Forward and backward are pads, reshapes and slices (a gather's backward is
    a scatter-add, slow on CPU).
    """
    Lq, D = bd.shape[-2:]
    c0 = offset - (D - 1)  # column of bd[i, D-1] in row 0
    left, start = max(c0, 0), max(-c0, 0)
    right = max(0, start + width - (left + D + Lq - 1))
    n = left + D + right
    lead = bd.shape[:-2]
    x = jnp.pad(bd if reversed_input else bd[..., ::-1], [(0, 0)] * len(lead) + [(0, 0), (left, right + Lq)])  # [..., Lq, n + Lq]
    x = x.reshape(lead + (Lq * (n + Lq),))[..., : Lq * (n + Lq - 1)]
    x = x.reshape(lead + (Lq, n + Lq - 1))  # row i shifted right by i
    return x[..., start: start + width]


def pad_to(x, axis: int, n: int, value=0):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def pad_left(x, axis: int, n: int, value=0):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (pad, 0)
    return jnp.pad(x, widths, constant_values=value)


def softmax_mix(groups, ops: Ops = PLAIN):
    """groups: list of (scores [..., Lq, n], mask broadcastable, values [..., n, Dv]).
    One shared normalizer with a stop-gradient row max; the value matmuls' sum divided by den. Scores,
    probabilities and the normalizer in float32 (or wider); values in the compute dtype take the probabilities cast
    to it, with the products accumulated in float32."""
    m = None
    for s, mask, _ in groups:
        gm = jnp.max(jnp.where(mask, s, NEG), axis=-1)
        m = gm if m is None else jnp.maximum(m, gm)
    m = sg(m)[..., None]
    probs = [jnp.where(mask, jnp.exp(jnp.where(mask, s, NEG) - m), 0.0) for s, mask, _ in groups]
    den = sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    den = jnp.maximum(den, 1e-30)
    num = sum(ops.pv_dot(p, vals) for p, (_, _, vals) in zip(probs, groups))
    lse = (m + jnp.log(den))[..., 0]
    return ops.normalize(num, den[..., 0]), lse


def cast_state(state, dt):
    return {k: (x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x) for k, x in state.items()}


def final_state(state, k_hat, z, v, T: int, M: int, S: int, ops: Ops = PLAIN):
    """New canonical state after T real tokens: band = newest M of [band; x], agg += everything older."""
    pos = state["pos"]
    ek = jnp.concatenate([state["band_k"], k_hat[:, :, :T]], axis=2)
    ev = jnp.concatenate([state["band_v"], v[:, :, :T]], axis=2)
    ez = jnp.concatenate([state["band_z"], z[:, :, :T]], axis=2)
    epos = pos - M + jnp.arange(M + T)
    n_old = T  # entries [0, T) leave the band
    mu, n = code_summary(ez[:, :, :n_old], ev[:, :, :n_old], epos[:n_old] >= 0, S, ops)
    agg_mu, agg_n = merge((state["agg_mu"], state["agg_n"]), (mu, n))
    return {
        "pos": pos + T,
        "band_k": ek[:, :, n_old:],
        "band_v": ev[:, :, n_old:],
        "band_z": ez[:, :, n_old:],
        "agg_mu": agg_mu,
        "agg_n": agg_n,
    }


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


def block_inputs(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, reduction: str = "serial", compute=None,
                 ops: Ops = PLAIN):
    """The blocked operands of the causal block-parallel form (§2.6); requires 1 <= M <= L.

    Returns a dict: ``qb`` [B,H,R,L,Dk] and ``bdb`` [B,H,R,L,M+1] (queries in R blocks of L, zero-padded);
    ``kx``, ``vx`` [B,H,R+1,L,.], ``zx`` and ``validx`` [R+1,L] (extended blocks: index 0 is the carried
    band left-padded to L, index e is block e-1); ``cmu`` [B,H,R,S,Dv] and ``cn`` [B,H,R,S] (the lag-2 cache
    of block n: carried agg merged with extended blocks 0..n-1; float32 or wider); ``Cs`` = sg(C).
    ``bd=None`` leaves ``bdb`` out (None). ``compute``: the dtype of ``qb``, ``kx``, ``vx`` and ``Cs`` (the matmul
    operands; the model's XLA path passes its compute dtype); None: float32 or wider, as everything else (the
    reference the kernels are tested against).
    """
    if not 1 <= M <= L:
        raise ValueError(f"causal_parallel needs 1 <= M <= L, got M={M}, L={L}")
    B, H, T, Dk = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)  # the carried state, the per-code cache and its counts (statistics)
    cd = dt if compute is None else jnp.dtype(compute)  # queries, keys, values and codes: the matmul operands
    state = cast_state(state, dt)
    R = -(-T // L)
    Tp = R * L

    def blocks(x, n):  # [B, H, n*L, ...] -> [B, H, n, L, ...]
        return x.reshape(x.shape[:2] + (n, L) + x.shape[3:])

    kx = jnp.concatenate([pad_left(state["band_k"].astype(cd), 2, L), pad_to(k_hat.astype(cd), 2, Tp)], axis=2)
    vx = jnp.concatenate([pad_left(state["band_v"].astype(cd), 2, L), pad_to(v.astype(cd), 2, Tp)], axis=2)
    zx = jnp.concatenate([pad_left(state["band_z"], 2, L), pad_to(z, 2, Tp)], axis=2)
    band_pos = state["pos"] - L + jnp.arange(L)
    band_valid = (band_pos >= 0) & (jnp.arange(L) >= L - M)  # left padding of the M-slot band is invalid
    validx = jnp.concatenate([band_valid, jnp.arange(Tp) < T]).reshape(R + 1, L)
    kx, vx, zx = blocks(kx, R + 1), blocks(vx, R + 1), blocks(zx, R + 1)
    # cache for block n = agg (+) ext blocks 0..n-1  (= blocks -1..n-2): lag 2; means and counts in dt
    bmu, bn = code_summary(zx[:, :, :R], vx[:, :, :R].astype(dt), validx[:R], S, ops)  # ext 0..R-1
    items_mu = jnp.concatenate([state["agg_mu"][:, :, None], bmu[:, :, : R - 1]], axis=2)
    items_n = jnp.concatenate([state["agg_n"][:, :, None], bn[:, :, : R - 1]], axis=2)
    cmu, cn = prefix_reduce(items_mu, items_n, reduction)  # [B,H,R,S,Dv], [B,H,R,S]
    bdb = None if bd is None else blocks(pad_to(bd.astype(dt), 2, Tp), R)
    return {"qb": blocks(pad_to(q_u.astype(cd), 2, Tp), R), "bdb": bdb,
            "kx": kx, "vx": vx, "zx": zx, "validx": validx, "cmu": cmu, "cn": cn, "Cs": sg(C).astype(cd),
            "state": state}


def causal_parallel(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, reduction: str = "serial",
                    return_lse: bool = False, compute=None, ops: Ops = PLAIN):
    """Linear-time causal form (§2.6) from a carried state; requires 1 <= M <= L.

    The carried band (M keys, left-padded with invalid slots to L) acts as block -1 and the carried agg as the
    summary of everything before it, so query block n uses agg (+) blocks -1..n-2 (lag 2), attends exactly to
    block n-1 and (causally) to block n, with the band bias for d <= M. T need not be a multiple of L.
    ``compute``: the matmul operands' dtype (None: float32 or wider, the reference; a narrower one, e.g. bfloat16:
    the products take it and accumulate in float32, scores, softmax statistics and the state stay float32).
    Returns (o [B,H,T,Dv], new_state) (+ lse [B,H,T] if return_lse).
    """
    B, H, T, _ = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    p = block_inputs(q_u, bd, k_hat, z, v, C, state, L=L, M=M, reduction=reduction, compute=compute, ops=ops)
    qb, kx, vx, validx, cn, R = p["qb"], p["kx"], p["vx"], p["validx"], p["cn"], p["qb"].shape[2]
    bias = skew_bias(p["bdb"], L, 2 * L)  # [B,H,R,L,2L]: bd[i, L + i - j] for 0 <= L + i - j <= M
    s_c = acc_einsum("bhrld,hsd->bhrls", qb, p["Cs"]) + log_count(cn)[:, :, :, None, :]
    s_p = ops.qk_dot(qb, kx[:, :, :R]) + bias[..., :L]
    s_r = ops.qk_dot(qb, kx[:, :, 1:]) + bias[..., L:]
    mask_c = (cn > 0)[:, :, :, None, :]
    mask_p = validx[:R][:, None, :]
    mask_r = (jnp.arange(L)[None, :] <= jnp.arange(L)[:, None])[None] & validx[1:][:, None, :]
    o, lse = softmax_mix([(s_c, mask_c, p["cmu"].astype(vx.dtype)), (s_p, mask_p, vx[:, :, :R]),
                          (s_r, mask_r, vx[:, :, 1:])], ops)
    o = o.reshape(B, H, R * L, Dv)[:, :, :T]
    dt = p["state"]["agg_mu"].dtype  # the state stays in the statistics dtype
    new_state = final_state(p["state"], k_hat.astype(dt), z, v.astype(dt), T, M, S, ops)
    if return_lse:
        return o, new_state, lse.reshape(B, H, R * L)[:, :, :T]
    return o, new_state

vq_cache_attention_reference = functools.partial(causal_parallel, reduction="serial")

KERNEL_DTYPES = ("float32", "bfloat16")


def input_reasons(*, L: int, M: int, dtype) -> list[str]:
    """What every VQ-cache kernel form (TPU, GPU) refuses whatever the platform: the band longer than a block,
    and dtypes other than :data:`KERNEL_DTYPES`."""
    reasons = []
    if not 1 <= M <= L:
        reasons.append(f"needs 1 <= mem_len <= block_len (got M={M}, L={L})")
    name = jnp.dtype(dtype).name
    if name not in KERNEL_DTYPES:
        reasons.append(f"dtype {name} not supported (allowed: {', '.join(KERNEL_DTYPES)})")
    return reasons


__all__ = [
    "KERNEL_DTYPES",
    "input_reasons",
    "NEG",
    "Ops",
    "PLAIN",
    "block_inputs",
    "REDUCTIONS",
    "causal_parallel",
    "cast_state",
    "acc_einsum",
    "code_summary",
    "code_sums",
    "compute_dtype",
    "final_state",
    "float_dtype",
    "log_count",
    "merge",
    "mix_dot",
    "normalize",
    "pad_left",
    "pad_to",
    "prefix_reduce",
    "score_dot",
    "skew_bias",
    "softmax_mix",
    "vq_cache_attention_reference",
]

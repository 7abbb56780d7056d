"""The portable XLA implementations of Transformer-VQ (docs/methods/transformer_vq.md; the § numbers cite it):
plain JAX for any backend, each equal to the reference (``reference.py``) in value, state and gradient.

* ``parallel``  -- the block-parallel causal form of §2.6 (``pallas_kernels.vq_cache_ref.causal_parallel``, the
                   Pallas kernel's reference) under autodiff; its ``reduction`` setting picks the cross-block scan;
                   a packed row (segment ids): :func:`causal_packed`, each document on its own block grid (§2.8)
* ``blocks``    -- :func:`causal_blocks`: the same form one tile of queries at a time, with a recomputing backward;
                   a packed row: :func:`causal_packed_blocks`, the packed form one rematerialized row block at a time
* ``stream``    -- :func:`causal_stream`: block by block, as decoding runs (§2.7; any band M); a packed row:
                   :func:`causal_packed_short`, one quadratic pass over the call (decoding steps)
* ``encoder``   -- :func:`encoder_parallel`: the bidirectional form (§2.5); a packed row: :func:`encoder_packed`

A causal packed row carries its last document's state (:func:`attend_packed`, ``state.packed_final_state``).

Each form is written with the products of ``vq_cache_ref.Ops`` (``ops``) and the tiled backward with those of
:class:`TileOps` (``tiles``): plain ones here; the XLA:CPU implementation (its own file) runs the same forms
with its own. :func:`form_for` is the size rule (which causal form suits a call of a given size); the declarations
(``IMPLEMENTATIONS``, at the end) make each causal form ``'auto'``'s choice on a GPU / TPU for the calls the rule
gives it (``prefer``, :func:`preferred_form`: the rule with the tiled form's ``tiled_min_scores`` for the
platform), after the kernel. Each implementation is a ``dispatch.Runner`` (:class:`Parallel`, :class:`Blocks`,
:class:`Stream`, :class:`Encoder`: a :class:`Form`) whose fields are the settings it reads; it runs its form by
:func:`attend` over the layer's inputs and returns :func:`result`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from longctx.attention import dispatch
from longctx.attention.base import document_starts
from longctx.attention.dispatch import Implementation
from longctx.attention.transformer_vq.state import packed_final_state
from pallas_kernels.precision import statistic
from pallas_kernels.vq_cache_ref import (
    NEG,
    PLAIN,
    Ops,
    acc_einsum,
    block_inputs,
    cast_state,
    causal_parallel,
    code_summary,
    compute_dtype,
    final_state,
    float_dtype,
    log_count,
    merge,
    pad_left,
    pad_to,
    prefix_reduce,
    skew_bias,
    softmax_mix,
)

sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- STVQ
# the nearest-code search runs in float32 or wider whatever the compute dtype (docs/methods/transformer_vq.md §10.6:
# every device and every implementation assign the same codes, which a bfloat16 product would not on near ties):
# a statistic, like the codebook's EMA sums it decides
SEARCH = "nearest-code search in float32 (the codes every device and implementation agree on)"


def nearest(k, C, half_c2):
    """(z, d2min) of keys k [B,H,t,Dk] against codes C [H,S,Dk] with half_c2 = |c|^2 / 2 [H,S]:
    argmin ||k - c||^2 = argmax (k.c - |c|^2 / 2), d^2 = |k|^2 - 2 max(.)."""
    with statistic(SEARCH):
        g = jnp.einsum("bhtd,hsd->bhts", k, C) - half_c2[:, None, :]
    return jnp.argmax(g, axis=-1).astype(jnp.int32), jnp.sum(k * k, -1) - 2.0 * jnp.max(g, -1)


def stvq(k, C, *, chunk: int = 512, nearest: Callable = nearest):
    """Straight-through VQ (§2.2). k: [B, H, T, Dk]; C: [H, S, Dk] (read under stop_gradient).

    Returns (k_hat, z, err2, c_z): k_hat = k + sg(c_z - k) (value c_z, Jacobian I) in k's dtype (the compute dtype:
    bfloat16 keys give a bfloat16 k_hat), z = argmin_s ||k - c_s||^2 in >= fp32 (ties -> lowest index),
    err2 = relu(min d^2), c_z = sg(C)[z] (>= fp32).
    The search runs over ``chunk`` keys at a time (a [chunk, S] distance tile instead of one [T, S] tensor),
    each by ``nearest(keys, C, half_c2)``.
    """
    dt = float_dtype(k, C)
    kf, Cf = k.astype(dt), sg(C).astype(dt)
    B, H, T, Dk = kf.shape
    half_c2 = 0.5 * jnp.sum(Cf * Cf, -1)
    if T <= chunk:
        z, d2min = nearest(kf, Cf, half_c2)
    else:
        n = -(-T // chunk)
        kc = jnp.moveaxis(pad_to(kf, 2, n * chunk).reshape(B, H, n, chunk, Dk), 2, 0)
        z, d2min = jax.lax.map(lambda x: nearest(x, Cf, half_c2), kc)
        z, d2min = (jnp.moveaxis(x, 0, 2).reshape(B, H, n * chunk)[:, :, :T] for x in (z, d2min))
    c_z = gather_codes(Cf, z)
    k_hat = (kf + sg(c_z - kf)).astype(k.dtype)  # float32 or wider keys: unchanged
    return k_hat, z, jax.nn.relu(d2min), c_z


def gather_codes(C, z):
    """C [H, S, D], z [B, H, T] -> [B, H, T, D]."""
    return jax.vmap(lambda c, zz: c[zz], in_axes=(0, 1), out_axes=1)(C, z)


def band_scores(q_v, r):
    """bd[b, h, t, n] = q_v[b, h, t] . r[n, h]; q_v [B, H, T, Dk], r [n, H, Dk]; float32 (or wider) scores."""
    return acc_einsum("bhtd,nhd->bhtn", q_v, r)


# ----------------------------------------------------------------------------- the size rule
def form_for(*, B: int, H: int, T: int, S: int, L: int, M: int, reduction: str = "serial", min_scores: int) -> str:
    """The causal form a call of this size suits: the streaming form for calls shorter than a block (decoding) or a
    band longer than a block, else the tiled form when the call's score tensor B*H*T*(S+2L) has at least
    ``min_scores`` entries (1: every call of at least a block) and the reduction is the serial one, else the
    one-shot block-parallel form."""
    if not (M <= L and T >= L):
        return "stream"
    big = B * H * T * (S + 2 * L) >= min_scores
    return "blocks" if reduction == "serial" and big else "parallel"


def preferred_form(platform: str, *, tiled_min_scores=dispatch.PLATFORM_DEFAULT, **shapes) -> str:
    """:func:`form_for` of a call (``shapes``: the layer's B, H, T, S, L, M, reduction) with ``tiled_min_scores`` as
    the tiled form declares it for ``platform`` (:data:`DEFAULTS`; a configured value runs as written): what
    ``'auto'`` prefers on a GPU / TPU (:func:`is_form`, and the kernel's ``prefer``)."""
    min_scores = _by_name()["blocks"].setting("tiled_min_scores", tiled_min_scores, platform)
    return form_for(**{k: shapes[k] for k in ("B", "H", "T", "S", "L", "M")},
                    reduction=shapes.get("reduction", "serial"), min_scores=min_scores)


# ----------------------------------------------------------------------------- block-parallel form, blocked
class TileOps(NamedTuple):
    """The products of the tiled backward (plain here; the XLA:CPU implementation passes its own, same results)."""

    rowsum_product: Callable  # (a [..., d], b [..., d]) -> sum_d a b  [...]
    swap_last: Callable  # (*xs) -> each x with its last two axes swapped (one array if one x)
    matmul_tn: Callable  # (a_t [..., i, q], b [..., q, j]) -> [..., i, j]


def _rowsum_product(a, b):
    return jnp.sum(a * b, axis=-1)


def _swap_last(*xs):
    out = tuple(jnp.swapaxes(x, -1, -2) for x in xs)
    return out if len(xs) > 1 else out[0]


def _matmul_tn(a_t, b):
    return jnp.einsum("...iq,...qj->...ij", a_t, b)


def _mm(spec: str, a, b):
    """``jnp.einsum(spec, a, b)``: exactly that for operands of float32 or wider, else (compute-dtype operands, e.g.
    bfloat16) accumulated and returned in float32. The tiled form's own backward calls it: no autodiff through it."""
    if a.dtype == b.dtype == float_dtype(a, b):
        return jnp.einsum(spec, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _acc_matmul_tn(t, a_t, b):
    """``t.matmul_tn`` for operands of float32 or wider, else its product accumulated and returned in float32."""
    if a_t.dtype == b.dtype == float_dtype(a_t, b):
        return t.matmul_tn(a_t, b)
    return jnp.einsum("...iq,...qj->...ij", a_t, b, preferred_element_type=jnp.float32)


PLAIN_TILES = TileOps(_rowsum_product, _swap_last, _matmul_tn)


def causal_blocks(q_u, q_v, r, k_hat, z, v, C, state, *, L: int, M: int, q_tile: int = 256, keep_budget: int = 0,
                  ops: Ops = PLAIN, tiles: TileOps = PLAIN_TILES):
    """``causal_parallel(q_u, band_scores(q_v, r), ..., reduction='serial')`` computed one tile of
    ``q_tile`` queries at a time (nested ``lax.scan`` over blocks and the tiles of a block), with a
    FlashAttention-style backward that recomputes each tile's probabilities from the saved log-sum-exp.

    q_v = q + v' [B,H,T,Dk] and r = r' [M+1, H, Dk]: each tile forms its own band scores q_v r'^T
    [q_tile, M+1] and their relative shift, so the [T, M+1] band tensor is never stored. A tile attends to
    S codes (values = the lag-2 cache), the previous block and the causal present: a [q_tile, S + 2L]
    score tile whose working set stays in cache, instead of [T, S + 2L] scores, probabilities and masks
    held for autodiff. ``q_tile`` is reduced to a divisor of L. ``keep_budget``: a call with at most this many
    scores B*H*T*(S+2L) keeps its attention weights from the forward for the backward (0 or -1: always recompute;
    the core passes the value its platform runs with).
    Same result and state as ``causal_parallel``. Returns (o [B,H,T,Dv], new_state).
    """
    B, H, T, _ = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    # the matmul operands (queries, keys, values, codes, cache means) take the compute dtype, the values' (as the
    # one-shot form's); scores, softmax statistics, the cache counts and the state stay float32 or wider, and
    # every product accumulates in float32, forward and backward (float32 inputs: all float32, as the reference)
    p = block_inputs(q_u, None, k_hat, z, v, C, state, L=L, M=M, reduction="serial", compute=v.dtype, ops=ops)
    qb = p["qb"]
    qvb = pad_to(q_v.astype(qb.dtype), 2, qb.shape[2] * L).reshape(qb.shape)
    # [H, M+1, Dk] (then broadcast to [B, H, M+1, Dk]), head-major for the per-tile batched matmuls, and reversed
    # along the lag: the band scores come out as bd[..., ::-1], the order the relative shift wants (no reversal
    # of a score tile, forward or back)
    # r and the codes are broadcast over the batch once, so every per-tile matmul is batched over (B, H) in the
    # order of its output: a head-only batch made XLA:CPU write [H, B, ..] and copy each score tile into place
    rh = jnp.swapaxes(r.astype(qb.dtype), 0, 1)[:, ::-1]
    rh, Cs = (jnp.broadcast_to(x[None], (B,) + x.shape) for x in (rh, p["Cs"]))
    q_tile = math.gcd(L, max(1, min(q_tile, L)))
    keep = B * H * qb.shape[2] * L * (S + 2 * L) <= keep_budget
    o = _tiled(tiles)(qb, qvb, rh, p["kx"], p["vx"], p["cmu"].astype(qb.dtype), log_count(p["cn"]), Cs, p["validx"],
                      q_tile, keep)
    o = o.reshape(B, H, -1, Dv)[:, :, :T]
    dt = p["state"]["agg_mu"].dtype  # the state stays in the statistics dtype
    return o, final_state(p["state"], k_hat.astype(dt), z, v.astype(dt), T, M, S, ops)

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
    s_c = _mm("bhld,bhsd->bhls", qt, Cs) + lcr[:, :, None, :]
    bdt = _mm("bhld,bhnd->bhln", qvt, r)
    causal = jnp.arange(n_pres)[None, :] <= (off + jnp.arange(Lq))[:, None]
    keep = jnp.concatenate([jnp.broadcast_to(valid_p[None, :], (Lq, L)), causal & valid_c[None, :n_pres]], axis=-1)
    band = _tile_bias(bdt, off, L) + jnp.where(keep, 0.0, NEG).astype(bdt.dtype)
    return s_c, _mm("bhld,bhnd->bhln", qt, K[:, :, :L + n_pres]) + band, bdt


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
            Vt = V[:, :, :s_l.shape[-1]]
            o = _mm("bhls,bhsd->bhld", p_c.astype(cm.dtype), cm) + _mm("bhln,bhnd->bhld", p_l.astype(Vt.dtype), Vt)
            return o / den, (m + jnp.log(den))[..., 0], ((p_c, p_l, 1.0 / den) if keep else None)

        outs = [tile(c) for c in range(L // Lq)]
        return None, (jnp.stack([x[0] for x in outs]), jnp.stack([x[1] for x in outs]), tuple(x[2] for x in outs))

    _, (o, lse, kept) = jax.lax.scan(block, None, jnp.arange(R))  # [R, nt, B,H,Lq,.]; kept: per tile, [R, ...]
    o = jnp.moveaxis(o, (0, 1), (2, 3)).reshape(B, H, R, L, -1)
    return o, jnp.moveaxis(lse, (0, 1), (2, 3)).reshape(B, H, R, L), (kept if keep else None)


def _vq_blocks_fwd(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep):
    o, lse, kept = _vq_blocks_fwd_impl(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep)
    return o, (qb, qvb, r, kx, vx, cmu, lc, Cs, validx, o, lse, kept)


def _vq_blocks_bwd(t: TileOps, Lq, keep, res, do):
    """FlashAttention-style backward, one block (and tile) at a time: each tile's weights are recomputed from the
    saved log-sum-exp, or, ``keep``, read from the forward's kept unnormalized weights and inverse normalizer
    (no score matmuls and no exp pass; the normalizer is folded into the small [Lq, Dv] operands)."""
    qb, qvb, r, kx, vx, cmu, lc, Cs, validx, o, lse, kept = res
    B, H, R, L, Dk = qb.shape
    cd = qb.dtype  # the products' operands (the cotangents cast to it); float32 accumulation
    delta = t.rowsum_product(do, o)  # [B,H,R,L]
    ops = (qb, qvb, kx, vx, cmu, lc, validx)

    def block(dr, xs):
        i, kept_i = xs
        K, V, cm, lcr, valid_p, valid_c = _block_kv(ops, i)

        def tile(carry, c):  # c static, as in the forward: keys beyond the tile's last query are not scored
            dr, dK, dV, dcm, dlc = carry
            qt, qvt, dot = _tile_rows(qb, i, c, Lq), _tile_rows(qvb, i, c, Lq), _tile_rows(do, i, c, Lq)
            delta_t = _tile_rows(delta, i, c, Lq)[..., None]
            if keep:  # unnormalized weights and 1/den from the forward; dp's normalizer goes into do
                p_c, p_l, w = kept_i[c]
                nk = p_l.shape[-1]
                bdt_shape = qvt.shape[:3] + (r.shape[2],)
                dow = (dot * w).astype(cd)
                ds_c = p_c * (_mm("bhld,bhsd->bhls", dow, cm) - delta_t * w)
                ds_l = p_l * (_mm("bhld,bhnd->bhln", dow, V[:, :, :nk]) - delta_t * w)
            else:
                s_c, s_l, bdt = _tile_scores(qt, qvt, c * Lq, r, Cs, lcr, K, valid_p, valid_c)
                nk = s_l.shape[-1]
                bdt_shape = bdt.shape
                lse_t = _tile_rows(lse, i, c, Lq)[..., None]
                p_c, p_l = jnp.exp(s_c - lse_t), jnp.exp(s_l - lse_t)  # masked entries: exp(NEG - lse) = 0
                dow = dot.astype(cd)
                ds_c = p_c * (_mm("bhld,bhsd->bhls", dow, cm) - delta_t)
                ds_l = p_l * (_mm("bhld,bhnd->bhln", dow, V[:, :, :nk]) - delta_t)
            Kt = K[:, :, :nk]
            ds_cc, ds_lc = ds_c.astype(cd), ds_l.astype(cd)
            dq = _mm("bhls,bhsd->bhld", ds_cc, Cs) + _mm("bhln,bhnd->bhld", ds_lc, Kt)
            # key-side gradients accumulate transposed, [.., D, keys] = qᵀ ds: the large query-major ds and p
            # stay as laid out and only the small [Lq, D] operands are transposed, first, so that the dots are
            # plain products (``tiles.matmul_tn``)
            qt_t, dow_t, qvt_t = t.swap_last(qt, dow, qvt)
            dK = dK.at[..., :nk].add(_acc_matmul_tn(t, qt_t, ds_lc))  # the codebook takes no gradient
            dV = dV.at[..., :nk].add(_acc_matmul_tn(t, dow_t, p_l.astype(cd)))
            dcm = dcm + _acc_matmul_tn(t, dow_t, p_c.astype(cd))
            dlc = dlc + jnp.sum(ds_c, axis=-2)  # the log counts are added to the code scores
            # the bias is linear in bdt: its transpose needs only bdt's shape
            _, bias_t = jax.vjp(lambda b: _tile_bias(b, c * Lq, L), jnp.zeros(bdt_shape, ds_l.dtype))
            (dbd,) = bias_t(ds_l)
            dbd = dbd.astype(cd)
            dqv = _mm("bhln,bhnd->bhld", dbd, r)
            dr = dr + _acc_matmul_tn(t, qvt_t, dbd)  # transposed too: [B, H, Dk, M+1]
            return (dr, dK, dV, dcm, dlc), (dq, dqv)

        zt = lambda x: jnp.zeros_like(jnp.swapaxes(x, -1, -2), delta.dtype)  # noqa: E731 -- float32 sums
        carry = (dr, zt(K), zt(V), zt(cm), jnp.zeros_like(lcr, delta.dtype))
        grads = []
        for c in range(L // Lq):
            carry, g = tile(carry, c)
            grads.append(g)
        dr, dK, dV, dcm, dlc = carry
        dq, dqv = (jnp.stack(x) for x in zip(*grads))
        # the key-side gradients leave the loop as accumulated, [.., D, keys]: each block's swap to keys-major
        # was a transposing write into the stacked outputs (at 16k, 64 blocks, ~7 % of a train step); after
        # the loop one swap per array goes into the pass that adds the blocks' two halves (ext)
        return dr, (dq, dqv, dK[..., :L], dK[..., L:], dcm, dV[..., :L], dV[..., L:], dlc)

    drt, (dq, dqv, dkp, dkc, dcmt, dvp, dvc, dlc) = jax.lax.scan(
        block, jnp.zeros_like(jnp.swapaxes(r, -1, -2), delta.dtype), (jnp.arange(R), kept))
    dr = jnp.swapaxes(drt, -1, -2)
    dcm = jnp.swapaxes(dcmt, -1, -2)

    def ext(prev, cur):  # [R, B,H,D,L] contributions to extended blocks r (prev) and r+1 (cur) -> [B,H,R+1,L,D]
        z0 = jnp.zeros_like(prev[:1])
        return jnp.swapaxes(jnp.moveaxis(jnp.concatenate([prev, z0], 0) + jnp.concatenate([z0, cur], 0), 0, 2),
                            -1, -2)

    def rows(x):  # [R, nt, B,H,Lq,.] -> [B,H,R,L,.]
        return jnp.moveaxis(x, (0, 1), (2, 3)).reshape(B, H, R, L, -1)

    # the log counts' cotangent (the code scores' dS summed over the queries) reaches the counts, a carried agg_n's
    # too, as the one-shot form's autodiff does (a None here also failed the transpose of the cache's serial scan)
    cts = (rows(dq), rows(dqv), dr, ext(dkp, dkc), ext(dvp, dvc), jnp.moveaxis(dcm, 0, 2), jnp.moveaxis(dlc, 0, 2))
    return tuple(g.astype(x.dtype) for g, x in zip(cts, (qb, qvb, r, kx, vx, cmu, lc))) + (None, None)


@functools.lru_cache(maxsize=None)
def _tiled(t: TileOps):
    """The tiled forward with its recomputing backward written with the products ``t``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
    def vq_blocks(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq, keep=False):
        return _vq_blocks_fwd_impl(qb, qvb, r, kx, vx, cmu, lc, Cs, validx, Lq)[0]

    vq_blocks.defvjp(_vq_blocks_fwd, functools.partial(_vq_blocks_bwd, t))
    return vq_blocks



# ----------------------------------------------------------------------------- streaming form
def _stream_step(state, q_u, bd, k_hat, z, v, Cs, M: int, S: int, ops: Ops = PLAIN):
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
    o, _ = softmax_mix([(s_c, (state["agg_n"] > 0)[:, :, None, :], state["agg_mu"].astype(V.dtype)),
                        (s_l, mask, V)], ops)
    sdt = state["agg_mu"].dtype  # the state (band, means, counts) stays in the statistics dtype
    mu, n = code_summary(Z[:, :, :Lc], V[:, :, :Lc].astype(sdt), kpos[:Lc] >= 0, S, ops)
    agg_mu, agg_n = merge((state["agg_mu"], state["agg_n"]), (mu, n))
    new = {"pos": pos + Lc, "band_k": K[:, :, Lc:].astype(sdt), "band_v": V[:, :, Lc:].astype(sdt),
           "band_z": Z[:, :, Lc:], "agg_mu": agg_mu, "agg_n": agg_n}
    return new, o


def causal_stream(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, ops: Ops = PLAIN):
    """Streaming form (§2.7): chunks of L (any L >= 1, any M >= 1), scanned; a ragged tail is one
    shorter step. Equals the quadratic reference for every L and M. Returns (o, new_state)."""
    B, H, T, _ = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)  # state and band scores
    cd = compute_dtype(q_u, v)  # the matmul operands
    state = cast_state(state, dt)
    Cs = sg(C).astype(cd)
    xs = (q_u.astype(cd), bd.astype(dt), k_hat.astype(cd), z, v.astype(cd))
    nfull, rem = divmod(T, L)
    outs = []
    if nfull:
        def chunks(x):
            x = x[:, :, : nfull * L]
            return jnp.moveaxis(x.reshape(x.shape[:2] + (nfull, L) + x.shape[3:]), 2, 0)

        def body(st, c):
            return _stream_step(st, *c, Cs, M, S, ops)

        state, o = jax.lax.scan(body, state, tuple(chunks(x) for x in xs))
        outs.append(jnp.moveaxis(o, 0, 2).reshape(B, H, nfull * L, -1))
    if rem:
        state, o = _stream_step(state, *(x[:, :, nfull * L:] for x in xs), Cs, M, S, ops)
        outs.append(o)
    return jnp.concatenate(outs, axis=2), state


# ----------------------------------------------------------------------------- encoder form
def encoder_parallel(q_u, bd, k_hat, z, v, C, *, L: int, M: int, band: bool, valid=None, ops: Ops = PLAIN):
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
        mu, n = code_summary(z, v.astype(dt), valid, S, ops)  # [B,H,S,Dv], [B,H,S]
        s_c = acc_einsum("bhtd,hsd->bhts", q_u.astype(cd), Cs) + log_count(n)[:, :, None, :]
        o, _ = softmax_mix([(s_c, (n > 0)[:, :, None, :], mu.astype(cd))], ops)
        return o
    if not 1 <= M <= L:
        raise ValueError(f"encoder band needs 1 <= M <= L, got M={M}, L={L}")
    R = -(-T // L)
    Tp = R * L

    def blocks(x, left=0, right=0):
        x = pad_to(x, 2, Tp)
        widths = [(0, 0)] * x.ndim
        widths[2] = (left * L, right * L)
        x = jnp.pad(x, widths)
        return x.reshape(x.shape[:2] + (x.shape[2] // L, L) + x.shape[3:])

    qb, bdb = blocks(q_u.astype(cd)), blocks(bd.astype(dt))
    kx, vx, zx = blocks(k_hat.astype(cd), 1, 1), blocks(v.astype(cd), 1, 1), blocks(z, 1, 1)  # R+2 blocks
    vpad = jnp.pad(pad_to(valid, 0, Tp), (L, L)).reshape(R + 2, L)
    bmu, bn = code_summary(zx[:, :, 1:-1], vx[:, :, 1:-1].astype(dt), vpad[1:-1], S, ops)  # [B,H,R,...]
    pm, pn = prefix_reduce(bmu, bn, "serial")
    sm, sn = prefix_reduce(bmu[:, :, ::-1], bn[:, :, ::-1], "serial")
    sm, sn = sm[:, :, ::-1], sn[:, :, ::-1]  # suffix over blocks >= r

    def shift(x, by):  # out[n] = x[n + by] or zeros
        z0 = jnp.zeros_like(x[:, :, : abs(by)])
        n = x.shape[2] - abs(by)
        return jnp.concatenate([z0, x[:, :, :n]], 2) if by < 0 else jnp.concatenate([x[:, :, by:], z0], 2)

    local_k = jnp.concatenate([kx[:, :, :R], kx[:, :, 1:R + 1], kx[:, :, 2:]], axis=3)  # [B,H,R,3L,Dk]
    local_v = jnp.concatenate([vx[:, :, :R], vx[:, :, 1:R + 1], vx[:, :, 2:]], axis=3)
    local_valid = jnp.concatenate([vpad[:R], vpad[1:R + 1], vpad[2:]], axis=1)  # [R, 3L]
    s_l = acc_einsum("bhrld,bhrjd->bhrlj", qb, local_k) + skew_bias(bdb, L + M, 3 * L)  # bd[i, L+M+i-j]
    groups = [(s_l, local_valid[:, None, :], local_v)]
    if R > 2:  # blocks two or more away exist: their code summaries are a group of their own
        fmu, fn = merge((shift(pm, -2), shift(pn, -2)), (shift(sm, 2), shift(sn, 2)))
        s_c = acc_einsum("bhrld,hsd->bhrls", qb, Cs) + log_count(fn)[:, :, :, None, :]
        groups.insert(0, (s_c, (fn > 0)[:, :, :, None, :], fmu.astype(cd)))
    # else every key is in the band: an empty summary group adds nothing (computed, it is a [B, H, R, L, S]
    # all-masked group, which XLA constant-folds for seconds and XLA:CPU's jit turns into NaN at R = 2, L = 512)
    o, _ = softmax_mix(groups, ops)
    return o.reshape(B, H, Tp, Dv)[:, :, :T]



# ----------------------------------------------------------------------------- packed rows (§2.8)
def _blocked(x, axis: int, n: int, L: int):
    """[.., n*L, ..] -> [.., n, L, ..] along ``axis``."""
    return x.reshape(x.shape[:axis] + (n, L) + x.shape[axis + 1:])


def _windows(x, axis: int, R: int, L: int, fill):
    """[.., R*L, ..] -> [.., R, 3L, ..]: for query block n the row blocks n-2, n-1, n (``fill`` before the row)."""
    xb = _blocked(pad_left(x, axis, (R + 2) * L, fill), axis, R + 2, L)
    return jnp.concatenate([jax.lax.slice_in_dim(xb, i, i + R, axis=axis) for i in range(3)], axis=axis + 1)


def _take_block(x, m):
    """x [B, H, R, ...] at block m [B, R] of each batch row and block -> [B, H, R, ...]."""
    return jnp.take_along_axis(x, m.reshape(m.shape[:1] + (1,) + m.shape[1:] + (1,) * (x.ndim - 3)), axis=2)


def _row_grid(segment_ids, L: int):
    """The row's block grid of a packed row [B, T]: (R blocks, Tp = R*L, each position's document start [B, Tp] (the
    padding joins the last document, after every real query), the real positions [Tp], each position's place in its
    document [B, Tp])."""
    T = segment_ids.shape[1]
    R = -(-T // L)
    Tp = R * L
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), mode="edge")
    start = document_starts(seg)
    pos = jnp.arange(Tp, dtype=jnp.int32)
    return R, Tp, start, pos < T, pos - start


def causal_packed(q_u, bd, k_hat, z, v, C, *, L: int, M: int, segment_ids, compute=None, ops: Ops = PLAIN,
                  state=None, seen=None, continues=None):
    """The causal block-parallel form (§2.6) of a packed row (``segment_ids`` [B, T]) from the empty state: every
    document on its own block grid from its first token (§2.8); requires 1 <= M <= L. Returns o [B, H, T, Dv].

    A query of relative position i in its document attends exactly to its document's keys from the start of the
    document block before its own (i - i mod L - L), which lie in the row's blocks n-2..n for a query of row block n
    (a window of 3L keys, the band bias by distance), and to the compressive cache of its document's older keys. Only
    the document holding the block's first token can have a cache there (a cache needs i >= 2L), at one of two
    cut-offs (i // L takes two values in a block): each is that document's running summary up to a row block edge (a
    serial scan over the row blocks that restarts where a document opens) merged with the summary of the part of
    the cut-off's row block before it. Memory and time as the one-shot form's, with 3L window keys and 2S codes a
    query for its 2L and S.

    ``state`` (the forms' layout), ``seen`` [B] and ``continues`` [B, T]: a carried document and the call's leading
    tokens that continue it (:func:`carried_groups`)."""
    if not 1 <= M <= L:
        raise ValueError(f"causal_packed needs 1 <= M <= L, got M={M}, L={L}")
    B, H, T, _ = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)
    cd = dt if compute is None else jnp.dtype(compute)
    R, Tp, start, valid, rel = _row_grid(segment_ids, L)
    # the exact window: the row's blocks n-2..n, masked to the query's document from its previous document block on
    qb = _blocked(pad_to(q_u.astype(cd), 2, Tp), 2, R, L)  # [B, H, R, L, Dk]
    kw, vw = (_windows(pad_to(x.astype(cd), 2, Tp), 2, R, L, 0) for x in (k_hat, v))  # [B, H, R, 3L, .]
    qstart, qrel = _blocked(start, 1, R, L), _blocked(rel, 1, R, L)  # [B, R, L]
    dist = 2 * L + jnp.arange(L)[:, None] - jnp.arange(3 * L)[None, :]  # [L, 3L]: query minus key position
    mask_w = ((_windows(start, 1, R, L, -1)[:, :, None, :] == qstart[..., None])
              & _windows(valid, 0, R, L, False)[None, :, None, :] & (dist >= 0)
              & (dist <= qrel[..., None] % L + L))[:, None]  # [B, 1, R, L, 3L]
    bias = skew_bias(_blocked(pad_to(bd.astype(dt), 2, Tp), 2, R, L), 2 * L, 3 * L)  # bd[i, d] for 0 <= d <= M
    s_w = ops.qk_dot(qb, kw) + bias
    zb, vb = _blocked(pad_to(z, 2, Tp), 2, R, L), _blocked(pad_to(v.astype(dt), 2, Tp), 2, R, L)
    s_c = acc_einsum("bhrld,hsd->bhrls", qb, sg(C).astype(cd))
    groups = _prefix_groups(s_c, zb, vb, qstart, qrel, T=T, L=L, S=S, cd=cd, ops=ops)
    if state is not None:
        bd0 = _blocked(pad_to(bd.astype(dt), 2, Tp), 2, R, L)[:, :, 0]  # the band bias reaches row block 0 only
        groups += carried_groups(qb, s_c, bd0, cast_state(state, dt), seen,
                                 _blocked(pad_to(continues, 1, Tp), 1, R, L), M=M, cd=cd, ops=ops)
    o, _ = softmax_mix(groups + [(s_w, mask_w, vw)], ops)
    return o.reshape(B, H, Tp, -1)[:, :, :T]


def _prefix_groups(s_c, zb, vb, qstart, qrel, *, T: int, L: int, S: int, cd, ops: Ops = PLAIN):
    """The cache groups of the packed block-parallel forms (§2.8), :func:`_prefix_caches` with the code scores
    ``s_c`` [B, H, R, L, S]. Returns two (scores, mask, means)."""
    return [(s_c + log_count(n)[:, :, :, None, :], reads[:, None, :, :, None] & (n > 0)[:, :, :, None, :],
             mu.astype(cd)) for mu, n, reads in _prefix_caches(zb, vb, qstart, qrel, T=T, L=L, S=S, ops=ops)]


def _open_runs(zb, vb, qstart, *, T: int, L: int, S: int, ops: Ops = PLAIN):
    """The running code summaries of a packed row's documents at its row block edges: for each row block m, (means
    [B, H, R, S, Dv], counts [B, H, R, S]) of the document open at the end of row block m-1 over its keys before row
    block m (a serial scan over the row blocks that restarts where a document opens; empty for m = 0). ``zb``,
    ``vb``: codes and values [B, H, R, L, .]; ``qstart``: each position's document start [B, R, L]."""
    B, H, R = vb.shape[:3]
    pos = jnp.arange(R * L, dtype=jnp.int32)
    posb, validb = pos.reshape(R, L), pos.reshape(R, L) < T
    last = code_summary(zb, vb, ((posb >= qstart[:, :, -1:]) & validb)[:, None], S, ops)  # [B,H,R,S,Dv], [B,H,R,S]
    goes_on = qstart[:, :, -1] < posb[None, :, 0]  # [B, R]: the block's last document opened before the block

    def step(run, x):
        mu, n, on = x
        keep = on[:, None, None]
        return merge((jnp.where(keep[..., None], run[0], 0.0), jnp.where(keep, run[1], 0.0)), (mu, n)), run

    empty = (jnp.zeros((B, H, S, vb.shape[-1]), vb.dtype), jnp.zeros((B, H, S), vb.dtype))
    _, runs = jax.lax.scan(step, empty, (jnp.moveaxis(last[0], 2, 0), jnp.moveaxis(last[1], 2, 0), goes_on.T))
    return tuple(jnp.moveaxis(x, 0, 2) for x in runs)  # [B, H, R, ...]: the open document before row block m


def _prefix_caches(zb, vb, qstart, qrel, *, T: int, L: int, S: int, ops: Ops = PLAIN):
    """The caches of the packed block-parallel forms (§2.8): a query of document block n >= 2 reads its
    document's keys before (n-1)L through the code summaries. Only the document holding a row block's first token
    can (a cache needs a relative position of 2L or more), at one of two cut-offs (n takes two values in a block):
    each its running summary up to a row block edge (a serial scan over the row blocks that restarts where a
    document opens) merged with the summary of the part of the cut-off's row block before it. ``zb``, ``vb``: codes
    and values (the statistics' dtype) [B, H, R, L, .]; ``qstart``, ``qrel``: each position's document start and
    position in it [B, R, L]. Returns two (means [B, H, R, S, Dv], counts [B, H, R, S], which queries read them
    [B, R, L])."""
    R = vb.shape[2]
    runs = _open_runs(zb, vb, qstart, T=T, L=L, S=S, ops=ops)
    # the two cut-offs of each query block's first document, and which queries read which
    d0, k0 = qstart[:, :, 0], qrel[:, :, 0] // L  # [B, R]
    cache_of = (qstart == d0[..., None]) & (qrel // L >= 2)  # [B, R, L]
    groups = []
    for j in (0, 1):
        cut = d0 + (k0 - 1 + j) * L  # [B, R]: keys before it and from d0 on are in the cache
        m = jnp.clip(cut // L, 0, R - 1)
        pm = m[..., None] * L + jnp.arange(L)  # [B, R, L]
        part = code_summary(_take_block(zb, m), _take_block(vb, m),
                            ((pm >= d0[..., None]) & (pm < cut[..., None]) & (pm < T))[:, None], S, ops)
        use = ((d0 < m * L) & (cut > d0))[:, None, :, None]
        mu, n = merge((jnp.where(use[..., None], _take_block(runs[0], m), 0.0),
                       jnp.where(use, _take_block(runs[1], m), 0.0)), part)
        groups.append((mu, n, cache_of & (qrel // L == (k0 + j)[..., None])))
    return groups


def _suffix_groups(s_c, zb, vb, qstart, qrel, qend, *, T: int, L: int, S: int, cd, ops: Ops = PLAIN):
    """The encoder's mirror of :func:`_prefix_groups`: a query of document block n reads its document's keys from
    (n+2)L on through the code summaries. Only the document holding a row block's last token can (it must go on
    past the block), at one of two cut-offs: each the summary of the cut-off's row block from it merged with the
    document's running summary from the next row block edge (a reverse serial scan that stops where a document
    closes). ``qend``: each position's document end (exclusive) [B, R, L]."""
    B, H, R = vb.shape[:3]
    pos = jnp.arange(R * L, dtype=jnp.int32)
    posb, validb = pos.reshape(R, L), pos.reshape(R, L) < T
    first = code_summary(zb, vb, ((posb < qend[:, :, :1]) & validb)[:, None], S, ops)  # the block's first document
    comes_in = qstart[:, :, 0] < posb[None, :, 0]  # [B, R]: the block's first document opened before the block
    spans = qend[:, :, 0] > posb[None, :, -1]  # [B, R]: and covers the whole block

    def step(nxt, x):  # nxt: the next block's first document's summary from that block on, if it comes in
        mu, n, over, into = x
        keep = over[:, None, None]
        g = merge((jnp.where(keep[..., None], nxt[0], 0.0), jnp.where(keep, nxt[1], 0.0)), (mu, n))
        into = into[:, None, None]
        out = (jnp.where(into[..., None], g[0], 0.0), jnp.where(into, g[1], 0.0))
        return out, out

    empty = (jnp.zeros((B, H, S, vb.shape[-1]), vb.dtype), jnp.zeros((B, H, S), vb.dtype))
    _, runs = jax.lax.scan(step, empty, (jnp.moveaxis(first[0], 2, 0), jnp.moveaxis(first[1], 2, 0), spans.T,
                                         comes_in.T), reverse=True)
    # [B, H, R, ...]: the document open at the end of row block m, from block m + 1 on
    runs = tuple(jnp.concatenate([jnp.moveaxis(x, 0, 2)[:, :, 1:], e[:, :, None]], axis=2) for x, e in zip(runs, empty))
    d1, e1 = qstart[:, :, -1], qend[:, :, -1]  # [B, R]: the block's last document
    k1 = (jnp.maximum(posb[None, :, 0], d1) - d1) // L  # its first query's document block in this row block
    mine = qstart == d1[..., None]
    groups = []
    for j in (0, 1):
        cut = d1 + (k1 + 2 + j) * L  # [B, R]: keys from it to e1 are in the cache
        m = jnp.clip(cut // L, 0, R - 1)
        pm = m[..., None] * L + jnp.arange(L)
        part = code_summary(_take_block(zb, m), _take_block(vb, m),
                            ((pm >= cut[..., None]) & (pm < e1[..., None]) & (pm < T))[:, None], S, ops)
        use = ((e1 > (m + 1) * L) & (cut < e1))[:, None, :, None]
        mu, n = merge((jnp.where(use[..., None], _take_block(runs[0], m), 0.0),
                       jnp.where(use, _take_block(runs[1], m), 0.0)), part)
        reads = (mine & (qrel // L == (k1 + j)[..., None]))[:, None, :, :, None]
        groups.append((s_c + log_count(n)[:, :, :, None, :], reads & (n > 0)[:, :, :, None, :], mu.astype(cd)))
    return groups


def _document_ends(segment_ids):
    """int32 [B, T]: the row position after the last token of each token's document."""
    T = segment_ids.shape[1]
    closes = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones_like(segment_ids[:, :1], bool)], 1)
    return jax.lax.cummin(jnp.where(closes, jnp.arange(1, T + 1, dtype=jnp.int32), T), axis=1, reverse=True)


def encoder_packed(q_u, bd, k_hat, z, v, C, *, L: int, M: int, band: bool, segment_ids, ops: Ops = PLAIN):
    """The bidirectional form (§2.5) of a packed row (``segment_ids`` [B, T]): every document on its own block grid
    (§2.8); with ``band`` requires 1 <= M <= L. A query of document block n attends exactly to its document's
    blocks n-1..n+1, which lie in the row's blocks m-2..m+2 for a query of row block m (a window of 5L keys, with
    the signed band bias ``bd`` [B, H, T, 2M+1] by distance), and to its document's keys before (n-1)L
    (:func:`_prefix_groups`) and from (n+2)L on (:func:`_suffix_groups`) through the code summaries. Without
    ``band`` (Thm 3.5) the same split with no bias and the window's keys under sg(k_hat) (every key is read
    through the code summaries there: the window is their exact equal). Returns o [B, H, T, Dv]."""
    if band and not 1 <= M <= L:
        raise ValueError(f"encoder band needs 1 <= M <= L, got M={M}, L={L}")
    B, H, T, _ = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)
    cd = compute_dtype(q_u, v)
    R = -(-T // L)
    Tp = R * L
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), mode="edge")
    start, end = document_starts(seg), _document_ends(seg)  # the padding joins the last document
    valid = jnp.arange(Tp) < T
    rel = jnp.arange(Tp, dtype=jnp.int32) - start
    qb = _blocked(pad_to(q_u.astype(cd), 2, Tp), 2, R, L)
    kx = k_hat.astype(cd) if band else sg(k_hat.astype(cd))
    kw, vw = (_span(pad_to(x, 2, Tp), 2, R, L, 0) for x in (kx, v.astype(cd)))  # [B, H, R, 5L, .]
    qstart, qrel, qend = (_blocked(x, 1, R, L) for x in (start, rel, end))  # [B, R, L]
    kblock = _span(rel // L, 1, R, L, -3)  # [B, R, 5L]: document block of each window key (-3: before the row)
    mask_w = ((_span(start, 1, R, L, -1)[:, :, None, :] == qstart[..., None])
              & _span(valid, 0, R, L, False)[None, :, None, :]
              & (jnp.abs(kblock[:, :, None, :] - (qrel // L)[..., None]) <= 1))[:, None]  # [B, 1, R, L, 5L]
    s_w = ops.qk_dot(qb, kw)
    if band:  # bias[l, c] = bd[l, 2L + M + l - c]: query mL + l, key (m-2)L + c, signed distance 2L + l - c
        s_w = s_w + skew_bias(_blocked(pad_to(bd.astype(dt), 2, Tp), 2, R, L), 2 * L + M, 5 * L)
    zb, vb = _blocked(pad_to(z, 2, Tp), 2, R, L), _blocked(pad_to(v.astype(dt), 2, Tp), 2, R, L)
    s_c = acc_einsum("bhrld,hsd->bhrls", qb, sg(C).astype(cd))
    kw_ = dict(T=T, L=L, S=S, cd=cd, ops=ops)
    groups = _prefix_groups(s_c, zb, vb, qstart, qrel, **kw_) + _suffix_groups(s_c, zb, vb, qstart, qrel, qend, **kw_)
    o, _ = softmax_mix(groups + [(s_w, mask_w, vw)], ops)
    return o.reshape(B, H, Tp, -1)[:, :, :T]


def _span(x, axis: int, R: int, L: int, fill):
    """[.., R*L, ..] -> [.., R, 5L, ..]: for query block m the row blocks m-2..m+2 (``fill`` outside the row)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (2 * L, 2 * L)
    xb = _blocked(jnp.pad(x, widths, constant_values=fill), axis, R + 4, L)
    return jnp.concatenate([jax.lax.slice_in_dim(xb, i, i + R, axis=axis) for i in range(5)], axis=axis + 1)


def carried_groups(qb, s_c, bd0, state, seen, continues, *, M: int, cd, ops: Ops = PLAIN):
    """The carried document's two softmax groups for the packed block-parallel form's queries ``qb`` [B, H, R, L,
    Dk] (``s_c`` their code scores [B, H, R, L, S]): its cache (logit plus log count, value the mean) and its band's
    M keys (valid slots: the last ``min(seen, M)``), both seen only by the queries that continue it (``continues``
    [B, R, L], the call's leading run, so row block 0 is their document block 0 and the band bias
    ``bd0 = bd[:, :, :L]`` reaches that block only: the distance i + M - slot is at most M for i < M <= L). The band
    is the previous document block of block 0's queries (exact), and in the cache of the later ones, whose logits
    take sg(band) (§2.7)."""
    B, H, R, L = qb.shape[:4]
    on = continues[:, None, :, :, None]  # [B, 1, R, L, 1]
    mu = jnp.broadcast_to(state["agg_mu"][:, :, None].astype(cd), (B, H, R) + state["agg_mu"].shape[2:])
    cache = (s_c + log_count(state["agg_n"])[:, :, None, None, :], on & (state["agg_n"] > 0)[:, :, None, None, :], mu)
    bk = state["band_k"].astype(cd)[:, :, None]  # [B, H, 1, M, Dk]
    s_b = ops.qk_dot(qb[:, :, :1], bk) + skew_bias(bd0, M, M)[:, :, None]  # bias[i, j] = bd[i, M + i - j]
    if R > 1:
        s_b = jnp.concatenate([s_b, ops.qk_dot(qb[:, :, 1:], jnp.broadcast_to(sg(bk), (B, H, R - 1) + bk.shape[3:]))],
                              axis=2)
    valid = (seen[:, None] - M + jnp.arange(M)[None, :] >= 0)[:, None, None, None, :]  # [B, 1, 1, 1, M]
    bv = jnp.broadcast_to(state["band_v"][:, :, None].astype(cd), (B, H, R) + state["band_v"].shape[2:])
    return [cache, (s_b, on & valid, bv)]


def kernel_packed(z, v, state, seen, continues, *, L: int, M: int, S: int, segment_ids, ops: Ops = PLAIN) -> dict:
    """What the kernel (``pallas_kernels.vq_cache_gpu``, its ``packed`` argument) takes for a causal packed row
    (§2.8, §9): the row's own block grid with every attention masked to the query's document, and per row block n
    one cache, that of the document holding the block's first token over its keys before row block n-1 (lag 2 on
    the row's grid; :func:`_open_runs`, the packed forms' running summaries), merged after the carried document's
    cache (and, from row block 1 on, its band) where that document continues. A query attends exactly to its
    document's keys of the row blocks n-1 and n: forward, the same as its own grid's split into window and cache
    (a key's logit ``q·k̂`` equals its code's ``q·C``; the band bias reaches distances up to M <= L only, inside
    both windows), so only the keys' gradients differ: the kernel gives ``dk̂`` only for the keys of the query's
    own window (from ``qwin`` on, row blocks n-2..n) and takes none from the others.

    ``state``: the forms' layout (the carried document's band and cache), ``seen`` [B] its length so far,
    ``continues`` [B, T] the tokens that continue it. Returns ``cmu`` [B, H, R, S, Dv] and ``cn`` [B, H, R, S]
    (each row block's cache, the statistics' dtype), per query [B, R·L] int32 ``qdoc`` (its document's start),
    ``qwin`` (its window's start, in the kernel's extended positions: the carried band is extended block 0) and
    ``qcache`` (1: it reads its block's cache), and per extended key [B, (R+1)·L] int32 ``kdoc`` (its document's
    start; -1: no query's, a padding key or a band slot the call does not continue)."""
    B, H, T, _ = v.shape
    dt = float_dtype(v)
    st = cast_state(state, dt)
    R, Tp, start, valid, rel = _row_grid(segment_ids, L)
    qstart = _blocked(start, 1, R, L)
    zb, vb = _blocked(pad_to(z, 2, Tp), 2, R, L), _blocked(pad_to(v.astype(dt), 2, Tp), 2, R, L)
    runs = _open_runs(zb, vb, qstart, T=T, L=L, S=S, ops=ops)
    d0 = qstart[:, :, 0]  # [B, R]: the document of each row block's first token
    use = (d0 < (jnp.arange(R) - 1) * L)[:, None, :, None]  # it has keys before row block n-1
    row = tuple(jnp.where(use[..., None] if x.ndim == 5 else use, pad_left(x[:, :, :-1], 2, R), 0.0) for x in runs)
    first = continues[:, 0]  # [B]: the row opens with the carried document
    slot_ok = first[:, None] & (seen[:, None] - M + jnp.arange(M)[None, :] >= 0)  # [B, M]: its band's valid slots
    late = merge((st["agg_mu"], st["agg_n"]), code_summary(st["band_z"], st["band_v"], slot_ok[:, None], S, ops))
    block0 = (jnp.arange(R) == 0)[:, None]  # row block 0 reads the band exactly (its previous block), not cached
    carried = (jnp.where(block0[..., None], st["agg_mu"][:, :, None], late[0][:, :, None]),
               jnp.where(block0, st["agg_n"][:, :, None], late[1][:, :, None]))
    on = (first[:, None] & (d0 == 0))[:, None, :, None]  # [B, 1, R, 1]
    cmu, cn = merge((jnp.where(on[..., None], carried[0], 0.0), jnp.where(on, carried[1], 0.0)), row)
    kband = jnp.where(pad_left(slot_ok, 1, L, False), 0, -1)  # [B, L]: the carried document starts at 0
    return {"cmu": cmu, "cn": cn, "qdoc": start, "qwin": start + (rel // L) * L,
            "qcache": (start == jnp.repeat(d0, L, axis=1)).astype(jnp.int32),
            "kdoc": jnp.concatenate([kband, jnp.where(valid[None], start, -1)], axis=1).astype(jnp.int32)}


def kernel_documents(seen, continues, *, L: int, M: int, segment_ids) -> dict:
    """What the TPU form of the kernel (``pallas_kernels.vq_cache``, its ``packed`` argument) takes for a causal
    packed row (§2.8, §9): the document arrays that let it restart its folded cache at documents, on the row's own
    block grid as :func:`kernel_packed` (the same split into window and cache, the same caches), without forming
    the caches in XLA. The kernel's running cache after its fold of extended block ``e`` (the carried band is
    extended block 0, row block m is extended block m + 1) is the summary of the document open at the end of that
    block over its keys up to there (:func:`_open_runs`' runs, the carried document's cache and band merged first
    where the row opens with it); query block n reads it (lag 2) where its first token's document began before row
    block n-1 (or is the carried one), and only that document's queries read it.

    ``seen`` [B]: the carried document's length so far; ``continues`` [B, T]: the tokens that continue it. Returns
    ``qdocs`` int32 [B, R·L, 3] (per query: its document's start, 1 where it reads its block's cache, its window's
    start in extended positions as ``kernel_packed``'s ``qwin``), ``kdocs`` int32 [B, R+1, 3, L] (per extended key:
    its document's start or -1 (a padding key, a band slot the call does not continue); 1 where the fold of its
    block takes it (a valid key of the block's last document); 1 on every lane of a block whose fold continues the
    running cache, 0 where it restarts it) and ``first`` bool [B] (the row opens with the carried document: the
    kernel starts from the carried cache)."""
    B = segment_ids.shape[0]
    R, Tp, start, valid, rel = _row_grid(segment_ids, L)
    first = continues[:, 0]
    slot_ok = pad_left(first[:, None] & (seen[:, None] - M + jnp.arange(M)[None, :] >= 0), 1, L, False)  # [B, L]
    sb = start.reshape(B, R, L)
    edge = jnp.arange(R, dtype=jnp.int32) * L  # [R]: each row block's first position
    last, d0 = sb[:, :, -1], sb[:, :, 0]  # [B, R]: each row block's last and first tokens' documents
    carried = lambda d: first[:, None] & (d == 0)  # noqa: E731 -- the carried document (it starts at 0)
    kdoc = jnp.concatenate([jnp.where(slot_ok, 0, -1), jnp.where(valid[None], start, -1)], axis=1)
    fold = jnp.concatenate([slot_ok, (valid.reshape(R, L)[None] & (sb == last[..., None])).reshape(B, Tp)], axis=1)
    keep = jnp.concatenate([first[:, None], (last < edge) | carried(last)], axis=1)  # [B, R+1]
    use = (d0 < edge - L) | carried(d0)  # [B, R]: the block's first document has keys before row block n-1
    reads = use[..., None] & (sb == d0[..., None])
    qdocs = jnp.stack([start, reads.reshape(B, Tp), start + (rel // L) * L], axis=-1).astype(jnp.int32)
    kdocs = jnp.stack([kdoc.reshape(B, R + 1, L), fold.reshape(B, R + 1, L),
                       jnp.broadcast_to(keep[..., None], (B, R + 1, L))], axis=2).astype(jnp.int32)
    return {"qdocs": qdocs, "kdocs": kdocs, "first": first}


def causal_packed_blocks(q_u, q_v, r, k_hat, z, v, C, *, L: int, M: int, segment_ids, ops: Ops = PLAIN, state=None,
                         seen=None, continues=None):
    """:func:`causal_packed` one row block of queries at a time (the tiled form of a packed row, §2.8): a
    ``lax.map`` over the row blocks whose step is rematerialized (``jax.checkpoint``), so autodiff keeps only each
    step's inputs and the backward recomputes one block's scores at a time, as the unpacked tiled form's recomputing
    backward does. A step forms its own band scores (q + v')·r'ᵀ [L, M+1] (no [T, M+1] band tensor), its window
    scores [L, 3L], its two cache groups' code scores [L, S] (the caches themselves, :func:`_prefix_caches`, are
    [R, S, Dv] summaries, as the unpacked form's) and, with a carried state, the carried cache and band
    (:func:`_carried_block`). Same arguments as :func:`causal_packed` with q_v [B, H, T, Dk] and r [M+1, H, Dk] for
    the band scores; requires 1 <= M <= L. Returns o [B, H, T, Dv]."""
    if not 1 <= M <= L:
        raise ValueError(f"causal_packed_blocks needs 1 <= M <= L, got M={M}, L={L}")
    B, H, T, _ = q_u.shape
    S = C.shape[1]
    dt = float_dtype(q_u, v)
    cd = jnp.dtype(v.dtype)
    R, Tp, start, valid, rel = _row_grid(segment_ids, L)
    qstart, qrel = _blocked(start, 1, R, L), _blocked(rel, 1, R, L)  # [B, R, L]
    zb, vb = _blocked(pad_to(z, 2, Tp), 2, R, L), _blocked(pad_to(v.astype(dt), 2, Tp), 2, R, L)
    caches = _prefix_caches(zb, vb, qstart, qrel, T=T, L=L, S=S, ops=ops)
    on = jnp.zeros((B, R, L), bool) if state is None else _blocked(pad_to(continues, 1, Tp), 1, R, L)
    st = None if state is None else cast_state(state, dt)
    steps = lambda x, axis: jnp.moveaxis(x, axis, 0)  # noqa: E731 -- the row blocks first, as lax.map takes them
    xs = (tuple(steps(_blocked(pad_to(x, 2, Tp), 2, R, L), 2) for x in (q_u.astype(cd), q_v))
          + tuple(steps(_windows(pad_to(x.astype(cd), 2, Tp), 2, R, L, 0), 2) for x in (k_hat, v))
          + (steps(qstart, 1), steps(qrel, 1), steps(_windows(start, 1, R, L, -1), 1), _windows(valid, 0, R, L, False),
             tuple((steps(mu, 2), steps(n, 2), steps(reads, 1)) for mu, n, reads in caches), steps(on, 1),
             jnp.arange(R)))
    Cs = sg(C).astype(cd)
    dist = 2 * L + jnp.arange(L)[:, None] - jnp.arange(3 * L)[None, :]  # [L, 3L]: query minus key position

    @jax.checkpoint  # its closed-over values passed in: a rematerialized step takes them as arguments
    def block(consts, x):
        r, Cs, st, seen = consts
        q, qv, kw, vw, qs, qr, ws, wv, cs, on_i, i = x
        bdt = band_scores(qv, r).astype(dt)  # [B, H, L, M+1]
        mask_w = ((ws[:, None, :] == qs[..., None]) & wv[None, None, :] & (dist >= 0)
                  & (dist <= qr[..., None] % L + L))[:, None]  # [B, 1, L, 3L]
        s_w = ops.qk_dot(q, kw) + skew_bias(bdt, 2 * L, 3 * L)
        s_c = acc_einsum("bhld,hsd->bhls", q, Cs)
        groups = [(s_c + log_count(n)[:, :, None, :], reads[:, None, :, None] & (n > 0)[:, :, None, :], mu.astype(cd))
                  for mu, n, reads in cs]
        if st is not None:
            groups += _carried_block(q, s_c, bdt, st, seen, on_i, i == 0, M=M, cd=cd, ops=ops)
        return softmax_mix(groups + [(s_w, mask_w, vw)], ops)[0]

    o = jax.lax.map(functools.partial(block, (r, Cs, st, seen)), xs)  # [R, B, H, L, Dv]
    return jnp.moveaxis(o, 0, 2).reshape(B, H, Tp, -1)[:, :, :T]


def _carried_block(q, s_c, bdt, state, seen, on, first, *, M: int, cd, ops: Ops = PLAIN):
    """:func:`carried_groups` for one row block of queries ``q`` [B, H, L, Dk] (``s_c`` their code scores, ``bdt``
    their band scores [B, H, L, M+1], ``on`` [B, L] those that continue the carried document, ``first``: the row
    block is the call's first, where the band is exact with its bias; later ones read it under sg(band))."""
    on = on[:, None, :, None]  # [B, 1, L, 1]
    cache = (s_c + log_count(state["agg_n"])[:, :, None, :], on & (state["agg_n"] > 0)[:, :, None, :],
             state["agg_mu"].astype(cd))
    bk = state["band_k"].astype(cd)
    s_b = ops.qk_dot(q, jnp.where(first, bk, sg(bk))) + jnp.where(first, skew_bias(bdt, M, M), 0.0)
    valid = (seen[:, None] - M + jnp.arange(M)[None, :] >= 0)[:, None, None, :]  # [B, 1, 1, M]
    return [cache, (s_b, on & valid, state["band_v"].astype(cd))]


def causal_packed_short(q_u, bd, k_hat, v, C, state, seen, continues, *, L: int, M: int, segment_ids,
                        ops: Ops = PLAIN):
    """The streaming form's packed row (§2.8) in one quadratic pass over the call (decoding calls are short; any
    band M): a query attends to the carried cache (the queries that continue the carried document, ``continues``
    [B, T]), to the carried band (the same queries; valid slots the last ``min(seen, M)``) and to its document's
    keys of the call, each with the band bias by distance; a key the streaming form would have folded into the
    cache (older than the band before the query's chunk of L, counted from the document's first token: §2.7) takes
    sg(k_hat). ``state``: the forms' layout. Returns o [B, H, T, Dv]."""
    T = q_u.shape[2]
    dt = float_dtype(q_u, v)
    cd = compute_dtype(q_u, v)
    st = cast_state(state, dt)
    q = q_u.astype(cd)
    K = jnp.concatenate([st["band_k"].astype(cd), k_hat.astype(cd)], axis=2)  # [B, H, M + T, Dk]
    V = jnp.concatenate([st["band_v"].astype(cd), v.astype(cd)], axis=2)
    start = document_starts(segment_ids.astype(jnp.int32))
    rel = jnp.arange(T, dtype=jnp.int32) - start  # [B, T]
    B = start.shape[0]
    kstart = jnp.pad(start, ((0, 0), (M, 0)))  # [B, M + T]; the band's slots are masked by band_ok below
    krel = jnp.concatenate([jnp.broadcast_to(jnp.arange(-M, 0, dtype=jnp.int32), (B, M)), rel], axis=1)
    ki = jnp.arange(M + T)[None, None, :] - M  # [1, 1, M + T]: key row position
    i = jnp.arange(T)[None, :, None]
    band_ok = continues[:, :, None] & (seen[:, None, None] + ki >= 0)  # [B, T, M + T] for the band slots
    mine = (kstart[:, None, :] == start[:, :, None]) & (ki <= i)
    visible = jnp.where(ki < 0, band_ok, mine)[:, None]  # [B, 1, T, M + T]
    far = (krel[:, None, :] < (rel[:, :, None] // L) * L - M)[:, None]
    s = jnp.where(far, ops.qk_dot(q, sg(K)), ops.qk_dot(q, K)) + skew_bias(bd.astype(dt), M, M + T)
    s_c = ops.qk_dot(q, jnp.broadcast_to(sg(C).astype(cd)[None], (q.shape[0],) + C.shape))
    s_c = s_c + log_count(st["agg_n"])[:, :, None, :]
    seen_c = continues[:, None, :, None] & (st["agg_n"] > 0)[:, :, None, :]
    o, _ = softmax_mix([(s_c, seen_c, st["agg_mu"].astype(cd)), (s, visible, V)], ops)
    return o


# ----------------------------------------------------------------------------- running a form
def attend(form: str, core, pre, v, C, state, *, settings: dict, ops: Ops = PLAIN, tiles: TileOps = PLAIN_TILES,
           quantize: Callable = stvq, segment_ids=None):
    """One call of ``core`` (its L, M and hyperparameters) by ``form``: 'parallel' | 'blocks' | 'stream' | 'encoder'.
    ``pre``: the core's prepared q_u, q_v, r and normalized keys; ``settings``: the running implementation's settings
    as they run on the platform (its runner's fields: ``search_chunk``; ``keep_budget`` for the tiled form,
    ``reduction`` for the one-shot block-parallel form); ``segment_ids``: a packed row (:func:`attend_packed`).
    Returns (o, new_state, (z, err2, c_z))."""
    k_hat, z, err2, c_z = quantize(pre["k"], C, chunk=settings["search_chunk"])
    L, M = core.L, core.M
    bd = lambda: band_scores(pre["q_v"], pre["r"])  # noqa: E731 -- [B,H,T,n]: formed only where needed
    if segment_ids is not None:
        o, new = attend_packed(form, core, pre, k_hat, z, v, C, state, ops=ops, segment_ids=segment_ids)
        return o, new, (z, err2, c_z)
    if form == "encoder":
        o = encoder_parallel(pre["q_u"], bd(), k_hat, z, v, C, L=L, M=M, band=core.cfg.encoder_band, ops=ops)
        return o, None, (z, err2, c_z)
    if form == "blocks":
        o, new = causal_blocks(pre["q_u"], pre["q_v"], pre["r"], k_hat, z, v, C, state, L=L, M=M,
                               keep_budget=settings["keep_budget"], ops=ops, tiles=tiles)
    elif form == "parallel":
        o, new = causal_parallel(pre["q_u"], bd(), k_hat, z, v, C, state, L=L, M=M, reduction=settings["reduction"],
                                 compute=v.dtype, ops=ops)
    elif form == "stream":  # chunks of a block, or the whole call when shorter (the same result)
        o, new = causal_stream(pre["q_u"], bd(), k_hat, z, v, C, state, L=min(L, v.shape[2]), M=M, ops=ops)
    else:
        raise ValueError(f"unknown form {form!r}")
    return o, new, (z, err2, c_z)


def attend_packed(form: str, core, pre, k_hat, z, v, C, state, *, segment_ids, ops: Ops = PLAIN):
    """A packed row (§2.8) by ``form`` (quantized keys ``k_hat``, codes ``z``): 'parallel' by
    :func:`causal_packed`, 'blocks' by :func:`causal_packed_blocks`, 'stream' by :func:`causal_packed_short`, each from and to the carried state (``state``
    without the core's document counters, whose ``seen`` and ``continues`` the core's ``prepare`` puts in ``pre``),
    'encoder' by :func:`encoder_packed`. Returns (o, the state of the call's last document with its ``seen``:
    ``state.packed_final_state``; None for the encoder)."""
    L, M = core.L, core.M
    bd = lambda: band_scores(pre["q_v"], pre["r"])  # noqa: E731 -- [B,H,T,n]: not by the tiled form
    carried = dict(state=state, seen=pre["seen"], continues=pre["continues"])
    if form == "parallel":
        o = causal_packed(pre["q_u"], bd(), k_hat, z, v, C, L=L, M=M, segment_ids=segment_ids, compute=v.dtype,
                          ops=ops, **carried)
    elif form == "blocks":
        o = causal_packed_blocks(pre["q_u"], pre["q_v"], pre["r"], k_hat, z, v, C, L=L, M=M,
                                 segment_ids=segment_ids, ops=ops, **carried)
    elif form == "stream":
        o = causal_packed_short(pre["q_u"], bd(), k_hat, v, C, L=L, M=M, segment_ids=segment_ids, ops=ops,
                                **carried)
    elif form == "encoder":
        return encoder_packed(pre["q_u"], bd(), k_hat, z, v, C, L=L, M=M, band=core.cfg.encoder_band,
                              segment_ids=segment_ids, ops=ops), None
    else:
        raise ValueError(f"a packed row runs the 'parallel', 'blocks', 'stream' or 'encoder' form, not {form!r}")
    dt = float_dtype(pre["q_u"], v)
    return o, packed_final_state(cast_state(state, dt), pre["seen"], pre["continues"], k_hat.astype(dt), z,
                                 v.astype(dt), segment_ids, M=M, S=C.shape[1], ops=ops)


def result(o, new_state, codes, *, code_sums: Callable = PLAIN.code_sums) -> dispatch.Result:
    """An implementation's :class:`dispatch.Result`: the output, the new state (None: a bidirectional or packed call)
    and in ``extras`` what the layer's ``finish`` needs: the codes ``z``, the squared quantization errors ``err2``,
    the codewords ``c_z`` (``codes``, as :func:`attend` returns them) and ``code_sums``, the running
    implementation's per-code sums of the EMA statistics (``vq_cache_ref.code_sums``' signature)."""
    z, err2, c_z = codes
    return dispatch.Result(o, new_state, {"z": z, "err2": err2, "c_z": c_z, "code_sums": code_sums})


@dataclasses.dataclass(frozen=True)
class Form(dispatch.Runner):
    """A portable form as an implementation: the layer's inputs (``TransformerVQAttention.prepare``) by
    :func:`attend` with the form :attr:`FORM`, the runner's fields as the settings it reads."""

    FORM: ClassVar[str] = ""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        o, new, codes = attend(self.FORM, core, x, x["v"], x["C"], call.state, settings=dataclasses.asdict(self),
                               segment_ids=x["segment_ids"])
        return result(o, new, codes)


@dataclasses.dataclass(frozen=True)
class Parallel(Form):
    """``parallel``: the one-shot block-parallel form with its ``reduction``; a packed row by :func:`causal_packed`."""

    FORM = "parallel"
    search_chunk: int
    reduction: str


@dataclasses.dataclass(frozen=True)
class Blocks(Form):
    """``blocks``: the tiled form (its ``tiled_min_scores`` is read by 'auto''s preference, :func:`preferred_form`)."""

    FORM = "blocks"
    search_chunk: int
    keep_budget: int
    tiled_min_scores: int


@dataclasses.dataclass(frozen=True)
class Stream(Form):
    """``stream``: block by block, as decoding runs."""

    FORM = "stream"
    search_chunk: int


@dataclasses.dataclass(frozen=True)
class Encoder(Form):
    """``encoder``: the bidirectional form."""

    FORM = "encoder"
    search_chunk: int


code_sums = PLAIN.code_sums  # the per-code sums of the EMA statistics (the layer's vq_stats)


# ----------------------------------------------------------------------------- the declarations
def band_reasons(platform, *, L: int, M: int, **_) -> list[str]:
    """What the block-parallel forms refuse: a band longer than a block."""
    return [] if M <= L else [f"the block-parallel form needs mem_len <= block_len (got M={M} > L={L})"]


def parallel_reasons(platform, **shapes) -> list[str]:
    """What the one-shot block-parallel form refuses: a band longer than a block."""
    return band_reasons(platform, **shapes)


def blocks_reasons(platform, *, L: int, M: int, reduction: str = "serial", segments: bool = False, **_) -> list[str]:
    """What the tiled form refuses: a band longer than a block, a reduction but the serial one (an unpacked call:
    a packed row's cache scan is serial whatever the reduction, :func:`causal_packed_blocks`)."""
    extra = [] if reduction == "serial" or segments else [
        f"reduction={reduction!r} (the tiled form computes the serial one)"]
    return band_reasons(platform, L=L, M=M) + extra


def is_form(name: str):
    """``prefer``: 'auto' tries the form ``name`` for the calls :func:`preferred_form` gives it."""
    def prefer(platform, **shapes) -> bool:
        return preferred_form(platform, **shapes) == name
    return prefer


def prefer_stream(platform, *, segments: bool = False, T: int = 0, L: int = 1, **shapes) -> bool:
    """'auto' tries the streaming form on a GPU / TPU for the calls :func:`preferred_form` gives it; a packed row
    (on a CPU too, where XLA:CPU's forms refuse them) only where it is shorter than a block (decoding: its packed
    form is quadratic in the call, :func:`causal_packed_short`)."""
    if segments:
        return T < L
    return platform != "cpu" and preferred_form(platform, T=T, L=L, **shapes) == "stream"


def prefer_parallel(platform, *, segments: bool = False, T: int = 0, L: int = 1, **shapes) -> bool:
    """'auto' tries the one-shot form on a GPU / TPU for the calls :func:`preferred_form` gives it, and for a packed
    row of a block or more the tiled form is not given (on a CPU every one: XLA:CPU's forms take them first, and
    refuse a band longer than a block as this form does)."""
    if segments:
        return T >= L and (platform == "cpu" or not prefer_blocks(platform, segments=True, T=T, L=L, **shapes))
    return platform != "cpu" and preferred_form(platform, T=T, L=L, **shapes) == "parallel"


def prefer_blocks(platform, **shapes) -> bool:
    """'auto' tries the tiled form for the calls :func:`preferred_form` gives it, a packed row too (its cache scan is
    serial whatever the ``reduction``: :func:`causal_packed_blocks`)."""
    if shapes.get("segments"):
        shapes = {**shapes, "reduction": "serial"}
    return preferred_form(platform, **shapes) == "blocks"


# Per-platform defaults of the execution knobs these forms read (a knob left at dispatch.PLATFORM_DEFAULT takes the
# value for the platform the call runs on). The CPU values are the ones the XLA:CPU forms were tuned with; the
# accelerator values are reasoned, not yet measured on a GPU or TPU.
SEARCH_CHUNK = {
    # keys per step of the nearest-code search (stvq: a serial lax.map, a [B, H, chunk, S] distance tile per step)
    "cpu": 512,
    # an accelerator runs a 512-key step's matmul far below the step's fixed cost (a loop iteration, its launches):
    # 2048 keys a step is a quarter of the steps at 256 MiB of float32 distances per step at B·H = 64, S = 512
    # (not yet measured on a GPU)
    "cuda": 2048, "rocm": 2048, "tpu": 2048,
}
DEFAULTS = {
    "search_chunk": SEARCH_CHUNK,
    # the tiled form keeps its attention weights (float32, B*H*T*(S+2L) entries per call) for the backward up to
    # this many; -1: always recompute. cpu: 2^26 (256 MiB per call) keeps the attention bench's 8k call (4 heads,
    # L = S = 512; 50M entries). On a GPU / TPU reading a kept weight back (4 bytes of HBM traffic) costs more than
    # recomputing it (a Dk-long product on the tensor cores and one exp), so they recompute (not yet measured on
    # a GPU)
    "keep_budget": {"cpu": 1 << 26, "cuda": -1, "rocm": -1, "tpu": -1},
    # the size rule (form_for) takes the tiled form for calls with at least this many scores B*H*T*(S+2L) (1: every
    # call of at least a block). cpu: 2^23 (32 MB in float32): below it the one-shot form is as fast or faster (configs/main_transformer_vq.py,
    # batch 8, L = S = 64, windows of 256, trains about a sixth slower through the tiles), above it autodiff's
    # [T, S+2L] residuals make it memory-bound. GPU / TPU: 2^26 (256 MiB per float32 score tensor, about 1 GiB of
    # autodiff residuals per layer call): the one-shot form is a few large batched products, while each tile of the
    # tiled form's scan is a loop step with its own launches, so the accelerators stay one-shot longer (not yet
    # measured on a GPU)
    "tiled_min_scores": {"cpu": 1 << 23, "cuda": 1 << 26, "rocm": 1 << 26, "tpu": 1 << 26},
}

# The ``reduction`` execution setting: the cross-block scan of the one-shot block-parallel form, read by ``parallel``
# (and by the XLA:CPU implementation's one-shot form): 'serial' (a scan over the blocks), 'matmul' (one triangular
# product over the blocks), 'assoc' (jax.lax.associative_scan); the same result to rounding. The tiled form and the
# kernel compute the serial one and refuse the others (their reasons, and one line at config validation). Not a
# per-platform knob: the config's value runs as written everywhere (this entry declares who reads it).
REDUCTIONS = ("serial", "matmul", "assoc")
REDUCTION = {"default": "serial"}

# 'auto' on a GPU / TPU: the kernel first where it prefers the call (pallas.py, rank 0), then the call's form
_AUTO = {"cuda": 1, "rocm": 1, "tpu": 1}
_SEARCH = {"search_chunk": SEARCH_CHUNK}
IMPLEMENTATIONS = (
    # the block-parallel form (the kernel's reference) under autodiff, with the reduction it is given
    # (and a packed row, causal_packed: 'auto' on a CPU too, before the quadratic reference)
    Implementation("parallel", reasons=parallel_reasons, config={"impl": "parallel"}, auto={**_AUTO, "cpu": 98},
                   prefer=prefer_parallel, code=Parallel, directions=("causal",),
                   defaults={**_SEARCH, "reduction": REDUCTION}),
    # its tiled form with a recomputing backward ('auto' on a GPU / TPU reads its tiled_min_scores)
    Implementation("blocks", reasons=blocks_reasons, config={"impl": "blocks", "reduction": "serial"}, auto=_AUTO,
                   prefer=prefer_blocks, code=Blocks, directions=("causal",), defaults=DEFAULTS),
    # block by block, as decoding runs (any band)
    # (and a packed row shorter than a block: decoding, on a CPU too)
    Implementation("stream", config={"impl": "stream"}, auto={**_AUTO, "cpu": 97}, prefer=prefer_stream, code=Stream, directions=("causal",), defaults=_SEARCH),
    # the bidirectional form (§2.5)
    Implementation("encoder", config={"impl": "encoder"}, auto=_AUTO, code=Encoder,
                   directions=("bidirectional",), defaults=_SEARCH),
)


def _by_name() -> dict:
    return dispatch.by_name(IMPLEMENTATIONS)

__all__ = ["DEFAULTS", "IMPLEMENTATIONS", "PLAIN_TILES", "REDUCTION", "REDUCTIONS", "SEARCH", "SEARCH_CHUNK",
           "Blocks", "Encoder", "Form", "Parallel", "Stream", "TileOps", "attend", "attend_packed", "band_reasons", "carried_groups", "causal_packed_short", "band_scores", "blocks_reasons", "causal_blocks",
           "causal_packed", "causal_packed_blocks", "causal_parallel", "causal_stream", "code_sums", "encoder_packed", "encoder_parallel", "form_for", "gather_codes", "is_form",
           "kernel_packed", "nearest", "parallel_reasons", "prefer_blocks", "prefer_parallel", "prefer_stream", "preferred_form", "result",
           "stvq"]

"""EVA: efficient attention via control variates (Zheng et al., ICLR 2023; arXiv 2302.04542).

Method notes: ``docs/methods/eva.md`` (the section numbers (§) below are its sections). Each query ``n`` sees

* a local block ``E_n`` (exact softmax terms, T5 relative-position bias), and
* ``C`` contiguous chunks ``P_c`` summarized by a representative key
  ``k̂_c = LN(Linear(mean_{P_c} k))`` (chunk logit ``s q_n·k̂_c``) and a
  query-independent control-variate coefficient ``β_c`` = a one-sample RFA over
  the chunk (Phase A, §2.3),

combined by one log-sum-exp normalised softmax over ``[local logits ; chunk
logits]`` (eq. 16, Phase B, §2.4).

Pure functions do the math; :class:`EVAAttention` only owns the parameters and
the decoding state. Both the full forward and the streaming/decoding path call
the same tile function :func:`attend_tile` with explicit absolute positions, so
every mask (local window, causal, chunk visibility ``c < ⌊n/P⌋``, ``disjoint``
partition) and the relative-position bias are functions of positions only; that
is what makes "streamed in any split == one full pass" hold.

Randomness: ``key`` -> ``noise_key, drop_key = jax.random.split(key)``; chunk
``c`` (absolute index) draws ``normal(fold_in(noise_key, c), (B, H, d))``
(§4.4 / §9.4), in the full forward and when a chunk is finished during
streaming alike.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from longctx.attention import dispatch
from longctx.attention.base import (
    AttentionCore,
    ContractCase,
    DropIn,
    KernelBench,
    axes,
    check_capacity,
    check_qkv,
    require,
)
from longctx.xla_cpu import materialized, rowdot, rows_dot, scale_rows, transposed
from pallas_kernels import eva_attend, eva_attend_ref, eva_chunks

# Phase A (chunk statistics, §2.3) and the static options live beside the Pallas kernel that must match
# them (pallas_kernels/eva_chunks_ref.py, DESIGN.md section 3); this file imports them: one copy of the math.
from pallas_kernels.eva_chunks_ref import (  # noqa: F401  (re-exported names)
    HIGHEST,
    LN_EPS,
    NEG,
    EVAOptions,
    chunk_beta,
    chunk_summaries,
    layer_norm,
    representatives,
    rf_log_feature,
)


def geometry(opts: EVAOptions, L: int, chunk_size: int, num_chunks: int):
    """(L_pad, P, C, query tile size) for a full pass over L tokens (§2.1)."""
    W = opts.W
    if num_chunks > 0 and not opts.causal:
        mult = W if W > 0 else num_chunks
        L_pad = -(-L // mult) * mult
        P = L_pad // num_chunks
    else:
        P = chunk_size
        mult = W if W > 0 else P
        L_pad = -(-L // mult) * mult
    C = L_pad // P
    tile = W if W > 0 else P
    return L_pad, P, C, tile


# ---------------------------------------------------------------------------
# relative position bias (§2.6)
# ---------------------------------------------------------------------------


def rpe_num_buckets(W: int, e: int) -> int:
    return int(min(max((W + e) // 2, 16), 64))


def t5_bucket(delta, num_buckets: int, max_distance: int, causal: bool):
    """T5 bucket of ``delta = key_pos - query_pos`` (int array). A numpy ``delta`` gives numpy buckets, computed
    while tracing (a constant of the compiled program; computed in XLA they were a measurable share of a layer's step)."""
    xp = np if isinstance(delta, np.ndarray) else jnp
    delta = delta.astype(xp.int32)
    if causal:
        n, offset, t = num_buckets, 0, xp.maximum(-delta, 0)
    else:
        n = num_buckets // 2
        offset = xp.where(delta > 0, n, 0)
        t = xp.abs(delta)
    me = max(n // 2, 1)
    denom = max(math.log(max_distance / me), 1e-6)
    tf = xp.maximum(t, me).astype(xp.float32)
    large = me + xp.floor(xp.log(tf / me) / xp.float32(denom) * (n - me)).astype(xp.int32)
    large = xp.minimum(large, n - 1)
    return xp.where(t < me, t, large) + offset


def rpe_bias(table, q_pos, k_pos, opts: EVAOptions, scale: float):
    """[Hb, Tq, Tk] bias ``s * θ[bucket(k_pos - q_pos)]``; Hb = 1 (causal, shared) or H. Numpy positions: the
    buckets are constants (:func:`t5_bucket`)."""
    b = t5_bucket(k_pos[None, :] - q_pos[:, None], opts.rpe_buckets, opts.rpe_max_distance, opts.causal)
    if table.ndim == 1:
        return scale * table[b][None]
    return scale * jnp.moveaxis(table[b], -1, 0)


# ---------------------------------------------------------------------------
# masks from absolute positions (§2.4, §2.5)
# ---------------------------------------------------------------------------


def window_bounds(q_pos, opts: EVAOptions):
    """[lo, hi) of the local window E_w of each query's block (pallas_kernels/eva_attend_ref.py)."""
    return eva_attend_ref.window_bounds(q_pos, opts.W, opts.e_l, opts.e_r)


def local_mask(q_pos, k_pos, k_valid, opts: EVAOptions):
    """[Tq, Tk] bool: key in the query's window (and not in its future when causal)."""
    return eva_attend_ref.local_mask(q_pos, k_pos, k_valid, W=opts.W, e_l=opts.e_l, e_r=opts.e_r, causal=opts.causal)


def chunk_mask(q_pos, chunk_ids, chunk_valid, P: int, opts: EVAOptions, keys_major: bool = False):
    """[Tq, C] bool ([C, Tq] with keys_major). Causal: chunk c visible iff c < ⌊n/P⌋ (released rule: own chunk
    hidden). 'disjoint': additionally drop chunks intersecting the query's window."""
    return eva_attend_ref.chunk_mask(q_pos, chunk_ids, chunk_valid, P=P, W=opts.W, e_l=opts.e_l, e_r=opts.e_r,
                                     causal=opts.causal, disjoint=opts.partition == "disjoint", keys_major=keys_major)


def local_bias_tiles(table, opts: EVAOptions, scale: float):
    """The Phase B kernel's bias operand [Hb, n_lt, W, W]: one tile per key-block offset of the window (the bias
    depends on ``offset·W + column − row`` only)."""
    r = np.arange(opts.W)
    tiles = [rpe_bias(table, r, o * opts.W + r, opts, scale) for o in eva_attend_ref.local_offsets(opts.e_l, opts.e_r)]
    return jnp.stack(tiles, axis=1)


# ---------------------------------------------------------------------------
# Phase A: chunk statistics (§2.3): chunk_summaries & co. in pallas_kernels/eva_chunks_ref.py
# ---------------------------------------------------------------------------


def chunk_noise(noise_key, chunk_ids, batch: int, heads: int, dim: int):
    """ε [B,H,C,d]: chunk c draws normal(fold_in(noise_key, c), (B,H,d)) (§4.4)."""
    eps = jax.vmap(lambda c: jax.random.normal(jax.random.fold_in(noise_key, c), (batch, heads, dim)))(chunk_ids)
    # materialised once (longctx.xla_cpu.materialized): else XLA:CPU fused the sampler into the chunk keys' gradient
    # and recomputed it P times per element
    return materialized(jnp.moveaxis(eps, 0, 2))


# ---------------------------------------------------------------------------
# Phase B: one tile of queries (§2.4)
# ---------------------------------------------------------------------------


def chunk_logits(q, k_hat, k_raw, k_raw_valid, scale: float, chunk_logit: str):
    """[B,H,Tq,C]: s q·k̂_c (eq. 16) or, 'exact_lse', logsumexp_{m∈P_c} s q·k_m (eq. 13)."""
    if chunk_logit == "rep":
        return scale * jnp.einsum("bhqd,bhcd->bhqc", q, k_hat)
    s = scale * jnp.einsum("bhqd,bhcpd->bhqcp", q, k_raw)
    s = jnp.where(k_raw_valid[:, None], s, NEG)  # k_raw_valid: [B|1, 1, C, P] -> broadcast
    return jax.nn.logsumexp(s, axis=-1)


def _local_pieces(Tq: int, Tk: int, halves: bool):
    """The local logits as row blocks [(first row, end row, keys)]. ``halves`` (causal, the keys are the tile's own
    queries): the first half of the rows is scored against the first half of the keys only (3/4 of the logits)."""
    if not halves:
        return [(0, Tq, Tk)]
    return [(0, Tq // 2, Tq // 2), (Tq // 2, Tq, Tk)]


def _piece_bias(bias, piece):
    """The bias [N|1,Hb,Tq,Tk] of one row block, broadcastable to its logits [B,H,N,rows,keys]."""
    r0, r1, nk = piece
    b = bias[..., r0:r1, :nk]
    return jnp.moveaxis(b, 0, 1)[None] if b.shape[1] > 1 else b[:, 0][None, None]


def _joint_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, scale: float, probs: bool = False,
                   halves: bool = False, rows_see_a_key: bool = False):
    """(out [B,H,N,Tq,dv], lse [B,H,N,Tq]) of one max-subtracted softmax over [local ; chunk] logits (eq. 16)
    for N tiles of queries; shapes as in :func:`tile_softmax`. ``probs``: (out, kept weights) instead, the
    weights ((local weights of each row block), chunk weights, 1 / row sum), unnormalised. ``rows_see_a_key``
    (static): every row has a visible local key, so its max is finite and exp(NEG - max) is already 0 where a
    mask holds: the masks are applied once, to the logits (the selects after the exp, with their masks built
    from iotas inside the fusion, made the chunk part's exp pass several times slower per element on
    XLA:CPU)."""
    Tq, Tk = q.shape[3], k.shape[3]
    pieces = _local_pieces(Tq, Tk, halves)
    a_loc = []
    for piece in pieces:
        r0, r1, nk = piece
        a = scale * jnp.einsum("bhnqd,bhnkd->bhnqk", q[:, :, :, r0:r1], k[:, :, :, :nk])
        if bias is not None:
            a = a + _piece_bias(bias, piece)
        a_loc.append(jnp.where(lmask[:, r0:r1, :nk], a, NEG))
    s_ch = scale * jnp.einsum("bhnqd,bhcd->bhnqc", q, k_hat)
    a_ch = jnp.where(cmask, s_ch, _fill_like(s_ch, NEG))
    m_loc = jnp.concatenate([jnp.max(a, axis=-1, initial=NEG) for a in a_loc], axis=-1)
    m = jnp.maximum(m_loc, jnp.max(a_ch, axis=-1, initial=NEG))[..., None]
    p_loc = [jnp.exp(a - m[:, :, :, r0:r1]) if rows_see_a_key else
             jnp.where(lmask[:, r0:r1, :nk], jnp.exp(a - m[:, :, :, r0:r1]), 0.0)
             for a, (r0, r1, nk) in zip(a_loc, pieces)]
    e_ch = jnp.exp(a_ch - m)
    p_ch = e_ch if rows_see_a_key else jnp.where(cmask, e_ch, _fill_like(e_ch, 0.0))
    den = jnp.concatenate([jnp.sum(p, axis=-1) for p in p_loc], axis=-1) + jnp.sum(p_ch, axis=-1)
    den = jnp.maximum(den, 1e-30)
    num = jnp.concatenate([jnp.einsum("bhnqk,bhnkd->bhnqd", p, v[:, :, :, :nk])
                           for p, (_, _, nk) in zip(p_loc, pieces)], axis=3)
    num = num + jnp.einsum("bhnqc,bhcd->bhnqd", p_ch, beta)
    if probs:
        return num / den[..., None], (tuple(p_loc), p_ch, 1.0 / den)
    return num / den[..., None], m[..., 0] + jnp.log(den)  # empty rows (only if W = 0) give 0


def _fill_like(x, value: float):
    """``value`` in x's shape, written as ``value + 0·x`` (x finite) so that it depends on x: a constant-filled
    operand of a select inside a lax.map is hoisted out of the loop by XLA and materialised at full size (at 32k
    causal: ~0.1 GB per map step, written and read every call)."""
    return value + 0.0 * jax.lax.stop_gradient(x)  # no cotangent flows through the fill


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def tile_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, cmask_t, scale: float, keep: bool = False,
                 halves: bool = False, rows_see_a_key: bool = False):
    """Eq. 16 for N query tiles at once: q [B,H,N,Tq,d] against each tile's local keys k, v [B,H,N,Tk,.]
    (plus ``bias`` [N,Hb,Tq,Tk] or None; mask ``lmask`` [N,Tq,Tk]) and the shared chunk summaries
    k̂ [B,H,C,d], β [B,H,C,dv] (mask ``cmask`` [N,Tq,C], and the same mask keys-major, ``cmask_t`` [C,N·Tq],
    for the backward: built from positions by the caller, since transposing a materialised [N,Tq,C] mask read it
    with a stride of C bytes, slowly). Returns out [B,H,N,Tq,dv].

    The backward is written out (FlashAttention style, from the saved log-sum-exp) in the keys-major
    orientation: it recomputes the transposed logits k·qᵀ, so dk, dv, dk̂ and dβ are plain matmuls (dk̂ and dβ
    contract over all N·Tq queries at once) and dq is formed as (kᵀ dsᵀ)ᵀ. Autodiff through a
    per-tile vmap instead transposed every tile's [Tq, C] probabilities for the key-side gradients: those
    copies were a large share of the backward's time. Same math as :func:`_joint_softmax`.

    ``keep`` (static): the forward keeps its attention weights (query-major, as computed) and the backward
    (:func:`_kept_bwd`) starts from them: the logits' matmul and exp passes are not redone, at the price of
    B·H·N·Tq·(Tk + C) floats held from the forward to the backward (the caller checks its budget).
    ``halves`` (static; with ``keep``; causal tiles whose keys are their own queries, Tk = Tq even): the local
    logits in two row blocks, the first half of the queries against the first half of the keys only, while the
    chunk part scores all Tq queries in one matmul. ``rows_see_a_key`` (static): see :func:`_joint_softmax`; the
    caller vouches that every query has a visible local key (a full pass with a local window)."""
    return _joint_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, scale, halves=halves,
                          rows_see_a_key=rows_see_a_key)[0]


def _tile_softmax_fwd(q, k, v, k_hat, beta, bias, lmask, cmask, cmask_t, scale, keep, halves, rows_see_a_key):
    if keep:
        out, probs = _joint_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, scale, probs=True, halves=halves,
                                    rows_see_a_key=rows_see_a_key)
        return out, (q, k, v, k_hat, beta, bias, None, None, out, probs)
    if halves:
        raise ValueError("tile_softmax: halves needs keep (the recomputing backward scores whole tiles)")
    out, lse = _joint_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, scale, rows_see_a_key=rows_see_a_key)
    return out, (q, k, v, k_hat, beta, bias, lmask, cmask_t, out, lse)


def _kept_bwd(scale, halves, res, do):
    """The backward from the forward's kept weights (query-major): no logits recomputed."""
    q, k, v, k_hat, beta, bias, _, _, out, (p_loc, p_ch, inv_den) = res
    B, H, N, Tq, d = q.shape
    Tk = k.shape[3]
    delta = rowdot(do, out)[..., None]  # [B,H,N,Tq,1] (a dot: longctx.xla_cpu)
    w = inv_den[..., None]
    do_w = do * w  # the weights' row normaliser folded into do ([Tq, dv]), not into the [Tq, Tk + C] weights
    pad = lambda x, n: x if n == Tk else jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, Tk - n), (0, 0)])  # noqa: E731
    # the key-side gradients contract over the queries: from q and do_w transposed first ([d, Tq], small), the dots
    # are plain [d, Tq] x [Tq, keys] products (longctx.xla_cpu.rows_dot: XLA:CPU runs row-contracting dots on a
    # generic path; see docs/DESIGN.md 'Where the time goes')
    q_t, dow_t = transposed(q, do_w)
    dq_loc, dk, dv, dbias = [], 0.0, 0.0, []
    for p, piece in zip(p_loc, _local_pieces(Tq, Tk, halves)):
        r0, r1, nk = piece
        rows = lambda x, r0=r0, r1=r1: x[:, :, :, r0:r1]  # noqa: E731
        cols = lambda x, r0=r0, r1=r1: x[..., r0:r1]  # noqa: E731
        ds = p * rows(w) * (jnp.einsum("bhnqd,bhnkd->bhnqk", rows(do), v[:, :, :, :nk])
                            - rows(delta))
        dq_loc.append(jnp.einsum("bhnqk,bhnkd->bhnqd", ds, k[:, :, :, :nk]))
        dk = dk + pad(jnp.swapaxes(rows_dot(cols(q_t), ds), -1, -2), nk)
        dv = dv + pad(jnp.swapaxes(rows_dot(cols(dow_t), p), -1, -2), nk)
        if bias is not None:
            g = _bias_grad(bias[..., r0:r1, :nk], ds)
            dbias.append(g if nk == Tk else jnp.pad(g, [(0, 0)] * 3 + [(0, Tk - nk)]))
    dp_ch = jnp.einsum("bhnqd,bhcd->bhnqc", do, beta)
    ds_ch = p_ch * w * (dp_ch - delta)
    dq = scale * (jnp.concatenate(dq_loc, axis=3) + jnp.einsum("bhnqc,bhcd->bhnqd", ds_ch, k_hat))
    flat = lambda x: x.reshape(x.shape[:2] + (N * Tq,) + x.shape[4:])  # noqa: E731
    flat_t = lambda x: jnp.moveaxis(x, 2, 3).reshape(x.shape[:2] + (x.shape[3], N * Tq))  # noqa: E731 -- [B,H,d,N*Tq]
    dk_hat = scale * jnp.swapaxes(rows_dot(flat_t(q_t), flat(ds_ch)), -1, -2)
    dbeta = jnp.swapaxes(rows_dot(flat_t(dow_t), flat(p_ch)), -1, -2)
    dbias = None if bias is None else jnp.concatenate(dbias, axis=2)
    return dq, scale * dk, dv, dk_hat, dbeta, dbias, None, None, None


def _bias_grad(bias, ds):
    """d bias [N|1,Hb,Tq,Tk] from the local logits' gradient ds [B,H,N,Tq,Tk] (bias was broadcast over the batch,
    and over the tiles when N = 1, the heads when Hb = 1); None without a bias. Only the bias's two leading
    sizes are read, so ds may be keys-major ([B,H,N,Tk,Tq]; the result is then [N|1,Hb,Tk,Tq])."""
    if bias is None:
        return None
    g = _sum_leading(ds)  # [H,N,Tq,Tk]: over the batch
    if bias.shape[0] == 1:  # one bias shared by the N tiles
        g = functools.reduce(jnp.add, [g[:, i:i + 1] for i in range(g.shape[1])])
    g = _sum_leading(g)[None] if bias.shape[1] == 1 else g
    return jnp.moveaxis(g, 0, 1)


def _tile_softmax_bwd(scale, keep, halves, rows_see_a_key, res, do):
    grads = _kept_bwd(scale, halves, res, do) if keep else _recomputing_bwd(scale, res, do)
    # each cotangent in its primal's dtype (a bf16 bias or q meets fp32 arithmetic here; autodiff of the ops
    # that made them expects their own dtype back)
    return tuple(None if g is None else g.astype(x.dtype) for g, x in zip(grads, res[:6])) + grads[6:]


def _recomputing_bwd(scale, res, do):
    """The backward from the saved log-sum-exp: the logits recomputed keys-major."""
    q, k, v, k_hat, beta, bias, lmask, ct, out, lse = res
    B, H, N, Tq, d = q.shape
    lse_r = lse[..., None, :]  # [B,H,N,1,Tq]
    delta = rowdot(do, out)[..., None, :]
    # local part, per tile, keys-major [B,H,N,Tk,Tq]
    at_loc = scale * jnp.einsum("bhnkd,bhnqd->bhnkq", k, q)
    if bias is not None:
        bt = jnp.swapaxes(bias, -1, -2)  # [N,Hb,Tk,Tq]
        at_loc = at_loc + (jnp.moveaxis(bt, 0, 1)[None] if bt.shape[1] > 1 else bt[:, 0][None, None])
    lt = jnp.swapaxes(lmask, -1, -2)
    pt_loc = jnp.where(lt, jnp.exp(at_loc - lse_r), 0.0)
    dst_loc = pt_loc * (jnp.einsum("bhnkd,bhnqd->bhnkq", v, do) - delta)
    dk = scale * jnp.einsum("bhnkq,bhnqd->bhnkd", dst_loc, q)
    dv = jnp.einsum("bhnkq,bhnqd->bhnkd", pt_loc, do)
    # dq as (kᵀ dsᵀ)ᵀ: the large keys-major operand stays as laid out and only the small [d, Tq] result is
    # transposed (XLA:CPU otherwise copies dsᵀ into query-major order, a full extra pass over the scores)
    dq_t = jnp.einsum("bhnkd,bhnkq->bhndq", k, dst_loc)  # [B,H,N,d,Tq]
    # chunk part: all N*Tq queries against the C shared chunks, keys-major [B,H,C,N*Tq]
    flat = lambda x: x.reshape(x.shape[:2] + (N * Tq,) + x.shape[4:])  # noqa: E731
    qf, dof = flat(q), flat(do)
    st_ch = scale * jnp.einsum("bhcd,bhmd->bhcm", k_hat, qf)
    # exp of the masked logits, not a select of exp: the probabilities are then one fusion's output, read by dβ's
    # matmul and by ds, where XLA materialised exp and the select separately (one more pass over [C, N·Tq]).
    # exp(NEG - lse) = 0; lse is clamped so that a row with nothing visible (lse ~ NEG, only if W = 0) gives 0 too
    lse_c = jnp.maximum(flat(lse), 0.5 * NEG)[:, :, None, :]
    pt_ch = jnp.exp(jnp.where(ct, st_ch, _fill_like(st_ch, NEG)) - lse_c)
    dst_ch = pt_ch * (jnp.einsum("bhcd,bhmd->bhcm", beta, dof) - flat(delta[..., 0, :])[:, :, None])
    dk_hat = scale * jnp.einsum("bhcm,bhmd->bhcd", dst_ch, qf)
    dbeta = jnp.einsum("bhcm,bhmd->bhcd", pt_ch, dof)
    dqc_t = jnp.einsum("bhcd,bhcm->bhdm", k_hat, dst_ch).reshape(B, H, d, N, Tq)
    # both parts summed as computed ([d, Tq] per tile), then one transpose (a sum of transposed reads is a slow,
    # strided pass on XLA:CPU)
    dq = scale * jnp.swapaxes(dq_t + jnp.moveaxis(dqc_t, 3, 2), -1, -2)
    # the bias gradient reduced keys-major (dst_loc as laid out), then one transpose of the small result
    dbias = None if bias is None else jnp.swapaxes(_bias_grad(bias, dst_loc), -1, -2)  # [N|1,Hb,Tq,Tk]
    return dq, dk, dv, dk_hat, dbeta, dbias, None, None, None


tile_softmax.defvjp(_tile_softmax_fwd, _tile_softmax_bwd)


def _sum_leading(x):
    """Σ over the leading axis as a chain of adds: XLA:CPU ran the equivalent reduce over a non-minor axis
    (the bias gradient's sum over heads) element by element, far slower than the fused adds."""
    return functools.reduce(jnp.add, [x[i] for i in range(x.shape[0])])


def _uses_tile_softmax(drop_key, opts: EVAOptions) -> bool:
    """The hand-written backward covers the paper's estimator: representative chunk logits, no attention
    dropout. 'exact_lse' chunk logits and dropout run through autodiff (rematerialised per tile)."""
    return opts.chunk_logit == "rep" and (drop_key is None or opts.attn_dropout == 0.0)


def attend_tile(q, q_pos, k, v, k_pos, k_valid, chunks, chunk_ids, chunk_valid, P, rpe_table, drop_key,
                opts: EVAOptions, scale: float):
    """Outputs [B,H,Tq,dv] of a tile of queries at absolute positions q_pos [Tq].

    Local candidates k, v [B,H,Tk,*] at positions k_pos [Tk] (k_valid: real key);
    chunks = (k̂ [B,H,C,d], β [B,H,C,dv], k_raw, k_raw_valid) with absolute ids chunk_ids [C].
    One max-subtracted softmax over [local ; chunk] logits (eq. 16 in log-sum-exp form)."""
    k_hat, beta, k_raw, k_raw_valid = chunks
    lmask = local_mask(q_pos, k_pos, k_valid, opts)
    cmask = chunk_mask(q_pos, chunk_ids, chunk_valid, P, opts)
    bias = rpe_bias(rpe_table, q_pos, k_pos, opts, scale) if opts.use_rpe and rpe_table is not None else None
    if _uses_tile_softmax(drop_key, opts):
        one = lambda x: None if x is None else x[None]  # noqa: E731 -- a batch of one tile
        return tile_softmax(q[:, :, None], k[:, :, None], v[:, :, None], k_hat, beta, one(bias), lmask[None],
                            cmask[None], chunk_mask(q_pos, chunk_ids, chunk_valid, P, opts, keys_major=True),
                            scale)[:, :, 0]
    a_loc = scale * jnp.einsum("bhqd,bhkd->bhqk", q, k)
    if bias is not None:
        a_loc = a_loc + bias
    a_loc = jnp.where(lmask, a_loc, NEG)
    a_ch = jnp.where(cmask, chunk_logits(q, k_hat, k_raw, k_raw_valid, scale, opts.chunk_logit), NEG)
    m = jnp.maximum(jnp.max(a_loc, axis=-1, initial=NEG), jnp.max(a_ch, axis=-1, initial=NEG))
    m = jax.lax.stop_gradient(m)[..., None]
    p_loc = jnp.where(lmask, jnp.exp(a_loc - m), 0.0)
    p_ch = jnp.where(cmask, jnp.exp(a_ch - m), 0.0)
    denom = jnp.sum(p_loc, axis=-1) + jnp.sum(p_ch, axis=-1)
    if drop_key is not None and opts.attn_dropout > 0.0:
        # dropout on the joint normalized weights == drop unnormalized p, keep the normalizer (§9.12)
        kl, kc = jax.random.split(drop_key)
        keep = 1.0 - opts.attn_dropout
        p_loc = jnp.where(jax.random.bernoulli(kl, keep, p_loc.shape), p_loc / keep, 0.0)
        p_ch = jnp.where(jax.random.bernoulli(kc, keep, p_ch.shape), p_ch / keep, 0.0)
    num = jnp.einsum("bhqk,bhkd->bhqd", p_loc, v)
    num = num + jnp.einsum("bhqc,bhcd->bhqd", p_ch, beta)
    return scale_rows(num, 1.0 / jnp.maximum(denom, 1e-30))  # empty rows (only if W = 0) give 0


def tiles_attend(q, q_pos, k, v, k_pos, k_valid, chunks, chunk_ids, chunk_valid, P, rpe_table, opts: EVAOptions,
                 scale: float, keep: bool = False, halves: bool = False, q_offset: int | None = None):
    """:func:`attend_tile` for a batch of N tiles at once (q [B,H,N,Tq,d], q_pos [N,Tq], k, v [B,H,N,Tk,.],
    k_pos, k_valid [N,Tk]; chunks = (k̂, β) shared) through :func:`tile_softmax`: the representative-logit
    estimator without dropout. Returns [B,H,N,Tq,dv].

    The tiles must share their relative key offsets (k_pos[n] - q_pos[n] the same for every n, as the tiles of
    :func:`eva_forward` do): the relative position bias is computed once, from the first tile, and its gradient
    summed over the tiles (per-tile biases and their transposed gradients were a measurable cost of a causal step).
    ``q_offset`` (static, optional): q_pos[n, 0] - k_pos[n, 0], which makes the bias's buckets constants."""
    k_hat, beta = chunks
    lmask = jax.vmap(lambda a, b, c: local_mask(a, b, c, opts))(q_pos, k_pos, k_valid)
    cmask = jax.vmap(lambda a: chunk_mask(a, chunk_ids, chunk_valid, P, opts))(q_pos)
    cmask_t = chunk_mask(q_pos.reshape(-1), chunk_ids, chunk_valid, P, opts, keys_major=True)  # [C, N*Tq]
    bias = None
    if opts.use_rpe and rpe_table is not None:  # depends on k_pos - q_pos only: the same for every tile
        qp, kp = (q_pos[0], k_pos[0]) if q_offset is None else (np.arange(q.shape[3]) + q_offset, np.arange(k.shape[3]))
        bias = rpe_bias(rpe_table, qp, kp, opts, scale)[None]  # [1,Hb,Tq,Tk]
    # a full pass with a local window: every query sees its own position (W > 0; the padding of L_pad is shorter
    # than a window, so no tile is all padding)
    return tile_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, cmask_t, scale, keep, halves, opts.W > 0)


def _map_tile_batches(fn, xs, axes, n_tiles: int, cost_per_tile: int, budget: int):
    """fn over batches of tiles (x's tile axis in ``axes``; fn returns [B,H,N,..]): one call when all tiles fit the
    logit budget, else lax.map over equal batches (the largest divisor of n_tiles that fits)."""
    bs = max(1, budget // max(cost_per_tile, 1))
    if bs >= n_tiles:
        return fn(*xs)
    bs = max(b for b in range(1, bs + 1) if n_tiles % b == 0)

    def split(x, ax):  # [.., n_tiles, ..] -> [n_tiles // bs, .., bs, ..]
        if x is None:
            return None
        return jnp.moveaxis(x.reshape(x.shape[:ax] + (n_tiles // bs, bs) + x.shape[ax + 1:]), ax, 0)

    out = jax.lax.map(lambda a: fn(*a), tuple(split(x, ax) for x, ax in zip(xs, axes)))  # [nb,B,H,bs,..]
    out = jnp.moveaxis(out, 0, 2)
    return out.reshape(out.shape[:2] + (n_tiles,) + out.shape[4:])


def _map_tiles(fn, xs, n_tiles: int, cost_per_tile: int, budget: int):
    """Apply fn over the leading tile axis: vmap when all tiles fit the logit budget, else lax.map in batches."""
    bs = max(1, budget // max(cost_per_tile, 1))
    if bs >= n_tiles:
        return jax.vmap(fn)(*xs)
    return jax.lax.map(lambda a: fn(*a), xs, batch_size=bs)


def _gather_tiles(x, idx):
    """x [B,H,L,d], idx [N, K] (clipped) -> [B,H,N,K,d]."""
    return jnp.take(x, idx.reshape(-1), axis=2).reshape(x.shape[:2] + idx.shape + x.shape[3:])


def _tile_keys(drop_key, n_tiles):
    if drop_key is None:
        return None
    return jax.vmap(lambda i: jax.random.fold_in(drop_key, i))(jnp.arange(n_tiles))


def tile_groups(n_tiles: int, tile: int, P: int, C: int, causal: bool, groups: int = 8):
    """Causal skip: [(first tile, end tile, chunks passed)] for up to ``groups`` contiguous groups of query
    tiles. A causal query at n sees chunks c < n // P only, so a group whose last query is n_max is given
    chunks 0..(n_max // P) - 1 and the chunks hidden from all of its queries are never scored (about
    (G+1)/(2G) of the chunk work for G groups). The chunks dropped are exactly ones the mask would
    zero, so the result is unchanged. Bidirectional: one group with all C chunks.

    A count of 64 or more is rounded up to a multiple of :data:`CHUNK_ALIGN` (at most C; the chunks added are
    masked): the causal counts are one short of a round number (1023 at 8k), and the trace showed the ops over
    1023-wide logits slower than over 1024-wide ones (a small end-to-end gain at long lengths, none at short
    ones, in an alternating A/B of ``longctx-bench``)."""
    if not causal:
        return [(0, n_tiles, C)]
    g = max(1, min(groups, n_tiles))
    bounds = [round(i * n_tiles / g) for i in range(g + 1)]
    return [(lo, hi, _aligned(max(1, min(C, (hi * tile - 1) // P)), C))
            for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


CHUNK_ALIGN = 16


def _aligned(nc: int, C: int) -> int:
    return nc if nc < 4 * CHUNK_ALIGN else min(C, -(-nc // CHUNK_ALIGN) * CHUNK_ALIGN)


def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                num_chunks: int, stats_fn=None, attend_fn=None):
    """Full pass over L tokens (no prefix). q,k [B,H,L,d], v [B,H,L,dv] -> (out [B,H,L,dv], extras).

    Query tiles are the blocks of W tokens; tile w's local candidates are positions
    [wW − e_l, (w+1)W + e_r) (out-of-range masked). Phase A over all C chunks of the padded
    sequence. ``stats_fn`` replaces the jnp Phase A (Pallas kernel), same signature as
    :func:`chunk_summaries`; ``attend_fn`` replaces Phase B (the Pallas kernel
    ``pallas_kernels.eva_attend.eva_attend``, same contract as ``eva_attend_reference``;
    no attention dropout, ``rep`` chunk logits, W > 0)."""
    B, H, L, d = q.shape
    dv = v.shape[-1]
    scale = d**-0.5
    L_pad, P, C, tile = geometry(opts, L, chunk_size, num_chunks)
    pad = ((0, 0), (0, 0), (0, L_pad - L), (0, 0))
    qf, kf, vf = (jnp.pad(x.astype(jnp.float32), pad) for x in (q, k, v))
    valid = np.arange(L_pad) < L  # static: a constant of the program, not a reduce computed at run time
    # Phase A
    k_valid_ch = jnp.asarray(valid.reshape(C, P))
    q_ch, k_ch, v_ch = (x.reshape(B, H, C, P, x.shape[-1]) for x in (qf, kf, vf))
    noise = None if noise_key is None else chunk_noise(noise_key, jnp.arange(C), B, H, d)
    k_hat, beta = (stats_fn or chunk_summaries)(q_ch, k_ch, v_ch, k_valid_ch, params, noise, opts, scale)
    exact = opts.chunk_logit == "exact_lse"
    chunks = (k_hat, beta, k_ch if exact else None, k_valid_ch[None, None] if exact else None)
    extras = {"k_hat": k_hat, "beta": beta, "L_pad": L_pad, "P": P, "C": C, "padded": (qf, kf, vf)}
    if attend_fn is not None:  # Phase B in the Pallas kernel
        bias = local_bias_tiles(rpe_table, opts, scale) if opts.use_rpe and rpe_table is not None else None
        flat = lambda x: x.reshape((B * H,) + x.shape[2:])  # noqa: E731
        o, _ = attend_fn(flat(qf * scale), flat(kf), flat(vf), flat(k_hat), flat(beta), bias, W=opts.W,
                         e_l=opts.e_l, e_r=opts.e_r, P=P, L=L, causal=opts.causal,
                         disjoint=opts.partition == "disjoint", heads=H)
        return o.reshape(B, H, L_pad, dv)[:, :, :L], extras
    chunk_ids = jnp.arange(C)
    chunk_valid = np.any(valid.reshape(C, P), axis=-1)  # [ours] all-padding chunks masked (bidirectional)
    # Phase B over query tiles
    n_tiles = L_pad // tile
    q_pos = jnp.arange(L_pad).reshape(n_tiles, tile)
    Tk = (tile + opts.e_l + opts.e_r) if opts.W > 0 else 0
    k_pos = jnp.arange(n_tiles)[:, None] * tile - opts.e_l + jnp.arange(Tk)[None, :]
    k_val = (k_pos >= 0) & (k_pos < L)
    idx = jnp.clip(k_pos, 0, L_pad - 1)
    # tiles stay [B,H,n_tiles,tile,d] (a reshape of q): moving the tile axis to the front and back again for every
    # group made XLA read the projections through chains of slow, strided transposes
    q_t = qf.reshape(B, H, n_tiles, tile, d)
    if Tk == tile:  # no overlap: the tiles' keys are the query tiles' own (a reshape; a gather's gradient scatters)
        k_t, v_t = kf.reshape(B, H, n_tiles, tile, d), vf.reshape(B, H, n_tiles, tile, dv)
    else:
        k_t, v_t = _gather_tiles(kf, idx), _gather_tiles(vf, idx)
    keys = _tile_keys(drop_key, n_tiles)

    xs = (q_t, q_pos, k_t, v_t, k_pos, k_val, keys)
    axes = (2, 0, 2, 2, 0, 0, 0)  # each operand's tile axis
    outs = []
    fused = _uses_tile_softmax(drop_key, opts)
    halves = opts.causal and Tk == tile and tile % 2 == 0
    # 8 tile groups up to 64 tiles, then groups of 8 tiles (at most 32 groups): fewer chunks scored at long
    # lengths for more, smaller calls (a small gain over 8 groups at 16k and 32k)
    groups = tile_groups(n_tiles, tile, P, C, opts.causal, min(32, max(8, n_tiles // 8)))
    # the attention weights of every tile, kept from the forward for the backward when they fit the budget
    kept = sum(B * H * (hi - lo) * tile * (Tk + nc) for lo, hi, nc in groups)
    keep = fused and kept <= opts.keep_budget
    # one split per operand (its gradient is one concatenate; slicing each group out of the whole would pad every
    # group's gradient to full length and sum them: many large copies per layer step)
    sizes = [hi - lo for lo, hi, _ in groups]
    parts = [[None] * len(groups) if x is None else jax.lax.split(x, sizes, axis=ax) for x, ax in zip(xs, axes)]
    for g, (lo, hi, nc) in enumerate(groups):
        cost = B * H * tile * (Tk + nc * (P if exact else 1))
        group = tuple(p[g] for p in parts)
        if fused:  # a batch of tiles per call through tile_softmax (kept weights, or logits recomputed)
            def batch(qt, qp, kt, vt, kp, kv, dk, nc=nc):
                ch = (k_hat[:, :, :nc], beta[:, :, :nc])
                attend = lambda *a, halves=False, off=opts.e_l: tiles_attend(  # noqa: E731
                    *a, ch, chunk_ids[:nc], chunk_valid[:nc], P, rpe_table, opts, scale, keep, halves, off)
                if not halves or keep:  # kept weights: the halves are row blocks inside one call
                    return attend(qt, qp, kt, vt, kp, kv, halves=halves)
                # causal, keys = the query tile: the first half of the queries sees only the first half of the
                # keys, so it is scored against those alone (3/4 of the local logits)
                h = tile // 2
                qa, qb = jax.lax.split(qt, [h, h], axis=3)
                ka, vka = kt[:, :, :, :h], vt[:, :, :, :h]
                oa = attend(qa, qp[:, :h], ka, vka, kp[:, :h], kv[:, :h])
                ob = attend(qb, qp[:, h:], kt, vt, kp, kv, off=h)
                return jnp.concatenate([oa, ob], axis=3)

            outs.append(_map_tile_batches(batch, group, axes, hi - lo, cost, opts.logit_budget))
            continue

        # autodiff path (dropout, 'exact_lse'): rematerialised, so the backward recomputes a tile's logits
        # instead of keeping every tile's [tile, local + chunks] scores alive (at 32k this cut XLA's memory by about
        # two thirds, and the step got faster too)
        @jax.checkpoint
        def one(qt, qp, kt, vt, kp, kv, dk, nc=nc):
            ch = tuple(None if x is None else x[:, :, :nc] for x in chunks)
            return attend_tile(qt, qp, kt, vt, kp, kv, ch, chunk_ids[:nc], chunk_valid[:nc], P, rpe_table, dk,
                               opts, scale)

        lead = tuple(x if x is None or ax == 0 else jnp.moveaxis(x, ax, 0) for x, ax in zip(group, axes))
        outs.append(jnp.moveaxis(_map_tiles(one, lead, hi - lo, cost, opts.logit_budget), 0, 2))
    out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]  # [B,H,n_tiles,tile,dv]
    out = out.reshape(B, H, L_pad, dv)[:, :, :L]
    return out, extras


# ---------------------------------------------------------------------------
# decoding / streaming state (§4; causal only)
# ---------------------------------------------------------------------------


def empty_state(B, H, d, dv, R, P, C_max, exact: bool):
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    st = {
        "pos": jnp.zeros((), jnp.int32),
        "win_k": z(B, H, R, d),  # last R tokens, chronological: slot j <-> position pos - R + j
        "win_v": z(B, H, R, dv),
        "cur_q": z(B, H, P, d),  # members of the unfinished chunk ⌊pos/P⌋, slot j <-> ⌊pos/P⌋P + j
        "cur_k": z(B, H, P, d),
        "cur_v": z(B, H, P, dv),
        "mem_khat": z(B, H, C_max, d),  # finished chunks c < ⌊pos/P⌋
        "mem_beta": z(B, H, C_max, dv),
    }
    if exact:
        st["mem_kraw"] = z(B, H, C_max, P, d)
    return st


def _last(x, R):
    """Last R entries along axis 2, zero-filled at the front when shorter."""
    n = x.shape[2]
    if n >= R:
        return x[:, :, n - R:]
    return jnp.pad(x, ((0, 0), (0, 0), (R - n, 0), (0, 0)))


def state_from_forward(extras, L: int, R: int, exact: bool):
    """The state the step path would have built after L tokens (§4.3)."""
    qf, kf, vf = extras["padded"]
    P = extras["P"]
    c_cur = L // P
    cur = [jnp.pad(x, ((0, 0), (0, 0), (0, P), (0, 0)))[:, :, c_cur * P:(c_cur + 1) * P] for x in (qf, kf, vf)]
    st = {
        "pos": jnp.asarray(L, jnp.int32),
        "win_k": _last(kf[:, :, :L], R),
        "win_v": _last(vf[:, :, :L], R),
        "cur_q": cur[0], "cur_k": cur[1], "cur_v": cur[2],
        "mem_khat": extras["k_hat"],
        "mem_beta": extras["beta"],
    }
    if exact:
        B, H, _, d = kf.shape
        st["mem_kraw"] = kf.reshape(B, H, -1, P, d)
    return st


def eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, P: int,
               stats_fn=None):
    """Causal EVA over T new tokens at positions [pos, pos+T) given the prefix state.

    1. Chunks completed by these tokens are summarized (Phase A, same formulas and noise
       rule as the full pass) and stored at their absolute index;
    2. queries attend to the updated chunk memory (visibility c < ⌊n/P⌋ keeps the own and
       later chunks hidden) and to local candidates = the last R prefix tokens + new tokens;
    3. the ring, current-chunk buffer and pos advance."""
    B, H, T, d = q.shape
    dv = v.shape[-1]
    scale = d**-0.5
    R = state["win_k"].shape[2]
    C_max = state["mem_khat"].shape[2]
    exact = opts.chunk_logit == "exact_lse"
    pos = state["pos"]
    _check_capacity(pos, T, P, C_max)
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    # -- 1. finish chunks -------------------------------------------------------------
    c0, r = pos // P, pos % P
    n_ext = -(-(P + T) // P)
    ext = []
    for cur, new in ((state["cur_q"], qf), (state["cur_k"], kf), (state["cur_v"], vf)):
        buf = jnp.zeros((B, H, n_ext * P, new.shape[-1]), jnp.float32).at[:, :, :P].set(cur)
        ext.append(jax.lax.dynamic_update_slice(buf, new, (0, 0, r, 0)))
    n_have = r + T  # ext slot j <-> position c0*P + j, valid for j < n_have
    ext_valid = (jnp.arange(n_ext * P) < n_have).reshape(n_ext, P)
    ext_ids = c0 + jnp.arange(n_ext)
    q_ch, k_ch, v_ch = (x.reshape(B, H, n_ext, P, x.shape[-1]) for x in ext)
    noise = None if noise_key is None else chunk_noise(noise_key, ext_ids, B, H, d)
    k_hat, beta = (stats_fn or chunk_summaries)(q_ch, k_ch, v_ch, ext_valid, params, noise, opts, scale)
    complete = (jnp.arange(n_ext) + 1) * P <= n_have
    slot = jnp.where(complete, ext_ids, C_max)  # out of range -> dropped
    mem_khat = state["mem_khat"].at[:, :, slot].set(k_hat, mode="drop")
    mem_beta = state["mem_beta"].at[:, :, slot].set(beta, mode="drop")
    new_state = {"mem_khat": mem_khat, "mem_beta": mem_beta}
    if exact:
        new_state["mem_kraw"] = state["mem_kraw"].at[:, :, slot].set(k_ch, mode="drop")
    off = (n_have // P) * P
    for name, x in zip(("cur_q", "cur_k", "cur_v"), ext):
        new_state[name] = jax.lax.dynamic_slice_in_dim(x, off, P, axis=2)
    # -- 2. attend --------------------------------------------------------------------
    tile = min(T, opts.W if opts.W > 0 else P)
    n_tiles = -(-T // tile)
    k_cat = jnp.concatenate([state["win_k"], kf], axis=2)
    v_cat = jnp.concatenate([state["win_v"], vf], axis=2)
    tail = n_tiles * tile - T
    k_ext = jnp.pad(k_cat, ((0, 0), (0, 0), (0, tail), (0, 0)))
    v_ext = jnp.pad(v_cat, ((0, 0), (0, 0), (0, tail), (0, 0)))
    j = jnp.arange(tile + R)
    kidx = jnp.arange(n_tiles)[:, None] * tile + j[None, :]  # [n_tiles, tile+R] into k_ext
    k_pos = pos - R + kidx
    k_val = (k_pos >= 0) & (kidx < R + T)
    q_pos = pos + jnp.arange(n_tiles * tile).reshape(n_tiles, tile)
    q_t = jnp.moveaxis(jnp.pad(qf, ((0, 0), (0, 0), (0, tail), (0, 0))).reshape(B, H, n_tiles, tile, d), 2, 0)
    k_t, v_t = (jnp.moveaxis(_gather_tiles(x, kidx), 2, 0) for x in (k_ext, v_ext))  # [n_tiles,B,H,tile+R,.]
    kraw = new_state.get("mem_kraw")
    chunks = (mem_khat, mem_beta, kraw, jnp.ones((1, 1, C_max, P), bool) if exact else None)
    chunk_ids = jnp.arange(C_max)
    chunk_valid = jnp.ones((C_max,), bool)
    keys = _tile_keys(drop_key, n_tiles)

    def one(qt, qp, kt, vt, kp, kv, dk):
        return attend_tile(qt, qp, kt, vt, kp, kv, chunks, chunk_ids, chunk_valid, P, rpe_table, dk, opts, scale)

    cost = B * H * tile * (tile + R + C_max * (P if exact else 1))
    out = _map_tiles(one, (q_t, q_pos, k_t, v_t, k_pos, k_val, keys), n_tiles, cost, opts.logit_budget)
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, n_tiles * tile, dv)[:, :, :T]
    # -- 3. advance ---------------------------------------------------------------------
    new_state["win_k"] = k_cat[:, :, T:T + R]
    new_state["win_v"] = v_cat[:, :, T:T + R]
    new_state["pos"] = pos + T
    return out, new_state


def _check_capacity(pos, T, P, C_max):
    """The chunk memory must hold every chunk finished by these tokens: a clear error otherwise,
    on the host when ``pos`` is concrete and through a raising host callback under jit."""
    check_capacity((pos + T) // P, C_max,
                   "eva: the decoding state holds {capacity} finished-chunk slots (init_state max_len) but the "
                   "tokens fed so far finish {needed} chunks; build it with core.init_state(batch_size, max_len) "
                   "with a larger max_len")


# ---------------------------------------------------------------------------
# the core
# ---------------------------------------------------------------------------


class EVAAttention(AttentionCore):
    """EVA attention core (causal: App. D; bidirectional: eq. 16). See module docstring."""

    name = "eva"
    EXECUTION_KEYS = ("impl", "logit_budget", "keep_budget")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """xla (the XLA tiles; the reference) and pallas (Phase A and Phase B kernels; interpret mode on CPU)."""
        from longctx.attention.dispatch import Implementation

        return (Implementation("xla", config={"impl": "xla"}),
                Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, config={"impl": "pallas"}))
    randomized = True  # one ω sample per chunk and attention dropout when deterministic=False

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                "window_size": 128,  # W: local block (|E| = W + overlap); 0 = no local part (test-only)
                "chunk_size": 8,  # P (causal; bidirectional when num_chunks == 0); W % P == 0
                "num_chunks": 0,  # C (bidirectional only; >0 overrides chunk_size; needs C | W); causal rejects it
                "overlap_window": False,  # causal: window extends W to the left; bidirectional: W/2 each side
                "partition": "full",  # 'full' (released: chunks may overlap the block, double count) | 'disjoint'
                "chunk_logit": "rep",  # 'rep' (eq. 16: s q·k̂_c) | 'exact_lse' (eq. 13, test-only, O(L²))
                "chunk_rep": "learned",  # 'learned' (Linear(+LN) of the chunk mean) | 'identity' (mean, test-only)
                "adaptive_proj": "qk",  # 'qk' (Linear+LN) | 'no-ln' (Linear) | 'none' (µ = 0, bidirectional only)
                "mu_mode": "auto",  # 'auto' (causal q̂+k̂, bidirectional ½(q̂+k̂)) | 'sum' | 'half'
                "rf_scale": "released",  # 'released' s(ω·k−½‖k‖²) | 'principled' √s ω·k − (s/2)‖k‖²
                "use_rpe": True,  # T5 relative position bias inside the local block
                "attn_dropout": 0.0,  # on the joint attention weights, only when not deterministic
                # Phase A and Phase B kernels: 'xla' | 'pallas' | 'auto' (longctx/attention/dispatch.py); steps with
                # attention dropout (attn_dropout > 0, deterministic=False) run Phase B in XLA
                "impl": "auto",
                # max materialized logits per lax.map step (memory knob): larger is faster (fewer, bigger calls) and
                # takes more memory; the returns shrink past 2^22, and 2^26 pays off only at 32k and beyond
                "logit_budget": 1 << 25,
                # max attention weights (fp32 entries, all tiles of a full pass) kept from the forward for the
                # backward, which then recomputes no logits (one chunk matmul and the exp passes fewer); larger
                # passes recompute them. 2^28 = 1 GiB per layer: causal 4 heads of 64 keep up to 16k tokens at
                # batch 1 (a faster backward at 8k and 16k, with the halves as row blocks); 0 always recomputes.
                # Per layer: a deep model holds one set per layer from its forward to its
                # backward unless model.remat recomputes each block when the backward reaches it
                "keep_budget": 1 << 28,
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = "attention.eva"
        W, P, C = cfg.window_size, cfg.chunk_size, cfg.num_chunks
        require(W >= 0, f"{p}.window_size={W}; must be >= 0 (0 disables the local block, test-only)")
        require(C >= 0, f"{p}.num_chunks={C}; must be >= 0")
        if causal:
            require(C == 0, f"{p}.num_chunks={C}: a causal EVA layer needs a fixed chunk_size (num_chunks makes "
                            "the partition depend on the total length and leaks the future); set num_chunks=0")
            require(P > 0, f"{p}.chunk_size={P}; must be > 0")
            require(W == 0 or W % P == 0, f"{p}: window_size={W} must be a multiple of chunk_size={P}")
        else:
            if C > 0:
                require(W == 0 or W % C == 0, f"{p}: num_chunks={C} must divide window_size={W} "
                                              "(so P = L_pad / C is an integer)")
            else:
                require(P > 0, f"{p}.chunk_size={P}; must be > 0 when num_chunks == 0")
                require(W == 0 or W % P == 0, f"{p}: window_size={W} must be a multiple of chunk_size={P}")
        require(not (cfg.overlap_window and W == 0), f"{p}.overlap_window needs window_size > 0")
        require(not (cfg.overlap_window and not causal and W % 2), f"{p}: bidirectional overlap needs an even window_size")
        for key, allowed in (
            ("partition", ("full", "disjoint")),
            ("chunk_logit", ("rep", "exact_lse")),
            ("chunk_rep", ("learned", "identity")),
            ("adaptive_proj", ("qk", "no-ln", "none")),
            ("mu_mode", ("auto", "sum", "half")),
            ("rf_scale", ("released", "principled")),
        ):
            require(cfg[key] in allowed, f"{p}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
        require(not (causal and cfg.adaptive_proj == "none"),
                f"{p}.adaptive_proj='none' exists only for bidirectional layers; use 'qk' or 'no-ln'")
        require(0.0 <= cfg.attn_dropout < 1.0, f"{p}.attn_dropout={cfg.attn_dropout}; must be in [0, 1)")
        why = dispatch.impl_problem(cfg.impl, ("xla", "pallas"))
        require(why is None, f"{p}.{why}")
        require(cfg.logit_budget > 0, f"{p}.logit_budget must be positive")
        require(cfg.keep_budget >= 0, f"{p}.keep_budget={cfg.keep_budget}; must be >= 0 (0: always recompute)")

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim)
        c = self.cfg
        d = head_dim
        W = c.window_size
        e = (W if causal else W // 2) if c.overlap_window else 0
        mu_mode = c.mu_mode if c.mu_mode != "auto" else ("sum" if causal else "half")
        self.opts = EVAOptions(
            causal=causal, W=W, e_l=e, e_r=0 if causal else e, partition=c.partition, chunk_logit=c.chunk_logit,
            chunk_rep=c.chunk_rep, adaptive_proj=c.adaptive_proj, mu_mode=mu_mode, rf_scale=c.rf_scale,
            use_rpe=c.use_rpe and W > 0, rpe_buckets=rpe_num_buckets(W, e), rpe_max_distance=max(W + e, 1),
            attn_dropout=float(c.attn_dropout), logit_budget=int(c.logit_budget), keep_budget=int(c.keep_budget),
        )
        # released inits (§3.1): causal Xavier-uniform gain 2^-1/2, bidirectional trunc-normal 0.02; biases 0
        if causal:
            w_init = nnx.initializers.variance_scaling(0.5, "fan_avg", "uniform")
        else:
            w_init = nnx.initializers.truncated_normal(0.02)
        mat, vec = axes(None, "head_dim"), axes("head_dim")  # shared by all heads: [d_in, d_out], [d]
        self.q_w = nnx.Param(w_init(rngs.params(), (d, d), jnp.float32), **mat)
        self.k_w = nnx.Param(w_init(rngs.params(), (d, d), jnp.float32), **mat)
        self.q_b, self.k_b = nnx.Param(jnp.zeros((d,)), **vec), nnx.Param(jnp.zeros((d,)), **vec)
        self.q_ln_scale, self.k_ln_scale = nnx.Param(jnp.ones((d,)), **vec), nnx.Param(jnp.ones((d,)), **vec)
        self.q_ln_bias, self.k_ln_bias = nnx.Param(jnp.zeros((d,)), **vec), nnx.Param(jnp.zeros((d,)), **vec)
        if self.opts.use_rpe:
            shape = (self.opts.rpe_buckets,) if causal else (self.opts.rpe_buckets, num_heads)
            names = (None,) if causal else (None, "heads")
            self.rpe_table = nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32), **axes(*names))
        else:
            self.rpe_table = None

    @classmethod
    def kernel_benches(cls):
        # impl='pallas' runs both kernels (chunk statistics and the chunk + local attention)
        return {"eva_chunk_stats+eva_attend": KernelBench(xla={"impl": "xla"}, pallas={"impl": "pallas"})}

    @classmethod
    def drop_in(cls):
        return DropIn(
            "chunk_rep='identity' (k̂_c = chunk mean of k, µ_c from chunk means of q and k; no learned projection), "
            "use_rpe=False (no learned position bias); other options default",
            {"chunk_rep": "identity", "use_rpe": False},
        )

    @classmethod
    def contract_cases(cls):
        # window 8, chunk 4, 48 tokens: the carried state holds 8+ finished chunks beyond the window
        small = {"window_size": 8, "chunk_size": 4, "attn_dropout": 0.0, "impl": "xla"}
        return {
            "xla": ContractCase(cfg=small, length=48),
            "xla_overlap_disjoint": ContractCase(cfg={**small, "overlap_window": True, "partition": "disjoint"},
                                                 length=48, directions=("causal",), slow=True),
            # Phase A and Phase B through the Pallas kernels (interpret mode on CPU)
            "pallas": ContractCase(cfg={**small, "impl": "pallas"}, length=48, slow=True),  # interpret mode
        }

    # -- helpers --------------------------------------------------------------------
    def chunk_params(self):
        names = ("q_w", "q_b", "q_ln_scale", "q_ln_bias", "k_w", "k_b", "k_ln_scale", "k_ln_bias")
        return {n: getattr(self, n)[...] for n in names}

    def _stats_fn(self, P: int):
        """Phase A runs the Pallas kernel of pallas_kernels/eva_chunks.py or the XLA ``chunk_summaries``, by the
        shared rule of ``longctx.attention.dispatch`` (the kernel declares its platforms and sizes in
        ``eva_chunks.unsupported_reasons``). Returns a ``stats_fn`` or None (XLA)."""
        choice = dispatch.resolve(self.cfg.impl, method="eva", kernel="eva_chunk_stats",
                                  reasons_fn=eva_chunks.unsupported_reasons, P=P, d=self.head_dim, dv=self.value_dim)
        if not choice.use_kernel:
            return None
        return eva_chunks.make_stats_fn(interpret=choice.interpret, platform=choice.platform)

    def _attend_fn(self, L: int, dropout: bool):
        """Phase B of a full pass runs the Pallas kernel of pallas_kernels/eva_attend.py or the XLA tiles, by the
        shared rule (``eva_attend.unsupported_reasons``). A step with attention dropout runs XLA (the kernel has
        none; §8.3). Returns an ``attend_fn`` or None (XLA)."""
        if dropout:
            return None
        o = self.opts
        C = geometry(o, L, self.cfg.chunk_size, self.cfg.num_chunks)[2]
        choice = dispatch.resolve(self.cfg.impl, method="eva", kernel="eva_attend",
                                  reasons_fn=eva_attend.unsupported_reasons, W=o.W, d=self.head_dim,
                                  dv=self.value_dim, C=C, e_l=o.e_l, e_r=o.e_r, chunk_logit=o.chunk_logit)
        if not choice.use_kernel:
            return None
        return functools.partial(eva_attend.eva_attend, interpret=choice.interpret,
                                 platform=None if choice.interpret else choice.platform)

    def _keys(self, deterministic, key):
        if deterministic:
            return None, None
        if key is None:
            raise ValueError("eva: deterministic=False needs a PRNG `key` (one ω sample per chunk, dropout)")
        noise_key, drop_key = jax.random.split(key)
        return noise_key, drop_key

    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("eva: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("eva: init_state needs max_len (tokens; sizes the finished-chunk memory)")
        P = self.cfg.chunk_size
        R = self.opts.W + self.opts.e_l
        return empty_state(batch_size, self.num_heads, self.head_dim, self.value_dim, R, P, -(-max_len // P),
                           self.opts.chunk_logit == "exact_lse")

    # -- sequence parallelism: chunk summaries sit at absolute slots, the window is the newest R --
    def sequence_refusal(self, slice_len: int) -> str | None:
        if slice_len % self.cfg.chunk_size:
            return f"a slice of {slice_len} tokens is not a multiple of chunk_size={self.cfg.chunk_size}"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return {**self.init_state(batch_size, max_len), "pos": jnp.asarray(start, jnp.int32)}

    def compose_states(self, a, b):
        # b ran from an empty state at a's end (a chunk border): its finished chunks occupy slots a's
        # are zero in, its window holds zeros where a's newest tokens belong, its chunk buffer is current
        out = dict(b)
        for name in a:
            if name.startswith("mem_"):
                out[name] = a[name] + b[name]
        R = a["win_k"].shape[2]
        shift = jnp.minimum(b["pos"] - a["pos"], R)
        for name in ("win_k", "win_v"):
            padded = jnp.concatenate([a[name], jnp.zeros_like(a[name])], axis=2)
            out[name] = b[name] + jax.lax.dynamic_slice_in_dim(padded, shift, R, axis=2)
        return out

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None):
        check_qkv(q, k, v)
        noise_key, drop_key = self._keys(deterministic, key)
        rpe = self.rpe_table[...] if self.rpe_table is not None else None
        c = self.cfg
        if state is None:
            out, extras = eva_forward(q, k, v, self.chunk_params(), rpe, noise_key, drop_key, self.opts,
                                      chunk_size=c.chunk_size, num_chunks=c.num_chunks,
                                      stats_fn=self._stats_fn(geometry(self.opts, q.shape[2], c.chunk_size,
                                                                       c.num_chunks)[1]),
                                      attend_fn=self._attend_fn(q.shape[2], drop_key is not None and c.attn_dropout > 0))
            new_state = None
            if self.causal:
                new_state = state_from_forward(extras, q.shape[2], self.opts.W + self.opts.e_l,
                                               self.opts.chunk_logit == "exact_lse")
            return out.astype(v.dtype), new_state
        if not self.causal:
            raise ValueError("eva: a bidirectional core takes no state")
        out, new_state = eva_stream(q, k, v, state, self.chunk_params(), rpe, noise_key, drop_key, self.opts,
                                    P=c.chunk_size, stats_fn=self._stats_fn(c.chunk_size))
        return out.astype(v.dtype), new_state


__all__ = [
    "EVAAttention",
    "EVAOptions",
    "attend_tile",
    "chunk_beta",
    "chunk_noise",
    "chunk_summaries",
    "eva_forward",
    "eva_stream",
    "rf_log_feature",
    "t5_bucket",
]

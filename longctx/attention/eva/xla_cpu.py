"""EVA tuned for XLA:CPU (implementation ``xla_cpu``, what ``impl='auto'`` runs on a CPU): the tiled algorithm of
``xla.py`` with the XLA:CPU helpers of ``longctx/xla_cpu.py`` and, for the representative-logit estimator without
dropout, Phase B written out per group of query tiles (:func:`tile_softmax`: a custom VJP from the saved log-sum-exp
or from the forward's kept weights within ``keep_budget``, causal tiles in halves). Every choice here was made on
XLA:CPU measurements (docs/DESIGN.md, "Where the time goes"); the arithmetic is the reference's
(tests/attention/test_implementations.py).

Precision (DESIGN.md §7), as ``xla.py``: q, k, v, k̂, β arrive in the compute dtype; every product takes it with
float32 accumulation (:func:`_mm`, :func:`_rows_mm_t`), the weights and score gradients are cast to it before their
products, and dO too; the softmax, its statistics, the kept weights (float32 entries, ``keep_budget``) and the
bias gradient are float32. Under float32 inputs every cast is the identity and the products are the plain ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention import dispatch
from longctx.attention.eva import packed, xla
from longctx.attention.eva.common import (
    NEG,
    EVAOptions,
    TileOps,
    chunk_mask,
    layer_norm,
    local_mask,
    rpe_bias,
    run_pass,
)
from longctx.xla_cpu import materialized, rowdot, rows_dot, scale_rows, transposed
from pallas_kernels.precision import float_dtype


def _mm(spec: str, a, b):
    """``einsum(spec, a, b)`` with float32 accumulation of operands in their (common) compute dtype; the plain einsum
    for float32 operands."""
    return jnp.einsum(spec, a, b, preferred_element_type=float_dtype(a, b))


def _rows_mm_t(a_t, b):
    """``swapaxes(rows_dot(a_t, b))`` (:func:`longctx.xla_cpu.rows_dot`, ``[..., j, i]``) with float32 accumulation
    (operands in their compute dtype). Narrower operands (bf16): the product is kept as laid out (an optimization
    barrier) before the transpose, which XLA:CPU otherwise folds into the dot's output layout, a form its dot
    runtime cannot run for bf16 operands into float32 (UNIMPLEMENTED "BF16 x BF16 = F32"); float32: as before."""
    out = rows_dot(a_t, b, preferred_element_type=float_dtype(a_t, b))
    if out.dtype != a_t.dtype:
        out = jax.lax.optimization_barrier(out)
    return jnp.swapaxes(out, -1, -2)


def layer_norm_rows(x, scale, bias):
    """:func:`common.layer_norm` with the rows flattened: XLA:CPU runs the gradient's row sums on a slow path when
    a leading dimension has size 1 (batch 1); same arithmetic."""
    if x.ndim > 2:
        return layer_norm(x.reshape(-1, x.shape[-1]), scale, bias).reshape(x.shape)
    return layer_norm(x, scale, bias)


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
    cd = q.dtype
    pieces = _local_pieces(Tq, Tk, halves)
    a_loc = []
    for piece in pieces:
        r0, r1, nk = piece
        a = scale * _mm("bhnqd,bhnkd->bhnqk", q[:, :, :, r0:r1], k[:, :, :, :nk])
        if bias is not None:
            a = a + _piece_bias(bias, piece)
        a_loc.append(jnp.where(lmask[:, r0:r1, :nk], a, NEG))
    s_ch = scale * _mm("bhnqd,bhcd->bhnqc", q, k_hat)
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
    num = jnp.concatenate([_mm("bhnqk,bhnkd->bhnqd", p.astype(cd), v[:, :, :, :nk])
                           for p, (_, _, nk) in zip(p_loc, pieces)], axis=3)
    num = num + _mm("bhnqc,bhcd->bhnqd", p_ch.astype(cd), beta)
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
    cd = q.dtype
    delta = rowdot(do, out)[..., None]  # [B,H,N,Tq,1] (a dot: longctx.xla_cpu; fp32, a statistic)
    w = inv_den[..., None]
    do_w = (do * w).astype(cd)  # the weights' row normaliser folded into do ([Tq, dv]), not into the weights
    do = do.astype(cd)
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
        ds = p * rows(w) * (_mm("bhnqd,bhnkd->bhnqk", rows(do), v[:, :, :, :nk])
                            - rows(delta))
        ds_c = ds.astype(cd)
        dq_loc.append(_mm("bhnqk,bhnkd->bhnqd", ds_c, k[:, :, :, :nk]))
        dk = dk + pad(_rows_mm_t(cols(q_t), ds_c), nk)
        dv = dv + pad(_rows_mm_t(cols(dow_t), p.astype(cd)), nk)
        if bias is not None:
            g = _bias_grad(bias[..., r0:r1, :nk], ds)
            dbias.append(g if nk == Tk else jnp.pad(g, [(0, 0)] * 3 + [(0, Tk - nk)]))
    dp_ch = _mm("bhnqd,bhcd->bhnqc", do, beta)
    ds_ch = p_ch * w * (dp_ch - delta)
    ds_ch_c = ds_ch.astype(cd)
    dq = scale * (jnp.concatenate(dq_loc, axis=3) + _mm("bhnqc,bhcd->bhnqd", ds_ch_c, k_hat))
    flat = lambda x: x.reshape(x.shape[:2] + (N * Tq,) + x.shape[4:])  # noqa: E731
    flat_t = lambda x: jnp.moveaxis(x, 2, 3).reshape(x.shape[:2] + (x.shape[3], N * Tq))  # noqa: E731 -- [B,H,d,N*Tq]
    dk_hat = scale * _rows_mm_t(flat_t(q_t), flat(ds_ch_c))
    dbeta = _rows_mm_t(flat_t(dow_t), flat(p_ch.astype(cd)))
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
    cd = q.dtype
    lse_r = lse[..., None, :]  # [B,H,N,1,Tq]
    delta = rowdot(do, out)[..., None, :]  # fp32, a statistic
    do = do.astype(cd)
    # local part, per tile, keys-major [B,H,N,Tk,Tq]
    at_loc = scale * _mm("bhnkd,bhnqd->bhnkq", k, q)
    if bias is not None:
        bt = jnp.swapaxes(bias, -1, -2)  # [N,Hb,Tk,Tq]
        at_loc = at_loc + (jnp.moveaxis(bt, 0, 1)[None] if bt.shape[1] > 1 else bt[:, 0][None, None])
    lt = jnp.swapaxes(lmask, -1, -2)
    pt_loc = jnp.where(lt, jnp.exp(at_loc - lse_r), 0.0)
    dst_loc = pt_loc * (_mm("bhnkd,bhnqd->bhnkq", v, do) - delta)
    dst_loc_c = dst_loc.astype(cd)
    dk = scale * _mm("bhnkq,bhnqd->bhnkd", dst_loc_c, q)
    dv = _mm("bhnkq,bhnqd->bhnkd", pt_loc.astype(cd), do)
    # dq as (kᵀ dsᵀ)ᵀ: the large keys-major operand stays as laid out and only the small [d, Tq] result is
    # transposed (XLA:CPU otherwise copies dsᵀ into query-major order, a full extra pass over the scores)
    dq_t = _mm("bhnkd,bhnkq->bhndq", k, dst_loc_c)  # [B,H,N,d,Tq]
    # chunk part: all N*Tq queries against the C shared chunks, keys-major [B,H,C,N*Tq]
    flat = lambda x: x.reshape(x.shape[:2] + (N * Tq,) + x.shape[4:])  # noqa: E731
    qf, dof = flat(q), flat(do)
    st_ch = scale * _mm("bhcd,bhmd->bhcm", k_hat, qf)
    # exp of the masked logits, not a select of exp: the probabilities are then one fusion's output, read by dβ's
    # matmul and by ds, where XLA materialised exp and the select separately (one more pass over [C, N·Tq]).
    # exp(NEG - lse) = 0; lse is clamped so that a row with nothing visible (lse ~ NEG, only if W = 0) gives 0 too
    lse_c = jnp.maximum(flat(lse), 0.5 * NEG)[:, :, None, :]
    pt_ch = jnp.exp(jnp.where(ct, st_ch, _fill_like(st_ch, NEG)) - lse_c)
    dst_ch = pt_ch * (_mm("bhcd,bhmd->bhcm", beta, dof) - flat(delta[..., 0, :])[:, :, None])
    dst_ch_c = dst_ch.astype(cd)
    dk_hat = scale * _mm("bhcm,bhmd->bhcd", dst_ch_c, qf)
    dbeta = _mm("bhcm,bhmd->bhcd", pt_ch.astype(cd), dof)
    dqc_t = _mm("bhcd,bhcm->bhdm", k_hat, dst_ch_c).reshape(B, H, d, N, Tq)
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




def _fused_tile(q, q_pos, k, v, k_hat, beta, bias, lmask, cmask, chunk_ids, chunk_valid, P, opts, scale):
    """One tile of a stream through :func:`tile_softmax` (``xla.attend_tile``'s fused form)."""
    one = lambda x: None if x is None else x[None]  # noqa: E731 -- a batch of one tile
    return tile_softmax(q[:, :, None], k[:, :, None], v[:, :, None], k_hat, beta, one(bias), lmask[None],
                        cmask[None], chunk_mask(q_pos, chunk_ids, chunk_valid, P, opts, keys_major=True),
                        scale)[:, :, 0]


def _fused_groups(ctx):
    """``xla.eva_forward``'s groups of query tiles through :func:`tiles_attend`: a batch of tiles per call (kept
    weights within ``keep_budget``, or logits recomputed in the backward)."""
    B, H, tile, Tk, P, opts = (ctx[n] for n in ("B", "H", "tile", "Tk", "P", "opts"))
    k_hat, beta, chunk_ids, chunk_valid = (ctx[n] for n in ("k_hat", "beta", "chunk_ids", "chunk_valid"))
    rpe_table, scale, axes = ctx["rpe_table"], ctx["scale"], ctx["axes"]
    halves = opts.causal and Tk == tile and tile % 2 == 0
    # the attention weights of every tile, kept from the forward for the backward when they fit the budget
    keep = sum(B * H * (hi - lo) * tile * (Tk + nc) for lo, hi, nc in ctx["groups"]) <= opts.keep_budget  # < 0: never

    def run_group(group, lo, hi, nc, cost):
        def batch(qt, qp, kt, vt, kp, kv):
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

        return _map_tile_batches(batch, group, axes, hi - lo, cost, opts.logit_budget)

    return run_group


# the chunk noise materialised once (longctx.xla_cpu.materialized): else XLA:CPU fused the sampler into the chunk
# keys' gradient and recomputed it P times per element
CPU_OPS = TileOps(layer_norm=layer_norm_rows, noise=materialized, row_scale=scale_rows, fused_groups=_fused_groups,
                  fused_tile=_fused_tile)


def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                num_chunks: int):
    """``xla.eva_forward`` with the CPU ops: (out [B,H,L,dv], extras)."""
    return xla.eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts, chunk_size=chunk_size,
                           num_chunks=num_chunks, ops=CPU_OPS)


def eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, P: int):
    """``xla.eva_stream`` with the CPU ops: (out [B,H,T,dv], new state)."""
    return xla.eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts, P=P, ops=CPU_OPS)


def eva_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int, segment_ids,
               state=None):
    """``packed.eva_packed`` (a packed row laid out on the block grid) with the CPU ops' LayerNorm, noise and row
    scaling (the written-out Phase B of full passes takes per-position masks; a packed row's are per document, so it
    runs the tiles under autodiff): (out [B,H,T,dv], state)."""
    return packed.eva_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts, chunk_size=chunk_size,
                             segment_ids=segment_ids, state=state, ops=CPU_OPS)


def attend_tile(*args, **kwargs):
    """``xla.attend_tile`` with the CPU ops."""
    return xla.attend_tile(*args, **kwargs, ops=CPU_OPS)


# its knobs, measured on XLA:CPU (docs/DESIGN.md "Where the time goes"): logit_budget 2^25 (the returns shrink past
# 2^22, and 2^26 pays off only at 32k and beyond); keep_budget 2^28 fp32 weights = 1 GiB per layer (causal 4 heads of
# 64 keep up to 16k tokens at batch 1: a faster backward at 8k and 16k). It runs on a CPU only; 'default' is the
# same tuning for any other platform name a caller passes
DEFAULTS = {"logit_budget": {"cpu": 1 << 25, "default": 1 << 25}, "keep_budget": {"cpu": 1 << 28, "default": 1 << 28}}



@dataclasses.dataclass(frozen=True)
class CPUTiles(dispatch.Runner):
    """``xla_cpu``: :func:`eva_forward` from a row's start, :func:`eva_stream` after a carried state."""

    logit_budget: int
    keep_budget: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        return run_pass(self, core, call, eva_forward, eva_stream, eva_packed)


# the implementation 'auto' runs on a CPU (and only there: it is the whole 'auto' list on a CPU)
IMPLEMENTATIONS = (
    dispatch.Implementation("xla_cpu", platforms=("cpu",), config={"impl": "xla_cpu"}, auto={"cpu": 0},
                            code=CPUTiles, defaults=DEFAULTS),
)

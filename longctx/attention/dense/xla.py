"""``blockwise``: exact attention by online softmax over key blocks, portable (GPU, TPU; CPU too), plain ops only.

The tiled algorithm of docs/methods/dense.md "Implementations": queries in blocks of ``block_q``, keys in blocks of
``block_k``, per query row a running max ``m``, normaliser ``ℓ`` and accumulator ``a`` updated block by block (Rabe &
Staats, arXiv:2112.05682; FlashAttention, arXiv:2205.14135), memory O(block_q · block_k) per head, and
FlashAttention-2's backward from the saved log-sum-exp (a custom VJP: only the output and the log-sum-exp are kept).
Two structures compute it:

* a full pass without a cache whose length whole blocks tile, up to ``MAX_UNROLLED_BLOCKS`` query blocks
  (:func:`self_blockwise_attention`): each query block is its own loop over exactly the key blocks it can see (the
  causal skip is in the loop bounds, static), only the blocks the diagonal crosses are masked, from the first query
  row that sees them;
* every other call (a KV-cache step, other lengths, a packed row) by the position-general loop
  (:func:`blockwise_attention`): every key block is visited and masked by positions, and for a packed row
  (``q_segment_ids`` / ``k_segment_ids``) by the documents too (maximal runs of equal ids, numbered over the whole
  row before the blocking: ``reference.document_ids``): a pair of blocks whose documents do not meet is
  computed under its mask, not skipped (its share is exp(NEG_INF - m) = 0).

The algorithm takes the few ops it needs as a :class:`TileOps` argument: :data:`PLAIN` here (no branch inside a
loop: each visited block is computed under its mask); the XLA:CPU implementation (its own file) runs this same code
with the XLA:CPU forms of them (its ``visit`` skips a key block wholly in a query block's future with a ``lax.cond``).

Declares ``blockwise`` (:data:`IMPLEMENTATIONS`): ``impl='auto'`` takes the tiles on every platform once Tq*Tk exceeds
``auto_threshold`` (the ``large`` flag of the call), after the platform's fused kernel and its CPU-tuned tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention import dispatch
from longctx.attention.dense.reference import NEG_INF, document_ids, visible
from longctx.attention.dispatch import ALL_PLATFORMS, Implementation


def _masked_visit(step, causal: bool, qpi, kmi, carry, skipped):
    """Every key block is computed, under its mask (a block wholly in the future adds exp(NEG_INF - m) = 0)."""
    return step(carry)


@dataclasses.dataclass(frozen=True)
class TileOps:
    """The ops the tiled algorithm takes as arguments (hashable: a static argument of its custom VJPs).

    rowsum_product(a, b): ``Σ_d a[..., d] b[..., d]`` in float32.
    swap_last(*xs):       each x with its last two axes swapped (one x: that array, else a tuple).
    matmul_tn(a_t, b, preferred_element_type=None): ``Σ_q a_t[..., i, q] b[..., q, j]`` as ``[..., i, j]``.
    visit(step, causal, qpi, kmi, carry, skipped): one key block of the position-general loop: ``step(carry)``,
        or ``skipped(carry)`` where (causal) the block's earliest key ``kmi`` lies after every query ``qpi``.
    """

    rowsum_product: Callable
    swap_last: Callable
    matmul_tn: Callable
    visit: Callable = _masked_visit


def _rowsum_product(a, b):
    return jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32), axis=-1)


def _swap_last(*xs):
    out = tuple(jnp.swapaxes(x, -1, -2) for x in xs)
    return out if len(xs) > 1 else out[0]


def _matmul_tn(a_t, b, precision=None, preferred_element_type=None):
    return jnp.einsum("...iq,...qj->...ij", a_t, b, precision=precision, preferred_element_type=preferred_element_type)


PLAIN = TileOps(rowsum_product=_rowsum_product, swap_last=_swap_last, matmul_tn=_matmul_tn)

# query blocks unrolled at most (each is a loop forward and one backward in the compiled program)
MAX_UNROLLED_BLOCKS = 32


def _pad_axis(x, axis: int, multiple: int, value=0):
    n = x.shape[axis]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, n_blocks: int, block: int):
    """[B, H, n*block, D] -> [n, B, H, block, D]."""
    B, H, _, D = x.shape
    return x.reshape(B, H, n_blocks, block, D).transpose(2, 0, 1, 3, 4)


def _unblocks(x, length: int):
    """[n, B, H, block, ...] -> [B, H, length, ...] (the inverse of _blocks, padding cut)."""
    n, B, H, block = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape(B, H, n * block, *x.shape[4:])[:, :, :length]


def _segment_blocks(ids, block: int):
    """Document numbers [B, T] (``reference.document_ids``) padded (0) and blocked as [n, B, block]; None stays None."""
    if ids is None:
        return None
    ids = _pad_axis(ids.astype(jnp.int32), 1, block)
    return jnp.moveaxis(ids.reshape(ids.shape[0], -1, block), 1, 0)


def _layout(q_pos, k_pos, k_valid, bq: int, bk: int):
    """Padded, blocked positions: query positions [nq, bq], key positions/validity [nk, bk], and the
    earliest valid key position of each key block [nk] (to skip blocks wholly in the future)."""
    qpos = _pad_axis(q_pos, 0, bq, value=jnp.iinfo(jnp.int32).max // 2)
    kpos = _pad_axis(k_pos, 0, bk)
    kval = _pad_axis(k_valid, 0, bk, value=False)
    qposb, kposb, kvalb = qpos.reshape(-1, bq), kpos.reshape(-1, bk), kval.reshape(-1, bk)
    kmin = jnp.min(jnp.where(kvalb, kposb, jnp.iinfo(jnp.int32).max), axis=1)
    return qposb, kposb, kvalb, kmin


def _softmax_step(carry, qi, ki, vi, mask=None, every_row_sees_a_key: bool = False):
    """One key block of the online softmax: carry (row max m, row sum l, unnormalised output acc) updated with the
    scores of qi (pre-scaled) against ki; ``mask`` [bq, bk] (None: every key visible). ``every_row_sees_a_key``
    (static): each row has a visible key in this block, so its new max is finite and exp(NEG_INF - max) is already
    0 where masked: the second select is skipped."""
    m, l, acc = carry
    s = jnp.einsum("bhqd,bhkd->bhqk", qi, ki, preferred_element_type=jnp.float32)  # statistics in float32
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    if mask is not None and not every_row_sees_a_key:  # a row that has seen no key yet: exp(s - m_new) = 1
        p = jnp.where(mask, p, 0.0)
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + jnp.einsum(
        "bhqk,bhkd->bhqd", p.astype(vi.dtype), vi, preferred_element_type=jnp.float32)


def _pair_grads(ops: TileOps, qi, ki, vi, doi, lsei, di, qi_t, doi_t, mask=None):
    """One (query block, key block) pair of FlashAttention-2's backward from the log-sum-exp lsei and
    di = rowsum(dO * O): its share of dq [.., bq, D] and, transposed, of dk [.., D, bk] and dv [.., Dv, bk].

    The key-side gradients contract over the queries; they are taken from qi_t, doi_t (qi, doi transposed,
    [.., D, bq], by the caller once per pass) as [D, bq] x [bq, bk] products (``ops.matmul_tn``)."""
    # operands in the compute dtype (q's), products accumulated in float32
    p = jnp.exp(jnp.einsum("bhqd,bhkd->bhqk", qi, ki, preferred_element_type=jnp.float32) - lsei[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    ds = p * (jnp.einsum("bhqd,bhkd->bhqk", doi, vi, preferred_element_type=jnp.float32) - di[..., None])
    p, ds = p.astype(qi.dtype), ds.astype(qi.dtype)
    return (jnp.einsum("bhqk,bhkd->bhqd", ds, ki, preferred_element_type=jnp.float32),
            ops.matmul_tn(qi_t, ds, preferred_element_type=jnp.float32),
            ops.matmul_tn(doi_t, p, preferred_element_type=jnp.float32))


# ----------------------------------------------------------------------------- the position-general loop
def _flash_forward(ops: TileOps, qb, kb, vb, qposb, kposb, kvalb, kmin, causal: bool, window: int = 0, qsegb=None,
                   ksegb=None):
    """Online softmax over key blocks for every query block. qb is pre-scaled, all fp32, blocked; ``qsegb``
    [nq, B, bq] / ``ksegb`` [nk, B, bk]: a packed row's document numbers (``reference.document_ids``; None: one
    document).
    Returns the output blocks [nq, B, H, bq, Dv] and the log-sum-exp [nq, B, H, bq]
    (NEG_INF for a query that sees no key)."""
    _, B, H, bq, _ = qb.shape
    Dv = vb.shape[-1]

    def one_query_block(args):
        qi, qpi, qsi = args

        def step(carry, xs):
            ki, vi, kpi, kvi, kmi, ksi = xs

            def compute(carry):
                return _softmax_step(carry, qi, ki, vi, visible(qpi, kpi, kvi, causal, window, qsi, ksi))

            return ops.visit(compute, causal, qpi, kmi, carry, lambda c: c), None

        init = (
            jnp.full((B, H, bq), NEG_INF, jnp.float32),
            jnp.zeros((B, H, bq), jnp.float32),
            jnp.zeros((B, H, bq, Dv), jnp.float32),
        )
        (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, kposb, kvalb, kmin, ksegb))
        out = acc / jnp.maximum(l, 1e-30)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), NEG_INF)
        return out, lse

    return jax.lax.map(one_query_block, (qb, qposb, qsegb))


def _flash_backward(ops: TileOps, qb, kb, vb, ob, lseb, dob, qposb, kposb, kvalb, kmin, causal: bool,
                    window: int = 0, qsegb=None, ksegb=None):
    """Gradients of the blocked attention from the saved log-sum-exp (FlashAttention-2's backward):
    each visited (query block, key block) pair recomputes its probabilities once and adds its share
    of dq (carried along the key blocks) and of dk, dv (summed over the query blocks)."""
    delta = ops.rowsum_product(dob, ob)  # [nq, B, H, bq]: rowsum(dO * O); float32
    dob = dob.astype(qb.dtype)  # the products' operands in the compute dtype
    qb_t, dob_t = ops.swap_last(qb, dob)
    zeros_k, zeros_v = (jnp.zeros(x.shape[1:-2] + x.shape[:-3:-1], jnp.float32) for x in (kb, vb))  # [B,H,D,bk]

    def query_block(dkv, xs):
        qi, doi, lsei, di, qpi, qi_t, doi_t, qsi = xs

        def key_block(dq, ys):
            ki, vi, kpi, kvi, kmi, ksi = ys

            def compute(dq):
                dqi, dk, dv = _pair_grads(ops, qi, ki, vi, doi, lsei, di, qi_t, doi_t,
                                          visible(qpi, kpi, kvi, causal, window, qsi, ksi))
                return dq + dqi, (dk, dv)

            return ops.visit(compute, causal, qpi, kmi, dq, lambda dq: (dq, (zeros_k, zeros_v)))

        dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qi.shape, jnp.float32),
                                    (kb, vb, kposb, kvalb, kmin, ksegb))
        return (dkv[0] + dk, dkv[1] + dv), dq

    init = tuple(jnp.zeros(x.shape[:1] + zeros.shape, jnp.float32) for x, zeros in ((kb, zeros_k), (vb, zeros_v)))
    (dk, dv), dq = jax.lax.scan(query_block, init, (qb, dob, lseb, delta, qposb, qb_t, dob_t, qsegb))
    return dq, jnp.swapaxes(dk, -1, -2), jnp.swapaxes(dv, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _blockwise(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk, ops, window, q_seg=None, k_seg=None):
    return _blockwise_fwd(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk, ops, window, q_seg, k_seg)[0]


def _blockwise_fwd(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk, ops, window, q_seg=None, k_seg=None):
    Tq, D = q.shape[2], q.shape[3]
    qb = _blocks(_pad_axis(q * D**-0.5, 2, bq), -(-Tq // bq), bq)
    kb = _blocks(_pad_axis(k, 2, bk), -(-k.shape[2] // bk), bk)
    vb = _blocks(_pad_axis(v, 2, bk), -(-k.shape[2] // bk), bk)
    layout = _layout(q_pos, k_pos, k_valid, bq, bk)
    segs = (_segment_blocks(q_seg, bq), _segment_blocks(k_seg, bk))
    ob, lseb = _flash_forward(ops, qb, kb, vb, *layout, causal, window, *segs)
    return _unblocks(ob, Tq), (qb, kb, vb, ob, lseb, layout, k_valid, segs)


def _blockwise_bwd(causal, bq, bk, ops, window, res, dout):
    qb, kb, vb, ob, lseb, layout, k_valid, segs = res
    Tq, Tk, D = dout.shape[2], k_valid.shape[0], qb.shape[-1]
    dob = _blocks(_pad_axis(dout, 2, bq), ob.shape[0], bq)
    dq, dk, dv = _flash_backward(ops, qb, kb, vb, ob, lseb, dob, *layout, causal, window, *segs)
    return ((_unblocks(dq, Tq) * D**-0.5).astype(qb.dtype), _unblocks(dk, Tk).astype(kb.dtype),
            _unblocks(dv, Tk).astype(vb.dtype), None, None, None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_q: int, block_k: int,
                        ops: TileOps = PLAIN, window: int = 0, q_segment_ids=None, k_segment_ids=None):
    """Exact attention by online softmax over key blocks (memory O(block_q*block_k)), with
    FlashAttention-2's backward: only the output and the per-query log-sum-exp are saved, and the
    backward recomputes each visited block's probabilities once. ``window`` > 0: the sliding window, by the
    positions' mask (every key block is visited). ``q_segment_ids`` [B, Tq] / ``k_segment_ids`` [B, Tk]: a packed
    row's documents (a key is visible only from its own document's queries; a document is a maximal run of equal
    ids, numbered here over the whole row, ``reference.document_ids``)."""
    Tq, Tk = q.shape[2], k.shape[2]
    bq, bk = min(block_q, Tq), min(block_k, Tk)
    cd = lambda x: x.astype(jnp.promote_types(q.dtype, v.dtype))  # noqa: E731  (the compute dtype; statistics fp32)
    docs = (None, None) if q_segment_ids is None else document_ids(q_segment_ids, k_segment_ids)  # whole-row numbers
    out = _blockwise(cd(q), cd(k), cd(v), q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), k_valid.astype(bool),
                     causal, bq, bk, ops, window, *docs)
    return out.astype(v.dtype)


# ----------------------------------------------------------------------------- self-attention over whole blocks
# A full pass with no cache (training, scoring a row): query i and key i are position i, every key is real. The
# block structure is then static, so each query block is its own unrolled loop over exactly the key blocks it can
# see (no branch per step, no mask on the blocks wholly in its past), and XLA may run query blocks side by side.


def _visible(i: int, bq: int, bk: int, nk: int, causal: bool) -> tuple[int, int]:
    """(key blocks wholly visible to every query of block i, key blocks it sees at all)."""
    if not causal:
        return nk, nk
    return min(nk, (i * bq + 1) // bk), min(nk, -(-(i + 1) * bq // bk))


def _first_row(i: int, j: int, bq: int, bk: int) -> int:
    """The first row of causal query block i that sees key block j (the rows above see none of it and are not
    scored: with query blocks twice the key blocks, a quarter of the diagonal's scores are skipped)."""
    return min(bq - 1, max(0, j * bk - i * bq))


def _diag_mask(i: int, j: int, bq: int, bk: int):
    """[bq, bk] causal mask of query block i against key block j, as a numpy constant: XLA:CPU ran the exp and
    select fusions markedly slower with the mask computed in them from iotas."""
    return (j * bk + np.arange(bk))[None, :] <= (i * bq + np.arange(bq))[:, None]


def _pair_visibility(i: int, j: int, bq: int, bk: int, causal: bool, window: int) -> tuple[bool, bool]:
    """(every query of block i sees every key of block j, some query of block i sees some key of it): the offsets
    r - c of the block pair run over [r0 - c1, r1 - c0], every integer between; visible offsets are [0, W - 1]
    (causal) or [-(W - 1), W - 1] (bidirectional), W = ``window`` (0: unbounded)."""
    lo, hi = i * bq - ((j + 1) * bk - 1), (i + 1) * bq - 1 - j * bk
    vis_hi = window - 1 if window else max(abs(lo), abs(hi))
    vis_lo = 0 if causal else -vis_hi
    return vis_lo <= lo and hi <= vis_hi, hi >= vis_lo and lo <= vis_hi


def _block_plan(i: int, bq: int, bk: int, nk: int, causal: bool, window: int):
    """Query block i's key blocks: (lo, hi, partial): blocks lo..hi-1 wholly visible to every query of the block,
    and the blocks it sees only in part, in order (the diagonal's, and with a sliding window its far edge's). No
    window: :func:`_visible`'s blocks."""
    if not window:
        full, seen = _visible(i, bq, bk, nk, causal)
        return 0, full, list(range(full, seen))
    vis = [_pair_visibility(i, j, bq, bk, causal, window) for j in range(nk)]
    full = [j for j, (a, _) in enumerate(vis) if a]
    lo, hi = (full[0], full[-1] + 1) if full else (0, 0)
    return lo, hi, [j for j, (a, b) in enumerate(vis) if b and not a]


def _block_mask(i: int, j: int, bq: int, bk: int, causal: bool, window: int):
    """[bq, bk] mask of query block i against key block j (numpy constant; :func:`_diag_mask` without a window)."""
    if causal and not window:
        return _diag_mask(i, j, bq, bk)
    d = (i * bq + np.arange(bq))[:, None] - (j * bk + np.arange(bk))[None, :]
    m = d >= 0 if causal else np.ones(d.shape, bool)
    if window:
        m &= (d < window) & (causal or d > -window)
    return m


def _key_blocks(x, lo: int, hi: int, bk: int):
    """Key blocks lo..hi-1 of x [B, H, T, D] as [hi - lo, B, H, bk, D]."""
    B, H, _, D = x.shape
    return jnp.moveaxis(x[:, :, lo * bk:hi * bk].reshape(B, H, hi - lo, bk, D), 2, 0)


def _self_forward(qs, k, v, causal: bool, bq: int, bk: int, window: int = 0):
    """Online softmax for each query block over its visible key blocks (``window``: only those the sliding window
    reaches; the blocks wholly outside it are never read). qs is pre-scaled. Returns out [B,H,T,Dv] and the
    log-sum-exp [B,H,T]."""
    B, H, T, _ = qs.shape
    nk = T // bk
    kb, vb = _key_blocks(k, 0, nk, bk), _key_blocks(v, 0, nk, bk)  # [nk, B, H, bk, .]: blocked once per pass
    outs, lses = [], []
    for i in range(T // bq):
        qi = qs[:, :, i * bq:(i + 1) * bq]
        lo, full, partial = _block_plan(i, bq, bk, nk, causal, window)

        carry = (jnp.full((B, H, bq), NEG_INF, jnp.float32), jnp.zeros((B, H, bq), jnp.float32),
                 jnp.zeros((B, H, bq, v.shape[-1]), jnp.float32))
        if full > lo:
            # a loop over block indices reading kb, vb in place (a scan over kb[:full] copied the slice every time)
            carry = jax.lax.fori_loop(lo, full, lambda j, c, qi=qi: _softmax_step(c, qi, kb[j], vb[j]), carry)
        for j in partial:  # the blocks seen in part: masked, from the first row that sees them
            r0 = _first_row(i, j, bq, bk) if causal else 0
            tail = _softmax_step(tuple(c[:, :, r0:] for c in carry), qi[:, :, r0:], k[:, :, j * bk:(j + 1) * bk],
                                 v[:, :, j * bk:(j + 1) * bk], _block_mask(i, j, bq, bk, causal, window)[r0:],
                                 not window)
            carry = tail if r0 == 0 else tuple(jnp.concatenate([c[:, :, :r0], t], axis=2) for c, t in zip(carry, tail))
        m, l, acc = carry
        outs.append(acc / l[..., None])  # l >= 1: the row max contributes exp(0)
        lses.append(m + jnp.log(l))
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


def _self_backward(ops: TileOps, qs, k, v, out, lse, do, causal: bool, bq: int, bk: int, window: int = 0):
    """FlashAttention-2's backward per query block from the saved log-sum-exp: dq carried along its key blocks,
    each (query block, key block) pair's dk, dv added to that key block's."""
    B, H, T, D = qs.shape
    nk = T // bk
    kb, vb = _key_blocks(k, 0, nk, bk), _key_blocks(v, 0, nk, bk)
    delta = ops.rowsum_product(do, out)  # float32
    do = do.astype(qs.dtype)  # the products' operands in the compute dtype
    qs_t, do_t = ops.swap_last(qs, do)  # [B,H,D,T]
    dk = jnp.zeros((nk, B, H, D, bk), jnp.float32)  # transposed, as _pair_grads gives them
    dv = jnp.zeros((nk, B, H, v.shape[-1], bk), jnp.float32)
    dqs = []
    for i in range(T // bq):
        rows = lambda x, i=i: x[:, :, i * bq:(i + 1) * bq]  # noqa: E731
        cols = lambda x, i=i: x[..., i * bq:(i + 1) * bq]  # noqa: E731
        qi, doi, li, di, qi_t, doi_t = rows(qs), rows(do), rows(lse), rows(delta), cols(qs_t), cols(do_t)
        lo, full, partial = _block_plan(i, bq, bk, nk, causal, window)

        def pair(dq, kj, vj, mask=None, qi=qi, doi=doi, li=li, di=di, qi_t=qi_t, doi_t=doi_t):
            dqi, dkj, dvj = _pair_grads(ops, qi, kj, vj, doi, li, di, qi_t, doi_t, mask)
            return dq + dqi, (dkj, dvj)

        dq = jnp.zeros(qi.shape, jnp.float32)
        if full > lo:
            def visible_block(j, c, pair=pair):  # dk, dv of key block j updated in place
                dq, dk, dv = c
                dq, (dkj, dvj) = pair(dq, kb[j], vb[j])
                return dq, dk.at[j].add(dkj), dv.at[j].add(dvj)

            dq, dk, dv = jax.lax.fori_loop(lo, full, visible_block, (dq, dk, dv))
        for j in partial:  # as the forward: the rows from the first that sees key block j
            r0 = _first_row(i, j, bq, bk) if causal else 0
            dqi, dkj, dvj = _pair_grads(ops, qi[:, :, r0:], k[:, :, j * bk:(j + 1) * bk],
                                        v[:, :, j * bk:(j + 1) * bk], doi[:, :, r0:], li[:, :, r0:], di[:, :, r0:],
                                        qi_t[..., r0:], doi_t[..., r0:], _block_mask(i, j, bq, bk, causal, window)[r0:])
            dq = dq + dqi if r0 == 0 else jnp.concatenate([dq[:, :, :r0], dq[:, :, r0:] + dqi], axis=2)
            dk, dv = dk.at[j].add(dkj), dv.at[j].add(dvj)
        dqs.append(dq)
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, H, T, x.shape[-1])  # noqa: E731
    return jnp.concatenate(dqs, axis=2), unblock(jnp.swapaxes(dk, -1, -2)), unblock(jnp.swapaxes(dv, -1, -2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _self_blocks(q, k, v, causal, bq, bk, ops, window):
    return _self_forward(q * q.shape[-1] ** -0.5, k, v, causal, bq, bk, window)[0]


def _self_blocks_fwd(q, k, v, causal, bq, bk, ops, window):
    qs = q * q.shape[-1] ** -0.5
    out, lse = _self_forward(qs, k, v, causal, bq, bk, window)
    return out, (qs, k, v, out, lse)


def _self_blocks_bwd(causal, bq, bk, ops, window, res, do):
    qs, k, v, out, lse = res
    dq, dk, dv = _self_backward(ops, qs, k, v, out, lse, do, causal, bq, bk, window)
    return (dq * qs.shape[-1] ** -0.5).astype(qs.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_self_blocks.defvjp(_self_blocks_fwd, _self_blocks_bwd)


def self_blocks_apply(T: int, block_q: int, block_k: int, max_unrolled: int = MAX_UNROLLED_BLOCKS) -> bool:
    """Whether a full pass over T tokens takes the unrolled self-attention structure: whole blocks only, and not more
    than ``max_unrolled`` query blocks (longer passes take the position-general loop)."""
    bq, bk = min(block_q, T), min(block_k, T)
    return T % bq == 0 and T % bk == 0 and T // bq <= max_unrolled


def self_blockwise_attention(q, k, v, *, causal: bool, block_q: int, block_k: int, ops: TileOps = PLAIN,
                             window: int = 0):
    """Exact self-attention of a full pass (query and key i at position i, every key real) by whole blocks: the
    same function and backward as :func:`blockwise_attention` with positions ``arange(T)``; T must be a multiple
    of both block sizes (:func:`self_blocks_apply`)."""
    T = q.shape[2]
    bq, bk = min(block_q, T), min(block_k, T)
    cd = lambda x: x.astype(jnp.promote_types(q.dtype, v.dtype))  # noqa: E731  (the compute dtype; statistics fp32)
    return _self_blocks(cd(q), cd(k), cd(v), causal, bq, bk, ops, window).astype(v.dtype)


# ----------------------------------------------------------------------------- one query against a cache
def one_query_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_k: int, window: int = 0,
                        layer=None, q_segment_ids=None, k_segment_ids=None):
    """A decoding step's attention: one query q [B,H,1,D] against every key of a cache k, v [B,H,M,.] (positions
    in any order: a ring cache's), by online softmax over key blocks of ``block_k`` read as slices of the cache
    (the last block ends at M and skips the keys before it already seen). The cache is read where it lies: the
    position-general loop's blocked copy of the keys, or one product over the whole cache, made XLA:CPU copy the
    cache every token (a written, donated state could not be updated in place: ``DenseAttention.prepare``). The
    cache may be stored wider than the compute dtype (q's): each block is cast as it is read. Output in q's dtype.
    ``layer`` (int32): k, v are a scanned stack's caches [L, B, H, M, .] and the query attends to that layer's,
    read by the same slices (a slice of the layer's cache first would be a copy of it). ``q_segment_ids`` [B, 1],
    ``k_segment_ids`` [B, M] (a packed row, keys in any order): the query's document is the keys after the newest
    valid key of another id (a document is a run of equal ids in position order), found in one pass over the ids."""
    M, D = k.shape[-2], q.shape[3]
    bk = min(block_k, M)
    cd = lambda x: x.astype(q.dtype)  # noqa: E731  (the compute dtype; statistics fp32)
    qs = cd(q * D**-0.5)
    kpos, kval = k_pos.astype(jnp.int32), k_valid.astype(bool)
    doc = None  # [B, 1, 1, 1]: the first position of the query's document
    if q_segment_ids is not None:
        other = (k_segment_ids.astype(jnp.int32) != q_segment_ids.astype(jnp.int32)) & kval[None, :]
        doc = jnp.max(jnp.where(other, kpos[None, :] + 1, jnp.iinfo(jnp.int32).min), axis=1)[:, None, None, None]

    def block(x, start):  # keys start..start+bk of the cache [B, H, M, .] (of the layer's, in a stack)
        if layer is None:
            return jax.lax.dynamic_slice_in_dim(x, start, bk, axis=2)
        return jax.lax.dynamic_slice(x, (layer, 0, 0, start, 0), (1, *x.shape[1:3], bk, x.shape[4]))[0]

    def step(carry, j):
        start = jnp.minimum(j * bk, M - bk)
        at = lambda x: jax.lax.dynamic_slice_in_dim(x, start, bk, axis=0)  # noqa: E731
        fresh = start + jnp.arange(bk, dtype=jnp.int32) >= j * bk  # the last block's keys not seen before
        mask = visible(q_pos, at(kpos), at(kval) & fresh, causal, window)
        if doc is not None:
            mask = mask & (at(kpos) >= doc)  # [B, 1, 1, bk]
        return _softmax_step(carry, qs, cd(block(k, start)), cd(block(v, start)), mask), None

    B, H = q.shape[:2]
    init = (jnp.full((B, H, 1), NEG_INF, jnp.float32), jnp.zeros((B, H, 1), jnp.float32),
            jnp.zeros((B, H, 1, v.shape[-1]), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(-(-M // bk), dtype=jnp.int32))
    return (acc / jnp.maximum(l, 1e-30)[..., None]).astype(q.dtype)


def tiled(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_q: int, block_k: int, full_pass: bool = False,
          ops: TileOps = PLAIN, max_unrolled: int = MAX_UNROLLED_BLOCKS, window: int = 0, q_segment_ids=None,
          k_segment_ids=None, layer=None):
    """The tiled algorithm with ``ops``: the unrolled structure for a full pass (``full_pass``, static: q_pos =
    k_pos = arange(T), every key valid) of one document that whole blocks tile, one query against a cache
    (:func:`one_query_attention`: a decoding step; ``layer``: in a scanned stack's caches), else the
    position-general loop (a packed row's too: its visibility is not static)."""
    if not full_pass and q.shape[2] == 1:
        return one_query_attention(q, k, v, q_pos, k_pos, k_valid, causal=causal, block_k=block_k, window=window,
                                   layer=layer, q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids)
    if layer is not None:
        raise ValueError("dense tiles: a scanned stack's caches are read by a decoding step only")
    if full_pass and q_segment_ids is None and self_blocks_apply(q.shape[2], block_q, block_k, max_unrolled):
        return self_blockwise_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k, ops=ops,
                                        window=window)
    return blockwise_attention(q, k, v, q_pos, k_pos, k_valid, causal=causal, block_q=block_q, block_k=block_k,
                               ops=ops, window=window, q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids)


def attend(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_q: int, block_k: int, full_pass: bool = False,
           window: int = 0, q_segment_ids=None, k_segment_ids=None, layer=None):
    """The ``blockwise`` implementation: :func:`tiled` with :data:`PLAIN` ops."""
    return tiled(q, k, v, q_pos, k_pos, k_valid, causal=causal, block_q=block_q, block_k=block_k,
                 full_pass=full_pass, ops=PLAIN, window=window, q_segment_ids=q_segment_ids,
                 k_segment_ids=k_segment_ids, layer=layer)


def prefers_long_rows(platform: str, *, large: bool = False, narrow_window: bool = False, one_query: bool = False,
                      **_) -> bool:
    """Where 'auto' takes tiles: calls with Tq*Tk past ``auto_threshold`` (``large``), sliding windows of at most
    half the keys (``narrow_window``: the tiles skip the key blocks outside the window) and decoding steps
    (``one_query``: one query of one stream against a cache, :func:`one_query_attention`); other calls take the
    reference's one softmax."""
    return large or narrow_window or one_query


@dataclasses.dataclass(frozen=True)
class Tiles(dispatch.Runner):
    """The ``blockwise`` runner: its knobs are the tiles (``block_q``, ``block_k``, as they run on the selection's
    platform); it reads everything else from ``call.inputs`` (dense's ``prepare``: q, k, v, positions, validity,
    segment ids, ``full_pass``, ``window``, ``causal``), so it runs without a core too (``dense.attend``).
    ``tiled``: the tiled entry it calls (the XLA:CPU form overrides it)."""

    block_q: int
    block_k: int
    tiled: ClassVar[Callable] = staticmethod(attend)

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        bq, bk = window_blocks(self.block_q, self.block_k, x["window"])
        return dispatch.Result(type(self).tiled(
            x["q"], x["k"], x["v"], x["q_pos"], x["k_pos"], x["k_valid"], causal=x["causal"], block_q=bq,
            block_k=bk, full_pass=x["full_pass"], window=x["window"], q_segment_ids=x["q_segment_ids"],
            k_segment_ids=x["k_segment_ids"], layer=x.get("layer")))


def window_blocks(block_q: int, block_k: int, window: int) -> tuple[int, int]:
    """The tiles' blocks for a sliding window of ``window`` keys (0: none): each no larger than the window rounded
    up to a power of two, so that a query block reaches its own key block and the one before and the tiles skip
    the rest (a larger block only adds masked work: the CPU's 1024 x 512 would visit every key of a 1k row for a
    window of 128)."""
    if not window:
        return block_q, block_k
    fit = 1 << max(0, window - 1).bit_length()
    return min(block_q, fit), min(block_k, fit)


# query / key blocks by platform (0 in the config). cpu: on a 2-core CPU, 1024x512 was the fastest of 1024x512,
# 512x512 and 512x256 for a causal forward+backward at 8k, in the unrolled full pass and in the loop alike (another
# CPU preferred 512x256 for the loop: rerun `longctx-bench attention` when it matters). GPU / TPU (where these tiles
# run only when the fused kernel refuses a call): 512x512 score tiles, not yet measured on a GPU or TPU.
BLOCKS = {"block_q": {"cpu": 1024, "default": 512}, "block_k": {"cpu": 512, "default": 512}}

# 'auto' on every platform: after the fused kernel (cuda, tpu) and the CPU-tuned tiles (cpu), for long calls only
TILES_RANK = 2
IMPLEMENTATIONS = (
    Implementation("blockwise", config={"impl": "blockwise"}, test_config={"block_q": 8, "block_k": 8},
                   auto={p: TILES_RANK for p in ALL_PLATFORMS}, prefer=prefers_long_rows, code=Tiles,
                   defaults=BLOCKS),
)


__all__ = ["BLOCKS", "IMPLEMENTATIONS", "MAX_UNROLLED_BLOCKS", "PLAIN", "TileOps", "Tiles", "attend", "prefers_long_rows", "blockwise_attention", "one_query_attention", "self_blocks_apply",
           "self_blockwise_attention", "tiled", "window_blocks"]

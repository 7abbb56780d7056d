"""Exact softmax attention, the baseline every method is compared with (method notes: docs/methods/dense.md).

Two paths compute the same function:

* ``naive``: materializes the [Tq, Tk] score matrix.
* ``blockwise``: online softmax over key blocks inside query blocks, so memory
  is O(block_q * block_k) per head; causal key blocks wholly in the future are
  skipped. Runs 65k-token forwards on a CPU. A full pass without a cache whose
  length is a multiple of both block sizes (up to 32 query blocks) takes the
  same algorithm with its block structure unrolled (:func:`self_blockwise_attention`:
  each query block loops over exactly its visible key blocks, only the blocks
  the diagonal crosses are masked); other calls take the position-general loop.

The state is a KV cache of fixed capacity (``init_state(batch, max_len)``);
slots are right-aligned, so slot j of a cache of capacity M that has seen
``length`` tokens holds absolute position ``length - M + j`` (invalid when < 0).
Feeding more than ``max_len`` tokens in total raises :class:`CapacityError`
(under jit too), unless ``kv_window=True`` names the sliding-window cache as
a feature: then the cache keeps the newest ``max_len`` keys and older ones are
dropped by design (Transformer-XL-style memory, not exact attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from longctx.attention import dense_platform, dispatch
from longctx.attention.base import AttentionCore, ContractCase, DropIn, check_capacity, check_qkv, require
from longctx.models.precision import einsum_f32
from longctx.xla_cpu import rowdot, rows_dot, transposed

NEG_INF = -1e30


def positions_mask(q_pos, k_pos, k_valid, causal: bool):
    """[Tq, Tk] boolean: key visible to query."""
    mask = k_valid[None, :]
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    return mask


def naive_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool):
    """Reference exact attention with explicit positions. Shapes as the contract."""
    scale = q.shape[-1] ** -0.5
    s = einsum_f32("bhqd,bhkd->bhqk", q, k.astype(q.dtype)) * scale  # compute-dtype operands, fp32 statistics
    mask = positions_mask(q_pos, k_pos, k_valid, causal)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(m)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = einsum_f32("bhqk,bhkd->bhqd", p.astype(v.dtype), v) / jnp.maximum(den, 1e-30)
    return out.astype(v.dtype)


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


def _layout(q_pos, k_pos, k_valid, bq: int, bk: int):
    """Padded, blocked positions: query positions [nq, bq], key positions/validity [nk, bk], and the
    earliest valid key position of each key block [nk] (to skip blocks wholly in the future)."""
    qpos = _pad_axis(q_pos, 0, bq, value=jnp.iinfo(jnp.int32).max // 2)
    kpos = _pad_axis(k_pos, 0, bk)
    kval = _pad_axis(k_valid, 0, bk, value=False)
    qposb, kposb, kvalb = qpos.reshape(-1, bq), kpos.reshape(-1, bk), kval.reshape(-1, bk)
    kmin = jnp.min(jnp.where(kvalb, kposb, jnp.iinfo(jnp.int32).max), axis=1)
    return qposb, kposb, kvalb, kmin


def _visit(step, causal: bool, qpi, kmi, carry, skipped):
    """Run ``step(carry)`` unless the key block lies wholly after every query of the block (causal)."""
    if not causal:
        return step(carry)
    return jax.lax.cond(kmi <= jnp.max(qpi), step, skipped, carry)


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


def _pair_grads(qi, ki, vi, doi, lsei, di, qi_t, doi_t, mask=None):
    """One (query block, key block) pair of FlashAttention-2's backward from the log-sum-exp lsei and
    di = rowsum(dO * O): its share of dq [.., bq, D] and, transposed, of dk [.., D, bk] and dv [.., Dv, bk].

    The key-side gradients contract over the queries; they are taken from qi_t, doi_t (qi, doi transposed,
    [.., D, bq], by the caller once per pass) as plain [D, bq] x [bq, bk] products (``longctx.xla_cpu.rows_dot``:
    contracting the row axis of both operands as laid out, XLA:CPU falls back to a generic dot at about half the
    rate; see docs/DESIGN.md 'Where the time goes')."""
    # operands in the compute dtype (q's), products accumulated in float32
    p = jnp.exp(jnp.einsum("bhqd,bhkd->bhqk", qi, ki, preferred_element_type=jnp.float32) - lsei[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    ds = p * (jnp.einsum("bhqd,bhkd->bhqk", doi, vi, preferred_element_type=jnp.float32) - di[..., None])
    p, ds = p.astype(qi.dtype), ds.astype(qi.dtype)
    return (jnp.einsum("bhqk,bhkd->bhqd", ds, ki, preferred_element_type=jnp.float32),
            rows_dot(qi_t, ds, preferred_element_type=jnp.float32), rows_dot(doi_t, p, preferred_element_type=jnp.float32))


def _flash_forward(qb, kb, vb, qposb, kposb, kvalb, kmin, causal: bool):
    """Online softmax over key blocks for every query block. qb is pre-scaled, all fp32, blocked.
    Returns the output blocks [nq, B, H, bq, Dv] and the log-sum-exp [nq, B, H, bq]
    (NEG_INF for a query that sees no key)."""
    _, B, H, bq, _ = qb.shape
    Dv = vb.shape[-1]

    def one_query_block(args):
        qi, qpi = args

        def step(carry, xs):
            ki, vi, kpi, kvi, kmi = xs

            def compute(carry):
                return _softmax_step(carry, qi, ki, vi, positions_mask(qpi, kpi, kvi, causal))

            return _visit(compute, causal, qpi, kmi, carry, lambda c: c), None

        init = (
            jnp.full((B, H, bq), NEG_INF, jnp.float32),
            jnp.zeros((B, H, bq), jnp.float32),
            jnp.zeros((B, H, bq, Dv), jnp.float32),
        )
        (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, kposb, kvalb, kmin))
        out = acc / jnp.maximum(l, 1e-30)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), NEG_INF)
        return out, lse

    return jax.lax.map(one_query_block, (qb, qposb))


def _flash_backward(qb, kb, vb, ob, lseb, dob, qposb, kposb, kvalb, kmin, causal: bool):
    """Gradients of the blocked attention from the saved log-sum-exp (FlashAttention-2's backward):
    each visible (query block, key block) pair recomputes its probabilities once and adds its share
    of dq (carried along the key blocks) and of dk, dv (summed over the query blocks)."""
    delta = rowdot(dob, ob)  # [nq, B, H, bq]: rowsum(dO * O), as a dot (longctx.xla_cpu); float32
    dob = dob.astype(qb.dtype)  # the products' operands in the compute dtype
    qb_t, dob_t = transposed(qb, dob)
    zeros_k, zeros_v = (jnp.zeros(x.shape[1:-2] + x.shape[:-3:-1], jnp.float32) for x in (kb, vb))  # [B,H,D,bk]

    def query_block(dkv, xs):
        qi, doi, lsei, di, qpi, qi_t, doi_t = xs

        def key_block(dq, ys):
            ki, vi, kpi, kvi, kmi = ys

            def compute(dq):
                dqi, dk, dv = _pair_grads(qi, ki, vi, doi, lsei, di, qi_t, doi_t, positions_mask(qpi, kpi, kvi, causal))
                return dq + dqi, (dk, dv)

            return _visit(compute, causal, qpi, kmi, dq, lambda dq: (dq, (zeros_k, zeros_v)))

        dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qi.shape, jnp.float32), (kb, vb, kposb, kvalb, kmin))
        return (dkv[0] + dk, dkv[1] + dv), dq

    init = tuple(jnp.zeros(x.shape[:1] + zeros.shape, jnp.float32) for x, zeros in ((kb, zeros_k), (vb, zeros_v)))
    (dk, dv), dq = jax.lax.scan(query_block, init, (qb, dob, lseb, delta, qposb, qb_t, dob_t))
    return dq, jnp.swapaxes(dk, -1, -2), jnp.swapaxes(dv, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _blockwise(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk):
    return _blockwise_fwd(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk)[0]


def _blockwise_fwd(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk):
    Tq, D = q.shape[2], q.shape[3]
    qb = _blocks(_pad_axis(q * D**-0.5, 2, bq), -(-Tq // bq), bq)
    kb = _blocks(_pad_axis(k, 2, bk), -(-k.shape[2] // bk), bk)
    vb = _blocks(_pad_axis(v, 2, bk), -(-k.shape[2] // bk), bk)
    layout = _layout(q_pos, k_pos, k_valid, bq, bk)
    ob, lseb = _flash_forward(qb, kb, vb, *layout, causal)
    return _unblocks(ob, Tq), (qb, kb, vb, ob, lseb, layout, k_valid)


def _blockwise_bwd(causal, bq, bk, res, dout):
    qb, kb, vb, ob, lseb, layout, k_valid = res
    Tq, Tk, D = dout.shape[2], k_valid.shape[0], qb.shape[-1]
    dob = _blocks(_pad_axis(dout, 2, bq), ob.shape[0], bq)
    dq, dk, dv = _flash_backward(qb, kb, vb, ob, lseb, dob, *layout, causal)
    return ((_unblocks(dq, Tq) * D**-0.5).astype(qb.dtype), _unblocks(dk, Tk).astype(kb.dtype),
            _unblocks(dv, Tk).astype(vb.dtype), None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_q: int, block_k: int):
    """Exact attention by online softmax over key blocks (memory O(block_q*block_k)), with
    FlashAttention-2's backward: only the output and the per-query log-sum-exp are saved, and the
    backward recomputes each visible block's probabilities once."""
    Tq, Tk = q.shape[2], k.shape[2]
    bq, bk = min(block_q, Tq), min(block_k, Tk)
    cd = lambda x: x.astype(jnp.promote_types(q.dtype, v.dtype))  # noqa: E731  (the compute dtype; statistics fp32)
    out = _blockwise(cd(q), cd(k), cd(v), q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), k_valid.astype(bool),
                     causal, bq, bk)
    return out.astype(v.dtype)


# ----------------------------------------------------------------------------- self-attention over whole blocks
# A full pass with no cache (training, scoring a row): query i and key i are position i, every key is real. The
# block structure is then static, so each query block is its own unrolled loop over exactly the key blocks it can
# see (no `cond` per step, no mask on the blocks wholly in its past), and XLA may run query blocks side by side.


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


def _key_blocks(x, lo: int, hi: int, bk: int):
    """Key blocks lo..hi-1 of x [B, H, T, D] as [hi - lo, B, H, bk, D]."""
    B, H, _, D = x.shape
    return jnp.moveaxis(x[:, :, lo * bk:hi * bk].reshape(B, H, hi - lo, bk, D), 2, 0)


def _self_forward(qs, k, v, causal: bool, bq: int, bk: int):
    """Online softmax for each query block over its visible key blocks. qs is pre-scaled. Returns out [B,H,T,Dv] and
    the log-sum-exp [B,H,T]."""
    B, H, T, _ = qs.shape
    nk = T // bk
    kb, vb = _key_blocks(k, 0, nk, bk), _key_blocks(v, 0, nk, bk)  # [nk, B, H, bk, .]: blocked once per pass
    outs, lses = [], []
    for i in range(T // bq):
        qi = qs[:, :, i * bq:(i + 1) * bq]
        full, seen = _visible(i, bq, bk, nk, causal)

        carry = (jnp.full((B, H, bq), NEG_INF, jnp.float32), jnp.zeros((B, H, bq), jnp.float32),
                 jnp.zeros((B, H, bq, v.shape[-1]), jnp.float32))
        if full:
            # a loop over block indices reading kb, vb in place (a scan over kb[:full] copied the slice every time)
            carry = jax.lax.fori_loop(0, full, lambda j, c, qi=qi: _softmax_step(c, qi, kb[j], vb[j]), carry)
        for j in range(full, seen):  # the blocks the diagonal crosses: masked, from the first row that sees them
            r0 = _first_row(i, j, bq, bk)
            tail = _softmax_step(tuple(c[:, :, r0:] for c in carry), qi[:, :, r0:], k[:, :, j * bk:(j + 1) * bk],
                                 v[:, :, j * bk:(j + 1) * bk], _diag_mask(i, j, bq, bk)[r0:], True)
            carry = tail if r0 == 0 else tuple(jnp.concatenate([c[:, :, :r0], t], axis=2) for c, t in zip(carry, tail))
        m, l, acc = carry
        outs.append(acc / l[..., None])  # l >= 1: the row max contributes exp(0)
        lses.append(m + jnp.log(l))
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


def _self_backward(qs, k, v, out, lse, do, causal: bool, bq: int, bk: int):
    """FlashAttention-2's backward per query block from the saved log-sum-exp: dq carried along its key blocks,
    each (query block, key block) pair's dk, dv added to that key block's."""
    B, H, T, D = qs.shape
    nk = T // bk
    kb, vb = _key_blocks(k, 0, nk, bk), _key_blocks(v, 0, nk, bk)
    delta = rowdot(do, out)  # float32
    do = do.astype(qs.dtype)  # the products' operands in the compute dtype
    qs_t, do_t = transposed(qs, do)  # [B,H,D,T]
    dk = jnp.zeros((nk, B, H, D, bk), jnp.float32)  # transposed, as _pair_grads gives them
    dv = jnp.zeros((nk, B, H, v.shape[-1], bk), jnp.float32)
    dqs = []
    for i in range(T // bq):
        rows = lambda x, i=i: x[:, :, i * bq:(i + 1) * bq]  # noqa: E731
        cols = lambda x, i=i: x[..., i * bq:(i + 1) * bq]  # noqa: E731
        qi, doi, li, di, qi_t, doi_t = rows(qs), rows(do), rows(lse), rows(delta), cols(qs_t), cols(do_t)
        full, seen = _visible(i, bq, bk, nk, causal)

        def pair(dq, kj, vj, mask=None, qi=qi, doi=doi, li=li, di=di, qi_t=qi_t, doi_t=doi_t):
            dqi, dkj, dvj = _pair_grads(qi, kj, vj, doi, li, di, qi_t, doi_t, mask)
            return dq + dqi, (dkj, dvj)

        dq = jnp.zeros(qi.shape, jnp.float32)
        if full:
            def visible_block(j, c, pair=pair):  # dk, dv of key block j updated in place
                dq, dk, dv = c
                dq, (dkj, dvj) = pair(dq, kb[j], vb[j])
                return dq, dk.at[j].add(dkj), dv.at[j].add(dvj)

            dq, dk, dv = jax.lax.fori_loop(0, full, visible_block, (dq, dk, dv))
        for j in range(full, seen):  # as the forward: the rows from the first that sees key block j
            r0 = _first_row(i, j, bq, bk)
            dqi, dkj, dvj = _pair_grads(qi[:, :, r0:], k[:, :, j * bk:(j + 1) * bk], v[:, :, j * bk:(j + 1) * bk],
                                        doi[:, :, r0:], li[:, :, r0:], di[:, :, r0:], qi_t[..., r0:], doi_t[..., r0:],
                                        _diag_mask(i, j, bq, bk)[r0:])
            dq = dq + dqi if r0 == 0 else jnp.concatenate([dq[:, :, :r0], dq[:, :, r0:] + dqi], axis=2)
            dk, dv = dk.at[j].add(dkj), dv.at[j].add(dvj)
        dqs.append(dq)
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, H, T, x.shape[-1])  # noqa: E731
    return jnp.concatenate(dqs, axis=2), unblock(jnp.swapaxes(dk, -1, -2)), unblock(jnp.swapaxes(dv, -1, -2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _self_blocks(q, k, v, causal, bq, bk):
    return _self_forward(q * q.shape[-1] ** -0.5, k, v, causal, bq, bk)[0]


def _self_blocks_fwd(q, k, v, causal, bq, bk):
    qs = q * q.shape[-1] ** -0.5
    out, lse = _self_forward(qs, k, v, causal, bq, bk)
    return out, (qs, k, v, out, lse)


def _self_blocks_bwd(causal, bq, bk, res, do):
    qs, k, v, out, lse = res
    dq, dk, dv = _self_backward(qs, k, v, out, lse, do, causal, bq, bk)
    return (dq * qs.shape[-1] ** -0.5).astype(qs.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_self_blocks.defvjp(_self_blocks_fwd, _self_blocks_bwd)

# query blocks unrolled at most (each is a loop forward and one backward in the compiled program)
MAX_UNROLLED_BLOCKS = 32


def self_blocks_apply(T: int, block_q: int, block_k: int) -> bool:
    """Whether a full pass over T tokens takes the unrolled self-attention path: whole blocks only, and not more
    than MAX_UNROLLED_BLOCKS query blocks (longer passes take the position-general loop)."""
    bq, bk = min(block_q, T), min(block_k, T)
    return T % bq == 0 and T % bk == 0 and T // bq <= MAX_UNROLLED_BLOCKS


def self_blockwise_attention(q, k, v, *, causal: bool, block_q: int, block_k: int):
    """Exact self-attention of a full pass (query and key i at position i, every key real) by whole blocks: the
    same function and backward as :func:`blockwise_attention` with positions ``arange(T)``; T must be a multiple
    of both block sizes (:func:`self_blocks_apply`)."""
    T = q.shape[2]
    bq, bk = min(block_q, T), min(block_k, T)
    cd = lambda x: x.astype(jnp.promote_types(q.dtype, v.dtype))  # noqa: E731  (the compute dtype; statistics fp32)
    return _self_blocks(cd(q), cd(k), cd(v), causal, bq, bk).astype(v.dtype)


def attend(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, impl: str, block_q: int, block_k: int, auto_threshold: int,
           full_pass: bool = False, platform: str | None = None):
    """``full_pass`` (static): q_pos = k_pos = arange(T) and every key valid, which allows the unrolled blocks.
    ``impl`` 'auto' | 'cudnn' | 'splash' first asks :func:`dense_platform.choose` for the platform's fused kernel
    (``platform``: default the running one); where it is not taken, 'auto' is the XLA rule below, as on a CPU."""
    if impl in dense_platform.FAST_IMPLS or impl == "auto":
        choice = dense_platform.choose(impl, dtype=q.dtype, k_dtype=k.dtype, v_dtype=v.dtype, head_dim=q.shape[-1],
                                       value_dim=v.shape[-1], kv_cache=not full_pass, platform=platform)
        if choice.impl == "cudnn":
            return dense_platform.cudnn_attention(q, k, v, causal=causal)
        if choice.impl == "splash":
            return dense_platform.splash_attention(q, k, v, causal=causal, interpret=choice.interpret)
        impl = "auto"
    if impl == "auto":
        impl = "blockwise" if q.shape[2] * k.shape[2] > auto_threshold else "naive"
    if impl == "naive":
        return naive_attention(q, k, v, q_pos, k_pos, k_valid, causal=causal)
    if full_pass and self_blocks_apply(q.shape[2], block_q, block_k):
        return self_blockwise_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    return blockwise_attention(q, k, v, q_pos, k_pos, k_valid, causal=causal, block_q=block_q, block_k=block_k)


class DenseAttention(AttentionCore):
    """Exact softmax attention; causal state = fixed-capacity KV cache."""

    name = "dense"
    exact = True
    # composed KV caches are exact but attend each slice to a whole-row buffer without the causal
    # skip; XLA's partitioner splits the queries and gathers K/V instead: 226 MiB against 1,847 MiB
    # of temporaries per device at 8k tokens over 8 devices (README, sequence parallelism)
    sequence_compose_in_training = False
    EXECUTION_KEYS = ("impl", "block_q", "block_k", "auto_threshold")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """naive (the reference: one masked softmax), blockwise (online softmax over key blocks; ``test_config``
        makes it take several blocks at test lengths), cudnn (GPU) and splash (TPU; interpret mode on CPU) for
        full passes. ``impl='auto'``: the platform's fused kernel where it serves the call, else blockwise when
        Tq*Tk > auto_threshold, else naive (:func:`attend`)."""
        from longctx.attention.dispatch import Implementation

        return (
            Implementation("naive", config={"impl": "naive"}),
            Implementation("blockwise", config={"impl": "blockwise"}, test_config={"block_q": 8, "block_k": 8}),
            Implementation("cudnn", platforms=("cuda",), reasons=dense_platform.cudnn_unsupported_reasons,
                           config={"impl": "cudnn"}),
            Implementation("splash", platforms=("tpu",), kernel=True,
                           reasons=dense_platform.splash_unsupported_reasons, config={"impl": "splash"}),
        )

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                # 'naive' | 'blockwise' | 'cudnn' (GPU) | 'splash' (TPU) | 'auto': the platform's fused kernel where it
                # serves the call (longctx/attention/dense_platform.py), else blockwise when Tq*Tk > auto_threshold,
                # else naive
                "impl": "auto",
                # query / key block sizes: on a 2-core CPU, 1024x512 was the fastest of 1024x512, 512x512 and
                # 512x256 for a causal forward+backward at 8k, in the unrolled full pass and in the loop alike
                # (another CPU preferred 512x256 for the loop: rerun `longctx-bench attention` when it matters)
                "block_q": 1024,
                "block_k": 512,
                "auto_threshold": 4096 * 4096,
                # False: the KV cache is exact and refuses to overflow. True: a sliding window of the
                # newest init_state(max_len) keys (older keys are dropped on purpose).
                "kv_window": False,
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        allowed = ("naive", "blockwise", "auto") + dense_platform.FAST_IMPLS
        require(cfg.impl in allowed, f"attention.dense.impl={cfg.impl!r}; allowed: {', '.join(allowed)}")
        require(cfg.block_q > 0 and cfg.block_k > 0, "attention.dense.block_q/block_k must be positive")
        require(cfg.auto_threshold > 0, "attention.dense.auto_threshold must be positive")

    @classmethod
    def bench_variants(cls):
        out = {"naive": {"impl": "naive"}, "blockwise": {"impl": "blockwise"}}
        kernel = dense_platform.PLATFORM_KERNEL.get(dispatch.current_platform())
        if kernel:  # the platform's fused exact attention, by name (an error, never a fallback, where it refuses)
            out[kernel] = {"impl": kernel}
        return out

    @classmethod
    def drop_in(cls):
        return DropIn("parameter-free: used as is")

    @classmethod
    def contract_cases(cls):
        return {
            "naive": ContractCase(cfg={"impl": "naive"}, length=40),
            "blockwise": ContractCase(cfg={"impl": "blockwise", "block_q": 8, "block_k": 8}, length=40,
                                      directions=("causal",)),
            "blockwise_bidirectional": ContractCase(cfg={"impl": "blockwise", "block_q": 8, "block_k": 8}, length=40,
                                                    directions=("bidirectional",), slow=True),
            # the TPU kernel in Pallas interpret mode: full passes by splash, KV-cache steps by the XLA path
            "splash": ContractCase(cfg={"impl": "splash"}, length=40),
        }

    def _attend(self, q, k, v, q_pos, k_pos, k_valid, full_pass: bool = False):
        c = self.cfg
        return attend(
            q, k, v, q_pos, k_pos, k_valid,
            causal=self.causal, impl=c.impl, block_q=c.block_q, block_k=c.block_k, auto_threshold=c.auto_threshold,
            full_pass=full_pass,
        )

    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("dense: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("dense: init_state needs max_len (the KV-cache capacity in tokens)")
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        return {
            "k": jnp.zeros((batch_size, H, max_len, D), jnp.float32),
            "v": jnp.zeros((batch_size, H, max_len, Dv), jnp.float32),
            "length": jnp.zeros((), jnp.int32),
        }

    # -- sequence parallelism: the KV cache composes by concatenation --------------------------
    def sequence_refusal(self, slice_len: int) -> str | None:
        if self.cfg.kv_window:
            return "kv_window=True keeps only the newest max_len keys; composition needs the whole cache"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return {**self.init_state(batch_size, max_len), "length": jnp.asarray(start, jnp.int32)}

    def compose_states(self, a, b):
        # both caches are right-aligned (slot j <-> position length - M + j) and zero outside their
        # own tokens: move a's keys left by the number of b's tokens and add (an exact concatenation)
        shift = b["length"] - a["length"]
        moved = {name: jnp.roll(a[name], -shift, axis=2) for name in ("k", "v")}
        return {"k": moved["k"] + b["k"], "v": moved["v"] + b["v"], "length": b["length"]}

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None):
        check_qkv(q, k, v)
        T = q.shape[2]
        pos = jnp.arange(T, dtype=jnp.int32)
        if state is None:
            out = self._attend(q, k, v, pos, pos, jnp.ones((T,), bool), full_pass=True)
            new_state = (
                {"k": k.astype(jnp.float32), "v": v.astype(jnp.float32), "length": jnp.asarray(T, jnp.int32)}
                if self.causal
                else None
            )
            return out, new_state
        if not self.causal:
            raise ValueError("dense: a bidirectional core takes no state")
        M = state["k"].shape[2]
        length = state["length"]
        if not self.cfg.kv_window:
            check_capacity(length + T, M, "dense: the KV cache holds {capacity} tokens (init_state max_len) but "
                           "{needed} were fed; build it with a larger max_len, or set attention.dense.kv_window=True "
                           "for a sliding window that drops the oldest keys")
        q_pos = length + pos
        k_pos = jnp.concatenate([length - M + jnp.arange(M, dtype=jnp.int32), q_pos])
        k_all = jnp.concatenate([state["k"].astype(q.dtype), k], axis=2)
        v_all = jnp.concatenate([state["v"].astype(v.dtype), v], axis=2)
        out = self._attend(q, k_all, v_all, q_pos, k_pos, k_pos >= 0)
        new_state = {
            "k": k_all[:, :, -M:].astype(jnp.float32),
            "v": v_all[:, :, -M:].astype(jnp.float32),
            "length": length + T,
        }
        return out, new_state


__all__ = ["DenseAttention", "attend", "blockwise_attention", "naive_attention", "positions_mask",
           "self_blockwise_attention"]

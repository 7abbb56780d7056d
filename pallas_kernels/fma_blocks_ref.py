"""Pure-JAX reference of the FMA "multilevel blocks" attention (docs/methods/fma.md §2.4, §8).

This is the math the Pallas kernel ``fma_blocks.py`` must match, and the blocked XLA paths of
``longctx.attention.fma`` run it (one copy of the math; this module never imports ``longctx``). Its three
products (scores, the weighted sum of values, the rows scaled by ``1 / den``) are plain einsums
(:data:`PLAIN_OPS`); a caller may pass other forms of the same products (``ops=``, a :class:`BlockOps`).

Layout. Queries come in fine blocks of ``m`` tokens, ``qb: [B, H, nq, m, d]`` (already scaled by
1/sqrt(d)). Query block ``c`` sits at absolute fine block ``q_block0 + c``. The fine keys ``kp`` are
the same sequence with one block in front: block ``c`` of ``kp`` is absolute block ``q_block0 + c - 1``,
so query block ``c`` reads key blocks ``c, c+1`` (causal: previous + own) or ``c, c+1, c+2``
(bidirectional: previous + own + next). Key validity is a function of absolute positions only
(``0 <= pos < n_valid``, and ``pos <= query`` when causal), which is what lets the streaming path and
the full pass share this function.

Coarse entries come in one of three forms:

* ``packed`` (FMA): each query block has ``C`` summary slots, gathered from ``kall/vall`` (all levels'
  summary rows, concatenated) by ``idx [nq, C]``, with a static bias ``bias [nq, C]`` = the
  log-multiplicity ``ln(m_l/p)`` on valid slots and ``NEG`` on masked ones (parity rule, out of range).
* ``stats`` (FMA-linear, joint normalisation): per query the coarse part's running max ``M``,
  numerator ``num`` and denominator ``den``, combined with the fine part by log-sum-exp rescaling
  (per query, ``[B,H,nq,m,...]``, or per row of ``m/r`` queries, ``[B,H,nq,r,...]``).
* ``normed`` (FMA-linear, per-level normalisation, paper eq. 11): the coarse part's already
  normalised output, added to the separately normalised fine part.

All of a query's fine and coarse scores share one softmax with one row max (no per-level max; a
fully masked level would give -inf). Precision (DESIGN.md §7): the products take their operands in the
compute dtype (the dtype of ``qb``, ``kp``, ``vp`` and the coarse slots: bfloat16 stays bfloat16) and accumulate
in float32 (float64 stays float64); the probabilities are cast down to the values' dtype before ``P V``, and the
backward casts ``dS`` down before its products (:func:`pallas_kernels.precision.acc_einsum`). Scores, softmax
statistics, accumulators and the output are at least float32; masks use the finite ``NEG`` (never -inf: a
fully masked segment would give exp(-inf - -inf) = NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.precision import acc_einsum

NEG = -1e30


class BlockOps(NamedTuple):
    """The products of :func:`attend_group`: ``qk_dot(q, k)`` = ``q kᵀ`` over the last axis (``[..., i, d]``,
    ``[..., j, d]`` -> ``[..., i, j]``), ``pv_dot(p, v)`` = ``p v`` (``[..., i, j]``, ``[..., j, f]`` -> ``[..., i, f]``)
    and ``row_scale(x, s)`` = ``x * s[..., None]``."""

    qk_dot: Callable
    pv_dot: Callable
    row_scale: Callable


# operands as given (the compute dtype), accumulated and returned in float32 for narrower ones (their backward
# casts the cotangent down first, so the gradient's products take narrow operands too); float32 / float64: plain
PLAIN_OPS = BlockOps(
    qk_dot=lambda q, k: acc_einsum("...id,...jd->...ij", q, k),
    pv_dot=lambda p, v: acc_einsum("...ij,...jd->...id", p, v),
    row_scale=lambda x, s: x * s[..., None],
)


# ---------------------------------------------------------------------------
# the interaction list (§2.2, parity rule)
# ---------------------------------------------------------------------------


def level_partners(a, causal: bool, n_groups=None, xp=np):
    """Partner groups of level-group index ``a`` (int array, any shape) at one level.

    Returns ``(groups, valid)``, each ``a.shape + (S,)`` with ``S = 2`` (causal) or ``4``
    (bidirectional), slot order: lower chunk halves h=0,1, then upper chunk halves h=0,1.
    Lower: half h of chunk P-1 (P = a // 2, pi = a % 2) iff h <= pi; upper: half h of chunk P+1 iff
    h >= pi. So even a -> {a-2} / {a+2, a+3}; odd a -> {a-3, a-2} / {a+2}. Groups below 0 or at or
    beyond ``n_groups`` (bidirectional) are invalid."""
    pi = a & 1
    P = a >> 1
    gs, vs = [], []
    for h in (0, 1):
        g = 2 * (P - 1) + h
        gs.append(g)
        vs.append((h <= pi) & (g >= 0))
    if not causal:
        for h in (0, 1):
            g = 2 * (P + 1) + h
            gs.append(g)
            vs.append((h >= pi) & (g < n_groups))
    return xp.stack(gs, axis=-1), xp.stack(vs, axis=-1)


def packed_slots(blocks, *, num_levels: int, m: int, p: int, causal: bool, betas, offsets, n_groups=None,
                 group_base=None, n_rows=None, xp=np):
    """Summary-row index and bias of every coarse slot of fine blocks ``blocks`` (int array [nq]).

    Level l (1-based) group of fine block b is ``a = b >> (l-1)``; its partner groups' p rows each are
    looked up in the concatenated summary rows at ``offsets[l-1] + (g - group_base[l-1]) * p + r``.
    Returns ``(idx [nq, C] int32, bias [nq, C] f32)``; ``C = 2 p L`` (causal) or ``4 p L``; slot order
    level-major, then low h=0,1, up h=0,1, then r. Invalid slots get bias NEG and a clipped index."""
    idxs, biases = [], []
    r = xp.arange(p)
    for li in range(num_levels):
        a = blocks >> li
        ng = None if n_groups is None else n_groups[li]
        g, valid = level_partners(a, causal, ng, xp)  # [nq, S]
        base = 0 if group_base is None else group_base[li]
        rows = offsets[li] + (g - base)[..., None] * p + r  # [nq, S, p]
        idxs.append(rows.reshape(rows.shape[0], -1))
        bias = xp.where(valid, xp.float32(betas[li]), xp.float32(NEG)).astype(xp.float32)
        biases.append(xp.repeat(bias, p, axis=-1))
    idx = xp.concatenate(idxs, axis=-1)
    if n_rows is not None:
        idx = xp.clip(idx, 0, n_rows - 1)
    return idx.astype(xp.int32), xp.concatenate(biases, axis=-1)


# ---------------------------------------------------------------------------
# one group of query blocks
# ---------------------------------------------------------------------------


def _blocks_of(x, G: int, w: int, m: int):
    """[B,H,(G+w-1)m,d] -> window [B,H,G,w m,d]: query block c reads blocks c..c+w-1."""
    B, H, _, d = x.shape
    return jnp.concatenate([x[:, :, s * m:(s + G) * m].reshape(B, H, G, m, d) for s in range(w)], axis=3)


def attend_group(qg, kg, vg, coarse, *, blk0, n_valid, causal: bool, drop_key=None, attn_dropout: float = 0.0,
                 ops: BlockOps = PLAIN_OPS, docs=None):
    """Outputs [B,H,G,m,dv] (at least f32) of G query blocks; see the module docstring for the operands.

    ``coarse`` here is already sliced to these G blocks: None, ("packed", kc [B,H,G,C,d],
    vc [B,H,G,C,dv], bias [G,C]), ("stats", M [B,H,G,m], num [B,H,G,m,dv], den [B,H,G,m]) or
    ("normed", out [B,H,G,m,dv]).

    ``docs`` (packed rows laid out again, docs/methods/fma.md §2.7; None: one sequence): ``(qdoc [B, G m],
    kdoc [B, (G+w-1) m], sdoc [B, G, C] or None)``, the document of every query, fine key and packed slot; a key or
    slot counts for a query only where its document is the query's."""
    B, H, G, m, d = qg.shape
    w = kg.shape[2] // m - G + 1
    if coarse is not None and coarse[0] in ("stats", "normed") and coarse[1].shape[3] != m:
        # per-row coarse parts (r rows per block, m/r queries each): broadcast to the queries here
        rep = m // coarse[1].shape[3]
        coarse = (coarse[0],) + tuple(jnp.repeat(x, rep, axis=3) for x in coarse[1:])
    kwin, vwin = _blocks_of(kg, G, w, m), _blocks_of(vg, G, w, m)
    s_f = ops.qk_dot(qg, kwin)
    c = jnp.arange(G)
    qpos = (blk0 + c)[:, None] * m + jnp.arange(m)[None, :]  # [G, m]
    kpos = (blk0 + c - 1)[:, None] * m + jnp.arange(w * m)[None, :]  # [G, w m]
    valid = ((kpos >= 0) & (kpos < n_valid))[:, None, :]
    if causal:
        valid = valid & (kpos[:, None, :] <= qpos[:, :, None])
    qdoc = None
    if docs is not None:  # [B, 1, G, m, w m]: a key of another document is no key
        qdoc = docs[0].reshape(B, G, m)
        kdoc = _blocks_of(docs[1][:, None, :, None], G, w, m)[:, 0, :, :, 0]  # [B, G, w m]
        valid = valid & (qdoc[:, :, :, None] == kdoc[:, :, None, :])[:, None]
    s_f = jnp.where(valid, s_f, NEG)
    mx = jnp.max(s_f, axis=-1)
    kind = None if coarse is None else coarse[0]
    if kind == "packed":
        _, kc, vc, cb = coarse
        valid_c = (cb > NEG / 2)[:, None, :]  # [G,1,C]
        if qdoc is not None:  # [B, 1, G, m, C]: a slot of another document's group is no slot
            valid_c = valid_c & (docs[2][:, :, None, :] == qdoc[:, :, :, None])[:, None]
        s_c = ops.qk_dot(qg, kc) + cb[:, None, :]
        s_c = jnp.where(valid_c, s_c, NEG)
        mx = jnp.maximum(mx, jnp.max(s_c, axis=-1))
    elif kind == "stats":
        mx = jnp.maximum(mx, coarse[1])
    mx = jax.lax.stop_gradient(mx)[..., None]
    p_f = jnp.where(valid, jnp.exp(s_f - mx), 0.0)
    den = jnp.sum(p_f, axis=-1)
    if kind == "packed":
        p_c = jnp.where(valid_c, jnp.exp(s_c - mx), 0.0)
        den = den + jnp.sum(p_c, axis=-1)
    elif kind == "stats":
        sc = jnp.exp(coarse[1] - mx[..., 0])
        den = den + coarse[3] * sc
    if drop_key is not None and attn_dropout > 0.0:
        # dropout on the jointly normalised weights == drop the unnormalised p, keep the normaliser
        kf, kc_ = jax.random.split(drop_key)
        keep = 1.0 - attn_dropout
        p_f = jnp.where(jax.random.bernoulli(kf, keep, p_f.shape), p_f / keep, 0.0)
        if kind == "packed":
            p_c = jnp.where(jax.random.bernoulli(kc_, keep, p_c.shape), p_c / keep, 0.0)
    num = ops.pv_dot(p_f.astype(vwin.dtype), vwin)  # P cast down to the values' (compute) dtype before its product
    if kind == "packed":
        num = num + ops.pv_dot(p_c.astype(vc.dtype), vc)
    elif kind == "stats":
        num = num + coarse[2] * sc[..., None]
    out = ops.row_scale(num, 1.0 / jnp.maximum(den, 1e-30))
    if kind == "normed":
        out = out + coarse[1]
    return out


def _slice_coarse(coarse, start, G, kall=None, vall=None):
    """Slice the block axis of the coarse operand; gather packed slots from kall/vall."""
    if coarse is None:
        return None
    kind = coarse[0]
    if kind == "packed":
        _, kall, vall, idx, bias = coarse
        idx_g = jax.lax.dynamic_slice_in_dim(idx, start, G, axis=0)
        bias_g = jax.lax.dynamic_slice_in_dim(bias, start, G, axis=0)
        B, H = kall.shape[:2]
        kc = jnp.take(kall, idx_g.reshape(-1), axis=2).reshape(B, H, G, -1, kall.shape[-1])
        vc = jnp.take(vall, idx_g.reshape(-1), axis=2).reshape(B, H, G, -1, vall.shape[-1])
        return ("packed", kc, vc, bias_g)
    return (kind,) + tuple(jax.lax.dynamic_slice_in_dim(x, start, G, axis=2) for x in coarse[1:])


def _slice_docs(docs, start, G: int, w: int, m: int):
    """The documents of G query blocks from block ``start`` (:func:`attend_group`'s ``docs``)."""
    if docs is None:
        return None
    qd, kd, sd = docs
    return (jax.lax.dynamic_slice_in_dim(qd, start * m, G * m, axis=1),
            jax.lax.dynamic_slice_in_dim(kd, start * m, (G + w - 1) * m, axis=1),
            None if sd is None else jax.lax.dynamic_slice_in_dim(sd, start, G, axis=1))


def _pad_docs(docs, extra: int, m: int):
    """``docs`` with ``extra`` more (padding) blocks: queries of document -1, keys and slots of -2 (never equal)."""
    if docs is None or extra == 0:
        return docs
    qd, kd, sd = docs
    return (jnp.pad(qd, ((0, 0), (0, extra * m)), constant_values=-1),
            jnp.pad(kd, ((0, 0), (0, extra * m)), constant_values=-2),
            None if sd is None else jnp.pad(sd, ((0, 0), (0, extra), (0, 0)), constant_values=-2))


def _pad_blocks(coarse, extra: int):
    if coarse is None or extra == 0:
        return coarse
    kind = coarse[0]
    if kind == "packed":
        _, kall, vall, idx, bias = coarse
        idx = jnp.pad(idx, ((0, extra), (0, 0)))
        bias = jnp.pad(bias, ((0, extra), (0, 0)), constant_values=NEG)
        return ("packed", kall, vall, idx, bias)
    out = [kind]
    for i, x in enumerate(coarse[1:]):
        widths = [(0, 0)] * x.ndim
        widths[2] = (0, extra)
        out.append(jnp.pad(x, widths, constant_values=NEG if (kind == "stats" and i == 0) else 0.0))
    return tuple(out)


def attend_blocks(qb, kp, vp, coarse, *, q_block0, n_valid, causal: bool, drop_key=None,
                  attn_dropout: float = 0.0, logit_budget: int = 1 << 24, ops: BlockOps = PLAIN_OPS, docs=None):
    """FMA attention of ``nq`` query blocks (see the module docstring). Returns [B,H,nq,m,dv] f32.

    ``kp, vp``: [B,H,(nq+w-1) m, *] with w = 2 (causal) or 3. ``coarse``: None,
    ("packed", kall [B,H,R,d], vall [B,H,R,dv], idx [nq,C], bias [nq,C]), ("stats", M, num, den)
    or ("normed", out) with a block axis 2 of size nq. When all blocks' logits exceed
    ``logit_budget`` the blocks are processed in groups under ``lax.map`` with a rematerialised body,
    so peak memory stays O(budget) in the forward and the backward. ``ops``: the three products
    (:class:`BlockOps`; plain einsums by default). ``docs``: the documents of a packed row laid out again
    (:func:`attend_group`; ``qdoc [B, nq m]``, ``kdoc`` like ``kp``'s positions, ``sdoc [B, nq, C]``)."""
    B, H, nq, m, d = qb.shape
    w = 2 if causal else 3
    C = coarse[3].shape[-1] if (coarse is not None and coarse[0] == "packed") else 0
    G = max(1, min(nq, logit_budget // max(1, B * H * m * (w * m + C + 1))))
    G = -(-nq // -(-nq // G))  # as many groups as the budget needs, of equal size (least padding)
    if G >= nq:
        return attend_group(qb, kp, vp, _slice_coarse(coarse, 0, nq), blk0=q_block0, n_valid=n_valid,
                            causal=causal, drop_key=drop_key, attn_dropout=attn_dropout, ops=ops, docs=docs)
    ng = -(-nq // G)
    extra = ng * G - nq
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))
    kp = jnp.pad(kp, ((0, 0), (0, 0), (0, extra * m), (0, 0)))
    vp = jnp.pad(vp, ((0, 0), (0, 0), (0, extra * m), (0, 0)))
    coarse = _pad_blocks(coarse, extra)
    docs = _pad_docs(docs, extra, m)

    @jax.checkpoint
    def body(gi):
        qg = jax.lax.dynamic_slice_in_dim(qb, gi * G, G, axis=2)
        kg = jax.lax.dynamic_slice_in_dim(kp, gi * G * m, (G + w - 1) * m, axis=2)
        vg = jax.lax.dynamic_slice_in_dim(vp, gi * G * m, (G + w - 1) * m, axis=2)
        key = None if drop_key is None else jax.random.fold_in(drop_key, gi)
        return attend_group(qg, kg, vg, _slice_coarse(coarse, gi * G, G), blk0=q_block0 + gi * G,
                            n_valid=n_valid, causal=causal, drop_key=key, attn_dropout=attn_dropout, ops=ops,
                            docs=_slice_docs(docs, gi * G, G, w, m))

    out = jax.lax.map(body, jnp.arange(ng))  # [ng, B, H, G, m, dv]
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, ng * G, m, -1)
    return out[:, :, :nq]


__all__ = ["NEG", "PLAIN_OPS", "BlockOps", "attend_blocks", "attend_group", "level_partners", "packed_slots"]

"""Pure-JAX reference of EVA's Phase B on the operands of the Pallas kernel "eva_attend" (docs/methods/eva.md §8.1, §8.3).

Phase B: every query ``n`` takes one softmax over its local window (exact logits ``q·k`` plus the relative-position
bias) and the chunks it may see (logit ``q·k̂_c``, value ``β_c``), eq. 16. The masks are functions of absolute
positions only; :func:`window_bounds`, :func:`local_mask` and :func:`chunk_mask` are the one copy of them (EVA's
XLA path imports them from here).

Kernel operands, all flattened over batch × heads (``BH``) and padded to whole windows (``Lp = nq·W``):
``q`` (already multiplied by the logit scale ``s``, so local logits are ``q·k`` and chunk logits ``q·k̂``),
``k [BH, Lp, d]``, ``v [BH, Lp, dv]``, ``k_hat [BH, Cp, d]``, ``beta [BH, Cp, dv]`` (chunks ``c >= ⌈L/P⌉`` are
padding) and the local bias ``bias [Hb, n_lt, W, W]`` (``s·θ[bucket]`` of query row ``r`` and key column ``c`` in key block
``i + offsets[t]`` of query block ``i``; it depends on ``offsets[t]·W + c − r`` only, so one tile per offset
serves every block; ``Hb`` is 1 (shared by heads) or the number of heads). Attention dropout (``dropout_rate``,
``seeds [BH]``): the keep mask of :func:`dropout_multiplier` (:mod:`pallas_kernels.hash_dropout` at absolute query
and key indices, chunk ``c`` at ``CHUNK_KEY_BASE + c``) on the normalised weights. The reference materialises the
``[BH, Lp, Lp + Cp]`` logits, so it is for tests (small ``Lp``) only. This module imports only JAX, the dropout
hash and the precision helpers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import hash_dropout
from pallas_kernels.precision import compute_dtype

NEG = -1e30  # finite mask value, never -inf (§9.11)


def local_offsets(e_l: int, e_r: int) -> tuple[int, ...]:
    """Key blocks (relative to the query block) a window ``[iW − e_l, (i+1)W + e_r)`` touches, for e_l, e_r <= W."""
    return tuple(o for o, used in ((-1, e_l > 0), (0, True), (1, e_r > 0)) if used)


def window_bounds(q_pos, W: int, e_l: int, e_r: int):
    """[lo, hi) of the local window E_w of each query's block."""
    if W == 0:
        z = jnp.zeros_like(q_pos)
        return z, z
    blk = q_pos // W
    lo = jnp.maximum(blk * W - e_l, 0)
    hi = (blk + 1) * W + e_r
    return lo, hi


def local_mask(q_pos, k_pos, k_valid, *, W: int, e_l: int, e_r: int, causal: bool):
    """[Tq, Tk] bool: key in the query's window (and not in its future when causal)."""
    lo, hi = window_bounds(q_pos, W, e_l, e_r)
    m = k_valid[None, :] & (k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] < hi[:, None])
    if causal:
        m = m & (k_pos[None, :] <= q_pos[:, None])
    return m


def chunk_mask(q_pos, chunk_ids, chunk_valid, *, P: int, W: int, e_l: int, e_r: int, causal: bool, disjoint: bool,
               keys_major: bool = False):
    """[Tq, C] bool ([C, Tq] with ``keys_major``, built in that orientation). Causal: chunk c visible iff
    c < ⌊n/P⌋ (released rule: own chunk hidden). ``disjoint``: additionally drop chunks intersecting the
    query's window."""
    if keys_major:
        n, c, ok = q_pos[None, :], chunk_ids[:, None], chunk_valid[:, None]
    else:
        n, c, ok = q_pos[:, None], chunk_ids[None, :], chunk_valid[None, :]
    m = jnp.broadcast_to(ok, jnp.broadcast_shapes(n.shape, c.shape))
    if causal:  # c < n // P, written (c + 1) P <= n: no integer division per element of the [Tq, C] tile
        m = m & ((c + 1) * P <= n)
    if disjoint and W > 0:
        lo, hi = window_bounds(n, W, e_l, e_r)
        m = m & ~((c * P < hi) & ((c + 1) * P > lo))
    return m


def full_bias(bias, Lp: int, W: int, offsets) -> jax.Array:
    """The tiles ``[Hb, n_lt, W, W]`` placed at their block offsets: ``[Hb, Lp, Lp]`` (zero elsewhere)."""
    pos = jnp.arange(Lp)
    rel = pos[None, :] // W - pos[:, None] // W  # key block - query block
    t = jnp.zeros_like(rel)
    hit = jnp.zeros(rel.shape, bool)
    for j, o in enumerate(offsets):
        t = jnp.where(rel == o, j, t)
        hit = hit | (rel == o)
    b = bias[:, t, pos[:, None] % W, pos[None, :] % W]  # [Hb, Lp, Lp]
    return jnp.where(hit[None], b, 0.0)


def dropout_multiplier(seeds, q_pos, key_pos, chunk_ids, rate: float):
    """The dropout multiplier ``keep / (1 − rate)`` of rows with int32 ``seeds [...]`` (one per row, e.g. ``[BH]`` or
    ``[B, H]``) for queries ``q_pos [Tq]`` on local keys ``key_pos [Tk]`` then chunks ``chunk_ids [C]``:
    ``[..., Tq, Tk + C]`` fp32 (absolute indices; the kernel draws the same)."""
    s = jnp.asarray(seeds, jnp.int32)[..., None, None]
    kidx = jnp.concatenate([jnp.asarray(key_pos, jnp.int32), hash_dropout.CHUNK_KEY_BASE + jnp.asarray(chunk_ids,
                                                                                                      jnp.int32)])
    return hash_dropout.multiplier(s, jnp.asarray(q_pos, jnp.int32)[:, None], kidx[None, :], rate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _product(spec: str, a, b, cd):
    """``einsum(spec, a, b)`` of fp32-held ``a``, ``b`` taken in the compute dtype ``cd`` with fp32 accumulation, as the
    kernels take their products; its backward casts the cotangent to ``cd`` too (``dS``, ``dO`` as the kernels take
    them) and returns fp32 cotangents accumulated in fp32 (each index of ``spec`` in two of its three terms)."""
    return jnp.einsum(spec, a.astype(cd), b.astype(cd), preferred_element_type=jnp.float32)


def _product_fwd(spec, a, b, cd):
    return _product(spec, a, b, cd), (a, b)


def _product_bwd(spec, cd, res, g):
    a, b = res
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    gc = g.astype(cd)
    da = jnp.einsum(f"{out},{sb}->{sa}", gc, b.astype(cd), preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{sa},{out}->{sb}", a.astype(cd), gc, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


_product.defvjp(_product_fwd, _product_bwd)


def segment_masks(segments, BH: int, heads: int, Cp: int, *, W: int, e_l: int, e_r: int, P: int, causal: bool,
                  disjoint: bool):
    """A packed row's masks (``segments`` as :func:`eva_attend_reference` takes them), per flattened row:
    ``(same [BH, Lp, Lp], cmask [BH, Lp, Cp], rel [BH, Lp], c_rel [BH, Cp])``: a key of the query's document, and a
    chunk of its document visible by the document's own indices (causal: ``c < ⌊n/P⌋``; disjoint: off the
    query's window), a negative document being none."""
    row = jnp.arange(BH) // heads
    rel, q_doc, k_doc, c_rel, c_doc = (jnp.asarray(x, jnp.int32)[row] for x in segments)
    C = c_rel.shape[1]
    c_rel, c_doc = (jnp.pad(x, ((0, 0), (0, Cp - C)), constant_values=-3) for x in (c_rel, c_doc))
    q_doc, k_doc, c_doc = (jnp.where(x < 0, none, x) for x, none in ((q_doc, -2), (k_doc, -1), (c_doc, -3)))
    n, c = rel[:, :, None], c_rel[:, None, :]
    cmask = q_doc[:, :, None] == c_doc[:, None, :]
    if causal:
        cmask = cmask & ((c + 1) * P <= n)
    if disjoint:
        lo, hi = window_bounds(n, W, e_l, e_r)
        cmask = cmask & ~((c * P < hi) & ((c + 1) * P > lo))
    return q_doc[:, :, None] == k_doc[:, None, :], cmask, rel, c_rel


def eva_attend_reference(q, k, v, k_hat, beta, bias, *, W: int, e_l: int, e_r: int, P: int, L: int, causal: bool,
                         disjoint: bool, heads: int, dropout_rate: float = 0.0, seeds=None, segments=None):
    """Phase B on kernel operands (see the module docstring). Returns ``(o [BH, Lp, dv], lse [BH, Lp])``: the
    normalised output (in the compute dtype) and the log-sum-exp (fp32) of each query's logits over its local and
    chunk candidates.

    ``segments`` (a packed row laid out on the window grid; None: one sequence): int32 ``(rel [B, Lp], q_doc [B,
    Lp], k_doc [B, Lp], c_rel [B, C], c_doc [B, C])``, ``B = BH / heads``: each position's own index in its
    document and its document as a query and as a key, each chunk's own index and document (negative: none).
    Keys and chunks count only for queries of their document; the chunk masks and the dropout counters take the
    documents' own indices (:func:`segment_masks`), the local window and causal masks the layout's positions.
    ``L`` is ``Lp`` then; a query that sees nothing (a gap) gives 0.

    Precision, as the kernel (DESIGN.md §7): q, k, v, k̂, β and the bias are cast to the compute dtype (that of q,
    k, v), the products take it with fp32 accumulation, the weights are cast to it before their product with the
    values; the softmax is fp32. Under fp32 operands every cast is the identity."""
    f32 = jnp.float32
    cd = compute_dtype(q, k, v)
    # values of the compute dtype, held in fp32 so that autodiff sums the gradient pieces in fp32 (as the kernels
    # accumulate them) and rounds once, at the cast back to the inputs' dtype
    q, k, v, k_hat, beta = (x.astype(cd).astype(f32) for x in (q, k, v, k_hat, beta))
    BH, Lp, _ = q.shape
    Cp = k_hat.shape[1]
    pos = jnp.arange(Lp)
    lmask = local_mask(pos, pos, pos < L, W=W, e_l=e_l, e_r=e_r, causal=causal)
    a_loc = _product("bqd,bkd->bqk", q, k, cd)
    if bias is not None:
        fb = full_bias(bias.astype(cd).astype(f32), Lp, W, local_offsets(e_l, e_r))  # [Hb, Lp, Lp]
        head = jnp.arange(BH) % heads if fb.shape[0] > 1 else jnp.zeros((BH,), jnp.int32)
        a_loc = a_loc + fb[head]
    cids = jnp.arange(Cp)
    if segments is None:
        cmask = chunk_mask(pos, cids, cids * P < L, P=P, W=W, e_l=e_l, e_r=e_r, causal=causal, disjoint=disjoint)
    else:
        same, cmask, rel, c_rel = segment_masks(segments, BH, heads, Cp, W=W, e_l=e_l, e_r=e_r, P=P, causal=causal,
                                                disjoint=disjoint)
        lmask = lmask & same
    a_ch = _product("bqd,bcd->bqc", q, k_hat, cd)
    logits = jnp.concatenate([jnp.where(lmask, a_loc, NEG), jnp.where(cmask, a_ch, NEG)], axis=-1)
    mask = jnp.concatenate([lmask, cmask], axis=-1)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    if segments is not None:
        den = jnp.maximum(den, 1e-30)  # a gap sees nothing (the kernel's bound)
    lse = (m + jnp.log(den))[..., 0]
    if dropout_rate > 0 and segments is not None:  # the documents' own counters
        kidx = jnp.concatenate([rel, hash_dropout.CHUNK_KEY_BASE + c_rel], axis=1)
        p = p * hash_dropout.multiplier(jnp.asarray(seeds, jnp.int32)[:, None, None], rel[:, :, None],
                                        kidx[:, None, :], dropout_rate)
    elif dropout_rate > 0:  # on the normalised weights: drop the unnormalised ones, keep the normaliser
        p = p * dropout_multiplier(seeds, pos, pos, cids, dropout_rate)
    o = _product("bqk,bkd->bqd", p, jnp.concatenate([v, beta], axis=1), cd) / den
    return o.astype(cd), lse


__all__ = ["NEG", "chunk_mask", "dropout_multiplier", "eva_attend_reference", "full_bias", "local_mask", "local_offsets",
           "segment_masks", "window_bounds"]

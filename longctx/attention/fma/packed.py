"""Packed rows (``segment_ids``) through the blocked FMA paths (docs/methods/fma.md §2.7; ours, not in the paper).

FMA's fine blocks and every level's groups are counted from a document's first token when it runs alone, so a
document that starts inside a block or a group of the packed row cannot be computed on the row's own grid. The
documents are laid out again (:func:`layout`) on a longer row of static size, where each document's blocks and
groups are the layout's own:

* a document of more than ``m + 1`` tokens starts at a multiple of ``m 2^L_d`` (``L_d``: the coarse levels it uses
  alone), so its groups of every level it uses, and their pairs (the parity rule of §2.2), are the layout's;
* a shorter one starts where it falls: it spans at most two adjacent fine blocks, where alone it is exact attention;
* bidirectional: a document with coarse levels is followed by padding up to a multiple of its top group
  ``m 2^(L_d - 1)``, so its last group, cut by its end, holds its zero padding only (as alone).

The gaps are zero padding, of no document. On the layout, a fine key counts for a query only where it is of the
query's document, and a packed slot only where its group starts on one of the query's document's tokens and holds
no other document's (:func:`longctx.attention.fma.xla.group_docs`): the levels above ``L_d`` then have no slot of
the document, as alone. The outputs are gathered back to the packed row; gradients follow the gather and scatter.
The layout is shorter than ``2n`` (causal) and ``2.5n`` (bidirectional): a document's alignment gap is shorter
than itself, its end padding shorter than half of it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longctx.attention.base import check_capacity, continues_state, document_starts
from longctx.attention.fma.options import RING, FMAOptions, acc_type, levels_used, pad_to
from longctx.attention.fma.reference import bias_rows, summarize
from pallas_kernels.precision import compute_dtype


def layout_size(n: int, opts: FMAOptions) -> int:
    """The static length of the layout of ``n`` packed tokens (a multiple of ``m``; bounds in the module doc)."""
    bound = 2 * n if opts.causal else (5 * n + 1) // 2
    return -(-bound // opts.m) * opts.m


def _bit_length(x):
    return 32 - jax.lax.clz(x.astype(jnp.int32))


def doc_levels(length, opts: FMAOptions):
    """The coarse levels a document of ``length`` tokens (int array) uses alone (:func:`levels_used`, traced)."""
    nb = -(-length // opts.m)
    return jnp.minimum(jnp.maximum(_bit_length(nb - 1) - 1, 0), opts.L)


def document_ends(segment_ids):
    """int32 [B, n]: one past the last token of each token's document."""
    n = segment_ids.shape[1]
    at = jnp.arange(n, dtype=jnp.int32)
    opens = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    nxt = jax.lax.cummin(jnp.where(opens, at, n), axis=1, reverse=True)  # the first opening at or after t
    return jnp.concatenate([nxt[:, 1:], jnp.full_like(nxt[:, :1], n)], axis=1)


def layout(segment_ids, opts: FMAOptions):
    """``(dest [B, n], docs [B, N])``: the layout position of every packed token, and the document (1, 2, ... in
    row order; 0: padding) of every layout position (:func:`layout_size` ``N``)."""
    B, n = segment_ids.shape
    N = layout_size(n, opts)
    m = opts.m
    start = document_starts(segment_ids)
    end = document_ends(segment_ids)
    at = jnp.arange(n, dtype=jnp.int32)
    opens = start == at[None, :]
    length = end - start
    Ld = doc_levels(length, opts)
    align = jnp.where(length > m + 1, m << Ld, 1)  # a short document starts where it falls
    # bidirectional: a document with coarse levels is padded to a multiple of its top group at its end
    tail = jnp.where((Ld > 0) & (not opts.causal), m << jnp.maximum(Ld - 1, 0), 1)
    last = end == at[None, :] + 1

    def step(cursor, xs):
        o, a, t, lst = xs
        cur = jnp.where(o, -(-cursor // a) * a, cursor)
        nxt = cur + 1
        return jnp.where(lst, -(-nxt // t) * t, nxt), cur

    _, dest = jax.lax.scan(step, jnp.zeros((B,), jnp.int32), (opens.T, align.T, tail.T, last.T))
    dest = dest.T
    doc = jnp.cumsum(opens.astype(jnp.int32), axis=1)
    docs = jnp.zeros((B, N), jnp.int32).at[jnp.arange(B)[:, None], dest].set(doc)
    return dest, docs


def spread(x, dest, N: int):
    """x [B, H, n, f] placed at the layout positions ``dest`` [B, n] of a zero [B, H, N, f]."""
    return jax.vmap(lambda xb, db: jnp.zeros((xb.shape[0], N, xb.shape[2]), xb.dtype).at[:, db].set(xb))(x, dest)


def gather(y, dest):
    """y [B, H, N, f] at the layout positions ``dest`` [B, n]: [B, H, n, f]."""
    return jax.vmap(lambda yb, db: yb[:, db])(y, dest)


def packed_forward(forward, q, k, v, ds, opts: FMAOptions, segment_ids, drop_key=None):
    """``forward`` (an implementation's full pass: :func:`longctx.attention.fma.xla.fma_forward`'s signature, with
    its ``docs`` and ``levels``) of a packed row: the documents laid out again, the outputs gathered back."""
    n = q.shape[2]
    Lu = levels_used(n, opts)  # a document uses at most the levels of the whole row
    dest, docs = layout(segment_ids, opts)
    N = docs.shape[1]
    lq, lk, lv = (spread(x, dest, N) for x in (q, k, v))
    out = forward(lq, lk, lv, ds, opts, drop_key, docs=docs, levels=Lu)
    return gather(out, dest)




# ---------------------------------------------------------------------------
# the carried state of packed calls (causal, docs/methods/fma.md §4)
# ---------------------------------------------------------------------------


def _rows(f, *xs):
    """``f`` of each batch row (a leading axis of 1 kept), as one vmap."""
    return jax.vmap(lambda *r: jax.tree.map(lambda y: y[0], f(*(jax.tree.map(lambda y: y[None], a) for a in r))))(*xs)


def last_document_state(q, k, v, ds, opts: FMAOptions, segment_ids, pos):
    """The state after a packed call (``q, k, v`` [B, H, n, *], ``segment_ids`` [B, n]) that summarizes only its last
    document, as that document alone would leave it (:func:`~longctx.attention.fma.state.state_from_forward`):
    its last ``2m`` keys and values, per level the ring of its last finished groups and the conv sums of its open
    group, its length ``doc_len`` and its id ``segment``; ``pos``: the row's position after the call."""
    B, H, n, _ = k.shape
    m = opts.m
    start = document_starts(segment_ids)[:, -1]
    length = n - start
    cdt = compute_dtype(q, k, v)
    inside = (jnp.arange(n)[None, :] < length[:, None])[:, None, :, None]

    def shifted(x):  # the last document's tokens from position 0, zeros after them
        x = x.astype(cdt)
        xs = jax.vmap(lambda xb, s: jax.lax.dynamic_slice_in_dim(jnp.pad(xb, ((0, 0), (0, n), (0, 0))), s, n,
                                                                 axis=1))(x, start)
        return jnp.where(inside, xs, jnp.zeros((), cdt))

    def window(x):  # positions [length - 2m, length) of the document (zeros before it)
        xp = jnp.pad(x.astype(acc_type(x)), ((0, 0), (0, 0), (2 * m, 0), (0, 0)))
        return jax.vmap(lambda xb, s: jax.lax.dynamic_slice_in_dim(xb, s, 2 * m, axis=1))(xp, length)

    xs = {"q": shifted(q), "k": shifted(k), "v": shifted(v)}
    st = {"pos": jnp.asarray(pos, jnp.int32), "segment": segment_ids[:, -1].astype(jnp.int32),
          "doc_len": length.astype(jnp.int32), "win_k": window(xs["k"]), "win_v": window(xs["v"])}
    for nm in ("k", "v") + (("q",) if opts.linear else ()):
        rings, accs = [], []
        for l in range(1, opts.L + 1):
            ml, prm = opts.m_l(l), ds[nm][l - 1]
            raw = summarize(pad_to(xs[nm], ml), prm, ml, opts, with_bias=False)  # [B, H, N_l, p, f]
            raw = jnp.pad(raw, ((0, 0), (0, 0), (RING, 1), (0, 0), (0, 0)))  # groups -RING.. and one past the end
            c = bias_rows(prm, opts)
            done = raw if c is None else raw + c
            live = (jnp.arange(raw.shape[2]) >= RING)[None, None, :, None, None]
            done = jnp.where(live, done, 0.0)  # no group before the document: zeros, as the empty state's ring
            G = length // ml
            rings.append(jax.vmap(lambda r, g: jax.lax.dynamic_slice_in_dim(r, g, RING, axis=1))(done, G))
            accs.append(jax.vmap(lambda r, g: jax.lax.dynamic_index_in_dim(r, g + RING, axis=1, keepdims=False))(
                raw, G))
        st[f"ring_{nm}"], st[f"acc_{nm}"] = tuple(rings), tuple(accs)
    return st


def packed_stream(stream, full, q, k, v, state, ds, opts: FMAOptions, segment_ids, drop_key=None):
    """A causal packed call given the carried ``state``: the call's leading tokens that continue the state's
    document (:func:`~longctx.attention.base.continues_state`) run as that document's streamed step from its own
    position ``doc_len`` (``stream``: :func:`~longctx.attention.fma.state.fma_stream` with the implementation's
    block function), every other document as a packed full pass from the empty state (``full(q, k, v, ds, opts,
    segment_ids, drop_key)``). The new state is the streamed one where the call's last document continues the
    state's, else its last document's (:func:`last_document_state`)."""
    T = q.shape[2]
    cont = continues_state(state["segment"], segment_ids)
    if not opts.allow_truncated:
        check_capacity(state["doc_len"] + jnp.sum(cont, axis=1), opts.max_len,
                       "fma: a document of the stream reached {needed} tokens but the layer's levels cover "
                       "max_len={capacity}; raise attention.fma.max_len or set allow_truncated_window=True")
    free = dataclasses.replace(opts, allow_truncated=True)  # the tokens past the continuation are dropped below
    rows = {key: val for key, val in state.items() if key not in ("pos", "segment", "doc_len")}

    def one(qb, kb, vb, st, at):
        out, new = stream(qb, kb, vb, {**st, "pos": at[0]}, ds, free, drop_key)
        return out, {key: val for key, val in new.items() if key != "pos"}

    out_s, new_s = _rows(one, q, k, v, rows, state["doc_len"])
    out_f = full(q, k, v, ds, opts, segment_ids, drop_key)
    out = jnp.where(cont[:, None, :, None], out_s.astype(out_f.dtype), out_f)
    pos = state["pos"] + T
    fresh = last_document_state(q, k, v, ds, opts, segment_ids, pos)
    new_s = {**new_s, "pos": pos, "segment": fresh["segment"], "doc_len": state["doc_len"] + T}
    keep = cont[:, -1]

    def pick(a, b):
        if a.ndim == 0:
            return a
        return jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a.astype(b.dtype), b)

    return out, jax.tree.map(pick, new_s, fresh)


__all__ = ["doc_levels", "document_ends", "gather", "last_document_state", "layout", "layout_size", "packed_forward",
           "packed_stream", "spread"]

"""EVA of a packed row in XLA tiles (``xla`` and ``xla_cpu`` with ``segment_ids``; docs/methods/eva.md, "Packed
rows"): the documents laid out again on the block grid, then the tiles of ``xla.py`` with per-document masks; the
kernels (``pallas.py``) run the same layout with Phase A and Phase B handed to them (:func:`eva_packed`'s
``stats_fn`` and ``attend``).

Layout (static size, :func:`layout_size`). EVA's blocks (``G = W``, or ``P`` without a local part) and chunks
(``P`` divides ``G``) restart at each document. Walking the row in order with a cursor ``x`` (the next free layout
position), a document of ``L`` tokens starts at

* ``⌈x/G⌉G`` when ``L > G`` (its blocks and chunks are then the layout's; the gap, ``< G < L``, is masked);
* ``a = ⌈x/P⌉P`` when ``P <= L <= G`` and ``[a, a + L)`` stays inside one block, else ``⌈x/G⌉G``: all its tokens
  are in its own first block, so its local window (its tokens up to the query; overlap only widens it to
  positions it does not have) lies inside the layout block that holds it, and its chunks are layout chunks;
* causal: ``x`` when ``L < P`` and ``[x, x + L)`` stays inside one block, else ``⌈x/G⌉G``: it has no finished
  chunk (a query at ``n < P`` sees none, and its state holds none), only its local window. Bidirectional: such a
  document has one chunk, visible to all its queries, so it follows the second rule.

A document's chunks are not exact local attention: inside its first block a query already sees the chunks before
its own (``partition='full'`` double counting), so a document of ``P`` tokens or more needs the chunk grid.
Bound: a gap is ``< L`` for the first and last rules and ``<= (L − 1) + (P − 1)`` for the second (at a block's
end, ``⌈x/G⌉G − a <= L − 1`` as the document did not fit, and ``a − x <= P − 1``), so the layout ends before
``2T + (P − 1)⌊T/P⌋`` (``< 3T``; a second-rule document has ``L >= P``); bidirectional, where documents shorter
than ``P`` take the second rule too, before ``2T + (P − 2)T`` (rows of many very short documents are costly there).
With a carried state a prefix of ``⌈R/G⌉G + G − 1`` positions goes first.

Every index the method takes is the document's own: a position's ``rel`` (from the document's first token, counted
on from ``doc_len`` after a carried state), a chunk's id ``rel/P`` (its noise draw, its dropout counter), the
masks (local window and chunk visibility from ``rel``, both restricted to the query's document); the bias is a
function of position differences, which the layout keeps inside a document. Gaps are never keys nor scored
queries. After a carried state the carried document is laid out so that its ``rel`` and layout positions agree
modulo ``G``, behind the state's ring (keys and values) and unfinished chunk (its members' queries): the chunk
that one opens is summarised with the call's members in the layout, the finished ones come from the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention.base import continues_state
from longctx.attention.eva.common import (
    PLAIN,
    EVAOptions,
    TileOps,
    check_state_capacity,
    chunk_mask,
    chunk_noise,
    dropout_multipliers,
    dropout_seeds,
    geometry,
    local_mask,
    rpe_bias,
    window_keys,
)
from longctx.attention.eva.reference import _take, document_positions
from longctx.attention.eva.tiles import joint_tile, map_tiles
from pallas_kernels.precision import compute_dtype


def grid_block(opts: EVAOptions, P: int) -> int:
    """G: the block a document's local window is computed on (W; P without a local part)."""
    return opts.W if opts.W > 0 else P


def layout_size(T: int, G: int, P: int, prefix: int = 0, causal: bool = True) -> int:
    """The static layout length of T packed tokens behind ``prefix`` positions (module docstring's bound: causal
    ``2T + (P − 1)⌊T/P⌋``, bidirectional ``2T + (P − 2)T``), rounded up to whole blocks."""
    gaps = (P - 1) * (T // P) if causal else max(P - 2, 0) * T
    return -(-(prefix + 2 * T + gaps) // G) * G


def _place(x, L, G: int, P: int, causal: bool = True):
    """The layout start of a document of L tokens at cursor x (module docstring's rules; bidirectional: a
    document shorter than P is aligned to P too, its one chunk being visible to its own queries)."""
    block = -(-x // G) * G
    a = jnp.where(L >= P, -(-x // P) * P, x) if causal else -(-x // P) * P
    fits = a // G == (a + L - 1) // G
    return jnp.where((L <= G) & fits, a, block)


def document_layout(segment_ids, G: int, P: int, cont=None, first=None, cursor: int = 0, causal: bool = True):
    """lay int32 [B, T]: each token's layout position. ``cont`` [B, T] (the tokens continuing a carried document)
    sit at ``first + t`` ([B]); the others follow from ``cursor`` by :func:`_place`."""
    B, T = segment_ids.shape
    start, rel = document_positions(segment_ids)
    end = T - 1 - jnp.flip(document_positions(jnp.flip(segment_ids, axis=1))[0], axis=1)  # last token of the doc
    length = end - start + 1
    if cont is None:
        cont, first = jnp.zeros((B, T), bool), jnp.zeros((B,), jnp.int32)
    fixed = first[:, None] + jnp.arange(T, dtype=jnp.int32)[None]

    def step(x, inp):
        is_start, L, c, f = inp
        lay = jnp.where(c, f, jnp.where(is_start, _place(x, L, G, P, causal), x))
        return lay + 1, lay

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (rel == 0, length, cont, fixed))
    _, lay = jax.lax.scan(step, jnp.full((B,), cursor, jnp.int32), xs)
    return jnp.moveaxis(lay, 0, 1)


def _gather(src, idx):
    """src [B,H,N,d] at idx [B,M] (-1: zero) along axis 2."""
    return _take(src, idx, idx >= 0)


def eva_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int, segment_ids,
               state=None, ops: TileOps = PLAIN, stats_fn=None, attend=None):
    """A packed row (``segment_ids`` [B, T]) in tiles: each document as if alone (module docstring). ``state``
    (causal): a carried one, continued by the tokens ``base.continues_state`` marks. Returns (out [B,H,T,dv]
    float32, the state of each row's last document (causal) or None), as ``reference.eva_reference_packed``.

    The kernels' form (``pallas.py``) runs the same layout: ``stats_fn`` (Phase A, ``chunk_summaries``'s signature
    with per-row chunk members) and ``attend(q, k, v, k_hat, beta, segments, chunk_base, seeds)`` (Phase B over the
    laid-out row, [B,H,Lp,·] in the compute dtype; ``segments`` = (each position's own index, its document as a
    query, as a key, each chunk's own index, its document; negative: none) and ``chunk_base`` the state's chunks
    ahead of the layout's, as ``pallas_kernels.eva_attend`` takes them) -> [B,H,Lp,dv]."""
    B, H, T, d = q.shape
    dv = v.shape[-1]
    scale = d**-0.5
    P = chunk_size
    G = grid_block(opts, P)
    cd = compute_dtype(q, k, v)
    seg = segment_ids.astype(jnp.int32)
    start, rel = document_positions(seg)
    carried = state is not None
    sources = {"q": q.astype(cd), "k": k.astype(cd), "v": v.astype(cd)}
    if carried:
        R, C_max = state["win_k"].shape[2], state["mem_khat"].shape[2]
        cont = continues_state(state["segment"], seg)
        on = cont[:, 0]  # the row continues the carried document
        n0 = jnp.where(on, state["doc_len"], 0)
        check_state_capacity(jnp.max(n0), T, P, C_max)
        rel = rel + jnp.where(cont, n0[:, None], 0)
        c0, r0 = n0 // P, n0 % P
        Rp = -(-R // G) * G
        first = Rp + n0 % G  # the carried document's next position: rel ≡ layout (mod G)
        lay = document_layout(seg, G, P, cont, first, Rp)
        Lp = layout_size(T, G, P, Rp + G - 1)
        # the state's ring (keys, values) and unfinished chunk (its members' q; k, v too, for a layout without a ring)
        for name, ring, cur in (("q", None, "cur_q"), ("k", "win_k", "cur_k"), ("v", "win_v", "cur_v")):
            parts = ([] if ring is None else [state[ring]]) + [state[cur], sources[name]]
            sources[name] = jnp.concatenate([x.astype(cd) for x in parts], axis=2)
    else:
        R, cont, on, n0 = 0, jnp.zeros((B, T), bool), jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32)
        lay = document_layout(seg, G, P, causal=opts.causal)
        Lp = layout_size(T, G, P, causal=opts.causal)

    # each layout position: the call's token there (-1: none), its rel, its document as a key and as a query
    rows = jnp.arange(B)[:, None]
    inv = jnp.full((B, Lp), -1, jnp.int32).at[rows, lay].set(jnp.arange(T, dtype=jnp.int32)[None])
    at = jnp.arange(Lp, dtype=jnp.int32)[None]
    mine = inv >= 0
    p_rel = jnp.take_along_axis(rel, jnp.clip(inv, 0), axis=1)
    p_doc = jnp.where(mine, jnp.take_along_axis(start, jnp.clip(inv, 0), axis=1), -1)
    idx = {name: jnp.where(mine, inv, -1) for name in "qkv"}
    if carried:
        behind = (first[:, None] - at)  # positions behind the carried document's first token in the call
        ring_ok = on[:, None] & (behind >= 1) & (behind <= R) & (n0[:, None] - behind >= 0)
        cur_ok = on[:, None] & (behind >= 1) & (behind <= r0[:, None])
        cur_slot = r0[:, None] - behind
        for name, off in (("q", P), ("k", R + P), ("v", R + P)):
            from_cur = jnp.where(cur_ok, cur_slot + (0 if name == "q" else R), -1)
            from_ring = jnp.where(ring_ok & (name != "q"), R - behind, -1)
            idx[name] = jnp.where(mine, inv + off, jnp.where(cur_ok, from_cur, from_ring))
        held = ring_ok | cur_ok
        p_rel = jnp.where(mine, p_rel, n0[:, None] - behind)
        p_doc = jnp.where(mine, p_doc, jnp.where(held, 0, -1))  # the carried document is the call's first
    key_doc = p_doc
    query_doc = jnp.where(mine, p_doc, -2)  # a gap or the state's prefix is no query
    q_l, k_l, v_l = (_gather(sources[n], idx[n]) for n in "qkv")  # [B,H,Lp,.] compute dtype, zero off documents

    # Phase A over the layout's chunks: a chunk opens where a document's rel is a multiple of P (else it is none)
    C_l = Lp // P
    c_rel, c_doc = p_rel[:, ::P], key_doc[:, ::P]
    c_ok = (c_doc >= 0) & (c_rel % P == 0)
    if carried:  # the carried document's finished chunks come from the state
        c_ok = c_ok & ~((c_doc == 0) & on[:, None] & (c_rel // P < c0[:, None]))
    c_id = c_rel // P
    members = c_ok[:, :, None] & (key_doc.reshape(B, C_l, P) == c_doc[:, :, None])  # [B, C_l, P]
    per_chunk = lambda x: jnp.where(members[:, None, :, :, None], x.reshape(B, H, C_l, P, x.shape[-1]), 0)  # noqa: E731
    q_ch, k_ch, v_ch = (per_chunk(x) for x in (q_l, k_l, v_l))
    noise = None
    if noise_key is not None:
        n_ids = -(-T // P) + (C_max + 1 if carried else 0)  # the chunk indices a document reaches in this call
        drawn = chunk_noise(noise_key, jnp.arange(n_ids), B, H, d)
        noise = ops.noise(jnp.take_along_axis(drawn, jnp.clip(c_id, 0, n_ids - 1)[:, None, :, None], axis=2)
                          .astype(cd))
    k_hat, beta = ops.summaries(stats_fn)(q_ch, k_ch, v_ch, members[:, None], params, noise, opts, scale)
    exact = opts.chunk_logit == "exact_lse"
    ch = {"hat": k_hat, "beta": beta, "raw": k_ch, "raw_ok": members, "id": c_id, "doc": c_doc, "ok": c_ok}
    if carried:  # the state's finished chunks first: ids 0..C_max-1, visible below the carried document's c0
        ids = jnp.broadcast_to(jnp.arange(C_max, dtype=jnp.int32), (B, C_max))
        kraw = state.get("mem_kraw")
        old = {"hat": state["mem_khat"], "beta": state["mem_beta"],
               "raw": None if kraw is None else kraw.astype(cd), "raw_ok": jnp.ones((B, C_max, P), bool), "id": ids,
               "doc": jnp.broadcast_to(jnp.where(on, 0, -1)[:, None], (B, C_max)), "ok": on[:, None] & (ids < c0[:, None])}
        ch = {n: None if ch[n] is None or old[n] is None else jnp.concatenate(
            [old[n], ch[n]], axis=2 if n in ("hat", "beta", "raw") else 1) for n in ch}
    chunks = (ch["hat"].astype(cd), ch["beta"].astype(cd), ch["raw"] if exact else None,
              ch["raw_ok"][:, None] if exact else None)
    C_t = ch["id"].shape[1]
    seeds = dropout_seeds(drop_key, opts, B, H)
    if attend is not None:  # the kernels: Phase B over the whole layout, every mask from these
        segments = (p_rel, query_doc, key_doc, ch["id"], jnp.where(ch["ok"], ch["doc"], -1))
        out = attend(q_l, k_l, v_l, chunks[0], chunks[1], segments, C_max if carried else 0, seeds)
        return _gather_back(out, lay, seg, rel, cont, n0, (q_l, k_l, v_l), k_ch, k_hat, beta, state, opts, P, T)

    # Phase B per layout block of G queries, its window [wG − e_l, (w+1)G + e_r)
    n_tiles = Lp // G
    Tk = window_keys(opts, G)
    q_pos = np.arange(Lp).reshape(n_tiles, G)
    k_pos = np.arange(n_tiles)[:, None] * G - opts.e_l + np.arange(Tk)[None, :]
    k_in = (k_pos >= 0) & (k_pos < Lp)
    kidx = np.clip(k_pos, 0, Lp - 1)
    tile_of = lambda x, ix: jnp.moveaxis(jnp.take(x, ix.reshape(-1), axis=-1).reshape(  # noqa: E731
        x.shape[:-1] + ix.shape), -2, 0)
    q_t = jnp.moveaxis(q_l.reshape(B, H, n_tiles, G, d), 2, 0)
    k_t, v_t = (jnp.moveaxis(x[:, :, kidx.reshape(-1)].reshape(B, H, n_tiles, Tk, x.shape[-1]), 2, 0)
                for x in (k_l, v_l))
    xs = (q_t, k_t, v_t, jnp.asarray(q_pos), jnp.asarray(k_pos), tile_of(p_rel, q_pos), tile_of(query_doc, q_pos),
          tile_of(p_rel, kidx), _key_docs(key_doc, kidx, k_in))

    @jax.checkpoint
    def one(qt, kt, vt, qp, kp, qr, qd, kr, kd):
        def masks(qr, qd, kr, kd, cid, cdoc, cok):
            lm = local_mask(qr, kr, kd >= 0, opts) & (qd[:, None] == kd[None, :])
            cm = chunk_mask(qr, cid, cok, P, opts) & (qd[:, None] == cdoc[None, :])
            return lm, cm

        lm, cm = jax.vmap(masks)(qr, qd, kr, kd, ch["id"], ch["doc"], ch["ok"])
        bias = rpe_bias(rpe_table, qp, kp, opts, scale) if opts.use_rpe and rpe_table is not None else None
        drop = None
        if seeds is not None:  # the documents' own counters: rel positions and chunk ids
            drop = jax.vmap(lambda sd, r, kr_, c: dropout_multipliers(sd, opts.attn_dropout, r, kr_, c))(
                seeds, qr, kr, ch["id"])
        return joint_tile(qt, kt, vt, chunks, lm[:, None], cm[:, None], bias, drop, opts, scale, ops)

    cost = B * H * G * (Tk + C_t * (P if exact else 1))
    out = map_tiles(one, xs, n_tiles, cost, opts.logit_budget)  # [n_tiles,B,H,G,dv]
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, Lp, dv)
    return _gather_back(out, lay, seg, rel, cont, n0, (q_l, k_l, v_l), k_ch, k_hat, beta, state, opts, P, T)


def _gather_back(out, lay, seg, rel, cont, n0, laid, k_ch, k_hat, beta, state, opts: EVAOptions, P: int, T: int):
    """The call's tokens out of the layout's outputs [B,H,Lp,dv], and (causal) the state of each row's last
    document."""
    out = jnp.take_along_axis(out, lay[:, None, :, None], axis=2)
    if not opts.causal:
        return out, None
    return out, _last_document_state(state, seg, rel, lay, cont, n0, laid, k_ch, k_hat, beta, opts, P, T)


def _key_docs(key_doc, kidx, k_in):
    """[n_tiles, B, Tk]: the key documents of each tile's window (-1 outside the layout)."""
    kd = jnp.where(jnp.asarray(k_in)[None], key_doc[:, kidx], -1)  # [B, n_tiles, Tk]
    return jnp.moveaxis(kd, 1, 0)


def _last_document_state(state, seg, rel, lay, cont, n0, laid, k_ch, k_hat, beta, opts: EVAOptions, P: int, T: int):
    """The state of each row's last document (its ring, unfinished chunk and finished chunks, from the layout and,
    for the carried document's older chunks, from ``state``), as ``reference.eva_reference_packed`` returns it."""
    carried = state is not None
    if carried:
        R, C_max = state["win_k"].shape[2], state["mem_khat"].shape[2]
    else:
        R, C_max = opts.W + opts.e_l, geometry(opts, T, P, 0)[2]  # a full pass's capacity (common.state_from_forward)
    q_l, k_l, v_l = (x.astype(jnp.float32) for x in laid)
    n1 = rel[:, -1] + 1  # [B] its length after the call
    org = (lay[:, -1] - rel[:, -1])[:, None]  # the layout position of its rel 0 (virtual for a carried document)
    new = {"pos": (state["pos"] if carried else 0) + jnp.asarray(T, jnp.int32), "segment": seg[:, -1], "doc_len": n1}
    x = n1[:, None] - R + np.arange(R)[None]
    new["win_k"], new["win_v"] = (_take(a, org + x, x >= 0) for a in (k_l, v_l))
    x = (n1 // P * P)[:, None] + np.arange(P)[None]
    new["cur_q"], new["cur_k"], new["cur_v"] = (_take(a, org + x, x < n1[:, None]) for a in (q_l, k_l, v_l))
    c = np.arange(C_max)[None]
    done = c < (n1 // P)[:, None]
    slot = (org + c * P) // P
    from_state = cont[:, -1:] & (c < (n0 // P)[:, None]) if carried else None
    tables = [("mem_khat", k_hat), ("mem_beta", beta)]
    if opts.chunk_logit == "exact_lse":
        tables.append(("mem_kraw", k_ch.astype(jnp.float32)))
    for name, table in tables:
        got = _take(table, slot, done)
        if carried:
            got = jnp.where(from_state.reshape(from_state.shape[:1] + (1,) + from_state.shape[1:]
                                               + (1,) * (got.ndim - 3)), state[name], got)
        new[name] = got
    return new

"""Transformer-VQ attention as the paper writes it (Lingle 2023, arXiv 2309.16354; our reading:
docs/methods/transformer_vq.md, whose sections the § numbers cite): the implementation named ``reference``,
which every other implementation of the method must equal (tests/attention/test_implementations.py).

Quadratic in the call's length: one [T, S + M + T] softmax per query row over the compressive cache (S codewords,
log counts added), the carried band (the newest M keys) and the call's own keys.

* :func:`stvq`           -- nearest codeword and straight-through quantized keys (§2.2)
* :func:`causal`         -- the causal logits of §2.3 over cache, band and present keys, one softmax (§2.4, §2.6,
                            §2.7): output and the new state
* :func:`bidirectional`  -- the encoder: all keys, the symmetric band bias where ``band`` (§2.5)
* :func:`packed`         -- either direction over a packed row (``segment_ids``): each document as if alone
                            (docs/methods/transformer_vq.md §2.8)

Gradients are the linear forms': a key reached through the cache enters its logit under a stop-gradient (the
codeword, §2.7: in the causal form every key older than the block before its query's block, relative to the
call's first token; in the encoder every key two or more blocks away, or every key without ``band``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.base import document_starts
from pallas_kernels.vq_cache_ref import NEG, cast_state, final_state, float_dtype, log_count

sg = jax.lax.stop_gradient


def stvq(k, C):
    """k [B,H,T,Dk], codebook C [H,S,Dk] -> (k_hat, z, err2, c_z): z = argmin_s ||k - c_s||^2 (fp32 or wider, ties
    to the lowest index), c_z = sg(C)[z], k_hat = k + sg(c_z - k) (value c_z, Jacobian I), err2 = the min distance."""
    dt = float_dtype(k, C)
    k, C = k.astype(dt), sg(C).astype(dt)
    d2 = jnp.sum(k * k, -1)[..., None] - 2.0 * jnp.einsum("bhtd,hsd->bhts", k, C) + jnp.sum(C * C, -1)[:, None]
    z = jnp.argmin(d2, axis=-1).astype(jnp.int32)
    c_z = jnp.take_along_axis(C[None], z[..., None], axis=2)
    return k + sg(c_z - k), z, jax.nn.relu(jnp.min(d2, -1)), c_z


def band_scores(q_v, r):
    """bd[b, h, t, n] = (q_t + v') . r'_n: q_v [B,H,T,Dk], r [n, H, Dk] (n = M+1 distances, or 2M+1 signed)."""
    return jnp.einsum("bhtd,nhd->bhtn", q_v, r)


def rel_bias(bd, idx, max_index: int):
    """bias[..., i, j] = bd[..., i, idx[i, j]] if 0 <= idx <= max_index else 0. bd: [..., Lq, D]."""
    ok = (idx >= 0) & (idx <= max_index)
    full = jnp.broadcast_to(jnp.clip(idx, 0, max_index), bd.shape[:-1] + idx.shape[-1:])
    return jnp.where(ok, jnp.take_along_axis(bd, full, axis=-1), 0.0)


def _attend(logits, visible, values):
    """softmax over the last axis of ``logits`` where ``visible``, times ``values``."""
    p = jax.nn.softmax(jnp.where(visible, logits, NEG), axis=-1)
    return jnp.einsum("...ij,...jd->...id", p, values)


def causal(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int):
    """Query i (of T) of a call that starts after ``state["pos"]`` tokens attends to (§2.3)

    - code s of the cache: logit (q_i + u') . c_s + log N_s, value the mean mu_s (codes with N_s = 0 are absent);
    - key j, the carried band's M keys (j = -M..-1) and the call's keys (j = 0..i): logit (q_i + u') . k_hat_j, plus
      (q_i + v') . r'_d for the distance d = i - j <= M; band slots before the row's first token are absent.

    A key j < (i // L) L - max(L, M) is one the block-parallel form reads through the cache (for M >= L the
    streaming form's too, with chunks of L): its logit takes sg(k_hat_j). Returns (o [B,H,T,Dv], the state after
    the call, §2.7).
    """
    dt = float_dtype(q_u, v)
    q_u, bd, kx, v = (x.astype(dt) for x in (q_u, bd, k_hat, v))
    st = cast_state(state, dt)
    T = q_u.shape[2]
    keys = jnp.concatenate([st["band_k"], kx], axis=2)  # [B,H,M+T,Dk]
    values = jnp.concatenate([st["band_v"], v], axis=2)
    i = jnp.arange(T)[:, None]
    j = jnp.arange(-M, T)[None, :]
    visible = (j <= i) & (st["pos"] + j >= 0)
    far = j < (i // L) * L - max(L, M)
    s = jnp.where(far, jnp.einsum("bhid,bhjd->bhij", q_u, sg(keys)), jnp.einsum("bhid,bhjd->bhij", q_u, keys))
    s = s + rel_bias(bd, i - j, M)
    s_c = jnp.einsum("bhid,hsd->bhis", q_u, sg(C).astype(dt)) + log_count(st["agg_n"])[:, :, None, :]
    logits = jnp.concatenate([s_c, s], axis=-1)
    seen = jnp.concatenate([jnp.broadcast_to((st["agg_n"] > 0)[:, :, None, :], s_c.shape),
                            jnp.broadcast_to(visible, s.shape)], axis=-1)
    o = _attend(logits, seen, jnp.concatenate([st["agg_mu"], values], axis=2))
    return o, final_state(st, kx, z, v, T, M, C.shape[1])


def bidirectional(q_u, bd, k_hat, v, *, L: int, M: int, band: bool):
    """Every query attends to every key (§2.5): logit (q_i + u') . k_hat_j, plus (q_i + v') . r'_{d+M} for |d| <= M
    where ``band`` (bd over the signed distances -M..M). Keys the encoder reads through the code summaries (blocks
    two or more away from the query's; every key without ``band``) take sg(k_hat)."""
    dt = float_dtype(q_u, v)
    q_u, bd, k_hat, v = (x.astype(dt) for x in (q_u, bd, k_hat, v))
    T = q_u.shape[2]
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    far = (jnp.abs(i // L - j // L) >= 2) | (not band)
    s = jnp.where(far, jnp.einsum("bhid,bhjd->bhij", q_u, sg(k_hat)), jnp.einsum("bhid,bhjd->bhij", q_u, k_hat))
    if band:
        s = s + rel_bias(bd, i - j + M, 2 * M)
    return _attend(s, jnp.ones((T, T), bool), v)




def packed(q_u, bd, k_hat, v, *, L: int, M: int, causal: bool, band: bool, segment_ids, C=None, carried=None):
    """:func:`causal` from the empty state (``causal``) or :func:`bidirectional` of a packed row (``segment_ids``
    [B, T]): every document as if alone (§2.8). A query sees only its document's keys; the block grid that decides
    which keys the linear forms read through the cache (their logits under sg(k_hat)) is the document's, counted
    from its first token; the band bias is by distance, which two tokens of one document share with the document
    alone. A document's compressive cache is, as in :func:`causal`, exact softmax over its own older quantized keys
    (what the code summaries of its earlier blocks hold), so no cache term appears. ``bd``: [B, H, T, M+1]
    (causal) or [B, H, T, 2M+1] (the signed distances, bidirectional). Quadratic in the row's length.

    ``carried`` (causal): ``(state, seen, continues)``, the carried state of one document (``seen`` [B] its length
    so far) and the tokens that continue it (``continues`` [B, T], the call's leading run,
    ``longctx.attention.base.continues_state``): those queries also attend, as in :func:`causal`, to the state's
    cache (codebook ``C``) and its band (valid slots: the last ``min(seen, M)``), the call's grid counted from its
    first token (the continued document's first token here). Returns o [B, H, T, Dv] (the state after the call:
    :func:`longctx.attention.transformer_vq.state.packed_final_state`)."""
    dt = float_dtype(q_u, v)
    q_u, bd, k_hat, v = (x.astype(dt) for x in (q_u, bd, k_hat, v))
    T = q_u.shape[2]
    start = document_starts(segment_ids.astype(jnp.int32))
    rel = jnp.arange(T, dtype=jnp.int32) - start  # [B, T] position inside the document
    i, j = rel[:, None, :, None], rel[:, None, None, :]  # [B, 1, T, T]
    same = start[:, None, :, None] == start[:, None, None, :]
    if causal:
        visible, far = same & (j <= i), j < (i // L) * L - max(L, M)
    else:
        visible, far = same, (jnp.abs(i // L - j // L) >= 2) | (not band)
    s = jnp.where(far, jnp.einsum("bhid,bhjd->bhij", q_u, sg(k_hat)), jnp.einsum("bhid,bhjd->bhij", q_u, k_hat))
    if causal:
        s = s + rel_bias(bd, i - j, M)
    elif band:
        s = s + rel_bias(bd, i - j + M, 2 * M)
    if carried is None:
        return _attend(s, visible, v)
    st, seen, cont = carried
    st = cast_state(st, dt)
    on = cont[:, None, :, None]  # [B, 1, T, 1]: the queries that continue the carried document
    jb = jnp.arange(-M, 0)  # the band's slots, relative to the call's first token
    far_b = jb < (i // L) * L - max(L, M)
    s_b = jnp.where(far_b, jnp.einsum("bhid,bhjd->bhij", q_u, sg(st["band_k"])),
                    jnp.einsum("bhid,bhjd->bhij", q_u, st["band_k"])) + rel_bias(bd, i - jb, M)
    s_c = jnp.einsum("bhid,hsd->bhis", q_u, sg(C).astype(dt)) + log_count(st["agg_n"])[:, :, None, :]
    seen_b = on & (seen[:, None, None, None] + jb >= 0)
    seen_c = on & (st["agg_n"] > 0)[:, :, None, :]
    o = _attend(jnp.concatenate([s_c, s_b, s], axis=-1),
                jnp.concatenate([jnp.broadcast_to(x, y.shape) for x, y in
                                 ((seen_c, s_c), (seen_b, s_b), (visible, s))], axis=-1),
                jnp.concatenate([st["agg_mu"], st["band_v"], v], axis=2))
    return o


__all__ = ["band_scores", "bidirectional", "causal", "packed", "rel_bias", "stvq"]

"""The decoding state of a causal Transformer-VQ core (docs/methods/transformer_vq.md §2.7), shared by every
implementation (each returns it in this layout)::

    {"pos": int32[],                       # tokens seen
     "band_k": [B, H, M, Dk], "band_v": [B, H, M, Dv], "band_z": int32[B, H, M],
     "agg_mu": [B, H, S, Dv], "agg_n": [B, H, S],
     "segment": int32[B], "seen": int32[B]}  # the core's document (DOCUMENT: packed rows, §2.8)

band = the newest M tokens (right-aligned; slot j holds position pos - M + j, invalid if < 0), agg = the running
mean of the values per code and the count of every older token (float32 or wider: statistics). The per-code
summaries and their merge are the kernel's reference's (``pallas_kernels.vq_cache_ref``: ``code_summary``,
``merge``), which the kernel's final state is tested against.

Packed rows (§2.8): ``segment`` is the id of the document the state summarizes (0: none, the empty state's; a call
without segment ids leaves it as given) and ``seen`` that document's length so far (a call without segment ids
adds its length: its tokens continue the row's one document). The band of a packed state holds its document's
last ``min(seen, M)`` tokens in its last slots (the other slots are not its document's and are never read: a packed
call masks them by ``seen``; a call without segment ids reads the band by ``pos``, so it continues a packed state
only where that document has at least M tokens). The forms (``xla.py``, ``xla_cpu.py``, the kernel) take and return
the state without ``DOCUMENT``; the core adds it (``TransformerVQAttention.finish``).
"""

from __future__ import annotations

import jax.numpy as jnp

from longctx.attention.base import document_starts
from pallas_kernels.vq_cache_ref import PLAIN, Ops, code_summary, merge

DOCUMENT = ("segment", "seen")  # the core's per-row document counters (packed rows), beside the forms' state


def empty_state(B, H, M, S, Dk, Dv, dtype=jnp.float32):
    """The state of an empty prefix: no tokens, an invalid band, an empty cache."""
    return {
        "pos": jnp.zeros((), jnp.int32),
        "band_k": jnp.zeros((B, H, M, Dk), dtype),
        "band_v": jnp.zeros((B, H, M, Dv), dtype),
        "band_z": jnp.zeros((B, H, M), jnp.int32),
        "agg_mu": jnp.zeros((B, H, S, Dv), dtype),
        "agg_n": jnp.zeros((B, H, S), dtype),
    }


def compose(a, b, *, M: int, S: int):
    """The state after ``a``'s tokens then ``b``'s, ``b`` run from the empty state with at least M tokens: ``a``'s
    band leaves the band when ``b``'s tokens arrive and joins the cache, merged count-weighted (associative). With
    ``DOCUMENT``: a row of ``b`` whose document spans all of ``b``'s tokens (``seen == pos``) under ``a``'s id
    continues ``a``'s document (rows without segment ids: always); any other row is ``b``'s document alone."""
    valid = a["pos"] - M + jnp.arange(M) >= 0
    band = code_summary(a["band_z"], a["band_v"], valid, S)
    agg_mu, agg_n = merge(merge((a["agg_mu"], a["agg_n"]), band), (b["agg_mu"], b["agg_n"]))
    out = {**b, "pos": a["pos"] + b["pos"], "agg_mu": agg_mu, "agg_n": agg_n}
    if "segment" not in b:
        return out
    joins = (b["segment"] == a["segment"]) & (b["seen"] == b["pos"])  # [B]
    pick = lambda x, y: jnp.where(joins.reshape(joins.shape + (1,) * (x.ndim - 1)), x, y)  # noqa: E731
    return {**out, "agg_mu": pick(agg_mu, b["agg_mu"]), "agg_n": pick(agg_n, b["agg_n"]),
            "seen": pick(a["seen"] + b["seen"], b["seen"])}


def packed_final_state(state, seen, continues, k_hat, z, v, segment_ids, *, M: int, S: int, ops: Ops = PLAIN):
    """The state after a packed call (§2.8), of its last document only: the carried ``state`` (without
    ``DOCUMENT``; ``seen`` [B] its document's length) advanced by the call's tokens where the whole call continues
    that document (``continues`` [B, T], ``longctx.attention.base.continues_state``), else that of the call's last
    document from the empty state. k_hat, v: [B, H, T, .] in the state's dtype, z [B, H, T], segment_ids [B, T].
    Returns the state with ``seen`` (the caller adds ``segment``)."""
    T = z.shape[2]
    start = document_starts(segment_ids.astype(jnp.int32))[:, -1]  # [B]: where the last document opens (0: continues)
    whole = continues[:, -1]
    base = jnp.where(whole, seen, 0)  # the last document's tokens before the call
    e = jnp.arange(M + T)
    # position inside the last document of each entry of [band; call]: band slot j is base - M + j, call token t
    # is base + t - start; a negative one is not the document's
    epos = base[:, None] - M + e[None, :] - jnp.where(e >= M, start[:, None], 0)  # [B, M + T]
    ek, ev, ez = (jnp.concatenate([state[n], x], axis=2) for n, x in (("band_k", k_hat), ("band_v", v),
                                                                       ("band_z", z)))
    mu, n = code_summary(ez[:, :, :T], ev[:, :, :T], (epos[:, :T] >= 0)[:, None], S, ops)
    keep = whole[:, None, None]
    agg_mu, agg_n = merge((jnp.where(keep[..., None], state["agg_mu"], 0.0), jnp.where(keep, state["agg_n"], 0.0)),
                          (mu, n))
    return {"pos": state["pos"] + T, "band_k": ek[:, :, T:], "band_v": ev[:, :, T:], "band_z": ez[:, :, T:],
            "agg_mu": agg_mu, "agg_n": agg_n, "seen": base + T - start}


__all__ = ["DOCUMENT", "compose", "empty_state", "packed_final_state"]

import jax.numpy as jnp

from longctx.attention import eva as E


def _joint_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, scale, probs=False, halves=False):
    Tq, Tk = q.shape[3], k.shape[3]
    pieces = E._local_pieces(Tq, Tk, halves)
    s_loc = []
    for piece in pieces:
        r0, r1, nk = piece
        a = scale * jnp.einsum("bhnqd,bhnkd->bhnqk", q[:, :, :, r0:r1], k[:, :, :, :nk], precision=E.HIGHEST)
        if bias is not None:
            a = a + E._piece_bias(bias, piece)
        s_loc.append(a)
    s_ch = scale * jnp.einsum("bhnqd,bhcd->bhnqc", q, k_hat, precision=E.HIGHEST)
    lm = [lmask[:, r0:r1, :nk] for (r0, r1, nk) in pieces]
    m_loc = jnp.concatenate([jnp.max(jnp.where(l, a, E.NEG), axis=-1, initial=E.NEG) for a, l in zip(s_loc, lm)], axis=-1)
    m = jnp.maximum(m_loc, jnp.max(jnp.where(cmask, s_ch, E._fill_like(s_ch, E.NEG)), axis=-1, initial=E.NEG))[..., None]
    p_loc = [jnp.where(l, jnp.exp(a - m[:, :, :, r0:r1]), 0.0) for a, l, (r0, r1, nk) in zip(s_loc, lm, pieces)]
    p_ch = jnp.where(cmask, jnp.exp(s_ch - m), E._fill_like(s_ch, 0.0))
    den = jnp.concatenate([jnp.sum(p, axis=-1) for p in p_loc], axis=-1) + jnp.sum(p_ch, axis=-1)
    den = jnp.maximum(den, 1e-30)
    num = jnp.concatenate([jnp.einsum("bhnqk,bhnkd->bhnqd", p, v[:, :, :, :nk], precision=E.HIGHEST)
                           for p, (_, _, nk) in zip(p_loc, pieces)], axis=3)
    num = num + jnp.einsum("bhnqc,bhcd->bhnqd", p_ch, beta, precision=E.HIGHEST)
    if probs:
        return num / den[..., None], (tuple(p_loc), p_ch, 1.0 / den)
    return num / den[..., None], m[..., 0] + jnp.log(den)
def apply():
    E._joint_softmax = _joint_softmax

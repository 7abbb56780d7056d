"""B: the chunk logits are not max-reduced: the row stabiliser is max(local max, a Cauchy-Schwarz bound of the
chunk logits) (probe only: no fallback for a large gap)."""
import sys
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]


def apply():
    import jax
    import jax.numpy as jnp
    from longctx.attention import eva as E

    def js(q, k, v, k_hat, beta, bias, lmask, cmask, scale, probs=False, halves=False):
        Tq, Tk = q.shape[3], k.shape[3]
        pieces = E._local_pieces(Tq, Tk, halves)
        a_loc = []
        for piece in pieces:
            r0, r1, nk = piece
            a = scale * jnp.einsum("bhnqd,bhnkd->bhnqk", q[:, :, :, r0:r1], k[:, :, :, :nk], precision=E.HIGHEST)
            if bias is not None:
                a = a + E._piece_bias(bias, piece)
            a_loc.append(jnp.where(lmask[:, r0:r1, :nk], a, E.NEG))
        s_ch = jnp.einsum("bhnqd,bhcd->bhnqc", q, k_hat, precision=E.HIGHEST)
        m_loc = jnp.concatenate([jnp.max(a, axis=-1, initial=E.NEG) for a in a_loc], axis=-1)
        kn = jnp.sqrt(jnp.max(jnp.sum(k_hat * k_hat, -1), -1))  # [B,H]
        bound = scale * jnp.sqrt(jnp.sum(q * q, -1)) * kn[:, :, None, None]
        m = jax.lax.stop_gradient(jnp.maximum(m_loc, bound))[..., None]
        p_loc = [jnp.where(lmask[:, r0:r1, :nk], jnp.exp(a - m[:, :, :, r0:r1]), 0.0)
                 for a, (r0, r1, nk) in zip(a_loc, pieces)]
        p_ch = jnp.exp(jnp.where(cmask, scale * s_ch - m, E.NEG))
        den = jnp.concatenate([jnp.sum(p, axis=-1) for p in p_loc], axis=-1) + jnp.sum(p_ch, axis=-1)
        den = jnp.maximum(den, 1e-30)
        num = jnp.concatenate([jnp.einsum("bhnqk,bhnkd->bhnqd", p, v[:, :, :, :nk], precision=E.HIGHEST)
                               for p, (_, _, nk) in zip(p_loc, pieces)], axis=3)
        num = num + jnp.einsum("bhnqc,bhcd->bhnqd", p_ch, beta, precision=E.HIGHEST)
        if probs:
            return num / den[..., None], (tuple(p_loc), p_ch, 1.0 / den)
        return num / den[..., None], m[..., 0] + jnp.log(den)

    E._joint_softmax = js

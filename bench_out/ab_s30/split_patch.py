"""B: Phase B's joint softmax split into parts that are combined afterwards: the local window of all tiles in one
call (its own row max and sum), the chunk logits per causal group (their own max and sum), then
out = (a o_loc + b o_ch) / (a l_loc + b l_ch) with a, b = exp(m_part - max). Each part keeps its weights for its
backward. Fewer, larger XLA ops than the per-group joint softmax (local + chunk in every group)."""
import functools
import os

ORIENT = os.environ.get('ORIENT') == '1'


def apply():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from longctx.attention import eva as E

    HI = E.HIGHEST

    def _logits(q, k, bias, mask, scale, pieces):
        out = []
        for r0, r1, nk in pieces:
            a = scale * jnp.einsum("bhnqd,bhnkd->bhnqk", q[:, :, :, r0:r1], k[:, :, :, :nk], precision=HI)
            if bias is not None:
                a = a + E._piece_bias(bias, (r0, r1, nk))
            out.append(jnp.where(mask[:, r0:r1, :nk], a, E._fill_like(a, E.NEG)))
        return out

    def _fwd_impl(q, k, v, bias, mask, scale, pieces):
        a = _logits(q, k, bias, mask, scale, pieces)
        m = jnp.concatenate([jnp.max(x, axis=-1, initial=E.NEG) for x in a], axis=-1)
        p = [jnp.exp(x - m[:, :, :, r0:r1, None]) for x, (r0, r1, _) in zip(a, pieces)]
        p = [jnp.where(mask[:, r0:r1, :nk], x, E._fill_like(x, 0.0)) for x, (r0, r1, nk) in zip(p, pieces)]
        l = jnp.concatenate([jnp.sum(x, axis=-1) for x in p], axis=-1)
        o = jnp.concatenate([jnp.einsum("bhnqk,bhnkd->bhnqd", x, v[:, :, :, :nk], precision=HI)
                             for x, (_, _, nk) in zip(p, pieces)], axis=3)
        return (o, l, m), tuple(p)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
    def part(q, k, v, bias, mask, scale, pieces):
        """(o = Σ exp(s - m) v, l = Σ exp(s - m), m = row max) over the masked logits s of q against k."""
        return _fwd_impl(q, k, v, bias, mask, scale, pieces)[0]

    def part_fwd(q, k, v, bias, mask, scale, pieces):
        out, p = _fwd_impl(q, k, v, bias, mask, scale, pieces)
        return out, (q, k, v, bias, p)

    def part_bwd(scale, pieces, res, cts):
        q, k, v, bias, p = res
        do, dl, _ = cts
        Tk = k.shape[3]
        pad = lambda x, n: x if n == Tk else jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, Tk - n), (0, 0)])  # noqa
        dqs, dk, dv, dbias = [], 0.0, 0.0, []
        for pp, (r0, r1, nk) in zip(p, pieces):
            rows = lambda x, r0=r0, r1=r1: x[:, :, :, r0:r1]  # noqa
            ds = pp * (jnp.einsum("bhnqd,bhnkd->bhnqk", rows(do), v[:, :, :, :nk], precision=HI) + rows(dl)[..., None])
            dqs.append(jnp.einsum("bhnqk,bhnkd->bhnqd", ds, k[:, :, :, :nk], precision=HI))
            if ORIENT:
                dk = dk + pad(jnp.einsum("bhnqk,bhnqd->bhnkd", ds, rows(q), precision=HI), nk)
                dv = dv + pad(jnp.einsum("bhnqk,bhnqd->bhnkd", pp, rows(do), precision=HI), nk)
            else:
                dk = dk + pad(jnp.swapaxes(jnp.einsum("bhnqd,bhnqk->bhndk", rows(q), ds, precision=HI), -1, -2), nk)
                dv = dv + pad(jnp.swapaxes(jnp.einsum("bhnqd,bhnqk->bhndk", rows(do), pp, precision=HI), -1, -2), nk)
            if bias is not None:
                g = E._bias_grad(bias[..., r0:r1, :nk], ds)
                dbias.append(g if nk == Tk else jnp.pad(g, [(0, 0)] * 3 + [(0, Tk - nk)]))
        dq = scale * (jnp.concatenate(dqs, axis=3) if len(dqs) > 1 else dqs[0])
        dbias = None if bias is None else jnp.concatenate(dbias, axis=2)
        return dq, scale * dk, dv, dbias, None

    part.defvjp(part_fwd, part_bwd)

    orig = E.eva_forward

    def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts, *, chunk_size, num_chunks, stats_fn=None,
                    attend_fn=None):
        B, H, L, d = q.shape
        L_pad, P, C, tile = E.geometry(opts, L, chunk_size, num_chunks)
        Tk = (tile + opts.e_l + opts.e_r) if opts.W > 0 else 0
        fused = E._uses_tile_softmax(drop_key, opts)
        if attend_fn is not None or not fused or Tk != tile or not opts.causal or L_pad != L:
            return orig(q, k, v, params, rpe_table, noise_key, drop_key, opts, chunk_size=chunk_size,
                        num_chunks=num_chunks, stats_fn=stats_fn, attend_fn=attend_fn)
        dv = v.shape[-1]
        scale = d ** -0.5
        qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
        k_valid_ch = np.ones((C, P), bool)
        q_ch, k_ch, v_ch = (x.reshape(B, H, C, P, x.shape[-1]) for x in (qf, kf, vf))
        noise = None if noise_key is None else E.chunk_noise(noise_key, jnp.arange(C), B, H, d)
        k_hat, beta = (stats_fn or E.chunk_summaries)(q_ch, k_ch, v_ch, jnp.asarray(k_valid_ch), params, noise, opts,
                                                       scale)
        extras = {"k_hat": k_hat, "beta": beta, "L_pad": L_pad, "P": P, "C": C, "padded": (qf, kf, vf)}
        n_tiles = L // tile
        # local part: every tile at once
        r = np.arange(tile)
        lmask = E.local_mask(r, r, np.ones(tile, bool), opts)[None]  # same for every tile
        bias = E.rpe_bias(rpe_table, r, r, opts, scale)[None] if opts.use_rpe and rpe_table is not None else None
        halves = tile % 2 == 0
        pieces = ((0, tile // 2, tile // 2), (tile // 2, tile, tile)) if halves else ((0, tile, tile),)
        t5 = lambda x: x.reshape(B, H, n_tiles, tile, x.shape[-1])  # noqa
        o_l, l_l, m_l = part(t5(qf), t5(kf), t5(vf), bias, lmask, scale, pieces)
        o_l, l_l, m_l = o_l.reshape(B, H, L, dv), l_l.reshape(B, H, L), m_l.reshape(B, H, L)
        # chunk part per group of tiles
        groups = E.tile_groups(n_tiles, tile, P, C, True, min(32, max(8, n_tiles // 8)))
        sizes = [(hi - lo) * tile for lo, hi, _ in groups]
        qs = jax.lax.split(qf, sizes, axis=2)
        outs = []
        for (lo, hi, nc), qg in zip(groups, qs):
            qpos = np.arange(lo * tile, hi * tile)
            cm = E.chunk_mask(qpos, np.arange(nc), np.ones(nc, bool), P, opts)[None]
            outs.append(part(qg[:, :, None], k_hat[:, :, None, :nc], beta[:, :, None, :nc], None, cm,
                             scale, ((0, qg.shape[2], nc),)))
        o_c = jnp.concatenate([o[:, :, 0] for o, _, _ in outs], axis=2)
        l_c = jnp.concatenate([x[:, :, 0] for _, x, _ in outs], axis=2)
        m_c = jnp.concatenate([x[:, :, 0] for _, _, x in outs], axis=2)
        m_l, m_c = jax.lax.stop_gradient(m_l), jax.lax.stop_gradient(m_c)
        rows = lambda x: x.reshape((B * H * L,) + x.shape[3:])  # noqa: E731 -- no size-1 dimension (xla_cpu)
        mx = jnp.maximum(rows(m_l), rows(m_c))
        a, b = jnp.exp(rows(m_l) - mx), jnp.exp(rows(m_c) - mx)
        den = jnp.maximum(a * rows(l_l) + b * rows(l_c), 1e-30)
        out = (a[..., None] * rows(o_l) + b[..., None] * rows(o_c)) / den[..., None]
        return out.reshape(B, H, L, dv), extras

    E.eva_forward = eva_forward

"""FMA and FMA-linear as the paper writes them: the n x n matrix C~ of paper eqs. (5)-(7), one row softmax over
it ("§" below: docs/methods/fma.md §2, numbered as the method's spec).

* §2.1 the downsampling operator: every group of ``m_l`` keys (values; queries in FMA-linear) becomes ``p``
  summary rows, ``x^_{G,r}[f] = c[f,r] + sum_t W[t,f,r] x_{G m_l + t}[f]`` (:func:`summarize`);
* §2.2 the partition: ``I_0 = {D_1 <= 1}``, ``I_l = {D_l >= 2 and D_{l+1} <= 1}`` (the corrected eq. (4);
  :func:`level_matrix`), intersected with ``j <= i`` when causal;
* §2.3 and §2.4 "dense reference": key ``j`` of level ``l`` is replaced by its summary row ``floor(j p / m_l)``
  (each summary column repeated ``m_l/p`` times, which is where the multiplicity offset ``ln(m_l/p)`` of the
  blocked form comes from; with ``multiplicity_weighting`` off it is subtracted here), one softmax per row;
* §2.5 FMA-linear: the query is replaced by its own summary row at level ``l`` (of group ``a-1`` when causal and
  ``lagged``); ``per_level`` normalises each level apart and sums (paper eq. (11));
* §2.6 lengths: ``levels_used`` levels; a bidirectional group that straddles the end is summarised over its
  zero-padded tokens, groups wholly in the padding and padded fine keys are masked.

O(n^2) memory: it runs at test lengths. No attention dropout (the implementation refuses a call that drops).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from longctx.attention.fma.options import FMAOptions, acc_type, f32, levels_used, pad_to
from pallas_kernels.precision import acc_einsum

NEG = -1e30  # a masked score (finite: a fully masked row must not give NaN)


def bias_rows(prm, opts: FMAOptions):
    """The conv bias ``c [f, p]`` as ``[p, f]`` (shared) or ``[H, 1, p, f]``, against ``[B, H, N, p, f]``."""
    if prm is None:
        return None
    c = jnp.swapaxes(prm["bias"], -1, -2)
    return c if opts.shared else c[:, None]


def summarize(x, prm, ml: int, opts: FMAOptions, with_bias: bool = True):
    """§2.1: summaries of every group of ``ml`` tokens, x [B,H,N*ml,f] -> [B,H,N,p,f].

    depthwise (the paper's): x^_{G,r}[f] = c[f,r] + sum_t W[t,f,r] x_{G ml + t}[f]; dense_conv mixes features
    (W [ml, f_in, f, p]); avgpool: the mean over sub-interval r of length ml/p (no parameters).

    The product takes x in its own (compute) dtype and the float32 master weights cast to it, accumulated in at
    least float32 (the result's dtype; bfloat16 x gives float32 summaries, float32 and float64 x as before)."""
    B, H, n, f = x.shape
    xg = x.reshape(B, H, n // ml, ml, f)
    if opts.downsample == "avgpool":
        return jnp.mean(xg.astype(acc_type(xg)).reshape(B, H, n // ml, opts.p, ml // opts.p, f), axis=4)
    W = prm["kernel"].astype(x.dtype)
    if opts.downsample == "depthwise_conv":
        s = acc_einsum("bhgtf,tfr->bhgrf" if opts.shared else "bhgtf,htfr->bhgrf", xg, W)
    else:
        s = acc_einsum("bhgte,tefr->bhgrf" if opts.shared else "bhgte,htefr->bhgrf", xg, W)
    return s + bias_rows(prm, opts) if with_bias else s


def lagged(qh):
    """§2.5: the query summaries of group a-1 at group a (zeros at a = 0), the leak-free causal FMA-linear rows."""
    return jnp.pad(qh, ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))[:, :, :-1]


def level_matrix(n: int, m: int, L: int, causal: bool) -> np.ndarray:
    """§2.2: lev[i, j] = 0 on I_0, l on I_l (l = 1..L), -1 on no set (or j > i, causal)."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    lev = np.full((n, n), -1, np.int32)
    lev[np.abs(i // m - j // m) <= 1] = 0
    for l in range(1, L + 1):
        ml = m << (l - 1)
        D_l, D_up = np.abs(i // ml - j // ml), np.abs(i // (2 * ml) - j // (2 * ml))
        lev[(lev < 0) & (D_l >= 2) & (D_up <= 1)] = l
    if causal:
        lev[j > i] = -1
    return lev


def fma_dense_reference(q, k, v, ds, opts: FMAOptions):
    """FMA (FMA-linear when ``opts.linear``) of q, k [B,H,n,d], v [B,H,n,dv] -> [B,H,n,dv] (f32, f64 stays).

    ``ds``: {'k': [per-level conv parameters], 'v': [...], 'q': [...] (FMA-linear)}, None entries for avgpool."""
    B, H, n, d = q.shape
    m, p, Lu = opts.m, opts.p, levels_used(n, opts)
    top = opts.m_l(max(Lu, 1))
    n_ref = -(-n // top) * top  # every level's groups complete (zero-padded, §2.6)
    q, k, v = (pad_to(f32(x), n_ref) for x in (q, k, v))
    lev = level_matrix(n_ref, m, Lu, opts.causal)[:n]  # [n, n_ref]
    j = np.arange(n_ref)
    for l in range(Lu + 1):  # padded fine keys, and groups wholly in the padding, are no keys
        start = j if l == 0 else (j // opts.m_l(l)) * opts.m_l(l)
        lev[(lev == l) & (start >= n)[None, :]] = -1

    def rows(x):  # [B,H,N,p,f] -> [B,H,N p,f]: row G p + r
        return x.reshape(B, H, -1, x.shape[-1])

    scale = d**-0.5
    S, V = [jnp.einsum("bhid,bhjd->bhij", q[:, :, :n] * scale, k)], [v]
    for l in range(1, Lu + 1):
        ml = opts.m_l(l)
        col = (j * p) // ml  # the summary row key j stands for: C~ repeats it for each of its m_l/p keys
        kt = rows(summarize(k, ds["k"][l - 1], ml, opts))[:, :, col]
        vt = rows(summarize(v, ds["v"][l - 1], ml, opts))[:, :, col]
        qt = q[:, :, :n]
        if opts.linear:  # §2.5: query i reads its own sub-interval's summary row
            qh = summarize(q, ds["q"][l - 1], ml, opts)
            if opts.causal and opts.query_summary == "lagged":
                qh = lagged(qh)
            qt = rows(qh)[:, :, (np.arange(n) * p) // ml]
        s = jnp.einsum("bhid,bhjd->bhij", qt * scale, kt)
        S.append(s if opts.multiplicity else s - math.log(ml / p))
        V.append(vt)
    lev = jnp.asarray(lev)
    full = S[0]
    for l in range(1, Lu + 1):
        full = jnp.where(lev == l, S[l], full)

    def softmax_out(keep):
        """One softmax over the entries ``keep`` of each row, applied to every level's values."""
        s = jnp.where(keep, full, NEG)
        e = jnp.where(keep, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
        den = jnp.sum(e, axis=-1, keepdims=True)
        a = e / jnp.where(den > 0, den, 1.0)
        return sum(jnp.einsum("bhij,bhjf->bhif", jnp.where(lev == l, a, 0.0), V[l]) for l in range(Lu + 1))

    if opts.linear and opts.normalization == "per_level":  # paper eq. (11): each level normalised apart
        return sum(softmax_out(lev == l) for l in range(Lu + 1))
    if opts.release_zero_slots:  # §9.3: the release's zero-padded columns, score 0 and value 0, left unmasked
        zeros = jnp.asarray(release_zero_columns(n, opts))[:, None]  # [n, 1] columns per query
        s = jnp.where(lev >= 0, full, NEG)
        M = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), jnp.where(zeros > 0, 0.0, NEG))
        e = jnp.where(lev >= 0, jnp.exp(s - M), 0.0)
        a = e / (jnp.sum(e, axis=-1, keepdims=True) + zeros * jnp.exp(-M))
        return sum(jnp.einsum("bhij,bhjf->bhif", jnp.where(lev == l, a, 0.0), V[l]) for l in range(Lu + 1))
    return softmax_out(lev >= 0)


def release_zero_columns(n: int, opts: FMAOptions) -> np.ndarray:
    """§9.3 (causal): how many score-0, value-0 columns of C~ query i sees in the release, which pads the keys
    with m zero rows (the previous block of block 0) and each level's summaries with one zero chunk of 2p rows
    (the lower partner chunk of groups 0 and 1) and masks neither: m for i < m, plus per level l, for level-l
    group a < 2, (a + 1) p summary slots, each m_l/p columns with multiplicity weighting (1 without). Every one
    of the layer's L levels counts, also those a shorter input leaves without real summaries: the release runs
    them all (tests/fidelity/test_fma_release.py, the short input)."""
    i = np.arange(n)
    z = np.where(i < opts.m, opts.m, 0).astype(np.float64)
    for l in range(1, opts.L + 1):
        a = i // opts.m_l(l)
        z += np.where(a < 2, (a + 1) * opts.p * (opts.m_l(l) / opts.p if opts.multiplicity else 1.0), 0.0)
    return z


__all__ = ["NEG", "bias_rows", "fma_dense_reference", "lagged", "level_matrix", "release_zero_columns",
           "summarize"]

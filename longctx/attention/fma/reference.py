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
* docs/methods/fma.md §2.7 packed rows (:func:`fma_packed_reference`, ours): groups and blocks counted from each
  document's start, so each document gives what it gives alone.

O(n^2) memory: it runs at test lengths. No attention dropout (the implementation refuses a call that drops).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from longctx.attention.base import document_starts
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
    return _joint_softmax(S, V, jnp.asarray(lev), Lu, opts, lambda: release_zero_columns(n, opts)[:, None])


def _joint_softmax(S, V, lev, Lu: int, opts: FMAOptions, zero_columns):
    """§2.3: the scores ``S[l]`` of every level merged by ``lev`` (level of each (query, key) pair, -1: none), one
    softmax per row (per level for FMA-linear's ``per_level``), applied to the values ``V[l]``. ``zero_columns()``:
    the release's unmasked zero columns per query (§9.3), read only with ``release_zero_slots``."""
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
        zeros = jnp.asarray(zero_columns())  # [n, 1] (or [B, 1, n, 1]) columns per query
        s = jnp.where(lev >= 0, full, NEG)
        M = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), jnp.where(zeros > 0, 0.0, NEG))
        e = jnp.where(lev >= 0, jnp.exp(s - M), 0.0)
        a = e / (jnp.sum(e, axis=-1, keepdims=True) + zeros * jnp.exp(-M))
        return sum(jnp.einsum("bhij,bhjf->bhif", jnp.where(lev == l, a, 0.0), V[l]) for l in range(Lu + 1))
    return softmax_out(lev >= 0)




def _document_summaries(x, prm, ml: int, opts: FMAOptions, start, rel, back: int = 0):
    """§2.1 on document-relative groups (``ml`` tokens counted from each document's start): at every token ``i``
    the ``p`` summary rows of the group ``back`` groups before i's own in i's document, [B,H,n,p,f] (zeros where
    that group would start before the document). A document's last group, cut by its end, sums its own tokens
    only: the zero padding it would have run alone with."""
    p = opts.p
    t = rel % ml  # position inside the group: the conv tap
    if opts.downsample == "avgpool":  # the mean over sub-interval r of ml/p tokens, as zero-padded alone
        hot = ((t * p) // ml)[..., None] == jnp.arange(p)  # [B, n, p]
        contrib = hot[:, None, :, :, None] * (x * (p / ml))[:, :, :, None, :]
    else:
        W = prm["kernel"]
        Wt = W[t][:, None] if opts.shared else jnp.moveaxis(W[:, t], 0, 1)  # [B, 1|H, n, ...]: each token's tap
        if opts.downsample == "depthwise_conv":  # Wt [..., f, p]
            contrib = jnp.swapaxes(x[..., None] * Wt, -1, -2)
        else:  # Wt [..., e, f, p]
            contrib = jnp.moveaxis(jnp.sum(x[..., None, None] * Wt, axis=-3), -1, -2)
    G = rel // ml - back
    member = (start[:, :, None] == start[:, None, :]) & (G[:, :, None] == (rel // ml)[:, None, :])  # [B, i, j]
    out = jnp.einsum("bij,bhjrf->bhirf", member.astype(contrib.dtype), contrib)
    if opts.downsample != "avgpool":
        c = jnp.swapaxes(prm["bias"], -1, -2)  # [p, f] or [H, p, f]
        out = out + (c if opts.shared else c[:, None, :, :])
    return jnp.where((G >= 0)[:, None, :, None, None], out, 0.0)


def fma_packed_reference(q, k, v, ds, opts: FMAOptions, segment_ids):
    """:func:`fma_dense_reference` of a packed row (``segment_ids`` [B, n]): every document computed as if it ran
    alone. Positions, fine blocks and every level's groups count from the document's start (a group never spans two
    documents: it is its document's group, cut short by the document's end, as it is cut by the zero padding when
    the document runs alone), each (query, key) pair of a document falls in the set of §2.2 its document-relative
    positions give, and pairs of two documents in none.

    The coarse columns are the groups' summary rows themselves, held at the group's first token, each with the
    offset ``beta_l`` (the blocked form's: a group's p rows count m_l/p keys each, also those of a cut group that
    the document does not fill, as the zero-padded group alone does). O(n^2) memory: tests only."""
    B, H, n, d = q.shape
    m, p, Lu = opts.m, opts.p, levels_used(n, opts)
    q, k, v = (f32(x) for x in (q, k, v))
    start = document_starts(segment_ids)
    rel = jnp.arange(n, dtype=jnp.int32)[None, :] - start  # [B, n]
    ri, rj = rel[:, :, None], rel[:, None, :]
    keep = start[:, :, None] == start[:, None, :]
    if opts.causal:
        keep = keep & (rj <= ri)
    near = jnp.abs(ri // m - rj // m) <= 1  # I_0
    scale = d**-0.5
    levs, scores, vals = [jnp.where(keep & near, 0, -1)], [jnp.einsum("bhid,bhjd->bhij", q * scale, k)], [v]
    for l in range(1, Lu + 1):
        ml = opts.m_l(l)
        D_l, D_up = jnp.abs(ri // ml - rj // ml), jnp.abs(ri // (2 * ml) - rj // (2 * ml))
        first = (rj % ml) == 0  # column j: the group starting at j (membership in I_l is the group's)
        lev = jnp.where(keep & first & (D_l >= 2) & (D_up <= 1), l, -1)  # [B, n, n]
        kh = _document_summaries(k, ds["k"][l - 1], ml, opts, start, rel)  # [B,H,n,p,f]: group at token j
        vh = _document_summaries(v, ds["v"][l - 1], ml, opts, start, rel)
        if opts.linear:  # §2.5: the query's own sub-interval row (of the group before, lagged)
            back = 1 if opts.causal and opts.query_summary == "lagged" else 0
            qh = _document_summaries(q, ds["q"][l - 1], ml, opts, start, rel, back)
            hot = ((((rel % ml) * p) // ml)[..., None] == jnp.arange(p))[:, None, :, :, None]
            qt = jnp.sum(jnp.where(hot, qh, 0.0), axis=3)
        else:
            qt = q
        s = jnp.einsum("bhid,bhjrd->bhijr", qt * scale, kh) + opts.beta(l)
        levs.append(jnp.repeat(lev, p, axis=-1))  # column j p + r: row r of the group at j
        scores.append(s.reshape(B, H, n, n * p))
        vals.append(vh.reshape(B, H, n * p, -1))
    lev = jnp.concatenate(levs, axis=-1)[:, None]  # [B, 1, n, C]: each column's level, -1 none
    full = jnp.concatenate(scores, axis=-1)
    vcat = jnp.concatenate(vals, axis=2)
    zeros = lambda: jnp.asarray(release_zero_columns(n, opts))[rel][:, None, :, None]  # noqa: E731
    # every level's columns in one array: level l's scores and values are the whole of it, ``lev`` picks
    return _joint_softmax([full] * (Lu + 1), [vcat] * (Lu + 1), lev, Lu, opts, zeros)


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


__all__ = ["NEG", "bias_rows", "fma_dense_reference", "fma_packed_reference", "lagged", "level_matrix", "release_zero_columns",
           "summarize"]

"""Fast Multipole Attention (Kang, Tran, De Sterck 2023; arXiv 2310.11960): FMA and FMA-linear.

Method notes: ``docs/methods/fma.md`` (section numbers below refer to it). Registered twice:
``fma`` (:class:`FMAAttention`) and ``fma_linear`` (:class:`FMALinearAttention`, paper App. A.1).

The method (§1). The sequence is cut into fine blocks of ``m`` tokens. A query attends exactly to
the keys of its own fine block and of the adjacent blocks (the previous one only, when causal). For
each coarse level l = 1..L (group size m_l = 2^(l-1) m), a learned strided depthwise 1-D convolution
(kernel = stride = m_l, separate weights for K and V, shared across heads, with a bias) turns every
group of keys and of values into ``p`` summary rows. A query attends to the summaries of the level-l
groups that are well separated at level l but neighbours at level l+1 (the FMM interaction list: 2 or
3 groups per level). All fine and coarse scores of a query share one softmax; each summary score gets
the log-multiplicity offset beta_l = ln(m_l / p), because in the paper's dense view (eqs. 5-7) a
summary column is repeated m_l/p times.

The partition (§2.2). I_0 = {D_1 <= 1}; I_l = {D_l >= 2 and D_{l+1} <= 1} for l = 1..L, where
D_l(i,j) = |floor(i/m_l) - floor(j/m_l)|. **Paper eq. (4) as printed keeps only D_l in {2, 3} and
drops the parent condition D_{l+1} <= 1; then I_l and I_{l+1} overlap and pairs are double-covered**
(e.g. for an even query group a, group a-3 lies inside a level-(l+1) partner). We implement the
corrected set (= the official release, = the paper's Figure 1b), which covers every pair exactly once;
``tests/attention/test_fma.py`` checks both facts. In code this is the parity rule of
:func:`pallas_kernels.fma_blocks_ref.level_partners`.

Three paths compute the same function:

* :func:`fma_dense_reference` -- the literal n x n matrix C~ of eqs. (5)-(7) (tests only, O(n^2));
* :func:`fma_forward` -- the blocked jnp path (``impl='xla'``): per fine block, a 2m (3m) window of
  raw keys plus the block's packed coarse summary slots, one softmax, query blocks processed in
  groups under a rematerialised ``lax.map`` so memory is O(n (m + p L)) at most and O(budget) per
  step; the math lives in ``pallas_kernels/fma_blocks_ref.py`` beside the Pallas kernel that must
  match it;
* the Pallas kernel ``pallas_kernels/fma_blocks.py`` (``impl='pallas'``; §8).

Causal decoding / streaming state (§4, our extension; the paper has no KV cache): the last ``2m`` raw
keys and values, and per level the partial conv sums of the open group (``acc_*``) plus a ring of the
last 4 finished group summaries (``ring_*``; query i in level group a reads groups a-2 and, if a is
odd, a-3, which are always finished). The state is O(m d + p d L) -- it does not grow with the
context -- and a step costs O(m d + p d L). Streaming in any split equals the full pass.

Lengths and padding (§2.6, documented rule). ``max_len`` (the training length n; ``max_len/m`` a
power of two) fixes the number of levels L = log2(max_len/m) - 1 and so the parameters. A sequence of
n <= max_len tokens uses the levels L_n = ceil(log2(ceil(n/m))) - 1 <= L (levels above L_n have no
partners). Queries and fine keys are right-padded to a multiple of m (padded keys masked). Causal:
partners are always complete groups, so padding never touches a real position. Bidirectional (our
extension; the paper uses fixed-length unpadded chunks): a group that straddles the end is summarised
over its zero-padded tokens and keeps its full multiplicity (the C~ of the zero-padded sequence with
padded fine keys masked); groups lying wholly in the padding are masked. For n = m 2^k nothing is
padded. n > max_len raises unless ``allow_truncated_window`` (our extension): then only L levels
exist and each query sees a window reaching back 3/4 max_len .. max_len tokens (meaningful with
relative or no positions; use it to stream past the training length).

Departures from the paper, all named:

* corrected partition (above); multiplicity offset beta_l on by default (``multiplicity_weighting``;
  the release's ``scale_attn``); zero-padded slots of the release are masked, and the release's
  "null slot" behaviour (``release_zero_slots``, §9.3) is not implemented;
* FMA-linear: joint normalisation by default (paper eq. 11 normalises each level separately and sums:
  ``fma_linear_normalization='per_level'``); causal FMA-linear uses **lagged** query summaries by
  default (query i reads the summary of its sub-interval slot in group a-1, fully in the past): the
  paper's own summaries mix in future tokens of i's group and leak the future (``paper_leaky``, for
  reproducing Table 1 only; rejected in causal configs unless ``allow_paper_leaky=True``; it cannot be
  streamed or decoded);
* the attention dropout of FMA-linear is applied to the per-row (shared) coarse weights;
* bidirectional padding as described above.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from longctx.attention.base import (
    AttentionCore,
    ContractCase,
    DropIn,
    KernelBench,
    check_capacity,
    check_qkv,
    logical,
    require,
)
from pallas_kernels.fma_blocks_ref import NEG, attend_blocks, level_partners, packed_slots

# ---------------------------------------------------------------------------
# static options
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FMAOptions:
    """Static (hashable) options of the pure functions."""

    causal: bool
    m: int
    p: int
    L: int  # coarse levels that have parameters (L_max)
    max_len: int
    linear: bool = False
    multiplicity: bool = True
    normalization: str = "joint"  # FMA-linear: 'joint' | 'per_level'
    query_summary: str = "lagged"  # FMA-linear causal: 'lagged' | 'paper_leaky'
    downsample: str = "depthwise_conv"  # 'depthwise_conv' | 'dense_conv' | 'avgpool'
    shared: bool = True  # downsampling weights shared across heads
    allow_truncated: bool = False
    attn_dropout: float = 0.0
    logit_budget: int = 1 << 24

    def m_l(self, l: int) -> int:
        return self.m << (l - 1)

    def beta(self, l: int) -> float:
        return math.log(self.m_l(l) / self.p) if self.multiplicity else 0.0

    @property
    def leaky(self) -> bool:
        return self.linear and self.causal and self.query_summary == "paper_leaky"


def levels_used(n: int, opts: FMAOptions) -> int:
    """Coarse levels a full pass over n tokens uses (§2.6); raises past max_len unless truncation is allowed."""
    nb = -(-n // opts.m)
    need = max(0, (nb - 1).bit_length() - 1)  # ceil(log2(nb)) - 1
    if need > opts.L:
        if not opts.allow_truncated:
            raise ValueError(
                f"fma: a sequence of {n} tokens needs {need} coarse levels but the layer has {opts.L} "
                f"(max_len={opts.max_len}); set attention.fma.max_len >= {n} or allow_truncated_window=True"
            )
        return opts.L
    return need


def _f32(x):
    """Compute dtype: f32 (bf16/f16 inputs are upcast; f64 stays f64 for finite-difference tests)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ---------------------------------------------------------------------------
# downsampling operators (§2.1)
# ---------------------------------------------------------------------------


def _pad_to(x, mult: int, axis: int = 2):
    n = x.shape[axis]
    pad = (-n) % mult
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _bias_rows(prm, opts: FMAOptions):
    """Bias as [p, f] (shared) or [H, 1, p, f] broadcastable against [B, H, N, p, f]; None for avgpool."""
    if prm is None:
        return None
    c = prm["bias"]
    if opts.shared:
        return jnp.swapaxes(c, -1, -2)
    return jnp.swapaxes(c, -1, -2)[:, None]


def summarize(x, prm, ml: int, opts: FMAOptions, with_bias: bool = True):
    """Summaries of every group of ``ml`` tokens: x [B,H,N*ml,f] -> [B,H,N,p,f].

    depthwise: x^_{G,r}[f] = c[f,r] + sum_t W[t,f,r] x_{G ml + t}[f]; dense_conv mixes features
    (W [ml, f_in, f, p]); avgpool: the mean over sub-interval r of length ml/p (no parameters)."""
    B, H, n, f = x.shape
    N, p = n // ml, opts.p
    xg = x.reshape(B, H, N, ml, f)
    if opts.downsample == "avgpool":
        return jnp.mean(xg.reshape(B, H, N, p, ml // p, f), axis=4)
    W = prm["kernel"]
    if opts.downsample == "depthwise_conv":
        s = jnp.einsum("bhgtf,tfr->bhgrf" if opts.shared else "bhgtf,htfr->bhgrf", xg, W)
    else:
        s = jnp.einsum("bhgte,tefr->bhgrf" if opts.shared else "bhgte,htefr->bhgrf", xg, W)
    if with_bias:
        s = s + _bias_rows(prm, opts)
    return s


def token_contrib(x, tau, prm, ml: int, opts: FMAOptions):
    """Each token's additive contribution (no bias) to its group's summary: x [B,H,T,f], tau [T]
    (offset inside the group) -> [B,H,T,p,f]. Summing these over a group gives summarize(...) - bias."""
    p = opts.p
    if opts.downsample == "avgpool":
        oh = (jnp.arange(p)[None, :] == (tau * p // ml)[:, None]).astype(x.dtype) * (p / ml)  # [T, p]
        return x[:, :, :, None, :] * oh[None, None, :, :, None]
    W = prm["kernel"]
    if opts.downsample == "depthwise_conv":
        if opts.shared:
            return jnp.einsum("bhtf,tfr->bhtrf", x, jnp.take(W, tau, axis=0))
        return jnp.einsum("bhtf,htfr->bhtrf", x, jnp.take(W, tau, axis=1))
    if opts.shared:
        return jnp.einsum("bhte,tefr->bhtrf", x, jnp.take(W, tau, axis=0))
    return jnp.einsum("bhte,htefr->bhtrf", x, jnp.take(W, tau, axis=1))


def level_summaries(x, prm, ml: int, opts: FMAOptions):
    """Summaries of all (zero-padded) groups of a sequence: [B,H,ceil(n/ml),p,f]."""
    return summarize(_pad_to(x, ml), prm, ml, opts)


def all_level_summaries(x, prms, Lu: int, opts: FMAOptions):
    """``[level_summaries(x, prms[l-1], m_l, opts) for l = 1..Lu]``, computed faster.

    For the paper's operator (depthwise, weights shared across heads) each level is one fused
    multiply-and-reduce over the group's tokens, ``sum_t x[g, t, f] W[t, f, r]``, reading the
    sequence in its stored order (features minor). Two earlier forms were slower on XLA:CPU: the
    per-level einsum transposed the whole sequence for every level, and so did a batched matmul over
    the features after one explicit transpose (XLA made the transpose a layout change and redid it in
    every level's dot), each about twice the time of this form over all levels of a long sequence.
    Other operators keep the per-level path."""
    if Lu == 0:
        return []
    if opts.downsample != "depthwise_conv" or not opts.shared:
        return [level_summaries(x, prms[l - 1], opts.m_l(l), opts) for l in range(1, Lu + 1)]
    B, H, n, f = x.shape
    # zero-padded once to the top level's group size (a per-level pad copied the sequence at every level, so that
    # an unpadded length ran slower than the next power of two); the extra all-zero groups of a level are cut
    xp = _pad_to(x, opts.m_l(Lu))
    out = []
    for l in range(1, Lu + 1):
        ml, prm = opts.m_l(l), prms[l - 1]
        # one leading axis for (batch, head, group): the same product with separate [BH, N_l, 1, ...] axes is
        # miscompiled by XLA:CPU (jax 0.10.2) when B*H = 1 (wrong sums under jit, right eagerly; see
        # tests/attention/test_fma.py::test_level_summaries_under_jit_equal_the_einsum_form)
        W = jnp.moveaxis(prm["kernel"], -1, 0).astype(x.dtype)  # [p, ml, f]
        y = _depthwise_groups(xp.reshape(-1, ml, f), W)  # [BH N_l', p, f]
        y = y.reshape(B, H, -1, opts.p, f)[:, :, : -(-n // ml)]
        out.append(y + _bias_rows(prm, opts))
    return out


@jax.custom_vjp
def _depthwise_groups(xg, W):
    """y[g, r, f] = sum_t xg[g, t, f] W[r, t, f]: xg [G, m, f], W [p, m, f] -> [G, p, f] (one leading axis for
    batch, head and group; see :func:`all_level_summaries`).

    The backward is written out. Autodiff of the multiply-and-reduce materialised [G, p, m, f] broadcasts of x,
    of the cotangent and of W for every level (134 MB each at 32k) and reduced them over the groups: at 32k
    causal the summaries' backward took an order of magnitude longer than the whole forward."""
    return jnp.sum(xg[:, None] * W[None], axis=2)


def _depthwise_groups_fwd(xg, W):
    return _depthwise_groups(xg, W), (xg, W)


def _depthwise_groups_bwd(res, ct):
    xg, W = res
    # dx[g, t, f] = sum_r ct[g, r, f] W[r, t, f]: p element-wise terms, no broadcast written out
    dx = ct[:, 0, None, :] * W[0][None]
    for r in range(1, W.shape[0]):
        dx = dx + ct[:, r, None, :] * W[r][None]
    dW = jnp.einsum("gtf,grf->rtf", xg, ct)  # a matmul over the groups, batched over features
    return dx, dW


_depthwise_groups.defvjp(_depthwise_groups_fwd, _depthwise_groups_bwd)


def _lagged(qh):
    """Query summaries of group a-1 at group a (zeros at a = 0): the leak-free causal FMA-linear rows."""
    return jnp.pad(qh, ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))[:, :, :-1]


# ---------------------------------------------------------------------------
# FMA-linear coarse statistics
# ---------------------------------------------------------------------------


def _combine(acc, stats, opts: FMAOptions):
    """Fold one level's per-query stats (M, num, den) into the running coarse part."""
    M, num, den = stats
    if opts.normalization == "per_level":
        out = num / jnp.where(den > 0, den, 1.0)[..., None]
        return ("normed", out) if acc is None else ("normed", acc[1] + out)
    if acc is None:
        return ("stats", M, num, den)
    _, Ma, na, da = acc
    Mn = jnp.maximum(Ma, M)
    sa, sb = jnp.exp(Ma - Mn), jnp.exp(M - Mn)
    return ("stats", Mn, na * sa[..., None] + num * sb[..., None], da * sa + den * sb)


def _row_stats(s, valid, vc, drop_key, opts: FMAOptions):
    """Softmax statistics of coarse scores s [..., C] with values vc [..., C, f] (valid: bool mask)."""
    s = jnp.where(valid, s, NEG)
    M = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    e = jnp.where(valid, jnp.exp(s - M[..., None]), 0.0)
    den = jnp.sum(e, axis=-1)
    if drop_key is not None and opts.attn_dropout > 0.0:
        keep = 1.0 - opts.attn_dropout
        e = jnp.where(jax.random.bernoulli(drop_key, keep, e.shape), e / keep, 0.0)
    return M, e, den


def _repeat_rows(acc, rep: int, n_rows: int):
    """Each row of a running coarse part (axis 2) repeated ``rep`` times, cut to ``n_rows``."""
    return (acc[0],) + tuple(jnp.repeat(x, rep, axis=2)[:, :, :n_rows] for x in acc[1:])


def linear_coarse_full(qf, kh, vh, qh, n_pad: int, Lu: int, drop_key, opts: FMAOptions):
    """FMA-linear coarse part of a full pass (§2.5): per level, scores of the N_l p query-summary rows
    against their group's partner summaries (a [N_l, p, C_l] tile) and local softmax statistics.

    Row R of level l covers tokens [R m_l/p, (R+1) m_l/p), exactly rows 2R and 2R+1 of level l-1, so
    the levels are combined coarse to fine at row resolution (level l's running part repeated twice,
    then folded with level l-1's rows). The result stays at level 1's rows ([B, H, nb p, ...], m/p
    tokens each); the block function broadcasts them to its queries. Broadcasting every level to
    the tokens first cost L passes over [n, dv] arrays, the superlinear term of the forward;
    the combination is associative, so the result is the same."""
    B, H = qf.shape[:2]
    d = qf.shape[-1]
    scale = d**-0.5
    acc = None
    for l in range(Lu, 0, -1):
        p = opts.p
        K, V, Q = kh[l - 1], vh[l - 1], qh[l - 1]
        N = K.shape[2]
        if opts.causal and opts.query_summary == "lagged":
            Q = _lagged(Q)
        g, valid = level_partners(np.arange(N), opts.causal, N)  # [N, S]
        rows = (g[..., None] * p + np.arange(p)).reshape(N, -1)
        rows = np.clip(rows, 0, N * p - 1)
        vmask = np.repeat(valid, p, axis=-1)[:, None, :]  # [N, 1, C]
        kc = jnp.take(K.reshape(B, H, N * p, d), rows.reshape(-1), axis=2).reshape(B, H, N, -1, d)
        vc = jnp.take(V.reshape(B, H, N * p, -1), rows.reshape(-1), axis=2).reshape(B, H, N, rows.shape[1], -1)
        s = jnp.einsum("bhard,bhacd->bharc", Q * scale, kc) + opts.beta(l)
        key = None if drop_key is None else jax.random.fold_in(drop_key, 1000 + l)
        M, e, den = _row_stats(s, vmask, vc, key, opts)
        num = jnp.einsum("bharc,bhacf->bharf", e, vc)
        flat = tuple(x.reshape((B, H, N * p) + x.shape[4:]) for x in (M, num, den))
        if acc is not None:
            acc = _repeat_rows(acc, 2, N * p)
        acc = _combine(acc, flat, opts)
    return acc  # level 1's rows: p per fine block; attend_group broadcasts them to the block's queries


def _to_blocks(coarse, nb: int, m: int):
    if coarse is None:
        return None
    out = [coarse[0]]
    for x in coarse[1:]:  # per query (m per block) or per level-1 row (p per block)
        B, H = x.shape[:2]
        out.append(x.reshape((B, H, nb, x.shape[2] // nb) + x.shape[3:]))
    return tuple(out)


# ---------------------------------------------------------------------------
# full pass (blocked jnp, §2.4)
# ---------------------------------------------------------------------------


def fma_forward(q, k, v, ds, opts: FMAOptions, drop_key=None, *, attend=None):
    """One full pass over n tokens (no prefix). q, k [B,H,n,d], v [B,H,n,dv] -> out [B,H,n,dv] f32.

    ``ds``: {'k': [params per level], 'v': [...], 'q': [...]} (None entries for avgpool).
    ``attend`` replaces :func:`attend_blocks` (the Pallas kernel), same signature."""
    attend = attend or attend_blocks
    B, H, n, d = q.shape
    dv = v.shape[-1]
    m, p = opts.m, opts.p
    nb = -(-n // m)
    n_pad = nb * m
    Lu = levels_used(n, opts)
    qf, kf, vf = (_f32(x) for x in (q, k, v))
    scale = d**-0.5
    qb = _pad_to(qf * scale, m).reshape(B, H, nb, m, d)
    back = n_pad - n + (0 if opts.causal else m)
    kp = jnp.pad(kf, ((0, 0), (0, 0), (m, back), (0, 0)))
    vp = jnp.pad(vf, ((0, 0), (0, 0), (m, back), (0, 0)))
    kh = all_level_summaries(kf, ds["k"], Lu, opts)
    vh = all_level_summaries(vf, ds["v"], Lu, opts)
    coarse = None
    if Lu > 0 and not opts.linear:
        n_groups = [x.shape[2] for x in kh]
        offsets = np.cumsum([0] + [g * p for g in n_groups])
        kall = jnp.concatenate([x.reshape(B, H, -1, d) for x in kh], axis=2)
        vall = jnp.concatenate([x.reshape(B, H, -1, dv) for x in vh], axis=2)
        idx, bias = packed_slots(np.arange(nb), num_levels=Lu, m=m, p=p, causal=opts.causal,
                                 betas=[opts.beta(l) for l in range(1, Lu + 1)], offsets=offsets,
                                 n_groups=n_groups, n_rows=int(offsets[-1]))
        coarse = ("packed", kall, vall, jnp.asarray(idx), jnp.asarray(bias))
    elif Lu > 0:
        qh = all_level_summaries(qf, ds["q"], Lu, opts)
        coarse = _to_blocks(linear_coarse_full(qf, kh, vh, qh, n_pad, Lu, drop_key, opts), nb, m)
    out = attend(qb, kp, vp, coarse, q_block0=0, n_valid=n, causal=opts.causal, drop_key=drop_key,
                 attn_dropout=opts.attn_dropout, logit_budget=opts.logit_budget)
    return out.reshape(B, H, n_pad, dv)[:, :, :n]


# ---------------------------------------------------------------------------
# causal state: from a full pass, and streaming (§4)
# ---------------------------------------------------------------------------

RING = 4  # finished groups kept per level: a query in group a reads a-2, a-3; the lagged query row a-1


def empty_state(B, H, d, dv, opts: FMAOptions):
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    st = {
        "pos": jnp.zeros((), jnp.int32),
        "win_k": z(B, H, 2 * opts.m, d),  # the last 2m raw keys, right-aligned (slot u <-> pos - 2m + u)
        "win_v": z(B, H, 2 * opts.m, dv),
        "ring_k": tuple(z(B, H, RING, opts.p, d) for _ in range(opts.L)),  # groups G-4..G-1, G = pos // m_l
        "ring_v": tuple(z(B, H, RING, opts.p, dv) for _ in range(opts.L)),
        "acc_k": tuple(z(B, H, opts.p, d) for _ in range(opts.L)),  # conv sums (no bias) of the open group
        "acc_v": tuple(z(B, H, opts.p, dv) for _ in range(opts.L)),
    }
    if opts.linear:
        st["ring_q"] = tuple(z(B, H, RING, opts.p, d) for _ in range(opts.L))
        st["acc_q"] = tuple(z(B, H, opts.p, d) for _ in range(opts.L))
    return st


def _tail_state(x, prm, ml: int, n: int, opts: FMAOptions):
    """(ring, acc) of one level after n tokens of x [B,H,n,f] (static n)."""
    B, H, _, f = x.shape
    G = n // ml
    lo = max(0, G - RING)
    ring = summarize(x[:, :, lo * ml:G * ml], prm, ml, opts) if G > lo else jnp.zeros((B, H, 0, opts.p, f))
    ring = jnp.pad(ring, ((0, 0), (0, 0), (RING - (G - lo), 0), (0, 0), (0, 0)))
    tail = _pad_to(x[:, :, G * ml:n], ml) if n > G * ml else jnp.zeros((B, H, ml, f))
    acc = summarize(tail, prm, ml, opts, with_bias=False)[:, :, 0]
    return ring, acc


def state_from_forward(q, k, v, ds, opts: FMAOptions):
    """The state the streaming path would hold after the n tokens of a full pass."""
    B, H, n, d = k.shape
    qf, kf, vf = (_f32(x) for x in (q, k, v))
    m = opts.m

    def last(x):
        x = x[:, :, max(0, n - 2 * m):]
        return jnp.pad(x, ((0, 0), (0, 0), (2 * m - x.shape[2], 0), (0, 0)))

    st = {"pos": jnp.asarray(n, jnp.int32), "win_k": last(kf), "win_v": last(vf)}
    names = (("k", kf), ("v", vf)) + ((("q", qf),) if opts.linear else ())
    for nm, x in names:
        rings, accs = [], []
        for l in range(1, opts.L + 1):
            ring, acc = _tail_state(x, ds[nm][l - 1], opts.m_l(l), n, opts)
            rings.append(ring)
            accs.append(acc)
        st[f"ring_{nm}"], st[f"acc_{nm}"] = tuple(rings), tuple(accs)
    return st


def _extend_level(x, prm, ring, acc, pos, T: int, ml: int, opts: FMAOptions):
    """Summaries of the groups around a chunk of T new tokens at positions [pos, pos+T).

    Returns (E [B,H,RING+n_new,p,f] with E[e] = group g_first - RING + e (g_first = pos // ml; only
    finished groups are meaningful), new ring, new acc)."""
    n_new = (T + ml - 1) // ml + 1
    n_ext = RING + n_new
    g_first = pos // ml
    abs_t = pos + jnp.arange(T)
    e_t = abs_t // ml - g_first + RING
    oh = (e_t[:, None] == jnp.arange(n_ext)[None, :]).astype(jnp.float32)  # [T, n_ext]
    raw = jnp.einsum("bhtrf,te->bherf", token_contrib(x, abs_t % ml, prm, ml, opts), oh)
    raw = raw.at[:, :, RING].add(acc)
    done = raw[:, :, RING:]
    b = _bias_rows(prm, opts)
    if b is not None:
        done = done + b
    E = jnp.concatenate([ring, done], axis=2)
    j = (pos + T) // ml - g_first
    new_ring = jax.lax.dynamic_slice_in_dim(E, j, RING, axis=2)
    new_acc = jax.lax.dynamic_index_in_dim(raw, j + RING, axis=2, keepdims=False)
    return E, new_ring, new_acc


def fma_stream(q, k, v, state, ds, opts: FMAOptions, drop_key=None, *, attend=None):
    """Causal FMA over T new tokens at positions [pos, pos+T) given the prefix state (§4).

    1. per level, the groups finished by these tokens are summarised (accumulated conv sums + bias);
    2. the new queries, laid out in fine blocks aligned to absolute positions, attend to the window
       of raw keys (state + new) and to their partner summaries, by the same block function as the
       full pass; 3. the window, rings, accumulators and pos advance."""
    attend = attend or attend_blocks
    if opts.leaky:
        raise ValueError("fma_linear: causal_query_summary='paper_leaky' reads summaries of unfinished groups "
                         "(it leaks the future) and cannot be streamed or decoded; use 'lagged'")
    B, H, T, d = q.shape
    dv = v.shape[-1]
    m, p = opts.m, opts.p
    pos = state["pos"]
    if not opts.allow_truncated:
        check_capacity(pos + T, opts.max_len,
                       "fma: the stream reached {needed} tokens but the layer's levels cover max_len={capacity}; "
                       "raise attention.fma.max_len or set allow_truncated_window=True")
    qf, kf, vf = (_f32(x) for x in (q, k, v))
    scale = d**-0.5
    new_state = {"pos": pos + T}
    E = {}
    for nm, x in (("k", kf), ("v", vf)) + ((("q", qf),) if opts.linear else ()):
        Es, rings, accs = [], [], []
        for l in range(1, opts.L + 1):
            e, ring, acc = _extend_level(x, ds[nm][l - 1], state[f"ring_{nm}"][l - 1], state[f"acc_{nm}"][l - 1],
                                         pos, T, opts.m_l(l), opts)
            Es.append(e)
            rings.append(ring)
            accs.append(acc)
        E[nm] = Es
        new_state[f"ring_{nm}"], new_state[f"acc_{nm}"] = tuple(rings), tuple(accs)
    # aligned blocks: query block c <-> absolute fine block b0 + c; key block c <-> b0 + c - 1
    b0, r = pos // m, pos % m
    nbs = (T - 1) // m + 2
    ext_q = jnp.pad(qf * scale, ((0, 0), (0, 0), (m, nbs * m - T), (0, 0)))
    qb = jax.lax.dynamic_slice_in_dim(ext_q, m - r, nbs * m, axis=2).reshape(B, H, nbs, m, d)
    ext_k = jnp.concatenate([state["win_k"], kf, jnp.zeros((B, H, nbs * m - T, d))], axis=2)
    ext_v = jnp.concatenate([state["win_v"], vf, jnp.zeros((B, H, nbs * m - T, dv))], axis=2)
    kp = jax.lax.dynamic_slice_in_dim(ext_k, m - r, (nbs + 1) * m, axis=2)
    vp = jax.lax.dynamic_slice_in_dim(ext_v, m - r, (nbs + 1) * m, axis=2)
    blocks = b0 + jnp.arange(nbs)
    L = opts.L
    coarse = None
    if L > 0 and not opts.linear:
        n_rows = [x.shape[2] * p for x in E["k"]]
        offsets = np.cumsum([0] + n_rows)
        idx, bias = packed_slots(blocks, num_levels=L, m=m, p=p, causal=True,
                                 betas=[opts.beta(l) for l in range(1, L + 1)], offsets=offsets,
                                 group_base=[pos // opts.m_l(l) - RING for l in range(1, L + 1)],
                                 n_rows=int(offsets[-1]), xp=jnp)
        kall = jnp.concatenate([x.reshape(B, H, -1, d) for x in E["k"]], axis=2)
        vall = jnp.concatenate([x.reshape(B, H, -1, dv) for x in E["v"]], axis=2)
        coarse = ("packed", kall, vall, idx, bias)
    elif L > 0:
        coarse = _linear_coarse_stream(qb, blocks, E, pos, drop_key, opts)
    out = attend(qb, kp, vp, coarse, q_block0=b0, n_valid=pos + T, causal=True, drop_key=drop_key,
                 attn_dropout=opts.attn_dropout, logit_budget=opts.logit_budget)
    out = jax.lax.dynamic_slice_in_dim(out.reshape(B, H, nbs * m, dv), r, T, axis=2)
    new_state["win_k"] = ext_k[:, :, T:T + 2 * m]
    new_state["win_v"] = ext_v[:, :, T:T + 2 * m]
    return out, new_state


def _linear_coarse_stream(qb, blocks, E, pos, drop_key, opts: FMAOptions):
    """FMA-linear (lagged) coarse stats for aligned query blocks: query i at level l reads the query
    summary of its slot in group a-1 and the partner summaries of group a (same dot products as the
    full pass's row tiles)."""
    B, H, nbs, m, d = qb.shape
    p = opts.p
    scale = d**-0.5
    i = blocks[:, None] * m + jnp.arange(m)[None, :]  # [nbs, m] absolute query positions
    acc = None
    for l in range(1, opts.L + 1):
        ml = opts.m_l(l)
        g_first = pos // ml
        EK, EV, EQ = E["k"][l - 1], E["v"][l - 1], E["q"][l - 1]
        n_ext = EK.shape[2]
        a = i // ml
        qrow = jnp.clip((a - 1 - g_first + RING) * p + (i % ml) * p // ml, 0, n_ext * p - 1)
        qr = jnp.take(EQ.reshape(B, H, n_ext * p, d), qrow.reshape(-1), axis=2).reshape(B, H, nbs, m, d)
        # num_levels=1 reads "level-1" groups of its argument, so pass the level-l group index a itself
        idx, bias = packed_slots(blocks >> (l - 1), num_levels=1, m=m, p=p, causal=True, betas=[opts.beta(l)],
                                 offsets=[0], group_base=[g_first - RING], n_rows=n_ext * p, xp=jnp)
        kc = jnp.take(EK.reshape(B, H, n_ext * p, d), idx.reshape(-1), axis=2).reshape(B, H, nbs, -1, d)
        vc = jnp.take(EV.reshape(B, H, n_ext * p, -1), idx.reshape(-1), axis=2).reshape(B, H, nbs, idx.shape[1], -1)
        s = jnp.einsum("bhcid,bhcsd->bhcis", qr * scale, kc) + bias[:, None, :]
        key = None if drop_key is None else jax.random.fold_in(drop_key, 1000 + l)
        M, e, den = _row_stats(s, (bias > NEG / 2)[:, None, :], vc, key, opts)
        num = jnp.einsum("bhcis,bhcsf->bhcif", e, vc)
        acc = _combine(acc, (M, num, den), opts)
    return acc


# ---------------------------------------------------------------------------
# dense reference (tests only, O(n^2)) and the partition
# ---------------------------------------------------------------------------


def level_matrix(n: int, m: int, L: int, causal: bool) -> np.ndarray:
    """lev[i, j] by the definition of §2.2 (corrected partition): 0 fine, l for I_l, -1 for none."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    lev = np.full((n, n), -1, np.int32)
    lev[np.abs(i // m - j // m) <= 1] = 0
    for l in range(1, L + 1):
        ml = m << (l - 1)
        D_l = np.abs(i // ml - j // ml)
        D_up = np.abs(i // (2 * ml) - j // (2 * ml))
        lev[(lev < 0) & (D_l >= 2) & (D_up <= 1)] = l
    if causal:
        lev[j > i] = -1
    return lev


def cover_count(n: int, m: int, L: int, causal: bool, parent_condition: bool = True) -> np.ndarray:
    """How many of the sets I_0..I_L contain each pair. With ``parent_condition=False`` the sets are paper
    eq. (4) as printed ({D_l in {2, 3}}), which double-covers pairs."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    cnt = (np.abs(i // m - j // m) <= 1).astype(np.int32)
    for l in range(1, L + 1):
        ml = m << (l - 1)
        D_l = np.abs(i // ml - j // ml)
        s = (D_l >= 2) & (D_l <= 3)
        if parent_condition:
            s = s & (np.abs(i // (2 * ml) - j // (2 * ml)) <= 1)
        cnt = cnt + s
    if causal:
        cnt = np.where(j > i, 0, cnt)
    return cnt


def level_matrix_parity(n: int, m: int, L: int, causal: bool) -> np.ndarray:
    """lev[i, j] from the parity rule (the interaction list the blocked path and the kernel use)."""
    lev = np.full((n, n), -1, np.int32)
    i = np.arange(n)
    for qi in range(n):
        b = qi // m
        for bb in (b - 1, b) + (() if causal else (b + 1,)):
            if 0 <= bb:
                lo, hi = bb * m, min(n, (bb + 1) * m)
                lev[qi, lo:hi] = 0
        for l in range(1, L + 1):
            ml = m << (l - 1)
            N = -(-n // ml)
            g, valid = level_partners(np.asarray(qi // ml), causal, N)
            for gg, vv in zip(g, valid):
                if vv:
                    lev[qi, gg * ml:min(n, (gg + 1) * ml)] = l
    if causal:
        lev[i[None, :] > i[:, None]] = -1
    return lev


def fma_dense_reference(q, k, v, ds, opts: FMAOptions):
    """The literal n x n matrix C~ of paper eqs. (5)-(7) (§2.4 "dense reference"): every summary column
    repeated for each key it stands for, one row softmax (or one per level for FMA-linear 'per_level').
    The multiplicity is implicit in the repetition; with ``multiplicity_weighting`` off ln(m_l/p) is
    subtracted on level-l entries. Bidirectional padding follows the module docstring's rule."""
    B, H, n, d = q.shape
    m, p = opts.m, opts.p
    Lu = levels_used(n, opts)
    top = opts.m_l(Lu) if Lu > 0 else m
    n_ref = -(-n // top) * top
    lev = level_matrix(n_ref, m, Lu, opts.causal)[:n]  # [n, n_ref]
    j = np.arange(n_ref)
    lev = np.where((lev == 0) & (j[None, :] >= n), -1, lev)
    for l in range(1, Lu + 1):
        ml = opts.m_l(l)
        lev = np.where((lev == l) & ((j // ml) * ml >= n)[None, :], -1, lev)
    qf, kf, vf = (_f32(x) for x in (q, k, v))
    kf = _pad_to(kf, n_ref)
    vf = _pad_to(vf, n_ref)
    scale = d**-0.5
    S = [jnp.einsum("bhid,bhjd->bhij", qf * scale, kf)]
    V = [None]
    for l in range(1, Lu + 1):
        ml = opts.m_l(l)
        rows = (j * p) // ml  # summary row of key j
        kt = summarize(kf, ds["k"][l - 1], ml, opts).reshape(B, H, -1, d)[:, :, rows]
        vt = summarize(vf, ds["v"][l - 1], ml, opts).reshape(B, H, n_ref // ml * p, -1)[:, :, rows]
        if opts.linear:
            qh = summarize(_pad_to(qf, n_ref), ds["q"][l - 1], ml, opts)
            if opts.causal and opts.query_summary == "lagged":
                qh = _lagged(qh)
            qt = qh.reshape(B, H, -1, d)[:, :, (np.arange(n) * p) // ml]
        else:
            qt = qf
        s = jnp.einsum("bhid,bhjd->bhij", qt * scale, kt)
        if not opts.multiplicity:
            s = s - math.log(ml / p)
        S.append(s)
        V.append(vt)
    levj = jnp.asarray(lev)
    full = S[0]
    for l in range(1, Lu + 1):
        full = jnp.where(levj == l, S[l], full)
    full = jnp.where(levj >= 0, full, NEG)
    if opts.linear and opts.normalization == "per_level":
        out = 0.0
        for l in range(0, Lu + 1):
            sl = jnp.where(levj == l, full, NEG)
            mx = jnp.max(sl, axis=-1, keepdims=True)
            e = jnp.where(levj == l, jnp.exp(sl - mx), 0.0)
            den = jnp.sum(e, axis=-1, keepdims=True)
            a = e / jnp.where(den > 0, den, 1.0)
            out = out + jnp.einsum("bhij,bhjf->bhif", a, vf if l == 0 else V[l])
        return out
    mx = jnp.max(full, axis=-1, keepdims=True)
    e = jnp.where(levj >= 0, jnp.exp(full - mx), 0.0)
    A = e / jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhij,bhjf->bhif", jnp.where(levj == 0, A, 0.0), vf)
    for l in range(1, Lu + 1):
        out = out + jnp.einsum("bhij,bhjf->bhif", jnp.where(levj == l, A, 0.0), V[l])
    return out


# ---------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------


def _uniform(bound: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class Downsample(nnx.Module):
    """One level's strided conv for one of K, V, Q: ``kernel`` [m_l, f, p] (depthwise) or
    [m_l, f, f, p] (dense_conv), with a leading heads axis when not shared; ``bias`` [f, p]."""

    def __init__(self, kind: str, ml: int, f: int, p: int, *, heads: int | None, init: str, feat_axis: str,
                 rngs: nnx.Rngs):
        if kind == "depthwise_conv":
            shape, names, fan_in = (ml, f, p), ("kernel_size", feat_axis, None), ml
        else:
            shape, names, fan_in = (ml, f, f, p), ("kernel_size", None, feat_axis, None), ml * f
        bshape, bnames = (f, p), (feat_axis, None)
        if heads is not None:
            shape, names = (heads,) + shape, ("heads",) + names
            bshape, bnames = (heads,) + bshape, ("heads",) + bnames
        if init == "subinterval_mean":
            t = np.arange(ml)
            w = ((t[:, None] * p) // ml == np.arange(p)[None, :]).astype(np.float32) * (p / ml)  # [ml, p]
            if kind == "depthwise_conv":
                w = np.broadcast_to(w[:, None, :], (ml, f, p))
            else:
                w = w[:, None, None, :] * np.eye(f, dtype=np.float32)[None, :, :, None]
            w = np.broadcast_to(w, shape).copy()
            kinit = lambda key, s, dt=jnp.float32: jnp.asarray(w, dt)  # noqa: E731
            binit = nnx.initializers.zeros
        else:  # PyTorch Conv1d defaults (the release): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for W and c
            kinit = binit = _uniform(1.0 / math.sqrt(fan_in))
        self.kernel = nnx.Param(logical(kinit, *names)(rngs.params(), shape, jnp.float32))
        self.bias = nnx.Param(logical(binit, *bnames)(rngs.params(), bshape, jnp.float32))

    def params(self):
        return {"kernel": self.kernel[...], "bias": self.bias[...]}


# ---------------------------------------------------------------------------
# the cores
# ---------------------------------------------------------------------------


class FMAAttention(AttentionCore):
    """Fast Multipole Attention core (see the module docstring)."""

    name = "fma"
    EXECUTION_KEYS = ("impl", "logit_budget")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """xla (the blocked XLA path; the reference) and pallas (the block kernel; interpret mode on CPU)."""
        from longctx.attention.dispatch import Implementation

        return (Implementation("xla", config={"impl": "xla"}),
                Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, config={"impl": "pallas"}))
    linear = False

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        c = {
            "m": 64,  # fine block size (group size of level 1)
            "p": 4,  # summary rows per group (p | m)
            # the training length n: fixes the levels L = log2(max_len/m) - 1 and the parameters
            # (2 p d (max_len/2 - m) + 2 L p d per layer); the default lets a benchmark run 131k tokens
            "max_len": 131072,
            "num_levels": None,  # k = L + 1 (paper's "k lev", fine level included); None = derived
            "downsample": "depthwise_conv",  # 'depthwise_conv' (paper) | 'dense_conv' | 'avgpool' (tests)
            "share_downsample_across_heads": True,
            "downsample_init": "torch_default",  # 'torch_default' | 'subinterval_mean'
            "multiplicity_weighting": True,  # beta_l = ln(m_l / p) on summary scores
            "allow_truncated_window": False,  # n > max_len: only L levels (a window of ~max_len tokens)
            "attn_dropout": 0.0,
            "impl": "auto",  # 'xla' | 'pallas' | 'auto' (Pallas on GPU/TPU, XLA on CPU)
            "logit_budget": 1 << 24,  # max materialised scores per lax.map step of the blocked path
        }
        if cls.linear:
            c["fma_linear_normalization"] = "joint"  # 'joint' | 'per_level' (paper eq. 11)
            c["causal_query_summary"] = "lagged"  # 'lagged' (leak-free) | 'paper_leaky' (reproduction only)
            c["allow_paper_leaky"] = False  # causal 'paper_leaky' must be asked for explicitly
        return ml_collections.ConfigDict(c)

    @classmethod
    def derived_levels(cls, cfg) -> int:
        return (cfg.max_len // cfg.m).bit_length() - 2  # log2(max_len/m) - 1

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        pre = f"attention.{cls.name}"
        m, p, n = cfg.m, cfg.p, cfg.max_len
        require(m > 0 and p > 0, f"{pre}: m={m} and p={p} must be positive")
        require(m % p == 0, f"{pre}: p={p} must divide m={m}")
        require(n >= m and n % m == 0 and ((n // m) & (n // m - 1)) == 0,
                f"{pre}: max_len/m must be a power of two (max_len={n}, m={m})")
        L = cls.derived_levels(cfg)
        if cfg.num_levels is not None:
            require(1 <= cfg.num_levels <= max(L, 0) + 1,
                    f"{pre}.num_levels={cfg.num_levels}; allowed 1..{max(L, 0) + 1} (= log2(max_len/m))")
            require(cfg.num_levels == max(L, 0) + 1 or cfg.allow_truncated_window,
                    f"{pre}.num_levels={cfg.num_levels} < log2(max_len/m) truncates the receptive field; "
                    "set allow_truncated_window=True to ask for it")
        for key, allowed in (
            ("downsample", ("depthwise_conv", "dense_conv", "avgpool")),
            ("downsample_init", ("torch_default", "subinterval_mean")),
        ):
            require(cfg[key] in allowed, f"{pre}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
        from longctx.attention import dispatch

        why = dispatch.impl_problem(cfg.impl, ("xla", "pallas"))
        require(why is None, f"{pre}.{why}")
        require(0.0 <= cfg.attn_dropout < 1.0, f"{pre}.attn_dropout={cfg.attn_dropout}; must be in [0, 1)")
        require(not (cfg.impl == "pallas" and cfg.attn_dropout > 0),
                f"{pre}: the Pallas kernel has no attention dropout; use impl='xla' or attn_dropout=0")
        require(cfg.logit_budget > 0, f"{pre}.logit_budget must be positive")
        if cls.linear:
            for key, allowed in (("fma_linear_normalization", ("joint", "per_level")),
                                 ("causal_query_summary", ("lagged", "paper_leaky"))):
                require(cfg[key] in allowed, f"{pre}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
            require(not (causal and cfg.causal_query_summary == "paper_leaky" and not cfg.allow_paper_leaky),
                    f"{pre}.causal_query_summary='paper_leaky' lets future tokens change past outputs (the "
                    "paper's causal FMA-linear); it exists to reproduce Table 1 only. Use 'lagged', or set "
                    "allow_paper_leaky=True to ask for it explicitly")

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim)
        c = self.cfg
        L = self.derived_levels(c) if c.num_levels is None else c.num_levels - 1
        L = max(L, 0)
        self.opts = FMAOptions(
            causal=causal, m=c.m, p=c.p, L=L, max_len=c.max_len, linear=self.linear,
            multiplicity=c.multiplicity_weighting,
            normalization=c.get("fma_linear_normalization", "joint"),
            query_summary=c.get("causal_query_summary", "lagged"),
            downsample=c.downsample, shared=c.share_downsample_across_heads,
            allow_truncated=c.allow_truncated_window, attn_dropout=float(c.attn_dropout),
            logit_budget=int(c.logit_budget),
        )
        heads = None if c.share_downsample_across_heads else num_heads
        names = (("k", head_dim, "head_dim"), ("v", self.value_dim, "value_dim"))
        if self.linear:
            names = names + (("q", head_dim, "head_dim"),)
        if c.downsample != "avgpool":
            for nm, f, ax in names:
                for l in range(1, L + 1):
                    setattr(self, f"ds_{nm}_{l}", Downsample(c.downsample, self.opts.m_l(l), f, c.p, heads=heads,
                                                             init=c.downsample_init, feat_axis=ax, rngs=rngs))

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        # m=4, p=2, max_len=64: L = 3 levels (groups of 4, 8, 16); 56 tokens populate every level
        # (the top level's partners start at position 32) and leave room for the suite's +5 tokens.
        base = {"m": 4, "p": 2, "max_len": 64, "impl": "xla"}
        return {
            "xla": ContractCase(cfg=base, length=56, num_heads=2, head_dim=8, value_dim=6),
            "xla_per_head_dense_conv": ContractCase(
                cfg={**base, "share_downsample_across_heads": False, "downsample": "dense_conv"},
                length=40, num_heads=2, head_dim=4, directions=("causal",), slow=True),
            # the Pallas kernel in interpret mode (full passes; streaming steps use the reference)
            "pallas": ContractCase(cfg={**base, "impl": "pallas"}, length=56, num_heads=2, head_dim=8, value_dim=6,
                                   slow=True),
        }

    @classmethod
    def kernel_benches(cls):
        return {"fma_blocks": KernelBench(xla={"impl": "xla"}, pallas={"impl": "pallas"})}

    @classmethod
    def drop_in(cls) -> DropIn:
        # parameter-free summaries (mean of each sub-interval of m_l/p tokens): FMA on given q, k, v, untrained
        return DropIn(description="summaries = sub-interval means (downsample='avgpool'), no training",
                      overrides={"downsample": "avgpool"})

    # -- helpers ----------------------------------------------------------------
    def ds_params(self):
        out = {}
        for nm in ("k", "v") + (("q",) if self.linear else ()):
            out[nm] = [getattr(self, f"ds_{nm}_{l}").params() if self.opts.downsample != "avgpool" else None
                       for l in range(1, self.opts.L + 1)]
        return out

    def _attend_fn(self):
        """The block function: the Pallas kernel where the shared impl rule picks it, else None (XLA)."""
        from longctx.attention import dispatch
        from pallas_kernels import fma_blocks

        choice = dispatch.resolve(
            self.cfg.impl, method=self.name, kernel="fma_blocks", reasons_fn=fma_blocks.unsupported_reasons,
            m=self.opts.m, d=self.head_dim, dv=self.value_dim, coarse_kind="stats" if self.linear else "packed",
            dropout=self.opts.attn_dropout,
        )
        if not choice.use_kernel:
            return None
        return fma_blocks.make_attend(interpret=choice.interpret,
                                      platform="interpret" if choice.interpret else choice.platform)

    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError(f"{self.name}: bidirectional attention has no prefix state")
        if self.opts.leaky:
            raise ValueError(f"{self.name}: causal_query_summary='paper_leaky' cannot be decoded; use 'lagged'")
        if max_len is not None and max_len > self.opts.max_len and not self.opts.allow_truncated:
            raise ValueError(
                f"{self.name}: a state for {max_len} tokens exceeds the layer's max_len={self.opts.max_len} "
                "(the levels it was built for); raise max_len or set allow_truncated_window=True"
            )
        return empty_state(batch_size, self.num_heads, self.head_dim, self.value_dim, self.opts)

    # -- sequence parallelism: rings of the newest groups per level, a window of the newest keys --
    def sequence_refusal(self, slice_len: int) -> str | None:
        if self.opts.leaky:
            return "causal_query_summary='paper_leaky' cannot be streamed"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return {**self.init_state(batch_size, max_len), "pos": jnp.asarray(start, jnp.int32)}

    def compose_states(self, a, b):
        # b ran from zeros at a's end: its window and rings hold zeros where a's newest keys and groups
        # belong, and the group open at a's end lacks a's part of its (linear) conv sum, a's acc
        def newest(old, new, shift):
            n = old.shape[2]
            padded = jnp.concatenate([old, jnp.zeros_like(old)], axis=2)
            return new + jax.lax.dynamic_slice_in_dim(padded, jnp.minimum(shift, n), n, axis=2)

        out = dict(b)
        for name in ("win_k", "win_v"):
            out[name] = newest(a[name], b[name], b["pos"] - a["pos"])
        for name in a:
            if not name.startswith("ring_"):
                continue
            acc_name = "acc_" + name[len("ring_"):]
            rings, accs = [], []
            for l, (ra, rb, acc_a, acc_b) in enumerate(zip(a[name], b[name], a[acc_name], b[acc_name])):
                ml = self.opts.m_l(l + 1)
                shift = b["pos"] // ml - a["pos"] // ml  # groups finished by b's tokens
                ring = newest(ra, rb, shift)
                # the group open at a's end finished in b: it sits at ring slot RING - shift (if still kept)
                at = (jnp.arange(RING) == RING - shift).astype(ring.dtype)
                rings.append(ring + at[None, None, :, None, None] * acc_a[:, :, None])
                accs.append(acc_b + jnp.where(shift == 0, acc_a, 0.0))
            out[name], out[acc_name] = tuple(rings), tuple(accs)
        return out

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None):
        check_qkv(q, k, v)
        drop_key = None
        if not deterministic and self.opts.attn_dropout > 0.0:
            if key is None:
                raise ValueError(f"{self.name}: attn_dropout > 0 with deterministic=False needs a PRNG `key`")
            drop_key = key
        ds = self.ds_params()
        attend = self._attend_fn()
        if state is None:
            out = fma_forward(q, k, v, ds, self.opts, drop_key, attend=attend)
            new_state = None
            if self.causal and not self.opts.leaky:
                new_state = state_from_forward(q, k, v, ds, self.opts)
            return out.astype(v.dtype), new_state
        if not self.causal:
            raise ValueError(f"{self.name}: a bidirectional core takes no state (state=None only)")
        if not isinstance(state, dict) or "pos" not in state:
            raise ValueError(f"{self.name}: state must come from init_state() or a previous call")
        out, new_state = fma_stream(q, k, v, state, ds, self.opts, drop_key, attend=attend)
        return out.astype(v.dtype), new_state


class FMALinearAttention(FMAAttention):
    """FMA-linear (paper App. A.1): queries are summarised too, so the coarse part is O(n)."""

    name = "fma_linear"

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """xla only: the block kernel computes FMA's packed summary slots, not FMA-linear's statistics."""
        from longctx.attention.dispatch import Implementation

        return (Implementation("xla", config={"impl": "xla"}),)
    linear = True

    @classmethod
    def kernel_benches(cls):
        return {}  # the fma_blocks kernel computes FMA's packed coarse slots, not FMA-linear's statistics

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        base = {"m": 4, "p": 2, "max_len": 64, "impl": "xla"}
        return {
            "xla": ContractCase(cfg=base, length=56, num_heads=2, head_dim=8, value_dim=6),
            "xla_per_level": ContractCase(cfg={**base, "fma_linear_normalization": "per_level"}, length=40,
                                          num_heads=1, head_dim=4, directions=("causal",), slow=True),
        }


__all__ = [
    "FMAAttention",
    "FMALinearAttention",
    "FMAOptions",
    "cover_count",
    "fma_dense_reference",
    "fma_forward",
    "fma_stream",
    "level_matrix",
    "level_matrix_parity",
    "levels_used",
    "state_from_forward",
    "summarize",
]

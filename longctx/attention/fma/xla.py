"""The blocked FMA path (docs/methods/fma.md §2.4, spec §2.4-§2.5), portable: plain einsums, the implementation
``xla`` (GPU and TPU where the kernel does not serve the call; any platform when named).

Per fine block: a 2m (bidirectional 3m) window of raw keys plus the block's packed coarse summary slots, one
softmax, query blocks processed in groups under a rematerialised ``lax.map`` so memory is O(n (m + p L)) at
most and O(``logit_budget``) per step. The block math is ``pallas_kernels/fma_blocks_ref.py`` (beside the
Pallas kernel that must match it). :func:`fma_forward` takes the block function (``attend``) and the
summaries (``summaries``) as arguments: the CPU-tuned implementation (its own file) passes its forms of the same
products, ``pallas.py`` the kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention.dispatch import ALL_PLATFORMS, Implementation
from longctx.attention.fma.coarse_stats import combine, row_stats
from longctx.attention.fma.options import FMAOptions, levels_used, pad_to
from longctx.attention.fma.reference import lagged, summarize
from longctx.attention.fma.state import Blocked
from pallas_kernels.fma_blocks_ref import NEG, attend_blocks, level_partners, packed_slots
from pallas_kernels.precision import acc_einsum, compute_dtype

attend = attend_blocks  # the block function (plain products); also the streaming steps' of the reference


def level_summaries(x, prm, ml: int, opts: FMAOptions):
    """Summaries of all (zero-padded) groups of a sequence: [B,H,ceil(n/ml),p,f]."""
    return summarize(pad_to(x, ml), prm, ml, opts)


def all_level_summaries(x, prms, Lu: int, opts: FMAOptions):
    """``[level_summaries(x, prms[l-1], m_l, opts) for l = 1..Lu]``: one einsum per level."""
    return [level_summaries(x, prms[l - 1], opts.m_l(l), opts) for l in range(1, Lu + 1)]


# ---------------------------------------------------------------------------
# FMA-linear coarse part (§2.5; its statistics: coarse_stats.py)
# ---------------------------------------------------------------------------


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
            Q = lagged(Q)
        g, valid = level_partners(np.arange(N), opts.causal, N)  # [N, S]
        rows = (g[..., None] * p + np.arange(p)).reshape(N, -1)
        rows = np.clip(rows, 0, N * p - 1)
        vmask = np.repeat(valid, p, axis=-1)[:, None, :]  # [N, 1, C]
        kc = jnp.take(K.reshape(B, H, N * p, d), rows.reshape(-1), axis=2).reshape(B, H, N, -1, d)
        vc = jnp.take(V.reshape(B, H, N * p, -1), rows.reshape(-1), axis=2).reshape(B, H, N, rows.shape[1], -1)
        # compute-dtype operands, scores and statistics in at least float32 (M, num, den), as the fine blocks' softmax
        s = acc_einsum("bhard,bhacd->bharc", Q * scale, kc) + opts.beta(l)
        key = None if drop_key is None else jax.random.fold_in(drop_key, 1000 + l)
        M, e, den = row_stats(s, vmask, vc, key, opts)
        num = acc_einsum("bharc,bhacf->bharf", e.astype(vc.dtype), vc)
        flat = tuple(x.reshape((B, H, N * p) + x.shape[4:]) for x in (M, num, den))
        if acc is not None:
            acc = _repeat_rows(acc, 2, N * p)
        acc = combine(acc, flat, opts)
    return acc  # level 1's rows: p per fine block; attend_group broadcasts them to the block's queries


def linear_coarse_docs(qf, kh, vh, qh, n_pad: int, Lu: int, drop_key, opts: FMAOptions, docs):
    """:func:`linear_coarse_full` of a packed row laid out again (``packed.py``; ``docs`` [B, n]: each token's
    document, 0: padding), per query [B, H, n_pad, ...]. A level's row (the queries of one sub-interval) may hold
    queries of several documents (a document ends, or a short one falls, inside it), and at most one of them has
    slots of its own document at that level (a document with slots at level l starts on a level-l group boundary,
    and the groups it reads are whole groups of it): a row's slots count where their group's document is one of the
    row's queries', and each query keeps the row's statistics only where they are of its document. The levels are
    combined per query (L passes over [n, dv], the price of the packed form)."""
    B, H = qf.shape[:2]
    d = qf.shape[-1]
    p = opts.p
    scale = d**-0.5
    acc = None
    for l in range(Lu, 0, -1):
        ml = opts.m_l(l)
        K, V, Q = kh[l - 1], vh[l - 1], qh[l - 1]
        N = K.shape[2]
        if opts.causal and opts.query_summary == "lagged":
            Q = lagged(Q)
        g, valid = level_partners(np.arange(N), opts.causal, N)  # [N, S]
        gc = np.clip(g, 0, N - 1)
        rows = (gc[..., None] * p + np.arange(p)).reshape(N, -1)
        slot_doc = jnp.repeat(group_docs(docs, ml)[:, gc], p, axis=-1)  # [B, N, C]
        qd = jnp.pad(docs, ((0, 0), (0, N * ml - docs.shape[1]))).reshape(B, N, p, ml // p)
        hi = jnp.max(qd, axis=-1)[..., None]  # [B, N, p, 1]: the row's documents are hi's and those down to lo
        lo = jnp.min(jnp.where(qd > 0, qd, jnp.iinfo(jnp.int32).max), axis=-1)[..., None]
        sd = slot_doc[:, :, None, :]
        ok = np.repeat(valid, p, axis=-1)[None, :, None, :] & (sd >= lo) & (sd <= hi)  # [B, N, p, C]
        owner = jnp.max(jnp.where(ok, sd, -1), axis=-1).reshape(B, N * p)  # the row's document with slots
        kc = jnp.take(K.reshape(B, H, N * p, d), rows.reshape(-1), axis=2).reshape(B, H, N, -1, d)
        vc = jnp.take(V.reshape(B, H, N * p, -1), rows.reshape(-1), axis=2).reshape(B, H, N, rows.shape[1], -1)
        s = acc_einsum("bhard,bhacd->bharc", Q * scale, kc) + opts.beta(l)
        key = None if drop_key is None else jax.random.fold_in(drop_key, 1000 + l)
        M, e, den = row_stats(s, ok[:, None], vc, key, opts)
        num = acc_einsum("bharc,bhacf->bharf", e.astype(vc.dtype), vc)
        mine = docs == jnp.repeat(owner, ml // p, axis=1)[:, :n_pad]  # [B, n_pad]: the row's stats are the query's
        M, num, den = (jnp.repeat(x.reshape((B, H, N * p) + x.shape[4:]), ml // p, axis=2)[:, :, :n_pad]
                       for x in (M, num, den))
        M = jnp.where(mine[:, None], M, NEG)
        num = jnp.where(mine[:, None, :, None], num, 0.0)
        den = jnp.where(mine[:, None], den, 0.0)
        acc = combine(acc, (M, num, den), opts)
    return acc


def _to_blocks(coarse, nb: int, m: int):
    if coarse is None:
        return None
    out = [coarse[0]]
    for x in coarse[1:]:  # per query (m per block) or per level-1 row (p per block)
        B, H = x.shape[:2]
        out.append(x.reshape((B, H, nb, x.shape[2] // nb) + x.shape[3:]))
    return tuple(out)


# ---------------------------------------------------------------------------
# full pass (§2.4)
# ---------------------------------------------------------------------------


def fma_forward(q, k, v, ds, opts: FMAOptions, drop_key=None, *, attend=attend_blocks,
                summaries=all_level_summaries, docs=None, levels=None):
    """One full pass over n tokens (no prefix). q, k [B,H,n,d], v [B,H,n,dv] -> out [B,H,n,dv] (the block
    function's dtype: at least float32 from the XLA block functions, the compute dtype from the kernel).

    ``ds``: {'k': [params per level], 'v': [...], 'q': [...]} (None entries for avgpool). ``attend``: the block
    function (:func:`pallas_kernels.fma_blocks_ref.attend_blocks`'s signature); ``summaries``: the form of
    :func:`all_level_summaries` to use.

    Precision (DESIGN.md §7): q, k, v stay in their (compute) dtype, bfloat16 as given; the summaries are
    accumulated in float32 from compute-dtype operands (the float32 downsampling weights cast down) and cast to
    the compute dtype, so every product of the block function takes compute-dtype operands; float32 and float64
    inputs run as they are.

    ``docs`` [B, n] int32 (packed rows laid out again, ``packed.py``; None: one sequence): the document of every
    token (0: padding), with ``levels`` the coarse levels the documents use; a fine key or a packed slot counts for
    a query only where it is of the query's document (a slot: its group starts on one of the document's tokens
    and holds no other document's)."""
    B, H, n, d = q.shape
    dv = v.shape[-1]
    m, p = opts.m, opts.p
    nb = -(-n // m)
    n_pad = nb * m
    Lu = levels_used(n, opts) if levels is None else levels
    cdt = compute_dtype(q, k, v)
    qf, kf, vf = (x.astype(cdt) for x in (q, k, v))
    scale = d**-0.5
    qb = pad_to(qf * scale, m).reshape(B, H, nb, m, d)
    back = n_pad - n + (0 if opts.causal else m)
    kp = jnp.pad(kf, ((0, 0), (0, 0), (m, back), (0, 0)))
    vp = jnp.pad(vf, ((0, 0), (0, 0), (m, back), (0, 0)))
    kh = [x.astype(cdt) for x in summaries(kf, ds["k"], Lu, opts)]
    vh = [x.astype(cdt) for x in summaries(vf, ds["v"], Lu, opts)]
    coarse = None
    if Lu == 0 and opts.release_zero_slots:  # only block 0's zero fine keys
        kall, vall = jnp.zeros((B, H, 0, d), cdt), jnp.zeros((B, H, 0, dv), cdt)
        kall, vall, idx, bias = release_zero_slots(kall, vall, np.zeros((nb, 0), np.int32),
                                                   np.zeros((nb, 0), np.float32), nb, 0, opts)
        coarse = ("packed", kall, vall, jnp.asarray(idx), jnp.asarray(bias))
    elif Lu > 0 and not opts.linear:
        n_groups = [x.shape[2] for x in kh]
        offsets = np.cumsum([0] + [g * p for g in n_groups])
        kall = jnp.concatenate([x.reshape(B, H, -1, d) for x in kh], axis=2)
        vall = jnp.concatenate([x.reshape(B, H, -1, dv) for x in vh], axis=2)
        idx, bias = packed_slots(np.arange(nb), num_levels=Lu, m=m, p=p, causal=opts.causal,
                                 betas=[opts.beta(l) for l in range(1, Lu + 1)], offsets=offsets,
                                 n_groups=n_groups, n_rows=int(offsets[-1]))
        if opts.release_zero_slots:
            kall, vall, idx, bias = release_zero_slots(kall, vall, idx, bias, nb, Lu, opts)
        coarse = ("packed", kall, vall, jnp.asarray(idx), jnp.asarray(bias))
        if docs is not None:
            slot_docs = jnp.concatenate([jnp.repeat(group_docs(docs, opts.m_l(l)), p, axis=1)
                                         for l in range(1, Lu + 1)], axis=1)
            docs = (docs, slot_docs[:, idx])
    elif Lu > 0:
        qh = [x.astype(cdt) for x in summaries(qf, ds["q"], Lu, opts)]
        if docs is None:
            coarse = linear_coarse_full(qf, kh, vh, qh, n_pad, Lu, drop_key, opts)
        else:
            coarse = linear_coarse_docs(qf, kh, vh, qh, n_pad, Lu, drop_key, opts, pad_to(docs[:, None, :, None],
                                                                                        m)[:, 0, :, 0])
        coarse = _to_blocks(coarse, nb, m)
    kw = {}
    if docs is not None:  # queries, fine keys (laid out as kp: one block in front) and slots of each document
        qdoc, sdoc = docs if isinstance(docs, tuple) else (docs, None)
        kw["docs"] = (jnp.pad(qdoc, ((0, 0), (0, n_pad - n)), constant_values=-1),
                      jnp.pad(qdoc, ((0, 0), (m, back)), constant_values=-2), sdoc)
    out = attend(qb, kp, vp, coarse, q_block0=0, n_valid=n, causal=opts.causal, drop_key=drop_key,
                 attn_dropout=opts.attn_dropout, logit_budget=opts.logit_budget, **kw)
    return out.reshape(B, H, n_pad, dv)[:, :, :n]


def group_docs(docs, ml: int):
    """[B, N_l]: the document of every group of ``ml`` tokens of a laid-out packed row (``docs`` [B, n], 0: padding):
    the document of its first token where it holds no other document's token, else -1 (no document's)."""
    g = pad_to(docs[:, None, :, None], ml)[:, 0, :, 0].reshape(docs.shape[0], -1, ml)
    first = g[:, :, 0]
    clean = jnp.all((g == first[:, :, None]) | (g == 0), axis=2) & (first > 0)
    return jnp.where(clean, first, -1)


def release_zero_slots(kall, vall, idx, bias, nb: int, Lu: int, opts: FMAOptions):
    """§9.3 (causal): the release's unmasked zero slots as packed slots. One zero row is appended to the
    summaries; a level-l slot of the lower chunk of groups a < 2 (h <= a mod 2, the chunk before the first)
    points to it with bias beta_l, and one extra slot per block stands for block 0's m zero fine keys (bias
    ln m: m columns of score 0). The levels past the Lu the input uses, up to the layer's L, have no real
    summaries but the release runs them: each adds its zero slots as 2p more columns."""
    B, H, R = kall.shape[:3]
    kall = jnp.concatenate([kall, jnp.zeros((B, H, 1, kall.shape[-1]), kall.dtype)], axis=2)
    vall = jnp.concatenate([vall, jnp.zeros((B, H, 1, vall.shape[-1]), vall.dtype)], axis=2)
    idx, bias = np.array(idx), np.array(bias)
    b, p = np.arange(nb), opts.p
    h = np.arange(2 * p) // p
    for l in range(1, opts.L + 1):  # slots of level l: [2p (l-1), 2p l), low chunk halves h = 0, 1, then r
        a = b >> (l - 1)
        zero = (a[:, None] < 2) & (h[None, :] <= (a % 2)[:, None])
        if l > Lu:  # a level without real summaries here: only its zero slots, appended
            idx = np.concatenate([idx, np.full((nb, 2 * p), R, idx.dtype)], axis=1)
            bias = np.concatenate([bias, np.where(zero, np.float32(opts.beta(l)), np.float32(NEG))], axis=1)
            continue
        cols = slice(2 * p * (l - 1), 2 * p * l)
        idx[:, cols] = np.where(zero, R, idx[:, cols])
        bias[:, cols] = np.where(zero, np.float32(opts.beta(l)), bias[:, cols])
    idx = np.concatenate([idx, np.full((nb, 1), R, idx.dtype)], axis=1)
    bias = np.concatenate([bias, np.where(b == 0, np.float32(np.log(opts.m)), np.float32(NEG))[:, None]], axis=1)
    return kall, vall, idx.astype(np.int32), bias.astype(np.float32)


def forward(q, k, v, ds, opts: FMAOptions, drop_key=None, **packed):
    """The implementation ``xla``: :func:`fma_forward` with the plain products and per-level summaries
    (``packed``: its ``docs`` and ``levels``, for a packed row laid out again)."""
    return fma_forward(q, k, v, ds, opts, drop_key, **packed)


@dataclasses.dataclass(frozen=True)
class Xla(Blocked):
    """The implementation ``xla``: :func:`forward` for a full pass, the streamed steps with its block function
    :func:`~pallas_kernels.fma_blocks_ref.attend_blocks` (its one knob, ``logit_budget``, reaches both through the
    options)."""

    def forward(self, call):
        return forward

    def attend(self, call):
        return attend


# ``logit_budget`` (materialised scores per ``lax.map`` step of :func:`attend_blocks`) per platform, for the
# config's 0 (dispatch.PLATFORM_DEFAULT). cpu: the value the blocked path was tuned with on XLA:CPU (the former
# single default). A step's working set is about 16 bytes per logit (scores, probabilities, masks in fp32), and a
# step of 2^24 logits is a fraction of a millisecond of an accelerator's work, where the loop's per-step cost
# dominates: cuda 2^27 (~2 GiB, a few % of an 80 GB H100), tpu 2^26 (~1 GiB of a v5e's 16 GiB); reasoned values,
# not yet measured on a GPU or TPU.
LOGIT_BUDGET = {"cpu": 1 << 24, "cuda": 1 << 27, "tpu": 1 << 26, "default": 1 << 24}

# 'auto' on every platform after the platform's own form (the CPU-tuned one on a CPU, the kernel on GPU and TPU
# where it serves the call); ``test_config`` makes it take several ``lax.map`` steps at test lengths
IMPLEMENTATIONS = (
    Implementation("xla", config={"impl": "xla"}, test_config={"logit_budget": 2000},
                   auto={p: 1 for p in ALL_PLATFORMS}, code=Xla, defaults={"logit_budget": LOGIT_BUDGET}),
)

__all__ = ["IMPLEMENTATIONS", "LOGIT_BUDGET", "Xla", "all_level_summaries", "attend", "combine", "fma_forward", "forward",
           "group_docs", "level_summaries", "linear_coarse_docs", "linear_coarse_full", "row_stats"]

"""Causal FMA's decoding / streaming state (docs/methods/fma.md §4, our extension; the paper has no KV cache),
shared by every implementation: the state after a full pass (:func:`state_from_forward`), the streamed step
(:func:`fma_stream`, run with the implementation's block function), and :class:`Blocked`, the runner every
implementation of the folder subclasses: a full pass with its forward, a call with a state with the streamed step
and its block function.

The state holds the last ``2m`` raw keys and values, and per level the partial conv sums of the open group
(``acc_*``) plus a ring of the last 4 finished group summaries (``ring_*``; query i in level group a reads
groups a-2 and, if a is odd, a-3, which are always finished). It is O(m d + p d L) -- it does not grow with the
context -- and a step costs O(m d + p d L). Streaming in any split equals the full pass.

Precision: the state is carried in at least float32 (the window's raw keys and values, the rings and the open
groups' conv sums); a step's products take the compute dtype (the inputs' dtype, bfloat16 as given, the state's
window and summaries cast down to it) and accumulate in float32, as the full pass does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention import dispatch
from longctx.attention.base import check_capacity
from longctx.attention.fma import packed
from longctx.attention.fma.coarse_stats import combine, row_stats
from longctx.attention.fma.options import RING, FMAOptions, acc_type, pad_to
from longctx.attention.fma.reference import bias_rows, summarize
from pallas_kernels.fma_blocks_ref import NEG, attend_blocks, packed_slots
from pallas_kernels.precision import acc_einsum, compute_dtype, statistic


def _unpacked(B: int, length):
    """The packed-row fields of a state of one sequence: document 0 (none), its length ``length`` tokens."""
    return {"segment": jnp.zeros((B,), jnp.int32), "doc_len": jnp.full((B,), length, jnp.int32)}


def empty_state(B, H, d, dv, opts: FMAOptions):
    """The state before any token. Besides the row's position ``pos`` it holds, for packed rows (§2.7), the id of
    the document it summarizes (``segment`` [B], 0: none) and that document's length so far (``doc_len`` [B]): a
    packed call continues the document from ``doc_len`` and starts every other one afresh."""
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    st = {
        "pos": jnp.zeros((), jnp.int32),
        **_unpacked(B, 0),
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


def token_contrib(x, tau, prm, ml: int, opts: FMAOptions):
    """Each token's additive contribution (no bias) to its group's summary: x [B,H,T,f], tau [T]
    (offset inside the group) -> [B,H,T,p,f] (at least float32: x and the weights cast to x's dtype are the
    operands, accumulated in float32). Summing these over a group gives summarize(...) - bias."""
    p = opts.p
    if opts.downsample == "avgpool":
        xa = x.astype(acc_type(x))
        oh = (jnp.arange(p)[None, :] == (tau * p // ml)[:, None]).astype(xa.dtype) * (p / ml)  # [T, p]
        return xa[:, :, :, None, :] * oh[None, None, :, :, None]
    W = prm["kernel"].astype(x.dtype)
    if opts.downsample == "depthwise_conv":
        if opts.shared:
            return acc_einsum("bhtf,tfr->bhtrf", x, jnp.take(W, tau, axis=0))
        return acc_einsum("bhtf,htfr->bhtrf", x, jnp.take(W, tau, axis=1))
    if opts.shared:
        return acc_einsum("bhte,tefr->bhtrf", x, jnp.take(W, tau, axis=0))
    return acc_einsum("bhte,htefr->bhtrf", x, jnp.take(W, tau, axis=1))


def _tail_state(x, prm, ml: int, n: int, opts: FMAOptions):
    """(ring, acc) of one level after n tokens of x [B,H,n,f] (static n)."""
    B, H, _, f = x.shape
    G = n // ml
    lo = max(0, G - RING)
    ring = (summarize(x[:, :, lo * ml:G * ml], prm, ml, opts) if G > lo
            else jnp.zeros((B, H, 0, opts.p, f), acc_type(x)))
    ring = jnp.pad(ring, ((0, 0), (0, 0), (RING - (G - lo), 0), (0, 0), (0, 0)))
    tail = pad_to(x[:, :, G * ml:n], ml) if n > G * ml else jnp.zeros((B, H, ml, f), x.dtype)
    acc = summarize(tail, prm, ml, opts, with_bias=False)[:, :, 0]
    return ring, acc


def state_from_forward(q, k, v, ds, opts: FMAOptions):
    """The state the streaming path would hold after the n tokens of a full pass (carried in at least float32;
    the summaries' products take the compute dtype, as the full pass's)."""
    B, H, n, d = k.shape
    cdt = compute_dtype(q, k, v)
    qf, kf, vf = (x.astype(cdt) for x in (q, k, v))
    m = opts.m

    def last(x):
        x = x[:, :, max(0, n - 2 * m):].astype(acc_type(x))
        return jnp.pad(x, ((0, 0), (0, 0), (2 * m - x.shape[2], 0), (0, 0)))

    st = {"pos": jnp.asarray(n, jnp.int32), "win_k": last(kf), "win_v": last(vf), **_unpacked(B, n)}
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
    with statistic("the groups' conv sums, carried in float32: a one-hot segment sum of the tokens' terms"):
        raw = jnp.einsum("bhtrf,te->bherf", token_contrib(x, abs_t % ml, prm, ml, opts), oh)
    raw = raw.at[:, :, RING].add(acc)
    done = raw[:, :, RING:]
    b = bias_rows(prm, opts)
    if b is not None:
        done = done + b
    E = jnp.concatenate([ring, done], axis=2)
    j = (pos + T) // ml - g_first
    new_ring = jax.lax.dynamic_slice_in_dim(E, j, RING, axis=2)
    new_acc = jax.lax.dynamic_index_in_dim(raw, j + RING, axis=2, keepdims=False)
    return E, new_ring, new_acc


def fma_stream(q, k, v, state, ds, opts: FMAOptions, drop_key=None, *, attend=attend_blocks):
    """Causal FMA over T new tokens at positions [pos, pos+T) given the prefix state (§4).

    1. per level, the groups finished by these tokens are summarised (accumulated conv sums + bias);
    2. the new queries, laid out in fine blocks aligned to absolute positions, attend to the window
       of raw keys (state + new) and to their partner summaries, by the block function ``attend`` (the
       implementation's, as in its full pass); 3. the window, rings, accumulators and pos advance."""
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
    cdt = compute_dtype(q, k, v)
    qf, kf, vf = (x.astype(cdt) for x in (q, k, v))
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
    # the window in the compute dtype (the state holds it in float32: the values as given, a bf16 one exactly)
    ext_k = jnp.concatenate([state["win_k"].astype(cdt), kf, jnp.zeros((B, H, nbs * m - T, d), cdt)], axis=2)
    ext_v = jnp.concatenate([state["win_v"].astype(cdt), vf, jnp.zeros((B, H, nbs * m - T, dv), cdt)], axis=2)
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
        kall = jnp.concatenate([x.reshape(B, H, -1, d) for x in E["k"]], axis=2).astype(cdt)
        vall = jnp.concatenate([x.reshape(B, H, -1, dv) for x in E["v"]], axis=2).astype(cdt)
        coarse = ("packed", kall, vall, idx, bias)
    elif L > 0:
        coarse = _linear_coarse_stream(qb, blocks, E, pos, drop_key, opts)
    out = attend(qb, kp, vp, coarse, q_block0=b0, n_valid=pos + T, causal=True, drop_key=drop_key,
                 attn_dropout=opts.attn_dropout, logit_budget=opts.logit_budget)
    out = jax.lax.dynamic_slice_in_dim(out.reshape(B, H, nbs * m, dv), r, T, axis=2)
    new_state["win_k"] = ext_k[:, :, T:T + 2 * m].astype(state["win_k"].dtype)
    new_state["win_v"] = ext_v[:, :, T:T + 2 * m].astype(state["win_v"].dtype)
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
        EK, EV, EQ = (E[nm][l - 1].astype(qb.dtype) for nm in ("k", "v", "q"))  # the compute dtype
        n_ext = EK.shape[2]
        a = i // ml
        qrow = jnp.clip((a - 1 - g_first + RING) * p + (i % ml) * p // ml, 0, n_ext * p - 1)
        qr = jnp.take(EQ.reshape(B, H, n_ext * p, d), qrow.reshape(-1), axis=2).reshape(B, H, nbs, m, d)
        # num_levels=1 reads "level-1" groups of its argument, so pass the level-l group index a itself
        idx, bias = packed_slots(blocks >> (l - 1), num_levels=1, m=m, p=p, causal=True, betas=[opts.beta(l)],
                                 offsets=[0], group_base=[g_first - RING], n_rows=n_ext * p, xp=jnp)
        kc = jnp.take(EK.reshape(B, H, n_ext * p, d), idx.reshape(-1), axis=2).reshape(B, H, nbs, -1, d)
        vc = jnp.take(EV.reshape(B, H, n_ext * p, -1), idx.reshape(-1), axis=2).reshape(B, H, nbs, idx.shape[1], -1)
        # compute-dtype operands, scores and statistics in at least float32, as the full pass
        s = acc_einsum("bhcid,bhcsd->bhcis", qr * scale, kc) + bias[:, None, :]
        key = None if drop_key is None else jax.random.fold_in(drop_key, 1000 + l)
        M, e, den = row_stats(s, (bias > NEG / 2)[:, None, :], vc, key, opts)
        num = acc_einsum("bhcis,bhcsf->bhcif", e.astype(vc.dtype), vc)
        acc = combine(acc, (M, num, den), opts)
    return acc


@dataclasses.dataclass(frozen=True)
class Blocked(dispatch.Runner):
    """An FMA implementation as it runs (``dispatch.Runner``): ``call.inputs`` holds ``q, k, v`` [B,H,T,d|dv],
    ``ds`` (the downsampling parameters, ``FMAAttention.ds_params``) and ``opts`` (the layer's
    :class:`~longctx.attention.fma.options.FMAOptions`); ``call.key`` is the attention dropout's key (None: no
    dropout). Without a state: the full pass, :meth:`forward`; with one (causal): :func:`fma_stream` with the
    implementation's block function, :meth:`attend`, and the new state. The options reach the code with this
    runner's ``logit_budget`` (the value for the platform the selection ran on). The layer's ``finish`` builds a
    full pass's state (:func:`state_from_forward`) and casts the output."""

    logit_budget: int  # max materialised scores per lax.map step of the block function

    def forward(self, call: dispatch.Call):
        """``forward(q, k, v, ds, opts, drop_key)``: the full pass."""
        raise NotImplementedError

    def attend(self, call: dispatch.Call):
        """The block function of the streamed steps (``pallas_kernels.fma_blocks_ref.attend_blocks``' signature)."""
        raise NotImplementedError

    def packed(self, call: dispatch.Call):
        """``full(q, k, v, ds, opts, segment_ids, drop_key)``: the full pass of a packed row (§2.7): the documents
        laid out again for :meth:`forward` (``packed.packed_forward``)."""
        return functools.partial(packed.packed_forward, self.forward(call))

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        opts = dataclasses.replace(x["opts"], logit_budget=int(self.logit_budget))
        seg = x.get("segment_ids")
        if seg is not None:  # a packed row (§2.7): each document as if alone, the state of the last one
            args = (x["q"], x["k"], x["v"])
            if call.state is None:
                return dispatch.Result(self.packed(call)(*args, x["ds"], opts, seg, call.key))
            stream = functools.partial(fma_stream, attend=self.attend(call))
            out, state = packed.packed_stream(stream, self.packed(call), *args, call.state, x["ds"], opts, seg,
                                              call.key)
            return dispatch.Result(out, state)
        if call.state is None:
            return dispatch.Result(self.forward(call)(x["q"], x["k"], x["v"], x["ds"], opts, call.key))
        out, state = fma_stream(x["q"], x["k"], x["v"], call.state, x["ds"], opts, call.key, attend=self.attend(call))
        state = {**state, "segment": call.state["segment"], "doc_len": call.state["doc_len"] + x["q"].shape[2]}
        return dispatch.Result(out, state)


__all__ = ["RING", "Blocked", "empty_state", "fma_stream", "state_from_forward", "token_contrib"]

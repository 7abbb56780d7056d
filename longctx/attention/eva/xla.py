"""EVA in XLA tiles (implementation ``xla``, portable: plain einsums under autodiff), and the tiled algorithm the
CPU-tuned implementation (its own file) shares by passing its ops (:class:`common.TileOps`).

A full pass (:func:`eva_forward`): Phase A over every chunk of the padded sequence, then Phase B per query tile
(the blocks of W queries; tile ``w``'s local candidates are positions ``[wW − e_l, (w+1)W + e_r)``), in
contiguous groups of tiles (:func:`tile_groups`: a causal group scores only the chunks its queries can see),
each tile rematerialised in the backward (``jax.checkpoint``) and mapped over in batches within the logit budget.
A stream (:func:`eva_stream`): the tokens after a carried state. Both call :func:`attend_tile` with explicit
absolute positions, so every mask and the relative-position bias are functions of positions only: what makes
"streamed in any split == one full pass" hold.

Precision (DESIGN.md §7): the tiles' products take the compute dtype (the inputs' dtype) with float32
accumulation (``pallas_kernels.precision.acc_einsum``: its backward casts the cotangents down, so the backward's
products take it too); the chunk summaries ``k̂``, ``β`` (float32 statistics of Phase A, and of the carried state)
are cast to it for Phase B and the weights are cast to it before their products with the values; the softmax and
its statistics are float32, and so is the carried state. Under float32 inputs every cast is the identity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention import dispatch
from longctx.attention.eva.common import (
    PLAIN,
    EVAOptions,
    TileOps,
    check_state_capacity,
    chunk_mask,
    chunk_noise,
    dropout_multipliers,
    dropout_seeds,
    geometry,
    local_mask,
    rpe_bias,
    run_pass,
    uses_fused,
    window_keys,
)
from longctx.attention.eva.packed import eva_packed
from longctx.attention.eva.tiles import joint_tile, map_tiles
from pallas_kernels.precision import compute_dtype


def attend_tile(q, q_pos, k, v, k_pos, k_valid, chunks, chunk_ids, chunk_valid, P, rpe_table, seeds,
                opts: EVAOptions, scale: float, ops: TileOps = PLAIN):
    """Outputs [B,H,Tq,dv] of a tile of queries at absolute positions q_pos [Tq].

    Local candidates k, v [B,H,Tk,*] at positions k_pos [Tk] (k_valid: real key);
    chunks = (k̂ [B,H,C,d], β [B,H,C,dv], k_raw, k_raw_valid) with absolute ids chunk_ids [C].
    One max-subtracted softmax over [local ; chunk] logits (eq. 16 in log-sum-exp form); ``seeds``: the rows'
    dropout seeds [B, H] (common.dropout_seeds) or None. Products in q's dtype (module docstring): k, v, k̂, β are
    cast to it, the weights too before their products; the result is float32."""
    k_hat, beta, k_raw, k_raw_valid = chunks
    cd = q.dtype
    k, v, k_hat, beta = (x.astype(cd) for x in (k, v, k_hat, beta))
    lmask = local_mask(q_pos, k_pos, k_valid, opts)
    cmask = chunk_mask(q_pos, chunk_ids, chunk_valid, P, opts)
    bias = rpe_bias(rpe_table, q_pos, k_pos, opts, scale) if opts.use_rpe and rpe_table is not None else None
    if ops.fused_tile is not None and uses_fused(seeds, opts):
        return ops.fused_tile(q, q_pos, k, v, k_hat, beta, bias, lmask, cmask, chunk_ids, chunk_valid, P, opts, scale)
    drop = None
    if seeds is not None and opts.attn_dropout > 0.0:
        drop = dropout_multipliers(seeds, opts.attn_dropout, q_pos, k_pos, chunk_ids)
    return joint_tile(q, k, v, (k_hat, beta, k_raw, k_raw_valid), lmask, cmask, bias, drop, opts, scale, ops)


def gather_tiles(x, idx):
    """x [B,H,L,d], idx [N, K] (clipped) -> [B,H,N,K,d]."""
    return jnp.take(x, idx.reshape(-1), axis=2).reshape(x.shape[:2] + idx.shape + x.shape[3:])


CHUNK_ALIGN = 16


def _aligned(nc: int, C: int) -> int:
    return nc if nc < 4 * CHUNK_ALIGN else min(C, -(-nc // CHUNK_ALIGN) * CHUNK_ALIGN)


def tile_groups(n_tiles: int, tile: int, P: int, C: int, causal: bool, groups: int = 8):
    """Causal skip: [(first tile, end tile, chunks passed)] for up to ``groups`` contiguous groups of query
    tiles. A causal query at n sees chunks c < n // P only, so a group whose last query is n_max is given
    chunks 0..(n_max // P) - 1 and the chunks hidden from all of its queries are never scored (about
    (G+1)/(2G) of the chunk work for G groups). The chunks dropped are exactly ones the mask would
    zero, so the result is unchanged. Bidirectional: one group with all C chunks.

    A count of 64 or more is rounded up to a multiple of :data:`CHUNK_ALIGN` (at most C; the chunks added are
    masked): the causal counts are one short of a round number (1023 at 8k), and the trace showed the ops over
    1023-wide logits slower than over 1024-wide ones (a small end-to-end gain at long lengths, none at short
    ones, in an alternating A/B of ``longctx-bench``)."""
    if not causal:
        return [(0, n_tiles, C)]
    g = max(1, min(groups, n_tiles))
    bounds = [round(i * n_tiles / g) for i in range(g + 1)]
    return [(lo, hi, _aligned(max(1, min(C, (hi * tile - 1) // P)), C))
            for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                num_chunks: int, ops: TileOps = PLAIN, stats_fn=None):
    """Full pass over L tokens (no prefix). q,k [B,H,L,d], v [B,H,L,dv] -> (out [B,H,L,dv], extras).

    Query tiles are the blocks of W tokens; tile w's local candidates are positions
    [wW − e_l, (w+1)W + e_r) (out-of-range masked). Phase A over all C chunks of the padded
    sequence: ``stats_fn`` (a kernel, same signature as ``chunk_summaries``) or ``ops``'s. ``ops``: the
    implementation's few ops (common.TileOps); its ``fused_groups`` (if any) runs each group of tiles of the
    representative-logit estimator without dropout."""
    B, H, L, d = q.shape
    seeds = dropout_seeds(drop_key, opts, B, H)
    dv = v.shape[-1]
    scale = d**-0.5
    L_pad, P, C, tile = geometry(opts, L, chunk_size, num_chunks)
    pad = ((0, 0), (0, 0), (0, L_pad - L), (0, 0))
    cd = compute_dtype(q, k, v)  # the products' operands (module docstring)
    qf, kf, vf = (jnp.pad(x.astype(cd), pad) for x in (q, k, v))
    valid = np.arange(L_pad) < L  # static: a constant of the program, not a reduce computed at run time
    # Phase A
    k_valid_ch = jnp.asarray(valid.reshape(C, P))
    q_ch, k_ch, v_ch = (x.reshape(B, H, C, P, x.shape[-1]) for x in (qf, kf, vf))
    # the noise joins ω in the compute dtype (pallas_kernels/eva_chunks_ref.py): cast where drawn
    noise = None if noise_key is None else ops.noise(chunk_noise(noise_key, jnp.arange(C), B, H, d).astype(cd))
    k_hat, beta = ops.summaries(stats_fn)(q_ch, k_ch, v_ch, k_valid_ch, params, noise, opts, scale)
    exact = opts.chunk_logit == "exact_lse"
    k_hat_c, beta_c = k_hat.astype(cd), beta.astype(cd)  # Phase B's operands; the extras keep the statistics
    chunks = (k_hat_c, beta_c, k_ch if exact else None, k_valid_ch[None, None] if exact else None)
    extras = {"k_hat": k_hat, "beta": beta, "L_pad": L_pad, "P": P, "C": C, "padded": (qf, kf, vf)}
    chunk_ids = jnp.arange(C)
    chunk_valid = np.any(valid.reshape(C, P), axis=-1)  # [ours] all-padding chunks masked (bidirectional)
    # Phase B over query tiles
    n_tiles = L_pad // tile
    q_pos = jnp.arange(L_pad).reshape(n_tiles, tile)
    Tk = window_keys(opts, tile)
    k_pos = jnp.arange(n_tiles)[:, None] * tile - opts.e_l + jnp.arange(Tk)[None, :]
    k_val = (k_pos >= 0) & (k_pos < L)
    idx = jnp.clip(k_pos, 0, L_pad - 1)
    # tiles stay [B,H,n_tiles,tile,d] (a reshape of q): moving the tile axis to the front and back again for every
    # group made XLA read the projections through chains of slow, strided transposes
    q_t = qf.reshape(B, H, n_tiles, tile, d)
    if Tk == tile:  # no overlap: the tiles' keys are the query tiles' own (a reshape; a gather's gradient scatters)
        k_t, v_t = kf.reshape(B, H, n_tiles, tile, d), vf.reshape(B, H, n_tiles, tile, dv)
    else:
        k_t, v_t = gather_tiles(kf, idx), gather_tiles(vf, idx)

    xs = (q_t, q_pos, k_t, v_t, k_pos, k_val)
    axes = (2, 0, 2, 2, 0, 0)  # each operand's tile axis
    # 8 tile groups up to 64 tiles, then groups of 8 tiles (at most 32 groups): fewer chunks scored at long
    # lengths for more, smaller calls (a small gain over 8 groups at 16k and 32k)
    groups = tile_groups(n_tiles, tile, P, C, opts.causal, min(32, max(8, n_tiles // 8)))
    run_group = None
    if ops.fused_groups is not None and uses_fused(seeds, opts):
        run_group = ops.fused_groups(dict(B=B, H=H, tile=tile, Tk=Tk, P=P, k_hat=k_hat_c, beta=beta_c,
                                          chunk_ids=chunk_ids, chunk_valid=chunk_valid, rpe_table=rpe_table,
                                          opts=opts, scale=scale, axes=axes, groups=groups))
    # one split per operand (its gradient is one concatenate; slicing each group out of the whole would pad every
    # group's gradient to full length and sum them: many large copies per layer step)
    sizes = [hi - lo for lo, hi, _ in groups]
    parts = [[None] * len(groups) if x is None else jax.lax.split(x, sizes, axis=ax) for x, ax in zip(xs, axes)]
    outs = []
    for g, (lo, hi, nc) in enumerate(groups):
        cost = B * H * tile * (Tk + nc * (P if exact else 1))
        group = tuple(p[g] for p in parts)
        if run_group is not None:
            outs.append(run_group(group, lo, hi, nc, cost))
            continue

        # autodiff, rematerialised: the backward recomputes a tile's logits instead of keeping every tile's
        # [tile, local + chunks] scores alive (at 32k this cut XLA's memory by about two thirds, and the step got
        # faster too)
        @jax.checkpoint
        def one(qt, qp, kt, vt, kp, kv, nc=nc):
            ch = tuple(None if x is None else x[:, :, :nc] for x in chunks)
            return attend_tile(qt, qp, kt, vt, kp, kv, ch, chunk_ids[:nc], chunk_valid[:nc], P, rpe_table, seeds,
                               opts, scale, ops)

        lead = tuple(x if x is None or ax == 0 else jnp.moveaxis(x, ax, 0) for x, ax in zip(group, axes))
        outs.append(jnp.moveaxis(map_tiles(one, lead, hi - lo, cost, opts.logit_budget), 0, 2))
    out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]  # [B,H,n_tiles,tile,dv]
    out = out.reshape(B, H, L_pad, dv)[:, :, :L]
    return out, extras


def eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, P: int,
               ops: TileOps = PLAIN, stats_fn=None):
    """Causal EVA over T new tokens at positions [pos, pos+T) given the prefix state.

    1. Chunks completed by these tokens are summarized (Phase A, same formulas and noise
       rule as the full pass) and stored at their absolute index;
    2. queries attend to the updated chunk memory (visibility c < ⌊n/P⌋ keeps the own and
       later chunks hidden) and to local candidates = the last R prefix tokens + new tokens;
    3. the ring, current-chunk buffer and pos advance."""
    B, H, T, d = q.shape
    dv = v.shape[-1]
    scale = d**-0.5
    R = state["win_k"].shape[2]
    C_max = state["mem_khat"].shape[2]
    exact = opts.chunk_logit == "exact_lse"
    pos = state["pos"]
    check_state_capacity(pos, T, P, C_max)
    cd = compute_dtype(q, k, v)  # the products' operands; the state stays float32 (module docstring)
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    # -- 1. finish chunks -------------------------------------------------------------
    c0, r = pos // P, pos % P
    n_ext = -(-(P + T) // P)
    ext = []
    for cur, new in ((state["cur_q"], qf), (state["cur_k"], kf), (state["cur_v"], vf)):
        buf = jnp.zeros((B, H, n_ext * P, new.shape[-1]), jnp.float32).at[:, :, :P].set(cur)
        ext.append(jax.lax.dynamic_update_slice(buf, new, (0, 0, r, 0)))
    n_have = r + T  # ext slot j <-> position c0*P + j, valid for j < n_have
    ext_valid = (jnp.arange(n_ext * P) < n_have).reshape(n_ext, P)
    ext_ids = c0 + jnp.arange(n_ext)
    # Phase A in the compute dtype, as a full pass (the buffers hold values of that dtype: the cast is exact)
    q_ch, k_ch, v_ch = (x.reshape(B, H, n_ext, P, x.shape[-1]).astype(cd) for x in ext)
    noise = None if noise_key is None else ops.noise(chunk_noise(noise_key, ext_ids, B, H, d).astype(cd))
    k_hat, beta = ops.summaries(stats_fn)(q_ch, k_ch, v_ch, ext_valid, params, noise, opts, scale)
    complete = (jnp.arange(n_ext) + 1) * P <= n_have
    slot = jnp.where(complete, ext_ids, C_max)  # out of range -> dropped
    mem_khat = state["mem_khat"].at[:, :, slot].set(k_hat, mode="drop")
    mem_beta = state["mem_beta"].at[:, :, slot].set(beta, mode="drop")
    new_state = {"mem_khat": mem_khat, "mem_beta": mem_beta}
    if exact:
        new_state["mem_kraw"] = state["mem_kraw"].at[:, :, slot].set(k_ch.astype(jnp.float32), mode="drop")
    off = (n_have // P) * P
    for name, x in zip(("cur_q", "cur_k", "cur_v"), ext):
        new_state[name] = jax.lax.dynamic_slice_in_dim(x, off, P, axis=2)
    # -- 2. attend --------------------------------------------------------------------
    tile = min(T, opts.W if opts.W > 0 else P)
    n_tiles = -(-T // tile)
    k_cat = jnp.concatenate([state["win_k"], kf], axis=2)
    v_cat = jnp.concatenate([state["win_v"], vf], axis=2)
    tail = n_tiles * tile - T
    k_ext = jnp.pad(k_cat, ((0, 0), (0, 0), (0, tail), (0, 0)))
    v_ext = jnp.pad(v_cat, ((0, 0), (0, 0), (0, tail), (0, 0)))
    j = jnp.arange(tile + R)
    kidx = jnp.arange(n_tiles)[:, None] * tile + j[None, :]  # [n_tiles, tile+R] into k_ext
    k_pos = pos - R + kidx
    k_val = (k_pos >= 0) & (kidx < R + T)
    q_pos = pos + jnp.arange(n_tiles * tile).reshape(n_tiles, tile)
    q_t = jnp.moveaxis(jnp.pad(qf, ((0, 0), (0, 0), (0, tail), (0, 0))).reshape(B, H, n_tiles, tile, d), 2, 0)
    k_t, v_t = (jnp.moveaxis(gather_tiles(x, kidx), 2, 0) for x in (k_ext, v_ext))  # [n_tiles,B,H,tile+R,.]
    q_t, k_t, v_t = (x.astype(cd) for x in (q_t, k_t, v_t))  # exact: values of the compute dtype
    kraw = new_state.get("mem_kraw")
    chunks = (mem_khat, mem_beta, kraw, jnp.ones((1, 1, C_max, P), bool) if exact else None)
    chunk_ids = jnp.arange(C_max)
    chunk_valid = jnp.ones((C_max,), bool)

    seeds = dropout_seeds(drop_key, opts, B, H)

    def one(qt, qp, kt, vt, kp, kv):
        return attend_tile(qt, qp, kt, vt, kp, kv, chunks, chunk_ids, chunk_valid, P, rpe_table, seeds, opts, scale,
                           ops)

    cost = B * H * tile * (tile + R + C_max * (P if exact else 1))
    out = map_tiles(one, (q_t, q_pos, k_t, v_t, k_pos, k_val), n_tiles, cost, opts.logit_budget)
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, n_tiles * tile, dv)[:, :, :T]
    # -- 3. advance ---------------------------------------------------------------------
    new_state["win_k"] = k_cat[:, :, T:T + R]
    new_state["win_v"] = v_cat[:, :, T:T + R]
    new_state["pos"] = pos + T
    new_state["segment"] = state["segment"]  # no segment ids: the tokens continue the one sequence
    new_state["doc_len"] = jnp.broadcast_to(pos + T, (B,))
    return out, new_state


# logit_budget (max materialized logits per lax.map step) by platform. XLA:CPU: measured (the returns shrink past
# 2^22, and 2^26 pays off only at 32k and beyond). GPU / TPU: not yet measured on a GPU or TPU; an accelerator runs
# larger calls better and has far more memory than the CPU budget assumes: 2^28 fp32 logits (1 GiB per step, and
# as much for their gradient) on a GPU's 80 GB, 2^27 on a TPU core's 16-32 GB
LOGIT_BUDGET = {"cpu": 1 << 25, "cuda": 1 << 28, "rocm": 1 << 28, "tpu": 1 << 27}



@dataclasses.dataclass(frozen=True)
class Tiles(dispatch.Runner):
    """``xla``: :func:`eva_forward` from a row's start, :func:`eva_stream` after a carried state."""

    logit_budget: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        return run_pass(self, core, call, eva_forward, eva_stream, eva_packed)


# 'auto' on a GPU / TPU after the kernels (where they do not serve); on a CPU the CPU-tuned tiles run instead
IMPLEMENTATIONS = (
    dispatch.Implementation("xla", config={"impl": "xla"}, auto={"cuda": 1, "rocm": 1, "tpu": 1},
                            code=Tiles, defaults={"logit_budget": LOGIT_BUDGET}),
)

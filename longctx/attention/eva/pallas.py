"""EVA through its Pallas kernels (implementation ``pallas``): Phase A by ``pallas_kernels/eva_chunks.py`` and
Phase B of a full pass by ``pallas_kernels/eva_attend.py``, attention dropout included (the kernel draws the hash
mask of ``common.dropout_seeds``, the same as the XLA tiles; docs/methods/eva.md §8.3); a stream attends in the
XLA tiles.

Under a train step's mesh (``longctx.attention.row_split.active_mesh``) the kernels are calls XLA's partitioner
cannot split, so a full pass runs both per shard: one ``shard_map`` with the rows over the batch axes and the
heads over ``tensor`` (the sequence axis whole), the chunk parameters replicated, the relative-position bias split
by heads where it has one per head, the chunk noise and the dropout row seeds drawn for the whole batch first (the
same draws as one device); a stream's Phase A runs per shard the same way.

Precision (DESIGN.md §7): q, k, v enter both kernels in the compute dtype (the inputs'); Phase A casts its float32
parameters and noise to it and returns float32 statistics ``k̂``, ``β``, which are cast to it for Phase B with the
relative-position bias; Phase B returns ``o`` in it. Under float32 inputs every cast is the identity."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from longctx.attention import dispatch, row_split
from longctx.attention.eva import xla
from longctx.attention.eva.common import (
    EVAOptions,
    chunk_noise,
    dropout_seeds,
    geometry,
    local_bias_tiles,
    run_pass,
    segments_reasons,
)
from pallas_kernels import eva_attend, eva_chunks
from pallas_kernels.precision import compute_dtype


def unsupported_reasons(platform: str, *, P: int, d: int, dv: int, W: int, C: int, e_l: int, e_r: int,
                        chunk_logit: str, full: bool, dropout: bool = False, segments: bool = False, **_) -> list[str]:
    """Why the kernels cannot serve a call: Phase A's limits, and Phase B's for a full pass (``full``; ``dropout``:
    with attention dropout); a packed row (``segments``)."""
    out = segments_reasons(platform, segments=segments)
    out += [f"eva_chunk_stats: {r}" for r in eva_chunks.unsupported_reasons(platform, P=P, d=d, dv=dv)]
    if full:
        out += [f"eva_attend: {r}" for r in eva_attend.unsupported_reasons(
            platform, W=W, d=d, dv=dv, C=C, e_l=e_l, e_r=e_r, chunk_logit=chunk_logit, dropout=dropout)]
    return out


def _stats_fn(interpret: bool, platform: str):
    """Phase A by the kernel, per shard of the batch and heads under a mesh (module docstring)."""
    inner = eva_chunks.make_stats_fn(interpret=interpret, platform=platform)

    def stats_fn(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale):
        mesh = row_split.active_mesh(q_ch, k_ch, v_ch)
        bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *q_ch.shape[:2])
        if bspec is None and hspec is None:
            return inner(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale)
        bh = PartitionSpec(bspec, hspec)
        specs = (bh, bh, bh, PartitionSpec(), jax.tree.map(lambda _: PartitionSpec(), params),
                 None if noise is None else bh)
        local = lambda q, k, v, ok, p, n: inner(q, k, v, ok, p, n, opts, scale)  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(bh, bh), check_vma=False)(
            q_ch, k_ch, v_ch, k_valid, params, noise)

    return stats_fn


def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                num_chunks: int, interpret: bool, platform: str, query_tile: int = eva_attend.PLAN,
                key_tile: int = eva_attend.PLAN, chunk_tile: int = eva_attend.PLAN, num_warps: int = eva_attend.PLAN):
    """Full pass: (out [B,H,L,dv], extras), as ``xla.eva_forward``. ``query_tile``, ``key_tile``, ``chunk_tile``,
    ``num_warps``: Phase B's tiles and GPU warps (execution settings; ``eva_attend.PLAN``: the kernel's plan)."""
    stats_fn = _stats_fn(interpret, platform)
    B, H, L, d = q.shape
    dv = v.shape[-1]
    scale = d**-0.5
    L_pad, P, C, _ = geometry(opts, L, chunk_size, num_chunks)
    pad = ((0, 0), (0, 0), (0, L_pad - L), (0, 0))
    cd = compute_dtype(q, k, v)
    qf, kf, vf = (jnp.pad(x.astype(cd), pad) for x in (q, k, v))
    valid = jnp.asarray((np.arange(L_pad) < L).reshape(C, P))
    noise = None if noise_key is None else chunk_noise(noise_key, jnp.arange(C), B, H, d)
    bias = local_bias_tiles(rpe_table, opts, scale) if opts.use_rpe and rpe_table is not None else None
    bias = None if bias is None else bias.astype(cd)  # a kernel operand: the compute dtype (eva_attend)
    seeds = dropout_seeds(drop_key, opts, B, H)  # [B, H]: row b·H + h of the whole batch, sharded like the rows
    attend = functools.partial(eva_attend.eva_attend, interpret=interpret, platform=None if interpret else platform,
                               dropout_rate=opts.attn_dropout if seeds is not None else 0.0,
                               **{name: None if x <= 0 else x for name, x in (
                                   ("query_tile", query_tile), ("key_tile", key_tile), ("chunk_tile", chunk_tile),
                                   ("num_warps", num_warps))})

    def kernels(qf, kf, vf, params, noise, bias, seeds):
        b, h = qf.shape[:2]
        q_ch, k_ch, v_ch = (x.reshape(b, h, C, P, x.shape[-1]) for x in (qf, kf, vf))
        k_hat, beta = stats_fn(q_ch, k_ch, v_ch, valid, params, noise, opts, scale)
        flat = lambda x: x.reshape((b * h,) + x.shape[2:])  # noqa: E731
        o, _ = attend(flat(qf * scale), flat(kf), flat(vf), flat(k_hat.astype(cd)), flat(beta.astype(cd)), bias,
                      W=opts.W, e_l=opts.e_l, e_r=opts.e_r, P=P, L=L, causal=opts.causal,
                      disjoint=opts.partition == "disjoint", heads=h, seeds=None if seeds is None else seeds.reshape(b * h))
        return o.reshape(b, h, L_pad, dv), k_hat, beta

    mesh = row_split.active_mesh(qf, kf, vf)
    bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, B, H)
    if bspec is None and hspec is None:
        o, k_hat, beta = kernels(qf, kf, vf, params, noise, bias, seeds)
    else:
        bh = PartitionSpec(bspec, hspec)
        per_head = bias is not None and bias.shape[0] == H > 1  # else one table shared by the heads
        specs = (bh, bh, bh, jax.tree.map(lambda _: PartitionSpec(), params), None if noise is None else bh,
                 None if bias is None else PartitionSpec(hspec if per_head else None), None if seeds is None else bh)
        o, k_hat, beta = jax.shard_map(kernels, mesh=mesh, in_specs=specs, out_specs=(bh, bh, bh),
                                       check_vma=False)(qf, kf, vf, params, noise, bias, seeds)
    extras = {"k_hat": k_hat, "beta": beta, "L_pad": L_pad, "P": P, "C": C, "padded": (qf, kf, vf)}
    return o[:, :, :L], extras


def eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, P: int,
               interpret: bool, platform: str, **tiles):
    """Tokens after a carried state: Phase A of the chunks they finish by the kernel, the rest in XLA tiles (Phase B's
    ``tiles`` unused)."""
    return xla.eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts, P=P,
                          stats_fn=_stats_fn(interpret, platform))


# Phase B's tiles and GPU warps as execution settings (eva_attend.eva_attend's overrides; a sweep writes them)
TILE_KEYS = ("query_tile", "key_tile", "chunk_tile", "num_warps")


@dataclasses.dataclass(frozen=True)
class Kernels(dispatch.Runner):
    """``pallas``: :func:`eva_forward` from a row's start, :func:`eva_stream` after a carried state, both lowered for
    the call's platform (interpret mode on a CPU); the tiles' logit budget serves a stream's XLA tiles."""

    logit_budget: int
    query_tile: int
    key_tile: int
    chunk_tile: int
    num_warps: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        tiles = {key: getattr(self, key) for key in TILE_KEYS}
        return run_pass(self, core, call, eva_forward, eva_stream, interpret=call.interpret, platform=call.platform,
                        **tiles)


# 'auto' tries the kernels first on a GPU / TPU (where they serve; rocm has no lowering, so the portable tiles
# follow), never on a CPU (interpret mode only when named)
IMPLEMENTATIONS = (
    dispatch.Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=unsupported_reasons,
                            config={"impl": "pallas"}, auto={"cuda": 0, "rocm": 0, "tpu": 0},
                            code=Kernels,
                            # a stream attends in the XLA tiles: their logit budget ('cpu': interpret mode); Phase B's
                            # tiles and warps take the kernel's plan on every platform unless written
                            defaults={"logit_budget": xla.LOGIT_BUDGET,
                                      **{key: {"default": eva_attend.PLAN} for key in TILE_KEYS}}),
)

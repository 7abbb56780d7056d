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
from longctx.attention.eva import packed, xla
from longctx.attention.eva.common import (
    EVAOptions,
    chunk_noise,
    dropout_seeds,
    geometry,
    local_bias_tiles,
    run_pass,
)
from pallas_kernels import eva_attend, eva_chunks
from pallas_kernels.precision import compute_dtype


def unsupported_reasons(platform: str, *, P: int, d: int, dv: int, W: int, C: int, e_l: int, e_r: int,
                        chunk_logit: str, full: bool, dropout: bool = False, segments: bool = False, **_) -> list[str]:
    """Why the kernels cannot serve a call: Phase A's limits, and Phase B's for a full pass (``full``; ``dropout``:
    with attention dropout) or a packed row (``segments``: the kernels run its layout, from a carried state too;
    ``C``: the layout's chunk count)."""
    out = [f"eva_chunk_stats: {r}" for r in eva_chunks.unsupported_reasons(platform, P=P, d=d, dv=dv)]
    if full or segments:
        out += [f"eva_attend: {r}" for r in eva_attend.unsupported_reasons(
            platform, W=W, d=d, dv=dv, C=C, e_l=e_l, e_r=e_r, chunk_logit=chunk_logit, dropout=dropout)]
    return out


def _stats_fn(interpret: bool, platform: str, make=None):
    """Phase A by the kernel, per shard of the batch and heads under a mesh (module docstring). ``make``:
    ``(interpret, platform) -> stats_fn`` of another Phase A kernel of ``eva_chunk_stats``'s contract (default: the
    Triton kernel's ``eva_chunks.make_stats_fn``)."""
    inner = (make or (lambda i, p: eva_chunks.make_stats_fn(interpret=i, platform=p)))(interpret, platform)

    def stats_fn(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale):
        mesh = row_split.active_mesh(q_ch, k_ch, v_ch)
        bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *q_ch.shape[:2])
        if bspec is None and hspec is None:
            return inner(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale)
        bh = PartitionSpec(bspec, hspec)
        ok = PartitionSpec(bspec) if k_valid.ndim > 2 else PartitionSpec()  # a packed row's: per batch row
        specs = (bh, bh, bh, ok, jax.tree.map(lambda _: PartitionSpec(), params),
                 None if noise is None else bh)
        local = lambda q, k, v, ok, p, n: inner(q, k, v, ok, p, n, opts, scale)  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(bh, bh), check_vma=False)(
            q_ch, k_ch, v_ch, k_valid, params, noise)

    return stats_fn


def _attend_fn(opts: EVAOptions, seeds, interpret: bool, platform: str, query_tile: int, key_tile: int,
               chunk_tile: int, num_warps: int, kernel=None):
    """Phase B's ``kernel`` (None: ``eva_attend.eva_attend``, looked up when called; or a kernel of its contract,
    e.g. the Mosaic GPU kernels' ``eva_attend_mgpu``, which reads neither the platform nor the tiles) with the
    call's platform, dropout rate and Phase B's tiles and warps bound."""
    return functools.partial(kernel or eva_attend.eva_attend, interpret=interpret, platform=None if interpret else platform,
                             dropout_rate=opts.attn_dropout if seeds is not None else 0.0,
                             **{name: None if x <= 0 else x for name, x in (
                                 ("query_tile", query_tile), ("key_tile", key_tile), ("chunk_tile", chunk_tile),
                                 ("num_warps", num_warps))})


def _per_shard(fn, args, specs, out_specs, B: int, H: int):
    """``fn(*args)``, per shard of the rows (batch axes) and heads (``tensor``) under a train step's mesh (module
    docstring); ``specs(bh, bspec, hspec)`` and ``out_specs(bh)``: the operands' and results' partition specs."""
    mesh = row_split.active_mesh(*args[:3])
    bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, B, H)
    if bspec is None and hspec is None:
        return fn(*args)
    bh = PartitionSpec(bspec, hspec)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs(bh, bspec, hspec), out_specs=out_specs(bh),
                         check_vma=False)(*args)


def _bias_spec(bias, H: int, hspec):
    """The relative-position bias tiles' partition: split by heads where it has one per head."""
    if bias is None:
        return None
    return PartitionSpec(hspec if bias.shape[0] == H > 1 else None)


def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int,
                num_chunks: int, interpret: bool, platform: str, query_tile: int = eva_attend.PLAN,
                key_tile: int = eva_attend.PLAN, chunk_tile: int = eva_attend.PLAN, num_warps: int = eva_attend.PLAN,
                kernel=None, stats=None):
    """Full pass: (out [B,H,L,dv], extras), as ``xla.eva_forward``. ``query_tile``, ``key_tile``, ``chunk_tile``,
    ``num_warps``: Phase B's tiles and GPU warps (execution settings; ``eva_attend.PLAN``: the kernel's plan);
    ``kernel``: Phase B's kernel (:func:`_attend_fn`); ``stats``: Phase A's (:func:`_stats_fn`'s ``make``)."""
    stats_fn = _stats_fn(interpret, platform, stats)
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
    attend = _attend_fn(opts, seeds, interpret, platform, query_tile, key_tile, chunk_tile, num_warps, kernel)

    def kernels(qf, kf, vf, params, noise, bias, seeds):
        b, h = qf.shape[:2]
        q_ch, k_ch, v_ch = (x.reshape(b, h, C, P, x.shape[-1]) for x in (qf, kf, vf))
        k_hat, beta = stats_fn(q_ch, k_ch, v_ch, valid, params, noise, opts, scale)
        flat = lambda x: x.reshape((b * h,) + x.shape[2:])  # noqa: E731
        o, _ = attend(flat(qf * scale), flat(kf), flat(vf), flat(k_hat.astype(cd)), flat(beta.astype(cd)), bias,
                      W=opts.W, e_l=opts.e_l, e_r=opts.e_r, P=P, L=L, causal=opts.causal,
                      disjoint=opts.partition == "disjoint", heads=h, seeds=None if seeds is None else seeds.reshape(b * h))
        return o.reshape(b, h, L_pad, dv), k_hat, beta

    specs = lambda bh, bspec, hspec: (bh, bh, bh, jax.tree.map(lambda _: PartitionSpec(), params),  # noqa: E731
                                      None if noise is None else bh, _bias_spec(bias, H, hspec),
                                      None if seeds is None else bh)
    o, k_hat, beta = _per_shard(kernels, (qf, kf, vf, params, noise, bias, seeds), specs,
                                lambda bh: (bh, bh, bh), B, H)
    extras = {"k_hat": k_hat, "beta": beta, "L_pad": L_pad, "P": P, "C": C, "padded": (qf, kf, vf)}
    return o[:, :, :L], extras


def eva_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, chunk_size: int, segment_ids,
               state=None, interpret: bool, platform: str, query_tile: int = eva_attend.PLAN,
               key_tile: int = eva_attend.PLAN, chunk_tile: int = eva_attend.PLAN, num_warps: int = eva_attend.PLAN,
               kernel=None, stats=None):
    """A packed row (from a carried state too) on the layout of ``packed.py`` (the documents laid out again on the
    window grid), Phase A and Phase B by the kernels: Phase A over the layout's chunks with each row's chunk
    members, Phase B (``kernel``, :func:`_attend_fn`) over the whole layout with each position's and chunk's
    document and own index (``eva_attend``'s ``segments``); ``stats``: Phase A's kernel (:func:`_stats_fn`'s
    ``make``); the layout and the state as the tiles'. Returns
    ``packed.eva_packed``'s."""
    P = chunk_size
    scale = q.shape[-1] ** -0.5
    bias = local_bias_tiles(rpe_table, opts, scale) if opts.use_rpe and rpe_table is not None else None
    bias = None if bias is None else bias.astype(compute_dtype(q, k, v))

    def attend(q_l, k_l, v_l, k_hat, beta, segments, base, seeds):
        B, H, Lp, dv = v_l.shape
        run = _attend_fn(opts, seeds, interpret, platform, query_tile, key_tile, chunk_tile, num_warps, kernel)

        def shard(q_l, k_l, v_l, k_hat, beta, bias, seeds, segments):
            b, h = q_l.shape[:2]
            flat = lambda x: x.reshape((b * h,) + x.shape[2:])  # noqa: E731
            o, _ = run(flat(q_l * scale), flat(k_l), flat(v_l), flat(k_hat), flat(beta), bias, W=opts.W,
                       e_l=opts.e_l, e_r=opts.e_r, P=P, L=Lp, causal=opts.causal,
                       disjoint=opts.partition == "disjoint", heads=h,
                       seeds=None if seeds is None else seeds.reshape(b * h), segments=segments, chunk_base=base)
            return o.reshape(b, h, Lp, dv)

        specs = lambda bh, bspec, hspec: (bh,) * 5 + (  # noqa: E731
            _bias_spec(bias, H, hspec), None if seeds is None else bh, (PartitionSpec(bspec),) * len(segments))
        return _per_shard(shard, (q_l, k_l, v_l, k_hat, beta, bias, seeds, segments), specs, lambda bh: bh, B, H)

    return packed.eva_packed(q, k, v, params, rpe_table, noise_key, drop_key, opts, chunk_size=P,
                             segment_ids=segment_ids, state=state, stats_fn=_stats_fn(interpret, platform, stats),
                             attend=attend)


def eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts: EVAOptions, *, P: int,
               interpret: bool, platform: str, stats=None, **tiles):
    """Tokens after a carried state: Phase A of the chunks they finish by the kernel (``stats``: :func:`_stats_fn`'s
    ``make``), the rest in XLA tiles (Phase B's ``tiles`` unused)."""
    return xla.eva_stream(q, k, v, state, params, rpe_table, noise_key, drop_key, opts, P=P,
                          stats_fn=_stats_fn(interpret, platform, stats))


# Phase B's tiles and GPU warps as execution settings (eva_attend.eva_attend's overrides; a sweep writes them)
TILE_KEYS = ("query_tile", "key_tile", "chunk_tile", "num_warps")


@dataclasses.dataclass(frozen=True)
class Kernels(dispatch.Runner):
    """``pallas``: :func:`eva_forward` from a row's start, :func:`eva_stream` after a carried state, :func:`eva_packed`
    for a packed row, all lowered for the call's platform (interpret mode on a CPU); the tiles' logit budget serves a
    stream's XLA tiles."""

    logit_budget: int
    query_tile: int
    key_tile: int
    chunk_tile: int
    num_warps: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        tiles = {key: getattr(self, key) for key in TILE_KEYS}
        kernel = dict(interpret=call.interpret, platform=call.platform, **tiles)
        return run_pass(self, core, call, eva_forward, eva_stream, functools.partial(eva_packed, **kernel), **kernel)


# 'auto' tries the kernels first on a GPU / TPU (where they serve; rocm has no lowering, so the portable tiles
# follow), never on a CPU (interpret mode only when named), nor on Hopper (mosaic_gpu.py's kernels there: JAX
# deprecated the Triton backend)
IMPLEMENTATIONS = (
    dispatch.Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=unsupported_reasons,
                            config={"impl": "pallas"}, auto={"cuda": 0, "rocm": 0, "tpu": 0},
                            prefer=dispatch.not_on_hopper(), code=Kernels,
                            atomics=("cuda",),  # the RPE bias gradient (eva_attend's key-side pass)
                            # a stream attends in the XLA tiles: their logit budget ('cpu': interpret mode); Phase B's
                            # tiles and warps take the kernel's plan on every platform unless written
                            defaults={"logit_budget": xla.LOGIT_BUDGET,
                                      **{key: {"default": eva_attend.PLAN} for key in TILE_KEYS}}),
)

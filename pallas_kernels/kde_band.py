"""Pallas kernel "KDEformer heavy band" (docs/methods/kdeformer.md §4.2, 'band'): the heavy part of a full causal
pass as an online softmax over the (query tile, key block) pairs the bands touch, forward and FlashAttention-2-style
backward, lowered for GPU (Triton); interpret mode on a CPU.

What it computes is ``longctx.attention.kdeformer.xla.heavy_band`` (the reference; that function's docstring gives
the layout): queries sorted by their band ends ``hi`` and cut into tiles of ``block`` rows, keys in code-sorted
order cut into blocks of ``block``, row ``r``'s heavy set the sorted key slots ``[lo_r, hi_r)``. The sorting, the
pair tables and the final un-sort are O(N) gathers in XLA (``longctx.attention.kdeformer.pallas``); this module
imports JAX and Pallas only (never ``longctx``).

Operands, one row of the grid per (batch, head), ``BH`` rows:

* ``q [BH, Np, d]`` the sorted queries (not pre-scaled: the logits are ``scale · q kᵀ`` in float32), ``k [BH, Mp, d]``,
  ``v [BH, Mp, dv]`` the code-sorted keys and values (``Mp = Mb · block``), all in the compute dtype;
* ``lo, hi [BH, Np, 1]`` int32, each sorted row's band (empty where ``hi <= lo``; padded rows empty);
* ``b0, cnt [BH, n_t, 1]`` int32, the first key block and the number of blocks of every query tile
  (``xla.band_pairs``);
* backward only: the pairs grouped by key block, ``ptile [BH, P]`` (the tile of every pair, pairs in block order)
  and ``pstart, pend [BH, Mb, 1]`` (the pairs of block ``j`` are ``ptile[pstart_j : pend_j]``).

Kernels:

* **forward**, grid ``(BH, n_t)``: a program loops over its tile's ``cnt`` key blocks (``fori_loop`` with a traced
  trip count) with an online softmax in float32 (running max, sum, accumulator), keys outside ``[lo, hi)`` masked
  with the finite ``NEG``. Writes ``o [BH, Np, dv]`` (compute dtype) and ``lse [BH, Np, 1]`` (float32, ``NEG`` on
  a row with an empty heavy set, whose ``o`` is 0), as the reference.
* **dq**, the forward's grid: ``P = exp(s − lse)`` recomputed, ``dS = P ⊙ (dP − Δ + dlse)`` with ``dP = dO vᵀ``,
  ``Δ = rowsum(dO ⊙ O)`` and the cotangent ``dlse`` of the log-sum-exp (the band's lse is merged with the other
  parts through their log-sum-exps, so it receives a gradient; ``Δ − dlse`` is formed in XLA as one float32
  column), ``dq = scale · dS k``.
* **dk/dv**, grid ``(BH, Mb)``: a program owns key block ``j`` and loops over the tiles that touch it through the
  inverse pair map (``ptile[pstart_j : pend_j]``): ``dv = Σ Pᵀ dO``, ``dk = scale · Σ dSᵀ q``. Every gradient is
  written by one program: no atomics, the results do not depend on the programs' order (deterministic).

So P is computed once per pair in the forward and twice in the backward (dq, dk/dv), as FlashAttention-2; no
``[pairs, tq, kb]`` logits array exists outside the kernels.

Dtypes (DESIGN.md §7): q, k, v and ``dO`` in the compute dtype; every dot takes its operands as they are (``P`` and
``scale · dS`` cast down to the compute dtype) with float32 accumulation (``preferred_element_type``); logits, the
softmax statistics (``lse``, ``Δ − dlse``) and the accumulators float32; ``o``, ``dq``, ``dk``, ``dv`` written in
the compute dtype, each rounded once from its float32 accumulator.

Support (:func:`unsupported_reasons`): GPU ``block`` in :data:`GPU_BLOCKS` (Triton dots need ≥ 16 rows), ``d``,
``dv`` powers of two in [16, 256] (Triton block shapes); 4 warps up to ``block = 64``, 8 at 128, 2 stages (a rule,
not a measurement). Not written for TPU (Mosaic) or ROCm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import lazy_triton as pltriton
from pallas_kernels.precision import dot_nn as _nn
from pallas_kernels.precision import dot_nt as _nt
from pallas_kernels.precision import dot_tn as _tn

f32 = jnp.float32
NEG = -1e30  # masked logits (finite), the reference's
GPU_BLOCKS = (16, 32, 64, 128)
GPU_MAX_HEAD = 256


def unsupported_reasons(platform: str, *, block: int, d: int, dv: int, **_) -> list[str]:
    """Why the kernel (forward and backward) cannot serve these shapes on ``platform`` ('cuda' | 'interpret' |
    others)."""
    if platform == "interpret":
        return [] if block >= 1 else [f"block={block} must be >= 1"]
    if platform != "cuda":
        return [f"the KDEformer band kernel is written for cuda (Triton), not {platform}"]
    out = list(pltriton.missing())
    if block not in GPU_BLOCKS:
        out.append(f"block={block} not in {GPU_BLOCKS} on GPU (Triton dots need >= 16 rows)")
    if d & (d - 1) or dv & (dv - 1) or not (16 <= d <= GPU_MAX_HEAD and 16 <= dv <= GPU_MAX_HEAD):
        out.append(f"head dims d={d}, dv={dv} must be powers of two in [16, {GPU_MAX_HEAD}] on GPU "
                   "(Triton block shapes)")
    return out


def gpu_tiles(block: int) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the GPU lowering: 4 warps up to 64 rows, 8 at 128; 2 stages."""
    return (4 if block <= 64 else 8), 2


def _scores(q, k, lo, hi, blk, kb: int, scale: float):
    """Logits ``[tq, kb]`` of a query tile against key block ``blk`` (traced) and their mask: key slot in each row's
    ``[lo, hi)`` (``lo, hi [tq, 1]``)."""
    s = scale * _nt(q, k)
    slot = blk * kb + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    valid = (slot >= lo) & (slot < hi)
    return jnp.where(valid, s, NEG), valid


# ----------------------------------------------------------------------------- kernels
def _fwd_kernel(b0_ref, cnt_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, kb: int, scale: float):
    b0, n = b0_ref[0, 0], cnt_ref[0, 0]
    q, lo, hi = q_ref[...], lo_ref[...], hi_ref[...]

    def body(i, carry):
        m, l, acc = carry
        keys = pl.ds((b0 + i) * kb, kb)
        v = v_ref[keys, :]
        s, valid = _scores(q, k_ref[keys, :], lo, hi, b0 + i, kb, scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + _nn(p.astype(v.dtype), v)

    tq = q.shape[0]
    init = (jnp.full((tq, 1), NEG, f32), jnp.zeros((tq, 1), f32), jnp.zeros((tq, o_ref.shape[-1]), f32))
    m, l, acc = jax.lax.fori_loop(0, n, body, init)
    lsafe = jnp.maximum(l, 1e-30)
    o_ref[...] = (acc / lsafe).astype(o_ref.dtype)  # an empty row: 0
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(lsafe), NEG)


def _dq_kernel(b0_ref, cnt_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, c_ref, dq_ref, *, kb: int,
               scale: float):
    b0, n = b0_ref[0, 0], cnt_ref[0, 0]
    q, lo, hi, do, lse, c = q_ref[...], lo_ref[...], hi_ref[...], do_ref[...], lse_ref[...], c_ref[...]

    def body(i, dq):
        keys = pl.ds((b0 + i) * kb, kb)
        k = k_ref[keys, :]
        s, valid = _scores(q, k, lo, hi, b0 + i, kb, scale)
        p = jnp.where(valid, jnp.exp(s - lse), 0.0)
        ds = scale * (p * (_nt(do, v_ref[keys, :]) - c))  # c = Δ − dlse
        return dq + _nn(ds.astype(k.dtype), k)

    dq_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros(dq_ref.shape, f32)).astype(dq_ref.dtype)


def _dkv_kernel(ps_ref, pe_ref, pt_ref, lo_ref, hi_ref, q_ref, do_ref, lse_ref, c_ref, k_ref, v_ref, dk_ref, dv_ref,
                *, tq: int, kb: int, scale: float):
    j = pl.program_id(1)
    k, v = k_ref[...], v_ref[...]

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(pt_ref[i] * tq, tq)  # the query tile of the block's i-th pair
        q, do = q_ref[rows, :], do_ref[rows, :]
        s, valid = _scores(q, k, lo_ref[rows, :], hi_ref[rows, :], j, kb, scale)
        p = jnp.where(valid, jnp.exp(s - lse_ref[rows, :]), 0.0)
        ds = scale * (p * (_nt(do, v) - c_ref[rows, :]))
        return dk + _tn(ds.astype(q.dtype), q), dv + _tn(p.astype(do.dtype), do)

    init = (jnp.zeros(dk_ref.shape, f32), jnp.zeros(dv_ref.shape, f32))
    dk, dv = jax.lax.fori_loop(ps_ref[0, 0], pe_ref[0, 0], body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls
def _call(kernel, grid, specs, out_specs, outs, interpret: bool, block: int):
    params = None
    if not interpret:
        warps, stages = gpu_tiles(block)
        params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    return pl.pallas_call(kernel, grid=grid, in_specs=specs, out_specs=out_specs, out_shape=outs,
                          interpret=interpret, compiler_params=params)


def _tile(rows: int, width: int):
    """The program's own ``rows`` rows of a ``[BH, n, width]`` operand (grid axis 1 steps over them)."""
    return pl.BlockSpec((None, rows, width), lambda bh, t: (bh, t, 0))


def _whole(x):
    """A row's whole operand ``[BH, n, ...]`` (read by index inside the program)."""
    return pl.BlockSpec((None,) + x.shape[1:], lambda bh, t: (bh,) + (0,) * (x.ndim - 1))


def _check(interpret: bool, platform, block: int, d: int, dv: int) -> None:
    if interpret:
        return
    platform = platform or {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    reasons = unsupported_reasons(platform, block=block, d=d, dv=dv)
    if reasons:
        raise ValueError(f"kde_band: unsupported on {platform}: " + "; ".join(reasons))


def kde_band_forward(q, k, v, lo, hi, b0, cnt, *, scale: float, block: int, interpret: bool = False,
                     platform: str | None = None):
    """Operands as the module docstring. Returns ``(o [BH, Np, dv]`` in the operands' dtype, ``lse [BH, Np, 1]``
    float32)."""
    BH, Np, d = q.shape
    dv = v.shape[-1]
    _check(interpret, platform, block, d, dv)
    n_t = Np // block
    one = pl.BlockSpec((None, 1, 1), lambda bh, t: (bh, t, 0))
    specs = [one, one, _tile(block, 1), _tile(block, 1), _tile(block, d), _whole(k), _whole(v)]
    outs = [jax.ShapeDtypeStruct((BH, Np, dv), v.dtype), jax.ShapeDtypeStruct((BH, Np, 1), f32)]
    body = functools.partial(_fwd_kernel, kb=block, scale=scale)
    return _call(body, (BH, n_t), specs, [_tile(block, dv), _tile(block, 1)], outs, interpret, block)(
        b0, cnt, lo, hi, q, k, v)


def kde_band_backward(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, o, lse, do, dlse, *, scale: float, block: int,
                      interpret: bool = False, platform: str | None = None):
    """Gradients ``(dq, dk, dv)`` (the operands' dtype) of the forward's ``o`` and ``lse`` for their cotangents
    ``do [BH, Np, dv]`` and ``dlse [BH, Np, 1]``, from the residuals ``o, lse``."""
    BH, Np, d = q.shape
    Mp, dvd = k.shape[1], v.shape[-1]
    _check(interpret, platform, block, d, dvd)
    n_t, Mb = Np // block, Mp // block
    do32 = do.astype(f32)
    c = jnp.sum(do32 * o.astype(f32), axis=-1, keepdims=True) - dlse.astype(f32)  # Δ − dlse, a statistic: fp32
    do = do.astype(v.dtype)
    one = pl.BlockSpec((None, 1, 1), lambda bh, t: (bh, t, 0))
    specs = [one, one, _tile(block, 1), _tile(block, 1), _tile(block, d), _whole(k), _whole(v), _tile(block, dvd),
             _tile(block, 1), _tile(block, 1)]
    body = functools.partial(_dq_kernel, kb=block, scale=scale)
    dq = _call(body, (BH, n_t), specs, _tile(block, d), jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, block)(
        b0, cnt, lo, hi, q, k, v, do, lse, c)
    specs = [one, one, _whole(ptile)] + [_whole(x) for x in (lo, hi, q, do, lse, c)] + [_tile(block, d),
                                                                                       _tile(block, dvd)]
    body = functools.partial(_dkv_kernel, tq=block, kb=block, scale=scale)
    outs = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    dk, dv = _call(body, (BH, Mb), specs, [_tile(block, d), _tile(block, dvd)], outs, interpret, block)(
        pstart, pend, ptile, lo, hi, q, do, lse, c, k, v)
    return dq, dk, dv


# ----------------------------------------------------------------------------- differentiable entry
@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13))
def _band(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, scale, block, interpret, platform):
    return kde_band_forward(q, k, v, lo, hi, b0, cnt, scale=scale, block=block, interpret=interpret,
                            platform=platform)


def _band_fwd(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, scale, block, interpret, platform):
    o, lse = kde_band_forward(q, k, v, lo, hi, b0, cnt, scale=scale, block=block, interpret=interpret,
                              platform=platform)
    return (o, lse), (q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, o, lse)


def _band_bwd(scale, block, interpret, platform, res, g):
    q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, o, lse = res
    do, dlse = g
    dq, dk, dv = kde_band_backward(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, o, lse, do, dlse, scale=scale,
                                   block=block, interpret=interpret, platform=platform)
    return (dq, dk, dv) + (None,) * 7


_band.defvjp(_band_fwd, _band_bwd)


def kde_band(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, *, scale: float, block: int, interpret: bool = False,
             platform: str | None = None):
    """``(o [BH, Np, dv], lse [BH, Np, 1])`` of the sorted query rows (operands as the module docstring; q, k, v
    cast to their common dtype, the compute dtype), differentiable in q, k, v (``lse`` included) by the backward
    kernels. ``platform`` ('cuda'; None: the default backend) picks the lowering; interpret mode runs anywhere;
    shapes the kernel does not support there raise ValueError naming the reasons."""
    dt = jnp.result_type(q, k, v)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    ints = tuple(jnp.asarray(x, jnp.int32) for x in (lo, hi, b0, cnt, ptile, pstart, pend))
    return _band(q, k, v, *ints, float(scale), int(block), bool(interpret), platform)


__all__ = ["GPU_BLOCKS", "NEG", "gpu_tiles", "kde_band", "kde_band_backward", "kde_band_forward",
           "unsupported_reasons"]

"""KDEformer's heavy band (docs/methods/kdeformer.md §4.2, 'band') as Pallas Mosaic GPU kernels for Hopper: forward
and backward.

It computes what the Triton kernel :mod:`pallas_kernels.kde_band` computes (``longctx.attention.kdeformer.xla.
heavy_band``, the reference) and takes its operands and returns its outputs, with the same entry
(:func:`kde_band_mgpu`, ``kde_band.kde_band``'s signature): the sorted queries ``q [BH, Np, d]`` (not pre-scaled),
the code-sorted keys and values ``k [BH, Mp, d]``, ``v [BH, Mp, dv]``, each sorted row's band ``lo, hi [BH, Np, 1]``,
every query tile's first key block and block count ``b0, cnt [BH, n_t, 1]`` and, for the backward, the pairs by key
block ``ptile [BH, P]``, ``pstart, pend [BH, Mb, 1]``; ``(o [BH, Np, dv]`` in the compute dtype, ``lse [BH, Np, 1]``
float32, ``NEG`` and ``o = 0`` on a row with an empty heavy set). It imports JAX, Pallas and the Mosaic GPU helpers
of :mod:`pallas_kernels.fma_blocks_mgpu` (wgmma into a scoped accumulator, the online-softmax step, a statistic
laid along an axis, a tile stored through shared memory, interpret mode's params); never ``longctx`` nor the
Triton lowering.

Design (``block`` rows a query tile = keys a key block, one warpgroup a program, ``plgpu.kernel``):

* **forward**, grid ``(n_t, BH)``: the query tile and its rows' ``lo, hi`` (int32) are copied once by TMA into
  shared memory; the tile's first block ``b0`` and count ``cnt`` are scalars read from global memory; a
  ``plgpu.emit_pipeline`` with a **traced grid** ``(cnt,)`` (jax 0.10.2's pipeline takes a dynamic step count: a
  prologue of ``min(2, cnt)`` fetches, then a ``fori_loop`` of ``cnt`` steps) brings key block ``b0 + i`` (the
  keys transposed, ``[d, block]``, and the values ``[block, dv]``) by TMA into a ring of two; each step is
  ``S = scale · q kᵀ`` by wgmma (f32 accumulator), the band mask ``lo <= slot < hi`` from iota, and the online
  softmax update with ``P`` (compute dtype) through shared memory and ``P V`` by wgmma
  (:func:`pallas_kernels.fma_blocks_mgpu._online_step`). A tile with ``cnt = 0`` runs no step. Epilogue
  ``o = acc / max(l, 1e-30)`` (compute dtype) and ``lse = m + log l`` (``NEG`` where ``l = 0``) by TMA.
* **dq**, the forward's grid (FlashAttention-2: ``P = exp(S − lse)`` recomputed, ``dP = dO vᵀ``,
  ``dS = scale · P ⊙ (dP − c)`` with ``c = Δ − dlse`` one float32 column formed in XLA, the cotangent of the
  log-sum-exp honoured as in the Triton kernel): the same traced-grid pipeline over the tile's key blocks (``kᵀ``,
  ``vᵀ``, ``k`` blocks), ``dq += dS k``.
* **dk/dv**, grid ``(Mb, BH)``, a program owns key block ``j`` (its keys and values loaded once) and runs a
  traced-grid pipeline over its pairs ``ptile[pstart_j : pend_j]`` (the step's query tile ``ptile[pstart_j + i]``
  read from global memory inside the index maps): keys-major ``Sᵀ = scale · k qᵀ``, ``Pᵀ``, ``dPᵀ = v dOᵀ``,
  ``dSᵀ``, ``dv += Pᵀ dO``, ``dk += dSᵀ q``. Every gradient row is written by one program: no atomics,
  deterministic.

Dtypes (DESIGN.md §7): q, k, v, ``dO`` and the ``P`` / ``dS`` tiles in the compute dtype into every wgmma, f32
accumulators; logits, ``lse``, ``c`` f32; ``o, dq, dk, dv`` rounded once from f32 to the compute dtype.

Departures from the Triton kernel (:mod:`pallas_kernels.kde_band`), named:

* the transposed operands are transposed in XLA (forward ``kᵀ [BH, d, Mp]``; backward also ``vᵀ``, ``qᵀ``,
  ``dOᵀ``), ``P`` and ``dS`` go through shared memory, ``P V`` is accumulated into a fresh accumulator added to the
  rescaled one, and the dk/dv kernel recomputes its scores keys-major (``k qᵀ``) rather than transposing ``P``:
  Mosaic GPU's interpret mode (jax 0.10.2) runs wgmma only on untransformed shared-memory operands and not
  ``pl.run_state`` (as :mod:`pallas_kernels.fma_blocks_mgpu`), so the code the CPU tests run is the code a GPU
  would run only in this form;
* the statistics are rows of ``[BH, Np]`` (``lo, hi`` int32; ``lse``, ``c`` f32) so that a tile's are one 1-D TMA
  block; the entry takes and returns the Triton kernel's ``[BH, Np, 1]`` columns (reshaped in XLA);
* ``dq``, ``dk``, ``dv`` leave the kernels in f32 and are rounded to the compute dtype in XLA (one rounding, as the
  Triton kernel's in-kernel cast); ``o`` is written in the compute dtype by the kernel;
* the scores are scaled after the product (``scale · (q kᵀ)``, f32) as the Triton kernel, not by a pre-scaled q;
* one warpgroup a program, no warp specialisation; a key block's (or a pair's) step is a pipeline step with a
  ring of two, and the pipeline's slots are allocated for two steps even where ``cnt`` is 0 or 1.

Support (:func:`unsupported_reasons`): on ``cuda`` ``block`` in :data:`MGPU_BLOCKS` (wgmma's 64-row granule),
``d, dv`` multiples of 64 up to :data:`MAX_HEAD`, the f32 accumulators and score tiles of the largest kernel within
``fma_blocks_mgpu.REG_WORDS`` registers a thread of a warpgroup (an estimate), shared memory within an SM's
(:func:`smem_bytes`, an estimate), bfloat16 / float16 operands (float32 would make wgmma round to tf32), compute
capability 9.0 where known. Interpret mode (``InterpretGPUParams``, simulating shared memory, TMA, barriers and
wgmma on a CPU) refuses none of these and runs float32 exactly.

Tested (tests/kernels/test_kde_band_mgpu.py, interpret mode on a CPU): values and gradients (q, k, v, the
log-sum-exp's cotangent included) against the reference and the Triton kernel's interpret mode, fp32 and bf16,
ragged bands (empty rows, tiles with no key block, key blocks with no pair, padded rows, packed rows), the refusals,
bf16 into every wgmma, no Triton import, and ``jax.export`` of forward and gradient for ``cuda`` at N = 4000 and
N = 32768 (Pallas' Mosaic GPU lowering runs on a CPU host and checks the shared memory; at the refused block 128,
heads of 64, it reports 233504 bytes against the 232448 limit, the estimate 233472). Nothing here has compiled or
run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fma_blocks_mgpu
from pallas_kernels.fma_blocks_mgpu import REG_WORDS, _matmul, _online_step, _rows, _store, interpret_params

f32 = jnp.float32
NEG = -1e30  # masked logits (finite), the Triton kernel's and the reference's
MGPU_BLOCKS = (64, 128)  # query tile rows = keys a block (wgmma: 64 rows a warpgroup)
MAX_HEAD = 256
GPU_DTYPES = ("bfloat16", "float16")
SMEM_LIMIT_BYTES = 232448  # an H100 SM's shared memory one block may use (227 KiB)
_SEMANTICS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def smem_bytes(block: int, d: int, dv: int, itemsize: int = 2) -> int:
    """Shared memory of the largest of the three kernels (their tiles, the pipelines' rings of two steps and the
    f32 output staging): an estimate; the lowering checks the exact figure."""
    m, i = block, itemsize
    fwd = (m * d + m * dv + m * m) * i + 12 * m + 2 * (d + dv) * m * i
    dq = (m * d + m * dv + m * m) * i + 16 * m + max(2 * (2 * d + dv) * m * i, 4 * m * d)
    dkv = (m * d + m * dv + 2 * m * m) * i + max(2 * (2 * d + 2 * dv) * m * i + 32 * m, 4 * m * max(d, dv))
    return max(fwd, dq, dkv)


def reg_words(block: int, d: int, dv: int) -> int:
    """f32 registers a thread of one warpgroup for the largest kernel's live tiles (an estimate): the forward's
    ``[m, dv]`` accumulator and ``[m, m]`` scores, dk/dv's two accumulators and ``[m, m]`` scores."""
    return block * max(dv + block, d + dv + block) // 128


def unsupported_reasons(platform: str, *, block: int, d: int, dv: int, dtype=None, compute_capability=None,
                        **_) -> list[str]:
    """Why the Mosaic GPU kernels (forward and backward) cannot serve these shapes on ``platform`` ('cuda' |
    'interpret' | other), one line a reason. ``compute_capability``: ``(major, minor)`` or a string like ``"9.0"``
    where the caller knows the device (None: unknown, served)."""
    if platform == "interpret":
        return [] if block >= 1 else [f"block={block} must be >= 1"]
    if platform != "cuda":
        return [f"Mosaic GPU kernels run on cuda (Hopper), not {platform}"]
    out = fma_blocks_mgpu.hopper_reasons(compute_capability)
    if block not in MGPU_BLOCKS:
        out.append(f"block={block} not in {MGPU_BLOCKS} (wgmma's 64-row query tiles and key blocks)")
    if d % 64 or dv % 64 or not (64 <= d <= MAX_HEAD and 64 <= dv <= MAX_HEAD):
        out.append(f"head dims d={d}, dv={dv} must be multiples of 64 in [64, {MAX_HEAD}] (wgmma tiles)")
    else:
        if (regs := reg_words(block, d, dv)) > REG_WORDS:
            out.append(f"block={block}, d={d}, dv={dv}: the f32 accumulators and scores need {regs} registers a "
                       f"thread of one warpgroup (limit {REG_WORDS}, an estimate)")
        if (smem := smem_bytes(block, d, dv)) > SMEM_LIMIT_BYTES:
            out.append(f"block={block}, d={d}, dv={dv}: ~{smem >> 10} KiB of shared memory (estimate) exceeds an "
                       f"SM's {SMEM_LIMIT_BYTES >> 10} KiB")
    if dtype is not None and jnp.dtype(dtype).name not in GPU_DTYPES:
        out.append(f"dtype {jnp.dtype(dtype).name}: wgmma operands in {GPU_DTYPES} (float32 would be rounded to tf32)")
    return out


# ----------------------------------------------------------------------------- kernels
def _band_mask(blk, lo_s, hi_s, m: int, keys_major: bool = False):
    """Key slot of block ``blk`` (traced) in each row's ``[lo, hi)`` (``lo_s, hi_s [m]`` int32 in shared memory):
    ``[m queries, m keys]``, or ``[m keys, m queries]`` keys-major."""
    ax_k, ax_q = (0, 1) if keys_major else (1, 0)
    slot = blk * m + jax.lax.broadcasted_iota(jnp.int32, (m, m), ax_k)
    return (slot >= _rows(lo_s, (m, m), ax_q)) & (slot < _rows(hi_s, (m, m), ax_q))


def _load(loads, bar):
    """TMA copies ``(gmem, smem)``, each on its own barrier, all waited for."""
    for i, (src, dst) in enumerate(loads):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
    for i in range(len(loads)):
        plgpu.barrier_wait(bar.at[i])


def _forward_call(q, kt, v, lo, hi, b0, cnt, *, block: int, scale: float, interpret):
    """q [BH, Np, d]; kt [BH, d, Mp] (keys transposed); v [BH, Mp, dv]; lo, hi [BH, Np] int32; b0, cnt [BH, n_t]
    int32. Returns o [BH, Np, dv] (compute dtype), lse [BH, Np] f32."""
    BH, Np, d = q.shape
    dv, m, dtype = v.shape[-1], block, q.dtype

    def body(b0_ref, cnt_ref, lo_ref, hi_ref, q_ref, kt_ref, v_ref, o_ref, lse_ref, q_s, lo_s, hi_s, o_s, lse_s,
             p_s, bar):
        t = jax.lax.axis_index("t")
        bh = jax.lax.axis_index("bh")
        rows = pl.ds(t * m, m)
        _load(((q_ref.at[bh, rows], q_s), (lo_ref.at[bh, rows], lo_s), (hi_ref.at[bh, rows], hi_s)), bar)
        first, n = b0_ref[bh, t], cnt_ref[bh, t]

        def step(idx, kt_t, v_t, carry):
            s = scale * _matmul(q_s, kt_t, (m, m))
            return _online_step(carry, s, _band_mask(first + idx[0], lo_s, hi_s, m), v_t, p_s)

        acc, m_i, l_i = plgpu.emit_pipeline(
            step, grid=(n,), max_concurrent_steps=2,
            init_carry=(jnp.zeros((m, dv), f32), jnp.full((m,), NEG, f32), jnp.zeros((m,), f32)),
            in_specs=[plgpu.BlockSpec((d, m), lambda i: (0, first + i)),
                      plgpu.BlockSpec((m, dv), lambda i: (first + i, 0))],
        )(kt_ref.at[bh], v_ref.at[bh])
        lsafe = jnp.maximum(l_i, 1e-30)
        o_s[...] = (acc / jax.lax.broadcast_in_dim(lsafe, acc.shape, [0])).astype(dtype)  # an empty row: 0
        lse_s[...] = jnp.where(l_i > 0, m_i + jnp.log(lsafe), NEG)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[bh, rows])
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[bh, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((BH, Np, dv), dtype), jax.ShapeDtypeStruct((BH, Np), f32)),
        scratch_types=(plgpu.SMEM((m, d), dtype), plgpu.SMEM((m,), jnp.int32), plgpu.SMEM((m,), jnp.int32),
                       plgpu.SMEM((m, dv), dtype), plgpu.SMEM((m,), f32), plgpu.SMEM((m, m), dtype),
                       plgpu.Barrier(num_barriers=3)),
        grid=(Np // m, BH), grid_names=("t", "bh"), compiler_params=_SEMANTICS, interpret=interpret,
        kernel_name="kde_band_mgpu_fwd",
    )(b0, cnt, lo, hi, q, kt, v)


def _dq_call(q, do, lo, hi, lse, c, kt, vt, k, b0, cnt, *, block: int, scale: float, interpret):
    """The query side, the forward's grid: ``dq [BH, Np, d]`` f32. ``c = Δ − dlse`` [BH, Np] f32."""
    BH, Np, d = q.shape
    dv, m, dtype = do.shape[-1], block, q.dtype

    def body(b0_ref, cnt_ref, lo_ref, hi_ref, lse_ref, c_ref, q_ref, do_ref, kt_ref, vt_ref, k_ref, dq_ref,
             q_s, do_s, lo_s, hi_s, lse_s, c_s, ds_s, bar):
        t = jax.lax.axis_index("t")
        bh = jax.lax.axis_index("bh")
        rows = pl.ds(t * m, m)
        _load(((q_ref.at[bh, rows], q_s), (do_ref.at[bh, rows], do_s), (lo_ref.at[bh, rows], lo_s),
               (hi_ref.at[bh, rows], hi_s), (lse_ref.at[bh, rows], lse_s), (c_ref.at[bh, rows], c_s)), bar)
        first, n = b0_ref[bh, t], cnt_ref[bh, t]

        def step(idx, kt_t, vt_t, k_t, dq):
            valid = _band_mask(first + idx[0], lo_s, hi_s, m)
            s = scale * _matmul(q_s, kt_t, (m, m))
            p = jnp.where(valid, jnp.exp(s - _rows(lse_s, (m, m), 0)), 0.0)
            ds_s[...] = (scale * (p * (_matmul(do_s, vt_t, (m, m)) - _rows(c_s, (m, m), 0)))).astype(dtype)
            plgpu.commit_smem()
            return dq + _matmul(ds_s, k_t, (m, d))

        dq = plgpu.emit_pipeline(
            step, grid=(n,), max_concurrent_steps=2, init_carry=jnp.zeros((m, d), f32),
            in_specs=[plgpu.BlockSpec((d, m), lambda i: (0, first + i)),
                      plgpu.BlockSpec((dv, m), lambda i: (0, first + i)),
                      plgpu.BlockSpec((m, d), lambda i: (first + i, 0))],
        )(kt_ref.at[bh], vt_ref.at[bh], k_ref.at[bh])
        pl.run_scoped(lambda s: _store(s, dq, dq_ref.at[bh, rows]), plgpu.SMEM((m, d), f32))

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((BH, Np, d), f32),
        scratch_types=(plgpu.SMEM((m, d), dtype), plgpu.SMEM((m, dv), dtype), plgpu.SMEM((m,), jnp.int32),
                       plgpu.SMEM((m,), jnp.int32), plgpu.SMEM((m,), f32), plgpu.SMEM((m,), f32),
                       plgpu.SMEM((m, m), dtype), plgpu.Barrier(num_barriers=6)),
        grid=(Np // m, BH), grid_names=("t", "bh"), compiler_params=_SEMANTICS, interpret=interpret,
        kernel_name="kde_band_mgpu_dq",
    )(b0, cnt, lo, hi, lse, c, q, do, kt, vt, k)


def _dkv_call(k, v, qt, q, dot, do, lo, hi, lse, c, ptile, pstart, pend, *, block: int, scale: float, interpret):
    """The key side, grid ``(Mb, BH)``: key block ``j``'s pairs ``ptile[pstart_j : pend_j]``, keys-major.
    Returns f32 ``(dk [BH, Mp, d], dv [BH, Mp, dv])``."""
    BH, Mp, d = k.shape
    dv, m, dtype = v.shape[-1], block, k.dtype

    def body(ps_ref, pe_ref, pt_ref, k_ref, v_ref, qt_ref, q_ref, dot_ref, do_ref, lo_ref, hi_ref, lse_ref, c_ref,
             dk_ref, dv_ref, k_s, v_s, pt_s, dst_s, bar):
        j = jax.lax.axis_index("j")
        bh = jax.lax.axis_index("bh")
        rows = pl.ds(j * m, m)
        _load(((k_ref.at[bh, rows], k_s), (v_ref.at[bh, rows], v_s)), bar)
        first, last = ps_ref[bh, j], pe_ref[bh, j]

        def tile(i):  # the query tile of the block's i-th pair
            return pt_ref[bh, first + i]

        def step(idx, qt_t, q_t, dot_t, do_t, lo_t, hi_t, lse_t, c_t, carry):
            dk, dvv = carry
            valid = _band_mask(j, lo_t, hi_t, m, keys_major=True)
            st = scale * _matmul(k_s, qt_t, (m, m))
            pt = jnp.where(valid, jnp.exp(st - _rows(lse_t, (m, m), 1)), 0.0)
            pt_s[...] = pt.astype(dtype)
            dst_s[...] = (scale * (pt * (_matmul(v_s, dot_t, (m, m)) - _rows(c_t, (m, m), 1)))).astype(dtype)
            plgpu.commit_smem()
            return dk + _matmul(dst_s, q_t, (m, d)), dvv + _matmul(pt_s, do_t, (m, dv))

        row_spec = plgpu.BlockSpec((m,), lambda i: (tile(i),))
        dk, dvv = plgpu.emit_pipeline(
            step, grid=(last - first,), max_concurrent_steps=2,
            init_carry=(jnp.zeros((m, d), f32), jnp.zeros((m, dv), f32)),
            in_specs=[plgpu.BlockSpec((d, m), lambda i: (0, tile(i))), plgpu.BlockSpec((m, d), lambda i: (tile(i), 0)),
                      plgpu.BlockSpec((dv, m), lambda i: (0, tile(i))),
                      plgpu.BlockSpec((m, dv), lambda i: (tile(i), 0))] + [row_spec] * 4,
        )(qt_ref.at[bh], q_ref.at[bh], dot_ref.at[bh], do_ref.at[bh], lo_ref.at[bh], hi_ref.at[bh], lse_ref.at[bh],
          c_ref.at[bh])
        pl.run_scoped(lambda s: _store(s, dk, dk_ref.at[bh, rows]), plgpu.SMEM((m, d), f32))
        pl.run_scoped(lambda s: _store(s, dvv, dv_ref.at[bh, rows]), plgpu.SMEM((m, dv), f32))

    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((BH, Mp, d), f32), jax.ShapeDtypeStruct((BH, Mp, dv), f32)),
        scratch_types=(plgpu.SMEM((m, d), dtype), plgpu.SMEM((m, dv), dtype), plgpu.SMEM((m, m), dtype),
                       plgpu.SMEM((m, m), dtype), plgpu.Barrier(num_barriers=2)),
        grid=(Mp // m, BH), grid_names=("j", "bh"), compiler_params=_SEMANTICS, interpret=interpret,
        kernel_name="kde_band_mgpu_dkv",
    )(pstart, pend, ptile, k, v, qt, q, dot, do, lo, hi, lse, c)


# ----------------------------------------------------------------------------- differentiable entry
def _t(x):
    """The last two axes swapped (wgmma operands without transposed views: module docstring)."""
    return jnp.swapaxes(x, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12))
def _band(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, scale, block, interpret):
    return _band_fwd(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, scale, block, interpret)[0]


def _band_fwd(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, scale, block, interpret):
    o, lse = _forward_call(q, _t(k), v, lo, hi, b0, cnt, block=block, scale=scale, interpret=interpret)
    return (o, lse), (q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, o, lse)


def _band_bwd(scale, block, interpret, res, cts):
    q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, o, lse = res
    do, dlse = cts
    # c = Δ − dlse = rowsum(dO ⊙ O) − dlse, one f32 column (a statistic); dO in the compute dtype (an operand)
    c = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1) - dlse.astype(f32)
    do = do.astype(v.dtype)
    kw = dict(block=block, scale=scale, interpret=interpret)
    dq = _dq_call(q, do, lo, hi, lse, c, _t(k), _t(v), k, b0, cnt, **kw)
    dk, dv = _dkv_call(k, v, _t(q), q, _t(do), do, lo, hi, lse, c, ptile, pstart, pend, **kw)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)) + (None,) * 7


_band.defvjp(_band_fwd, _band_bwd)


def kde_band_mgpu(q, k, v, lo, hi, b0, cnt, ptile, pstart, pend, *, scale: float, block: int, interpret=False,
                  platform: str | None = None):
    """``(o [BH, Np, dv], lse [BH, Np, 1])`` of the sorted query rows by the Mosaic GPU kernels: the contract of
    :func:`pallas_kernels.kde_band.kde_band` (operands as the module docstring; q, k, v cast to their common dtype,
    the compute dtype), differentiable in q, k, v (``lse`` included). ``interpret``: True runs Mosaic GPU's
    interpret mode on any backend; an ``InterpretGPUParams`` is passed as given. ``platform`` ('cuda'; None: the
    default backend) is what compiled calls are checked for; shapes the kernels do not support there raise
    ValueError naming the reasons."""
    BH, Np, d = q.shape
    Mp, dv = k.shape[1], v.shape[-1]
    dt = jnp.result_type(q, k, v)
    if interpret:
        plat = "interpret"
    else:
        plat = platform or {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    reasons = unsupported_reasons(plat, block=block, d=d, dv=dv, dtype=dt)
    if Np % block or Mp % block:
        reasons.append(f"Np={Np} and Mp={Mp} must be multiples of block={block}")
    if reasons:
        raise ValueError(f"kde_band_mgpu: unsupported on {plat}: " + "; ".join(reasons))
    if interpret is True:
        interpret = interpret_params()
    q, k, v = (x.astype(dt) for x in (q, k, v))
    rows = lambda x: jnp.asarray(x, jnp.int32).reshape(x.shape[0], -1)  # noqa: E731  ([BH, n, 1] -> [BH, n])
    o, lse = _band(q, k, v, rows(lo), rows(hi), rows(b0), rows(cnt), rows(ptile), rows(pstart), rows(pend),
                   float(scale), int(block), interpret or False)
    return o, lse[..., None]


__all__ = ["MGPU_BLOCKS", "NEG", "SMEM_LIMIT_BYTES", "kde_band_mgpu", "reg_words", "smem_bytes",
           "unsupported_reasons"]

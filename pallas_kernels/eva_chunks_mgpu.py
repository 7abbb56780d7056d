"""EVA's Phase A (the chunk summaries, docs/methods/eva.md §8.2) as Pallas Mosaic GPU kernels for Hopper: forward
and the token-level backward.

It computes what :func:`pallas_kernels.eva_chunks.eva_chunk_stats` computes and takes its operands (``q_ch, k_ch
[B,H,C,P,d]``, ``v_ch [B,H,C,P,dv]``, ``k_valid [C,P]`` or per batch row ``[B,1,C,P]`` (a packed row's chunk
members), the chunk parameters, the noise ``[B,H,C,d]`` or None) and returns its outputs (``k̂ [B,H,C,d]``,
``β [B,H,C,dv]``, float32 statistics); the reference is :func:`pallas_kernels.eva_chunks_ref.chunk_summaries`.
It imports JAX, that reference, the Triton kernel's module (its padding of the validity rows and its refusals of
dtypes), and the Mosaic GPU helpers of :mod:`pallas_kernels.eva_attend_mgpu` and
:mod:`pallas_kernels.fma_blocks_mgpu` (wgmma into a scoped accumulator, the online-softmax step, a statistic laid
along an axis, a tile stored through shared memory, interpret mode's params).

Design (``t`` = :data:`TILE` = 64, wgmma's row granule). One program a **chunk tile** of ``t`` chunks of a row
(``plgpu.kernel`` grid ``(C_pad / t, BH)``, one warpgroup), whose ``t·P`` tokens are ``P`` **token tiles** of ``t``
rows (a chunk may straddle two token tiles when ``P`` does not divide ``t``: nothing below assumes it does):

* **means**: a pipeline (``plgpu.emit_pipeline``, a ring of two) over the ``P`` token tiles brings ``q`` and ``k``
  ``[t, d]`` by TMA; the segment matrix ``S [t chunks, t tokens]`` (``c·P <= token < (c + 1)·P``, from iota, exact
  in the compute dtype) goes to shared memory and ``Σ q``, ``Σ k`` accumulate as wgmma products ``S q``, ``S k``
  (compute-dtype operands, f32 carries), divided by ``P``;
* **chunk level**: the means cast to the compute dtype, ``k̄ A_k`` and ``q̄ A_q`` by wgmma against the projection
  matrices (the whole ``[d, d]`` in shared memory), the biases and LayerNorms in f32 (rows of ``t`` chunks, the
  parameter vectors laid along the feature axis), ``µ`` as the options say, ``ω = µ + ε`` cast to the compute
  dtype into shared memory;
* **β**: a second pipeline over the token tiles (``kᵀ [d, t]``, ``v [t, dv]``, each token's validity and half
  squared norm ``[t]``) runs one online softmax a chunk (:func:`pallas_kernels.eva_attend_mgpu._softmax_step`):
  ``ℓ = a·(ω kᵀ) − b·½‖k‖²`` (``ω kᵀ`` by wgmma), masked off each chunk's tokens and at padding, ``P`` (compute
  dtype) through shared memory into ``P v`` by wgmma. A chunk's tokens lie in one or two token tiles, so before
  them its row is fully masked (``p = 0``, the running max stays the mask value), and where one tile holds them
  all (``P`` divides 64, as the configs' chunks of 8 do) that tile sets its max and weights exactly as the Triton
  kernel's single tile does; β ``= acc / max(l, 1e-30)`` and the log-sum-exp ``m + log max(l, 1e-30)``;
* epilogue: ``k̂``, ``β`` (f32) and, for the backward of a differentiated call, ``ω`` (compute dtype) and the
  log-sum-exp (f32) by TMA.

Backward (``jax.custom_vjp``), as the Triton kernel's: the chunk-level half (means, projections, LayerNorms,
``ω = µ + ε``) is autodiff of the reference's :func:`chunk_proposals` in XLA, and the token-level half a second
kernel on the forward's grid, keys-major: a pipeline over the chunk tile's token tiles recomputes
``wᵀ = exp(ℓᵀ − lse)`` (``ℓᵀ = k ωᵀ`` by wgmma) from the forward's ω and log-sum-exp, ``dwᵀ = v dβᵀ``,
``dℓᵀ = wᵀ ⊙ (dwᵀ − Δ)``, and writes per token tile ``dv = wᵀ dβ`` and the logits' share of ``dk``
(``a·dℓᵀ ω``) with ``Σ_c dℓ`` per token, accumulating ``dωᵀ += kᵀ (a·dℓᵀ)`` (f32 carry) over the tiles. Products
in the compute dtype (``wᵀ``, ``a·dℓᵀ`` cast down into shared memory), f32 accumulators.

Departures from the Triton kernel (:mod:`pallas_kernels.eva_chunks`), named:

* tiles of ``t = 64`` chunks (wgmma's row granule; the Triton kernel takes 16): ``C`` is padded to a multiple of
  64 chunks, and the segment-matrix products cost a factor ``t`` of the useful flops (``O(L·t·d)``, the Triton
  kernel's factor 16) — Phase A is ``O(L·d)`` against Phase B's ``O(L·W·d)``;
* each token's half squared norm ``½‖k‖²`` (f32, ``[BH, N]``) is computed in XLA and enters as a ``[t]`` operand of
  each step: reduced inside the kernel it would come out laid along the tile's other axis (the key tile ``[t, d]``
  reduces to a vector along axis 0; the logits need it along axis 1), which would take a shared-memory round trip
  per step; the validity rows enter as f32 ``[BH, N]`` (broadcast over heads);
* the backward's ``Δ_c = Σ_t w_ct (v_t·dβ_c)`` is computed in XLA as ``dβ_c·β_c`` from the forward's β
  (FlashAttention's ``Δ = rowsum(dO ⊙ O)``): keys-major, the kernel would reduce along the tile's token axis (axis
  0); and the key gradient's norm term ``− b·(Σ_c dℓ_ct)·k_t`` is added in XLA from the kernel's per-token
  ``Σ_c dℓ_ct`` (an ``O(L·d)`` elementwise product; in the kernel it would multiply a row statistic into a tile
  loaded from shared memory, whose register layout is not a wgmma result's);
* transposed operands are transposed in XLA (forward ``kᵀ``; backward ``kᵀ``, ``ωᵀ``, ``dβᵀ``, and ``dωᵀ``
  back), and ``S``, ``P``, ``wᵀ``, ``a·dℓᵀ`` and the means go through shared memory: Mosaic GPU's interpret mode
  (jax 0.10.2) runs wgmma only on untransformed shared-memory operands (no ``transpose_ref`` view, no register
  operand) and not ``pl.run_state`` (so each ``P v`` is a fresh accumulator added to the rescaled one), as in
  :mod:`pallas_kernels.eva_attend_mgpu`;
* a chunk straddling two token tiles (``P`` not dividing 64) takes the online softmax's rescaling: its first
  tile's weights are cast to the compute dtype relative to that tile's max and rescaled by the second's, where the
  Triton kernel and the reference cast them once relative to the chunk's max (the same in float32 up to rounding;
  under bfloat16 a rounding of the weights' order, tested at a looser tolerance);
* one warpgroup a program, no warp specialisation.

Support (:func:`unsupported_reasons`): on ``cuda`` ``d, dv`` multiples of 64 up to :data:`MAX_HEAD` (the backward's
``dωᵀ`` product has ``d`` rows), bfloat16 / float16 operands (float32 would make wgmma round to tf32), shared
memory within an SM's (an estimate), compute capability 9.0 where known. Any chunk size. Interpret mode
(``InterpretGPUParams``) runs float32 exactly and any head size.

Tested (tests/kernels/test_eva_chunks_mgpu.py, interpret mode on a CPU): values and gradients against the
reference (fp32, bf16; option variants, ragged lengths, a packed row's chunk members) and ``jax.export`` for
``cuda`` at configs/wikitext103/eva_16l.py's shapes. Nothing here has compiled or run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import eva_attend_mgpu, eva_chunks
from pallas_kernels.eva_attend_mgpu import _SEMANTICS, _rows_of, _softmax_step
from pallas_kernels.eva_chunks_ref import LN_EPS, NEG, EVAOptions, chunk_proposals
from pallas_kernels.fma_blocks_mgpu import _matmul, _rows, _store, interpret_params
from pallas_kernels.precision import compute_dtype, statistic

f32 = jnp.float32
TILE = 64  # chunks a program, tokens a pipeline step (wgmma: 64 rows a warpgroup)
MAX_HEAD = eva_attend_mgpu.MAX_HEAD
GPU_DTYPES = eva_attend_mgpu.GPU_DTYPES
SMEM_LIMIT_BYTES = 232448  # an H100 SM's shared memory one block may use (227 KiB)
_PARAMS = ("q_w", "q_b", "q_ln_scale", "q_ln_bias", "k_w", "k_b", "k_ln_scale", "k_ln_bias")


def smem_bytes(d: int, dv: int, t: int = TILE, itemsize: int = 2) -> int:
    """Shared memory of the larger kernel (an estimate; the lowering checks the exact figure). Forward, its β phase:
    the projection matrices, ``ω``, ``ε`` and the means' staging, a ring of two steps of ``kᵀ``, ``v``, validity and
    norms, ``P``, an f32 output tile. Backward: ``ω``, ``ωᵀ``, ``dβ``, ``dβᵀ``, ``wᵀ`` and ``a·dℓᵀ``, the f32
    staging tile(s), a ring of two steps of ``k``, ``kᵀ``, ``v``, validity and norms."""
    i = itemsize
    fwd = (2 * d * d + 3 * t * d + t * t) * i + 8 * d * 4 + 2 * (t * d * i + t * dv * i + 8 * t) + 4 * t * max(d, dv)
    staging = 4 * t * max(d, dv) + (4 * t * dv if d != dv else 0)
    bwd = (2 * t * d + 2 * t * dv + 2 * t * t) * i + staging + 2 * ((2 * t * d + t * dv) * i + 8 * t) + 16 * t
    return max(fwd, bwd)


def unsupported_reasons(platform: str, *, P: int, d: int, dv: int, dtype=None, compute_capability=None,
                        **_) -> list[str]:
    """Why the kernels cannot serve a call on ``platform`` ('cuda' | 'interpret' | other), one line a reason."""
    out = [r for r in eva_chunks.unsupported_reasons("interpret", P=P, d=d, dv=dv, dtype=jnp.float32)]
    if platform == "interpret":
        return out
    # the device, head dims and dtypes Phase B's Mosaic GPU kernels take (theirs at a one-tile window, which
    # they take: this kernel has no window); then this kernel's own shared memory
    out += eva_attend_mgpu.unsupported_reasons(platform, W=TILE, d=d, dv=dv, dtype=dtype,
                                               compute_capability=compute_capability)
    if platform == "cuda" and (smem := smem_bytes(d, dv)) > SMEM_LIMIT_BYTES:
        out.append(f"d={d}, dv={dv}: ~{smem >> 10} KiB of shared memory (estimate) exceeds an SM's "
                   f"{SMEM_LIMIT_BYTES >> 10} KiB")
    return out


def _segment(P: int, s, t: int, keys_major: bool = False):
    """Which tokens of token tile ``s`` (of the chunk tile's ``t·P``) belong to which of the tile's ``t`` chunks:
    ``[t chunks, t tokens]`` bool (or keys-major ``[t tokens, t chunks]``)."""
    ax_c, ax_t = (1, 0) if keys_major else (0, 1)
    c = jax.lax.broadcasted_iota(jnp.int32, (t, t), ax_c)
    tok = s * t + jax.lax.broadcasted_iota(jnp.int32, (t, t), ax_t)
    return (tok >= c * P) & (tok < (c + 1) * P)


def _rf_coefficients(scale: float, opts: EVAOptions) -> tuple[float, float]:
    """(a, b) of ``ℓ = a·(ω·k) − b·½‖k‖²`` (the Triton kernel's)."""
    return (scale, scale) if opts.rf_scale == "released" else (scale**0.5, scale)


def _layer_norm(x, g, b):
    """LayerNorm of the rows of ``x [t, d]`` (f32), ``g``, ``b`` laid along axis 1."""
    n = x.shape[1]
    xc = x - _rows_of(jnp.sum(x, axis=1) / n, x.shape)
    inv = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1) / n + LN_EPS)
    return xc * _rows_of(inv, x.shape) * g + b


# ----------------------------------------------------------------------------- forward
def _forward_call(q, k, kt, v, valid, sq, eps, w, vecs, *, P: int, scale: float, opts: EVAOptions, save: bool,
                  interpret):
    """q, k [BH, N, d], kt [BH, d, N], v [BH, N, dv] (compute dtype; N = C_pad·P); valid, sq [BH, N] f32 (each
    token's validity, ½‖k‖²); eps [BH, C_pad, d] (compute dtype); w [2, d, d] (A_q, A_k, compute dtype), vecs
    [6, d] (q_b, q_ln_scale, q_ln_bias, k_b, k_ln_scale, k_ln_bias; compute dtype, used in f32). Returns
    k̂ [BH, C_pad, d], β [BH, C_pad, dv] f32 and with ``save`` ω [BH, C_pad, d] (compute dtype), lse [BH, C_pad]
    f32."""
    BH, N, d = q.shape
    dv, t, dtype = v.shape[-1], TILE, q.dtype
    C_pad = N // P
    a, b = _rf_coefficients(scale, opts)
    project = opts.chunk_rep != "identity"
    use_ln = opts.adaptive_proj != "no-ln"

    def body(q_ref, k_ref, kt_ref, v_ref, valid_ref, sq_ref, eps_ref, w_ref, vec_ref, *rest):
        outs, (wq_s, wk_s, vec_s, eps_s, mean_s, om_s, p_s, bar) = rest[:len(rest) - 8], rest[len(rest) - 8:]
        ct, bh = jax.lax.axis_index("ct"), jax.lax.axis_index("bh")
        crows, tok0 = pl.ds(ct * t, t), ct * P  # the chunk tile's rows, its first token tile
        loads = ((w_ref.at[0], wq_s), (w_ref.at[1], wk_s), (vec_ref, vec_s), (eps_ref.at[bh, crows], eps_s))
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(len(loads)):
            plgpu.barrier_wait(bar.at[i])

        def means(idx, q_t, k_t, carry):
            qs, ks = carry
            p_s[...] = jnp.where(_segment(P, idx[0], t), 1.0, 0.0).astype(dtype)  # the segment matrix: 0 / 1, exact
            plgpu.commit_smem()
            return qs + _matmul(p_s, q_t, (t, d)), ks + _matmul(p_s, k_t, (t, d))

        tok = lambda s: (tok0 + s, 0)  # noqa: E731
        qs, ks = plgpu.emit_pipeline(
            means, grid=(P,), max_concurrent_steps=min(2, P), init_carry=(jnp.zeros((t, d), f32),) * 2,
            in_specs=[plgpu.BlockSpec((t, d), tok)] * 2)(q_ref.at[bh], k_ref.at[bh])
        q_bar, k_bar = qs / P, ks / P
        vec = lambda i: _rows(vec_s.at[i], (t, d), 1).astype(f32)  # noqa: E731

        def rep(x, w_s, i):  # x̄ A + b (+ LN): the chunk representative, f32
            mean_s[...] = x.astype(dtype)
            plgpu.commit_smem()
            y = _matmul(mean_s, w_s, (t, d)) + vec(i)
            return _layer_norm(y, vec(i + 1), vec(i + 2)) if use_ln else y

        if project:
            k_hat = rep(k_bar, wk_s, 3)
            q_hat = None if opts.adaptive_proj == "none" else rep(q_bar, wq_s, 0)
        else:
            k_hat, q_hat = k_bar, q_bar
        if q_hat is None:
            mu = jnp.zeros_like(k_hat)
        elif opts.mu_mode == "sum":
            mu = q_hat + k_hat
        else:
            mu = 0.5 * (q_hat + k_hat)
        om_s[...] = (mu + eps_s[...].astype(f32)).astype(dtype)
        plgpu.commit_smem()

        def beta_step(idx, kt_t, v_t, valid_t, sq_t, carry):
            dots = _matmul(om_s, kt_t, (t, t))
            ell = a * dots - b * _rows(sq_t, (t, t), 1)
            mask = _segment(P, idx[0], t) & (_rows(valid_t, (t, t), 1) > 0.5)
            return _softmax_step(carry, ell, mask, None, v_t, p_s)

        carry = (jnp.zeros((t, dv), f32), jnp.full((t,), NEG, f32), jnp.zeros((t,), f32))
        acc, m_i, l_i = plgpu.emit_pipeline(
            beta_step, grid=(P,), max_concurrent_steps=min(2, P), init_carry=carry,
            in_specs=[plgpu.BlockSpec((d, t), lambda s: (0, tok0 + s)), plgpu.BlockSpec((t, dv), tok),
                      plgpu.BlockSpec((t,), lambda s: (tok0 + s,)), plgpu.BlockSpec((t,), lambda s: (tok0 + s,))],
        )(kt_ref.at[bh], v_ref.at[bh], valid_ref.at[bh], sq_ref.at[bh])
        l_i = jnp.maximum(l_i, 1e-30)
        pl.run_scoped(lambda s: _store(s, k_hat, outs[0].at[bh, crows]), plgpu.SMEM((t, d), f32))
        pl.run_scoped(lambda s: _store(s, acc / jax.lax.broadcast_in_dim(l_i, acc.shape, [0]),
                                       outs[1].at[bh, crows]), plgpu.SMEM((t, dv), f32))
        if save:
            plgpu.copy_smem_to_gmem(om_s, outs[2].at[bh, crows])
            plgpu.wait_smem_to_gmem(0)
            pl.run_scoped(lambda s: _store(s, m_i + jnp.log(l_i), outs[3].at[bh, crows]), plgpu.SMEM((t,), f32))

    out_type = (jax.ShapeDtypeStruct((BH, C_pad, d), f32), jax.ShapeDtypeStruct((BH, C_pad, dv), f32))
    if save:
        out_type += (jax.ShapeDtypeStruct((BH, C_pad, d), dtype), jax.ShapeDtypeStruct((BH, C_pad), f32))
    scratch = (plgpu.SMEM((d, d), dtype), plgpu.SMEM((d, d), dtype), plgpu.SMEM((6, d), dtype),
               plgpu.SMEM((t, d), dtype), plgpu.SMEM((t, d), dtype), plgpu.SMEM((t, d), dtype),
               plgpu.SMEM((t, t), dtype), plgpu.Barrier(num_barriers=4))
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(C_pad // t, BH), grid_names=("ct", "bh"),
        compiler_params=_SEMANTICS, interpret=interpret, kernel_name="eva_chunks_mgpu_fwd",
    )(q, k, kt, v, valid, sq, eps, w, vecs)


# ----------------------------------------------------------------------------- backward
def _backward_call(k, kt, v, valid, sq, om, omt, lse, delta, dbeta, dbt, *, P: int, scale: float, opts: EVAOptions,
                   interpret):
    """The token-level backward, the forward's grid, keys-major: k [BH, N, d], kt [BH, d, N], v [BH, N, dv]; valid,
    sq [BH, N] f32; om [BH, C_pad, d], omt [BH, d, C_pad] (the forward's ω), lse, delta [BH, C_pad] f32; dbeta
    [BH, C_pad, dv], dbt [BH, dv, C_pad] (compute dtype). Returns (the logits' ``a·dℓᵀ ω`` [BH, N, d] f32, dv
    [BH, N, dv] f32, ``Σ_c dℓ`` [BH, N] f32, dωᵀ [BH, d, C_pad] f32)."""
    BH, N, d = k.shape
    dv, t, dtype = v.shape[-1], TILE, k.dtype
    C_pad = N // P
    a, b = _rf_coefficients(scale, opts)

    def body(k_ref, kt_ref, v_ref, valid_ref, sq_ref, om_ref, omt_ref, lse_ref, dl_ref, db_ref, dbt_ref, dka_ref,
             dv_ref, r_ref, domt_ref, om_s, omt_s, lse_s, dl_s, db_s, dbt_s, w_s, dd_s, dka_o, r_o, bar, *own):
        dv_o = own[0] if own else dka_o  # the f32 staging tile, shared by dk and dv where d == dv
        ct, bh = jax.lax.axis_index("ct"), jax.lax.axis_index("bh")
        crows, tok0 = pl.ds(ct * t, t), ct * P
        loads = ((om_ref.at[bh, crows], om_s), (omt_ref.at[bh, :, crows], omt_s), (lse_ref.at[bh, crows], lse_s),
                 (dl_ref.at[bh, crows], dl_s), (db_ref.at[bh, crows], db_s), (dbt_ref.at[bh, :, crows], dbt_s))
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(len(loads)):
            plgpu.barrier_wait(bar.at[i])

        def step(idx, k_t, kt_t, v_t, valid_t, sq_t, domt):
            rows = pl.ds((tok0 + idx[0]) * t, t)
            ell = a * _matmul(k_t, omt_s, (t, t)) - b * _rows(sq_t, (t, t), 0)
            mask = _segment(P, idx[0], t, keys_major=True) & (_rows(valid_t, (t, t), 0) > 0.5)
            w = jnp.where(mask, jnp.exp(ell - _rows(lse_s, (t, t), 1)), 0.0)
            dl = w * (_matmul(v_t, dbt_s, (t, t)) - _rows(dl_s, (t, t), 1))  # zero off the segment (w = 0)
            w_s[...] = w.astype(dtype)
            dd_s[...] = (a * dl).astype(dtype)
            plgpu.commit_smem()
            _store(dka_o, _matmul(dd_s, om_s, (t, d)), dka_ref.at[bh, rows])
            _store(dv_o, _matmul(w_s, db_s, (t, dv)), dv_ref.at[bh, rows])
            _store(r_o, jnp.sum(dl, axis=1), r_ref.at[bh, rows])
            return domt + _matmul(kt_t, dd_s, (d, t))

        tok = lambda s: (tok0 + s, 0)  # noqa: E731
        vec = plgpu.BlockSpec((t,), lambda s: (tok0 + s,))
        domt = plgpu.emit_pipeline(
            step, grid=(P,), max_concurrent_steps=min(2, P), init_carry=jnp.zeros((d, t), f32),
            in_specs=[plgpu.BlockSpec((t, d), tok), plgpu.BlockSpec((d, t), lambda s: (0, tok0 + s)),
                      plgpu.BlockSpec((t, dv), tok), vec, vec],
        )(k_ref.at[bh], kt_ref.at[bh], v_ref.at[bh], valid_ref.at[bh], sq_ref.at[bh])
        pl.run_scoped(lambda s: _store(s, domt, domt_ref.at[bh, :, crows]), plgpu.SMEM((d, t), f32))

    out_type = (jax.ShapeDtypeStruct((BH, N, d), f32), jax.ShapeDtypeStruct((BH, N, dv), f32),
                jax.ShapeDtypeStruct((BH, N), f32), jax.ShapeDtypeStruct((BH, d, C_pad), f32))
    scratch = (plgpu.SMEM((t, d), dtype), plgpu.SMEM((d, t), dtype), plgpu.SMEM((t,), f32), plgpu.SMEM((t,), f32),
               plgpu.SMEM((t, dv), dtype), plgpu.SMEM((dv, t), dtype), plgpu.SMEM((t, t), dtype),
               plgpu.SMEM((t, t), dtype), plgpu.SMEM((t, d), f32), plgpu.SMEM((t,), f32), plgpu.Barrier(num_barriers=6))
    scratch += (plgpu.SMEM((t, dv), f32),) if dv != d else ()
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(C_pad // t, BH), grid_names=("ct", "bh"),
        compiler_params=_SEMANTICS, interpret=interpret, kernel_name="eva_chunks_mgpu_bwd",
    )(k, kt, v, valid, sq, om, omt, lse, delta, dbeta, dbt)


# ----------------------------------------------------------------------------- differentiable entry
def _t(x):
    """The last two axes swapped (wgmma operands without transposed views: module docstring)."""
    return jnp.swapaxes(x, -1, -2)


def _layout(q_ch, k_ch, v_ch, k_valid, noise, cd):
    """The kernels' operands: q, k, v [BH, N, d·] (compute dtype, C padded to C_pad, a multiple of :data:`TILE`),
    the validity [BH, N] f32 (broadcast over heads, or per batch row), each key's ½‖k‖² [BH, N] f32, the noise
    [BH, C_pad, d] (compute dtype)."""
    B, H, C, P, d = q_ch.shape
    C_pad = -(-C // TILE) * TILE
    padc = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, C_pad - C)) + ((0, 0),) * (x.ndim - 3))  # noqa: E731
    flat = lambda x: padc(x.astype(cd)).reshape(B * H, C_pad * P, x.shape[-1])  # noqa: E731
    q, k, v = flat(q_ch), flat(k_ch), flat(v_ch)
    rows = eva_chunks._valid_rows(k_valid, C, C_pad, P, TILE)  # [C_pad/t, 1, t·P] or [B, C_pad/t, 1, t·P]
    valid = rows.reshape(-1, C_pad * P)
    valid = jnp.broadcast_to(valid[:, None], (valid.shape[0], H, C_pad * P)) if valid.shape[0] > 1 else valid
    valid = jnp.broadcast_to(valid.reshape(-1, C_pad * P), (B * H, C_pad * P))
    with statistic("EVA log-features: the half squared key norms"):
        kf = k.astype(f32)
        sq = 0.5 * jnp.sum(kf * kf, axis=-1)
    return q, k, v, valid, sq, padc(noise.astype(cd)).reshape(B * H, C_pad, d)


def _params(params, d: int, cd):
    """The projection matrices [2, d, d] and the six vectors [6, d], in the compute dtype as the Triton kernel casts
    them (the vectors are added and scaled in f32 inside the kernel: no product takes them)."""
    w = jnp.stack([params[n].astype(cd).reshape(d, d) for n in ("q_w", "k_w")])
    vecs = jnp.stack([params[n].astype(cd).reshape(d) for n in _PARAMS if not n.endswith("_w")])
    return w, vecs


def _run(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret, save):
    B, H, C, P, d = q_ch.shape
    cd = compute_dtype(q_ch, k_ch, v_ch)
    q, k, v, valid, sq, eps = _layout(q_ch, k_ch, v_ch, k_valid, noise, cd)
    w, vecs = _params(params, d, cd)
    out = _forward_call(q, k, _t(k), v, valid, sq, eps, w, vecs, P=P, scale=scale, opts=opts, save=save,
                        interpret=interpret)
    unflat = lambda x: x.reshape((B, H) + x.shape[1:])[:, :, :C]  # noqa: E731
    return (unflat(out[0]), unflat(out[1])), tuple(out[2:]) + ((out[1],) if save else ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret):
    return _run(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret, False)[0]


def _stats_fwd(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret):
    out, saved = _run(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret, True)
    return out, (q_ch, k_ch, v_ch, k_valid, params, noise) + saved


def _stats_bwd(opts, scale, interpret, res, g):
    """The chunk-level half by autodiff of :func:`chunk_proposals` in XLA, the token-level half by
    :func:`_backward_call`, whose ``dω`` enters the chunk-level VJP with the cotangent of ``k̂`` (the Triton
    kernel's split)."""
    q_ch, k_ch, v_ch, k_valid, params, noise, omega_k, lse, beta_pad = res
    dk_hat, dbeta = g
    B, H, C, P, d = q_ch.shape
    cd = compute_dtype(q_ch, k_ch, v_ch)
    chunk_level = lambda q, k, p, n: chunk_proposals(q, k, p, n, opts, dtype=cd)  # noqa: E731
    (_, omega), vjp = jax.vjp(chunk_level, q_ch.astype(cd), k_ch.astype(cd), params, noise)
    _, k, v, valid, sq, _ = _layout(q_ch, k_ch, v_ch, k_valid, noise, cd)
    C_pad = beta_pad.shape[1]
    db = jnp.pad(dbeta.astype(cd).reshape(B * H, C, -1), ((0, 0), (0, C_pad - C), (0, 0)))
    with statistic("EVA chunk weights' gradient: Δ = dβ·β (FlashAttention's rowsum(dO ⊙ O))"):
        delta = jnp.sum(db.astype(f32) * beta_pad, axis=-1)
    dka, dv, r, domt = _backward_call(k, _t(k), v, valid, sq, omega_k, _t(omega_k), lse, delta, db, _t(db), P=P,
                                      scale=scale, opts=opts, interpret=interpret)
    _, b = _rf_coefficients(scale, opts)
    dk_tok = dka - b * r[..., None] * k.astype(f32)
    unflat = lambda x: x.reshape(B, H, C_pad, P, x.shape[-1])[:, :, :C]  # noqa: E731
    domega = _t(domt).reshape(B, H, C_pad, d)[:, :, :C]
    dq, dk_means, dp, dn = vjp((dk_hat, domega.astype(omega.dtype)))
    dk = dk_means.astype(f32) + unflat(dk_tok)
    return (dq.astype(q_ch.dtype), dk.astype(k_ch.dtype), unflat(dv).astype(v_ch.dtype), None, dp,
            dn.astype(noise.dtype))


_stats.defvjp(_stats_fwd, _stats_bwd)


def eva_chunk_stats_mgpu(q_ch, k_ch, v_ch, k_valid, params, noise, opts: EVAOptions, scale: float, *,
                         interpret=False, compute_capability=None):
    """:func:`pallas_kernels.eva_chunks.eva_chunk_stats`'s contract (``chunk_summaries``'s operands, ``k_valid``
    ``[C,P]`` or per batch row ``[B,1,C,P]``; ``(k̂, β)`` f32, differentiable in q, k, v, the parameters and the
    noise) by the Mosaic GPU kernels. ``interpret``: True runs Mosaic GPU's interpret mode (any backend); an
    ``InterpretGPUParams`` is passed as given."""
    P, d, dv = q_ch.shape[-2], q_ch.shape[-1], v_ch.shape[-1]
    reasons = unsupported_reasons("interpret" if interpret else "cuda", P=P, d=d, dv=dv,
                                  dtype=compute_dtype(q_ch, k_ch, v_ch), compute_capability=compute_capability)
    if reasons:
        raise ValueError("eva_chunks_mgpu cannot run: " + "; ".join(reasons))
    if interpret is True:
        interpret = interpret_params()
    if noise is None:
        noise = jnp.zeros(q_ch.shape[:3] + (d,), f32)
    return _stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret or False)


def make_stats_fn(*, interpret=False):
    """A drop-in ``stats_fn`` for EVA's passes (``eva_chunks.make_stats_fn``'s)."""

    def stats_fn(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale):
        return eva_chunk_stats_mgpu(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, interpret=interpret)

    return stats_fn


__all__ = ["GPU_DTYPES", "MAX_HEAD", "TILE", "eva_chunk_stats_mgpu", "make_stats_fn", "smem_bytes",
           "unsupported_reasons"]

"""Pallas kernel "FMA multilevel blocks" (docs/methods/fma.md §8): forward and FlashAttention-2-style backward
kernels, lowered for GPU (Triton) and TPU (Mosaic); interpret mode on a CPU.

The reference it must match is :func:`pallas_kernels.fma_blocks_ref.attend_blocks` (operands on the kernel's
``[BH, ...]`` layout: :func:`_ref_blocks`). This module imports JAX, NumPy and its reference only (never ``longctx``).

Operands: ``q, k [BH, n_pad, d]`` (``q`` pre-scaled), ``v [BH, n_pad, dv]``, the packed coarse slots
``kc [BH, nb, C_pad, d], vc [BH, nb, C_pad, dv]`` of each fine block (``nb = n_pad / m``) and their static bias
``cbias [nb, 1, C_pad]`` (beta_l on valid slots, NEG on masked and pad slots). A fine query block reads its own
key block (causal mask), the previous one and, bidirectional, the next one, all from the same K/V arrays
through clamped index maps (an out-of-range block is masked), and its own coarse slots.

Kernels, each on grid ``(BH, nb)`` with both axes parallel (every program writes only its own blocks):

* **forward**: one program per fine query block; one online softmax over the segments current (first, so the
  running max is finite), previous, next, coarse. Writes ``o`` and the per-row log-sum-exp ``lse`` (fp32), kept
  with the inputs as the backward's residuals.
* **dq** (the forward's grid): probabilities recomputed from the saved ``lse`` over the same segments,
  ``dS = P (dO Vᵀ - Δ)`` with ``Δ = rowsum(dO ⊙ O)`` (computed in JAX); writes ``dq`` and the gradient of its
  own packed coarse slots ``dkc = dSᵀ q``, ``dvc = Pᵀ dO`` (``[BH, nb, C_pad, *]``; one program owns a block's
  slots, so no races). From the packed slots the gradient reaches the level summaries by JAX autodiff of the
  caller's packing (a gather; XLA).
* **dk/dv**: one program per key block ``j``; it takes the query blocks that see it through clamped index maps:
  ``j`` itself (causal mask), ``j + 1`` (whose "previous" block ``j`` is) and, bidirectional, ``j - 1`` (whose
  "next" block ``j`` is); ``dv = Σ Pᵀ dO``, ``dk = Σ dSᵀ q``.

Dtypes (DESIGN.md §7): q, k, v, the coarse slots and ``dO`` in the compute dtype (fp32 or bf16, one dtype; the
entry casts mixed operands to their common type); every dot takes its operands as they are (``P``, ``dS`` and
``dO`` cast down to the compute dtype) with fp32 accumulation (``preferred_element_type``); scores, softmax
statistics (``lse``, ``Δ``, the static bias) and accumulators fp32; the activations and gradients written
(``o``, ``dq``, ``dk``, ``dv``, ``dkc``, ``dvc``) in the compute dtype, each rounded once from its fp32 accumulator. Masks use the finite
NEG (never -inf). No attention dropout (refused). The static bias gets a zero gradient (the caller's is a
constant table).

Support (:func:`unsupported_reasons`): GPU ``m`` in :data:`GPU_M` (Triton dots need >= 16 rows; a 256 x 256 fp32
probability tile, 256 KiB, is more than an H100 SM's 228 KiB of shared memory, through which Triton may stage a
dot's operand: an estimate, not a GPU measurement), ``d``, ``dv`` powers of two in [16, 256], the coarse slots
padded to a power of two >= 16, by default 4 warps up to ``m = 64`` and 8 at 128 and 2 pipeline stages (the
callers' ``num_warps`` / ``num_stages`` override them: :func:`gpu_tiles`); TPU ``m`` in :data:`SUPPORTED_M`, ``d``,
``dv`` multiples of 128 (or 64), the coarse slots padded to a multiple of 8. The backward kernels use the
forward's tiles (one ``[m, m]`` or ``[m, C_pad]`` score tile at a time), so they take every shape the forward takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fma_blocks_ref import NEG, attend_blocks
from pallas_kernels.precision import dot_nn as _nn
from pallas_kernels.precision import dot_nt as _nt
from pallas_kernels.precision import dot_tn as _tn

f32 = jnp.float32
SUPPORTED_M = (8, 16, 32, 64, 128, 256)
GPU_M = (16, 32, 64, 128)
GPU_MAX_HEAD = 256


def unsupported_reasons(platform: str, *, m: int, d: int, dv: int, coarse_kind=None, q_block0_static=True,
                        dropout: float = 0.0, **_) -> list[str]:
    """Why the kernel (forward and backward) cannot serve these shapes on ``platform``
    ('tpu' | 'cuda' | 'rocm' | 'interpret')."""
    out = []
    if coarse_kind not in (None, "packed"):
        out.append(f"coarse operand {coarse_kind!r} (FMA-linear) is not computed by the kernel, only FMA's packed slots")
    if not q_block0_static:
        out.append("streaming/decoding calls (a traced block offset) use the reference")
    if dropout > 0:
        out.append("no attention dropout in the kernel")
    if platform == "interpret":
        return out
    if platform == "rocm":
        out.append("not written for ROCm")
    if platform == "cuda":
        if m not in GPU_M:
            out.append(f"fine block m={m} not in {GPU_M} on GPU (Triton dots need >= 16 rows; a 256 x 256 fp32 "
                       "probability tile is more than an SM's shared memory)")
        if d & (d - 1) or dv & (dv - 1) or not (16 <= d <= GPU_MAX_HEAD and 16 <= dv <= GPU_MAX_HEAD):
            out.append(f"head dims d={d}, dv={dv} must be powers of two in [16, {GPU_MAX_HEAD}] on GPU "
                       "(Triton block shapes)")
    elif m not in SUPPORTED_M:
        out.append(f"fine block m={m} not in {SUPPORTED_M}")
    if platform == "tpu" and (d % 128 and d not in (64,) or dv % 128 and dv not in (64,)):
        out.append(f"head dims d={d}, dv={dv}: TPU blocks want multiples of 128 (or 64)")
    return out


def _c_pad(C: int, platform: str) -> int:
    if C == 0:
        return 0
    if platform == "cuda":
        return max(16, 1 << (C - 1).bit_length())
    return -(-C // 8) * 8




def _fine_scores(q, k, qblk, kblk, in_range, *, m: int, causal: bool, n_valid: int):
    """Scores [m, m] of query block ``qblk`` against key block ``kblk`` (traced ints) and their mask."""
    s = _nt(q, k)
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
    kpos = kblk * m + cols
    valid = (kpos >= 0) & (kpos < n_valid) & in_range
    if causal:
        valid = valid & (kpos <= qblk * m + rows)
    return jnp.where(valid, s, NEG), valid


def _coarse_scores(q, kc, cb):
    """Scores [m, C_pad] of a query block against its packed coarse slots (bias ``cb [1, C_pad]``) and their mask."""
    s = _nt(q, kc) + cb
    valid = jnp.broadcast_to(cb > NEG / 2, s.shape)
    return jnp.where(valid, s, NEG), valid


def _q_segments(b, nb: int, causal: bool):
    """(key block, in range) of the fine segments query block ``b`` reads, in the forward's order."""
    segs = [(b, True), (b - 1, b > 0)]
    if not causal:
        segs.append((b + 1, b < nb - 1))
    return segs


def _split_q_refs(refs, causal: bool, has_coarse: bool, n_extra: int):
    """(q, [(k, v) per fine segment], (kc, vc, cb) or None, extra inputs, outputs)."""
    n_seg = 2 if causal else 3
    q_ref = refs[0]
    kv = [(refs[1 + 2 * t], refs[2 + 2 * t]) for t in range(n_seg)]
    rest = refs[1 + 2 * n_seg:]
    coarse = None
    if has_coarse:
        coarse, rest = rest[:3], rest[3:]
    return q_ref, kv, coarse, rest[:n_extra], rest[n_extra:]


# ----------------------------------------------------------------------------- forward / dq kernels
def _fwd_kernel(*refs, m: int, nb: int, causal: bool, n_valid: int, has_coarse: bool):
    q_ref, kv, coarse, _, (o_ref, lse_ref) = _split_q_refs(refs, causal, has_coarse, 0)
    b = pl.program_id(1)
    q = q_ref[...]

    def online(carry, s, valid, vals):
        mi, li, acc = carry
        m_new = jnp.maximum(mi, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(mi - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        li = alpha * li + jnp.sum(p, axis=1, keepdims=True)
        return m_new, li, alpha * acc + _nn(p.astype(vals.dtype), vals)

    carry = (jnp.full((m, 1), NEG, f32), jnp.zeros((m, 1), f32), jnp.zeros((m, o_ref.shape[-1]), f32))
    for (blk, ok), (k_ref, v_ref) in zip(_q_segments(b, nb, causal), kv):
        s, valid = _fine_scores(q, k_ref[...], b, blk, ok, m=m, causal=causal, n_valid=n_valid)
        carry = online(carry, s, valid, v_ref[...])
    if coarse is not None:
        kc_ref, vc_ref, cb_ref = coarse
        s, valid = _coarse_scores(q, kc_ref[...], cb_ref[...])
        carry = online(carry, s, valid, vc_ref[...])
    mi, li, acc = carry
    li = jnp.maximum(li, 1e-30)  # a row with no valid key (none in practice): output 0, as the reference
    o_ref[...] = (acc / li).astype(o_ref.dtype)
    lse_ref[...] = mi + jnp.log(li)


def _dq_kernel(*refs, m: int, nb: int, causal: bool, n_valid: int, has_coarse: bool):
    q_ref, kv, coarse, (do_ref, lse_ref, dl_ref), outs = _split_q_refs(refs, causal, has_coarse, 3)
    b = pl.program_id(1)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], dl_ref[...]

    def probs_and_ds(s, valid, vals):
        p = jnp.where(valid, jnp.exp(s - lse), 0.0)
        return p, p * (_nt(do, vals) - delta)

    dq = jnp.zeros((m, q.shape[-1]), f32)
    for (blk, ok), (k_ref, v_ref) in zip(_q_segments(b, nb, causal), kv):
        k = k_ref[...]
        s, valid = _fine_scores(q, k, b, blk, ok, m=m, causal=causal, n_valid=n_valid)
        _, ds = probs_and_ds(s, valid, v_ref[...])
        dq = dq + _nn(ds.astype(k.dtype), k)
    if coarse is not None:
        kc_ref, vc_ref, cb_ref = coarse
        dq_ref, dkc_ref, dvc_ref = outs
        kc = kc_ref[...]
        s, valid = _coarse_scores(q, kc, cb_ref[...])
        p, ds = probs_and_ds(s, valid, vc_ref[...])
        dq = dq + _nn(ds.astype(kc.dtype), kc)
        dkc_ref[...] = _tn(ds.astype(q.dtype), q).astype(dkc_ref.dtype)
        dvc_ref[...] = _tn(p.astype(do.dtype), do).astype(dvc_ref.dtype)
    else:
        (dq_ref,) = outs
    dq_ref[...] = dq.astype(dq_ref.dtype)


# ----------------------------------------------------------------------------- dk / dv kernel
def _key_roles(j, nb: int, causal: bool):
    """(query block, in range) of the query blocks that read key block ``j``: itself ("current"), ``j + 1``
    (through its "previous") and, bidirectional, ``j - 1`` (through its "next")."""
    roles = [(j, True), (j + 1, j + 1 < nb)]
    if not causal:
        roles.append((j - 1, j > 0))
    return roles


def _dkv_kernel(*refs, m: int, nb: int, causal: bool, n_valid: int):
    k_ref, v_ref = refs[0], refs[1]
    n_roles = 2 if causal else 3
    per = [refs[2 + 4 * t: 6 + 4 * t] for t in range(n_roles)]
    dk_ref, dv_ref = refs[2 + 4 * n_roles:]
    j = pl.program_id(1)
    k, v = k_ref[...], v_ref[...]
    dk = jnp.zeros(dk_ref.shape, f32)
    dv = jnp.zeros(dv_ref.shape, f32)
    for (i, ok), (q_ref, do_ref, lse_ref, dl_ref) in zip(_key_roles(j, nb, causal), per):
        q, do = q_ref[...], do_ref[...]
        s, valid = _fine_scores(q, k, i, j, ok, m=m, causal=causal, n_valid=n_valid)  # [m_q, m_k]
        p = jnp.where(valid, jnp.exp(s - lse_ref[...]), 0.0)
        dv = dv + _tn(p.astype(do.dtype), do)
        ds = p * (_nt(do, v) - dl_ref[...])
        dk = dk + _tn(ds.astype(q.dtype), q)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_call wrappers
def gpu_tiles(m: int, num_warps: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the GPU lowering: as given, else the rule (4 warps up to ``m = 64`` rows, 8
    at 128; 2 stages)."""
    return (num_warps or (4 if m <= 64 else 8), num_stages or 2)


def _compiler_params(platform, m: int, tiles=(None, None)):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    if platform in ("gpu", "cuda"):
        from jax.experimental.pallas import triton as pltriton

        warps, stages = gpu_tiles(m, *tiles)
        return pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    return None


def _call(kernel, nb, BH, specs, out_specs, outs, interpret, platform, m, tiles=(None, None)):
    return pl.pallas_call(kernel, grid=(BH, nb), in_specs=specs, out_specs=out_specs, out_shape=outs,
                          interpret=interpret,
                          compiler_params=None if interpret else _compiler_params(platform, m, tiles))


def _qside(kernel, q, k, v, kc, vc, cbias, extra, outs, out_specs, *, m, causal, n_valid, interpret, platform,
           tiles=(None, None)):
    """Run a kernel on the forward's grid: the query block, its fine key blocks, its coarse slots and ``extra``
    per-query-row inputs ``[BH, n_pad, *]``."""
    BH, n_pad, d = q.shape
    dv = v.shape[-1]
    nb = n_pad // m
    cur = lambda bh, b: (bh, b, 0)  # noqa: E731
    prev = lambda bh, b: (bh, jnp.maximum(b - 1, 0), 0)  # noqa: E731
    nxt = lambda bh, b: (bh, jnp.minimum(b + 1, nb - 1), 0)  # noqa: E731
    specs = [pl.BlockSpec((None, m, d), cur)]
    args = [q]
    for imap in (cur, prev) + (() if causal else (nxt,)):
        specs += [pl.BlockSpec((None, m, d), imap), pl.BlockSpec((None, m, dv), imap)]
        args += [k, v]
    has_coarse = kc is not None
    if has_coarse:
        C = kc.shape[2]
        specs += [pl.BlockSpec((None, None, C, d), lambda bh, b: (bh, b, 0, 0)),
                  pl.BlockSpec((None, None, C, dv), lambda bh, b: (bh, b, 0, 0)),
                  pl.BlockSpec((None, 1, C), lambda bh, b: (b, 0, 0))]
        args += [kc, vc, cbias]
    for arr in extra:
        specs.append(pl.BlockSpec((None, m, arr.shape[-1]), cur))
        args.append(arr)
    body = functools.partial(kernel, m=m, nb=nb, causal=causal, n_valid=n_valid, has_coarse=has_coarse)
    return _call(body, nb, BH, specs, out_specs, outs, interpret, platform, m, tiles)(*args)


def _check(q, v, m, interpret, platform):
    """The platform the lowering targets (None in interpret mode); raises ValueError on refused shapes."""
    if interpret:
        return None
    platform = platform or {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    reasons = unsupported_reasons(platform, m=m, d=q.shape[-1], dv=v.shape[-1])
    if reasons:
        raise ValueError(f"fma_blocks: unsupported on {platform}: " + "; ".join(reasons))
    return platform


def fma_blocks_forward(q, k, v, kc, vc, cbias, *, m: int, causal: bool, n_valid: int, interpret: bool = False,
                       platform: str | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """q, k [BH, n_pad, d] (q pre-scaled), v [BH, n_pad, dv]; kc [BH, nb, C_pad, d], vc [BH, nb, C_pad, dv],
    cbias [nb, 1, C_pad] (or kc = None: fine level only). Returns ``(o [BH, n_pad, dv], lse [BH, n_pad, 1])``: ``o``
    in the operands' (compute) dtype, ``lse`` f32.
    ``platform`` ('tpu' | 'cuda'; None: the default backend) picks the lowering's compiler parameters
    (``num_warps``, ``num_stages``: the GPU lowering's, None: :func:`gpu_tiles`' rule); shapes the kernel does not
    support there raise ValueError naming the reasons."""
    platform = _check(q, v, m, interpret, platform)
    BH, n_pad, _ = q.shape
    dv = v.shape[-1]
    cur = lambda bh, b: (bh, b, 0)  # noqa: E731
    outs = [jax.ShapeDtypeStruct((BH, n_pad, dv), v.dtype), jax.ShapeDtypeStruct((BH, n_pad, 1), f32)]
    out_specs = [pl.BlockSpec((None, m, dv), cur), pl.BlockSpec((None, m, 1), cur)]
    o, lse = _qside(_fwd_kernel, q, k, v, kc, vc, cbias, [], outs, out_specs, m=m, causal=causal,
                    n_valid=n_valid, interpret=interpret, platform=platform, tiles=(num_warps, num_stages))
    return o, lse


def fma_blocks_backward(q, k, v, kc, vc, cbias, o, lse, do, *, m: int, causal: bool, n_valid: int,
                        interpret: bool = False, platform: str | None = None, num_warps: int | None = None,
                        num_stages: int | None = None):
    """Gradients ``(dq, dk, dv, dkc, dvc)`` (the operands' dtype; ``dkc = dvc = None`` without coarse slots) of the forward's
    ``o`` for the cotangent ``do [BH, n_pad, dv]``, from its residuals ``o, lse``."""
    platform = _check(q, v, m, interpret, platform)
    BH, n_pad, d = q.shape
    dvd = v.shape[-1]
    nb = n_pad // m
    do = do.astype(f32)
    delta = jnp.sum(do * o.astype(f32), axis=-1, keepdims=True)  # a statistic: fp32
    do = do.astype(v.dtype)
    tiles = (num_warps, num_stages)
    kw = dict(m=m, causal=causal, n_valid=n_valid, interpret=interpret, platform=platform, tiles=tiles)
    cur = lambda bh, b: (bh, b, 0)  # noqa: E731
    outs = [jax.ShapeDtypeStruct((BH, n_pad, d), q.dtype)]
    out_specs = [pl.BlockSpec((None, m, d), cur)]
    if kc is not None:
        C = kc.shape[2]
        slot = lambda bh, b: (bh, b, 0, 0)  # noqa: E731
        outs += [jax.ShapeDtypeStruct((BH, nb, C, d), kc.dtype), jax.ShapeDtypeStruct((BH, nb, C, dvd), vc.dtype)]
        out_specs += [pl.BlockSpec((None, None, C, d), slot), pl.BlockSpec((None, None, C, dvd), slot)]
    res = _qside(_dq_kernel, q, k, v, kc, vc, cbias, [do, lse, delta], outs, out_specs, **kw)
    dq, dkc, dvc = (res[0], res[1], res[2]) if kc is not None else (res[0], None, None)

    specs = [pl.BlockSpec((None, m, d), cur), pl.BlockSpec((None, m, dvd), cur)]
    args = [k, v]
    for o_ in (0, 1) + (() if causal else (-1,)):  # the query block j + o_ reads key block j
        imap = lambda bh, j, o_=o_: (bh, jnp.clip(j + o_, 0, nb - 1), 0)  # noqa: E731
        specs += [pl.BlockSpec((None, m, d), imap), pl.BlockSpec((None, m, dvd), imap),
                  pl.BlockSpec((None, m, 1), imap), pl.BlockSpec((None, m, 1), imap)]
        args += [q, do, lse, delta]
    outs = [jax.ShapeDtypeStruct((BH, n_pad, d), k.dtype), jax.ShapeDtypeStruct((BH, n_pad, dvd), v.dtype)]
    out_specs = [pl.BlockSpec((None, m, d), cur), pl.BlockSpec((None, m, dvd), cur)]
    body = functools.partial(_dkv_kernel, m=m, nb=nb, causal=causal, n_valid=n_valid)
    dk, dv = _call(body, nb, BH, specs, out_specs, outs, interpret, platform, m, tiles)(*args)
    return dq, dk, dv, dkc, dvc


# ----------------------------------------------------------------------------- differentiable entry
def _ref_blocks(q, k, v, kc, vc, cbias, m, causal, n_valid, logit_budget):
    """The reference on the kernel's operands ([BH, ...] layout) -> [BH, n_pad, dv]."""
    BH, n_pad, d = q.shape
    nb = n_pad // m
    back = 0 if causal else m
    kp = jnp.pad(k, ((0, 0), (m, back), (0, 0)))[None]
    vp = jnp.pad(v, ((0, 0), (m, back), (0, 0)))[None]
    coarse = None
    if kc is not None:
        C = kc.shape[2]
        coarse = ("packed", kc.reshape(1, BH, nb * C, d), vc.reshape(1, BH, nb * C, -1),
                  jnp.arange(nb * C, dtype=jnp.int32).reshape(nb, C), cbias[:, 0, :])
    out = attend_blocks(q.reshape(1, BH, nb, m, d), kp, vp, coarse, q_block0=0, n_valid=n_valid, causal=causal,
                        logit_budget=logit_budget)
    return out.reshape(BH, n_pad, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _blocks(q, k, v, kc, vc, cbias, m, causal, n_valid, interpret, platform, tiles):
    return fma_blocks_forward(q, k, v, kc, vc, cbias, m=m, causal=causal, n_valid=n_valid, interpret=interpret,
                              platform=platform, num_warps=tiles[0], num_stages=tiles[1])[0]


def _blocks_fwd(q, k, v, kc, vc, cbias, m, causal, n_valid, interpret, platform, tiles):
    o, lse = fma_blocks_forward(q, k, v, kc, vc, cbias, m=m, causal=causal, n_valid=n_valid, interpret=interpret,
                                platform=platform, num_warps=tiles[0], num_stages=tiles[1])
    return o, (q, k, v, kc, vc, cbias, o, lse)


def _blocks_bwd(m, causal, n_valid, interpret, platform, tiles, res, g):
    q, k, v, kc, vc, cbias, o, lse = res
    dq, dk, dv, dkc, dvc = fma_blocks_backward(q, k, v, kc, vc, cbias, o, lse, g, m=m, causal=causal,
                                               n_valid=n_valid, interpret=interpret, platform=platform,
                                               num_warps=tiles[0], num_stages=tiles[1])
    cast = lambda x, ref: None if ref is None else x.astype(ref.dtype)  # noqa: E731
    return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dkc, kc), cast(dvc, vc),
            None if cbias is None else jnp.zeros_like(cbias))


_blocks.defvjp(_blocks_fwd, _blocks_bwd)


def fma_blocks(q, k, v, kc, vc, cbias, m, causal, n_valid, interpret, logit_budget=None, platform=None,
               num_warps=None, num_stages=None):
    """The kernel's output ``o [BH, n_pad, dv]`` (the operands' common dtype), differentiable in q, k, v, kc, vc by the backward kernels
    (operands as :func:`fma_blocks_forward`; mixed dtypes are cast to their common type). ``logit_budget`` is
    the reference's and unused here (the kernels hold one block's scores at a time); ``num_warps``,
    ``num_stages``: the GPU lowering's (None: :func:`gpu_tiles`' rule)."""
    del logit_budget
    ops = [x for x in (q, k, v, kc, vc) if x is not None]
    dt = jnp.result_type(*ops)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    if kc is not None:
        kc, vc = kc.astype(dt), vc.astype(dt)
    return _blocks(q, k, v, kc, vc, cbias, m, causal, n_valid, interpret, platform, (num_warps, num_stages))


def make_attend(*, interpret: bool, platform: str = "interpret", num_warps: int | None = None,
                num_stages: int | None = None):
    """An ``attend_blocks``-compatible function that runs the kernel on full-pass FMA operands
    (static block offset 0, packed or no coarse slots, no dropout) and the reference otherwise
    (streaming steps, FMA-linear statistics) -- the caller resolved that the kernel applies. ``num_warps``,
    ``num_stages``: the GPU lowering's (None: :func:`gpu_tiles`' rule)."""
    platform_ = None if platform == "interpret" else platform

    def attend(qb, kp, vp, coarse, *, q_block0, n_valid, causal, drop_key=None, attn_dropout=0.0,
               logit_budget=1 << 24):
        kind = None if coarse is None else coarse[0]
        if (kind not in (None, "packed") or not isinstance(q_block0, int) or q_block0 != 0
                or not isinstance(n_valid, int) or (drop_key is not None and attn_dropout > 0)):
            return attend_blocks(qb, kp, vp, coarse, q_block0=q_block0, n_valid=n_valid, causal=causal,
                                 drop_key=drop_key, attn_dropout=attn_dropout, logit_budget=logit_budget)
        B, H, nb, m, d = qb.shape
        dv = vp.shape[-1]
        BH = B * H
        q = qb.reshape(BH, nb * m, d)
        k = kp[:, :, m:m + nb * m].reshape(BH, nb * m, d)
        v = vp[:, :, m:m + nb * m].reshape(BH, nb * m, dv)
        kc = vc = cb = None
        if kind == "packed":
            _, kall, vall, idx, bias = coarse
            C = idx.shape[1]
            Cp = _c_pad(C, platform)
            idx = jnp.pad(idx, ((0, 0), (0, Cp - C)))
            cb = jnp.pad(bias, ((0, 0), (0, Cp - C)), constant_values=NEG)[:, None, :]
            kc = jnp.take(kall, idx.reshape(-1), axis=2).reshape(BH, nb, Cp, d)
            vc = jnp.take(vall, idx.reshape(-1), axis=2).reshape(BH, nb, Cp, dv)
        out = fma_blocks(q, k, v, kc, vc, cb, m, causal, n_valid, interpret, logit_budget, platform_, num_warps,
                         num_stages)
        return out.reshape(B, H, nb, m, dv)

    return attend


__all__ = ["GPU_M", "SUPPORTED_M", "fma_blocks", "fma_blocks_backward", "fma_blocks_forward", "gpu_tiles",
           "make_attend", "unsupported_reasons"]

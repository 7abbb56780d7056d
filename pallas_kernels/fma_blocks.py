"""Pallas kernel "FMA multilevel blocks" (docs/methods/fma.md §8), forward; backward v1 by a
``jax.custom_vjp`` that recomputes through the pure-JAX reference (``fma_blocks_ref.attend_blocks``).

Grid ``(BH, nb)``, both axes parallel; one program = one fine query block of ``m`` tokens. It reads its
own key block, the previous one (and the next one, bidirectional) from the same K/V arrays through
clamped index maps, and its packed coarse slots ``kc, vc [BH, nb, C_pad, d]`` with the static bias
``cbias [nb, 1, C_pad]`` (beta_l on valid slots, NEG on masked and pad slots). Body: one online softmax
over the segments current (causal mask; first, so the running max is finite), previous, next, coarse;
scores and statistics in f32, finite NEG masks (never -inf). No attention dropout.

Pre-stage (summaries, packing) is jnp in the caller and differentiable by XLA. This module imports
JAX, NumPy and its reference only (never ``longctx``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fma_blocks_ref import NEG, attend_blocks

SUPPORTED_M = (8, 16, 32, 64, 128, 256)


def unsupported_reasons(platform: str, *, m: int, d: int, dv: int, coarse_kind=None, q_block0_static=True,
                        dropout: float = 0.0, **_) -> list[str]:
    """Why the kernel cannot serve these shapes on ``platform`` ('tpu' | 'cuda' | 'rocm' | 'interpret')."""
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
    if m not in SUPPORTED_M:
        out.append(f"fine block m={m} not in {SUPPORTED_M}")
    if platform == "cuda" and (d & (d - 1) or dv & (dv - 1) or d < 16 or dv < 16):
        out.append(f"head dims d={d}, dv={dv} must be powers of two >= 16 on GPU (Triton block shapes)")
    if platform == "tpu" and (d % 128 and d not in (64,) or dv % 128 and dv not in (64,)):
        out.append(f"head dims d={d}, dv={dv}: TPU blocks want multiples of 128 (or 64)")
    return out


def _c_pad(C: int, platform: str) -> int:
    if C == 0:
        return 0
    if platform == "cuda":
        return max(16, 1 << (C - 1).bit_length())
    return -(-C // 8) * 8


def _kernel(*refs, m: int, causal: bool, n_valid: int, has_coarse: bool):
    if causal:
        q_ref, kc_ref, vc_ref, kp_ref, vp_ref = refs[:5]
        rest = refs[5:]
        kn_ref = vn_ref = None
    else:
        q_ref, kc_ref, vc_ref, kp_ref, vp_ref, kn_ref, vn_ref = refs[:7]
        rest = refs[7:]
    if has_coarse:
        kco_ref, vco_ref, cb_ref, o_ref = rest
    else:
        (o_ref,) = rest
    b = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)
    dv = o_ref.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
    qpos = b * m + rows

    def seg(carry, k, v, blk, in_range):
        mi, li, acc = carry
        s = jax.lax.dot_general(q, k.astype(jnp.float32), (((1,), (1,)), ((), ())))
        kpos = blk * m + cols
        valid = (kpos >= 0) & (kpos < n_valid) & in_range
        if causal:
            valid = valid & (kpos <= qpos)
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(mi, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(mi - m_new)
        pr = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        li = alpha * li + jnp.sum(pr, axis=1, keepdims=True)
        acc = alpha * acc + jax.lax.dot_general(pr, v.astype(jnp.float32), (((1,), (0,)), ((), ())))
        return m_new, li, acc

    carry = (jnp.full((m, 1), NEG, jnp.float32), jnp.zeros((m, 1), jnp.float32), jnp.zeros((m, dv), jnp.float32))
    carry = seg(carry, kc_ref[...], vc_ref[...], b, True)
    carry = seg(carry, kp_ref[...], vp_ref[...], b - 1, b > 0)
    if not causal:
        nb = pl.num_programs(1)
        carry = seg(carry, kn_ref[...], vn_ref[...], b + 1, b < nb - 1)
    mi, li, acc = carry
    if has_coarse:
        kc = kco_ref[...].astype(jnp.float32)
        cb = cb_ref[...]  # [1, C_pad]
        s = jax.lax.dot_general(q, kc, (((1,), (1,)), ((), ()))) + cb
        valid = jnp.broadcast_to(cb > NEG / 2, s.shape)
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(mi, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(mi - m_new)
        pr = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        li = alpha * li + jnp.sum(pr, axis=1, keepdims=True)
        acc = alpha * acc + jax.lax.dot_general(pr, vco_ref[...].astype(jnp.float32), (((1,), (0,)), ((), ())))
    o_ref[...] = (acc / li).astype(o_ref.dtype)


def _compiler_params(platform):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    if platform in ("gpu", "cuda"):
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return None


def fma_blocks_forward(q, k, v, kc, vc, cbias, *, m: int, causal: bool, n_valid: int, interpret: bool = False,
                       platform: str | None = None):
    """q, k [BH, n_pad, d] (q pre-scaled), v [BH, n_pad, dv]; kc [BH, nb, C_pad, d], vc [BH, nb, C_pad, dv],
    cbias [nb, 1, C_pad] (or kc = None: fine level only). Returns o [BH, n_pad, dv] f32.
    ``platform`` ('tpu' | 'cuda'; None: the default backend) picks the lowering's compiler parameters;
    shapes the kernel does not support there raise ValueError naming the reasons."""
    BH, n_pad, d = q.shape
    dv = v.shape[-1]
    nb = n_pad // m
    if not interpret:
        platform = platform or {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
        reasons = unsupported_reasons(platform, m=m, d=d, dv=dv)
        if reasons:
            raise ValueError(f"fma_blocks: unsupported on {platform}: " + "; ".join(reasons))
    cur = lambda bh, b: (bh, b, 0)  # noqa: E731
    prev = lambda bh, b: (bh, jnp.maximum(b - 1, 0), 0)  # noqa: E731
    nxt = lambda bh, b: (bh, jnp.minimum(b + 1, nb - 1), 0)  # noqa: E731
    specs = [pl.BlockSpec((None, m, d), cur), pl.BlockSpec((None, m, d), cur), pl.BlockSpec((None, m, dv), cur),
             pl.BlockSpec((None, m, d), prev), pl.BlockSpec((None, m, dv), prev)]
    args = [q, k, v, k, v]
    if not causal:
        specs += [pl.BlockSpec((None, m, d), nxt), pl.BlockSpec((None, m, dv), nxt)]
        args += [k, v]
    has_coarse = kc is not None
    if has_coarse:
        C = kc.shape[2]
        specs += [pl.BlockSpec((None, None, C, d), lambda bh, b: (bh, b, 0, 0)),
                  pl.BlockSpec((None, None, C, dv), lambda bh, b: (bh, b, 0, 0)),
                  pl.BlockSpec((None, 1, C), lambda bh, b: (b, 0, 0))]
        args += [kc, vc, cbias]
    kernel = functools.partial(_kernel, m=m, causal=causal, n_valid=n_valid, has_coarse=has_coarse)
    return pl.pallas_call(
        kernel,
        grid=(BH, nb),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, m, dv), cur),
        out_shape=jax.ShapeDtypeStruct((BH, n_pad, dv), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform),
    )(*args)


# ---------------------------------------------------------------------------
# differentiable wrapper: forward kernel, backward through the reference (v1)
# ---------------------------------------------------------------------------


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
def fma_blocks(q, k, v, kc, vc, cbias, m, causal, n_valid, interpret, logit_budget, platform=None):
    return fma_blocks_forward(q, k, v, kc, vc, cbias, m=m, causal=causal, n_valid=n_valid, interpret=interpret,
                              platform=platform)


def _fwd(q, k, v, kc, vc, cbias, m, causal, n_valid, interpret, logit_budget, platform):
    out = fma_blocks_forward(q, k, v, kc, vc, cbias, m=m, causal=causal, n_valid=n_valid, interpret=interpret,
                             platform=platform)
    return out, (q, k, v, kc, vc, cbias)


def _bwd(m, causal, n_valid, interpret, logit_budget, platform, res, g):
    q, k, v, kc, vc, cbias = res
    _, vjp = jax.vjp(lambda *a: _ref_blocks(*a, cbias, m, causal, n_valid, logit_budget), q, k, v, kc, vc)
    return vjp(g) + (None if cbias is None else jnp.zeros_like(cbias),)


fma_blocks.defvjp(_fwd, _bwd)


def make_attend(*, interpret: bool, platform: str = "interpret"):
    platform_ = None if platform == "interpret" else platform
    """An ``attend_blocks``-compatible function that runs the kernel on full-pass FMA operands
    (static block offset 0, packed or no coarse slots, no dropout) and the reference otherwise
    (streaming steps, FMA-linear statistics) -- the caller resolved that the kernel applies."""

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
        out = fma_blocks(q, k, v, kc, vc, cb, m, causal, n_valid, interpret, logit_budget, platform_)
        return out.reshape(B, H, nb, m, dv)

    return attend


__all__ = ["fma_blocks", "fma_blocks_forward", "make_attend", "unsupported_reasons"]

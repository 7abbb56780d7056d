"""EVA Phase A as a fused Pallas kernel: ``eva_chunk_stats`` (docs/methods/eva.md §8.2).

For every chunk ``c`` of ``P`` tokens (query-independent control-variate statistics)::

    q̄_c, k̄_c = mean_p q, mean_p k                      k̂_c = LN(k̄_c A_k + a_k), q̂_c likewise
    ω_c = µ_c + ε_c                                     µ_c = q̂_c + k̂_c (or ½(·), or 0)
    ℓ_{c,p} = log ξ(k_{c,p}, ω_c)                       β_c = Σ_p softmax_p(ℓ_{c,·}) v_{c,p}

The reference it must match is :func:`pallas_kernels.eva_chunks_ref.chunk_summaries` (pure jnp,
also EVA's XLA path; re-exported here as :func:`eva_chunk_stats_reference`). This module imports only
JAX and that reference.

Kernel layout: grid ``(B, H, C_pad / G)``; one step handles ``G`` chunks = ``T = G·P``
tokens. The chunk means and β use a ``(G, T)`` segment matrix built from iota
(``t // P == g``) so everything stays on the MXU (a factor ``G`` of wasted flops, ``O(L·T·d)``
total). ε is drawn outside by the per-chunk ``fold_in`` rule (zeros in deterministic mode).
Padding: a ``(1, T)`` validity row per tile masks ``ℓ`` (never -inf: all-padding chunks give β = 0).

Backward: ``custom_vjp`` whose backward is ``jax.vjp`` of the jnp reference (Phase A is
``O(L·d)``; a hand-written backward kernel would not pay off). So there is no kernel backward to test:
the kernel test skips its gradient check and says so.

Dtypes: fp32 and bf16 inputs, as the reference (DESIGN.md §7): q, k, v, the noise and the parameters enter in
the compute dtype (the inputs' dtype; the wrapper casts the float32 parameters and noise to it), every product
takes operands in it with fp32 accumulation (the segment matrix is exact in it; the chunk means, ``ω`` and the
weights are cast down before their products), LayerNorm, log-features and softmax run in fp32, and the outputs
``k̂``, ``β`` are fp32 statistics.

Platforms: TPU (Mosaic) and GPU (Triton) lowering are exercised by
``tests/kernels/test_eva_chunks.py`` through ``jax.export``; on CPU the kernel runs only in
interpret mode. Triton needs power-of-two block dims: ``P`` and the head dims must be
powers of two on GPU (``G = 16`` makes ``T`` one as well). The token tiles are loaded where they are
used (q for its means, k through the logits, v for β), and the GPU form takes 4 or 8 warps by a register
estimate (:func:`gpu_warps`; heads of 128 at chunks of 8 take 8). :func:`unsupported_reasons` lists why a
platform or shape is refused (the shared implementation-selection rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.eva_chunks_ref import LN_EPS, NEG, EVAOptions, chunk_summaries
from pallas_kernels.precision import compute_dtype
from pallas_kernels.precision import dot_nt as _nt

GROUP = 16  # chunks per kernel step (multiple of 8 for TPU sublanes, >= 16 for Triton dots)

eva_chunk_stats_reference = chunk_summaries


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


PLATFORMS = ("tpu", "cuda")
DTYPES = ("float32", "bfloat16")
VMEM_LIMIT_BYTES = 16 * 2**20  # Mosaic's default scoped VMEM limit (this kernel sets none)
REG_WORDS_LIMIT = 192  # live fp32 tile words per thread the GPU estimate allows (of 255 registers), as eva_attend's


def gpu_words(*, P: int, d: int, dv: int, group: int = GROUP) -> int:
    """Live fp32 tile words of one GPU step: the key tile ``[T, d]`` (live from its means through the logits) and
    one other token tile (the queries, ``k ⊙ k`` for the norms, or the values: each loaded or made where it is used),
    ``T = G·P``, plus three ``[G, T]`` tiles (segment matrix, logits, weights). An estimate, not a measurement."""
    T = group * P
    return 2 * T * max(d, dv) + 3 * group * T


def gpu_warps(*, P: int, d: int, dv: int, group: int = GROUP) -> tuple[int, float]:
    """(num_warps, words per thread): 4 warps where :func:`gpu_words` fits :data:`REG_WORDS_LIMIT`, else 8 (chunks
    of 8: heads of 64 take 4 warps at 176 words, heads of 128 take 8 at 152)."""
    words = gpu_words(P=P, d=d, dv=dv, group=group)
    warps = 4 if words / 128 <= REG_WORDS_LIMIT else 8
    return warps, words / (32 * warps)


def vmem_bytes(*, P: int, d: int, dv: int, group: int = GROUP) -> int:
    """VMEM estimate of one step: double-buffered blocks (q, k, v, validity, ε in; k̂, β out), the
    parameter blocks, and the (G, T) f32 temporaries (segment matrix, logits, weights); fp32 blocks."""
    T = group * P
    pad = lambda r, c: (-(-r // 8) * 8) * (-(-c // 128) * 128) * 4  # noqa: E731
    blocks = 2 * pad(T, d) + pad(T, dv) + pad(1, T) + pad(group, d) + pad(group, d) + pad(group, dv)
    params = 2 * pad(d, d) + 6 * pad(1, d)
    return 2 * (blocks + params) + 3 * pad(group, T)


def unsupported_reasons(platform: str, *, P: int, d: int, dv: int, dtype=jnp.float32,
                        group: int = GROUP) -> list[str]:
    """Why the kernel cannot serve these sizes on ``platform`` ('tpu' | 'cuda' | 'rocm' | 'interpret');
    empty when it can."""
    reasons = []
    if jnp.dtype(dtype).name not in DTYPES:
        reasons.append(f"dtype {jnp.dtype(dtype).name} not supported (allowed: {', '.join(DTYPES)})")
    if platform == "interpret":
        return reasons
    if platform not in PLATFORMS:
        return reasons + [f"no {platform} lowering (kernel platforms: {', '.join(PLATFORMS)})"]
    if platform == "cuda" and not (_is_pow2(P) and _is_pow2(d) and _is_pow2(dv)):
        reasons.append(f"GPU (Triton) blocks need power-of-two chunk_size and head dims; got P={P}, d={d}, dv={dv}")
    elif platform == "cuda":
        warps, words = gpu_warps(P=P, d=d, dv=dv, group=group)
        if words > REG_WORDS_LIMIT:
            reasons.append(f"register estimate {words:.0f} words per thread at {warps} warps exceeds "
                           f"{REG_WORDS_LIMIT} (P={P}, d={d}, dv={dv}, group={group})")
    if platform == "tpu":
        need = vmem_bytes(P=P, d=d, dv=dv, group=group)
        if need > VMEM_LIMIT_BYTES:
            reasons.append(f"VMEM estimate {need / 2**20:.1f} MiB exceeds the {VMEM_LIMIT_BYTES / 2**20:.0f} MiB "
                           f"default limit (P={P}, d={d}, dv={dv}, group={group})")
    return reasons


def check_supported(P: int, d: int, dv: int, platform: str) -> None:
    """Raise ValueError when the kernel cannot be lowered for ``platform`` with these sizes."""
    plat = "cuda" if platform in ("gpu", "cuda") else platform
    reasons = unsupported_reasons(plat, P=P, d=d, dv=dv)
    if reasons:
        raise ValueError("eva_chunk_stats cannot run: " + "; ".join(reasons)
                         + ". Use attention.eva.impl='xla' for these sizes.")


def _layer_norm(x, g, b):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + LN_EPS) * g + b


def _kernel(q_ref, k_ref, v_ref, valid_ref, eps_ref, qw_ref, qb_ref, qg_ref, qbeta_ref, kw_ref, kb_ref, kg_ref,
            kbeta_ref, khat_ref, beta_ref, *, P: int, G: int, scale: float, opts: EVAOptions):
    T = G * P
    cd = k_ref.dtype  # the compute dtype: every product's operands (module docstring)
    t_idx = jax.lax.broadcasted_iota(jnp.int32, (G, T), 1)
    start = jax.lax.broadcasted_iota(jnp.int32, (G, T), 0) * P  # no integer division (no sign op on Mosaic)
    seg = (t_idx >= start) & (t_idx < start + P)
    segf = seg.astype(cd)  # 0 / 1: exact in any float dtype
    # each token tile loaded where it is used (gpu_words): q for its means, k through the logits, v for β
    q_bar = jnp.dot(segf, q_ref[...], preferred_element_type=jnp.float32) / P
    k = k_ref[...]
    k_bar = jnp.dot(segf, k, preferred_element_type=jnp.float32) / P
    if opts.chunk_rep == "identity":
        k_hat, q_hat = k_bar, q_bar
    else:
        use_ln = opts.adaptive_proj != "no-ln"
        k_hat = jnp.dot(k_bar.astype(cd), kw_ref[...], preferred_element_type=jnp.float32) + kb_ref[...]
        q_hat = jnp.dot(q_bar.astype(cd), qw_ref[...], preferred_element_type=jnp.float32) + qb_ref[...]
        if use_ln:
            k_hat = _layer_norm(k_hat, kg_ref[...], kbeta_ref[...])
            q_hat = _layer_norm(q_hat, qg_ref[...], qbeta_ref[...])
    if opts.adaptive_proj == "none" and opts.chunk_rep != "identity":
        mu = jnp.zeros_like(k_hat)
    elif opts.mu_mode == "sum":
        mu = q_hat + k_hat
    else:
        mu = 0.5 * (q_hat + k_hat)
    omega = mu + eps_ref[...].astype(jnp.float32)
    dots = _nt(omega.astype(cd), k)  # (G, T)
    kf = k.astype(jnp.float32)
    sq = 0.5 * _nt(jnp.ones((1, k.shape[1]), jnp.float32), kf * kf)  # (1, T): ½‖k_t‖², a row of fp32 norms
    if opts.rf_scale == "released":
        ell = scale * (dots - sq)
    else:
        ell = (scale**0.5) * dots - scale * sq
    mask = seg & (valid_ref[...] > 0.5)
    ell = jnp.where(mask, ell, NEG)
    m = jnp.max(ell, axis=1, keepdims=True)
    p = jnp.where(mask, jnp.exp(ell - m), 0.0)
    den = jnp.sum(p, axis=1, keepdims=True)
    beta = jnp.dot(p.astype(cd), v_ref[...], preferred_element_type=jnp.float32) / jnp.maximum(den, 1e-30)
    khat_ref[...] = k_hat.astype(khat_ref.dtype)
    beta_ref[...] = beta.astype(beta_ref.dtype)


def _compiler_params(platform, warps: int = 4):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    if platform in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=warps, num_stages=2)
    return None


def _pallas_stats(q, k, v, valid_rows, eps, params, *, P, G, scale, opts, interpret, platform):
    """q, k: [B,H,N,d]; v: [B,H,N,dv]; N = C_pad·P; valid_rows [N/T, 1, T] f32; eps [B,H,C_pad,d]; all but the
    validity rows in one compute dtype (the parameters are cast to it here)."""
    B, H, N, d = q.shape
    dv = v.shape[-1]
    T = G * P
    n_t = N // T
    C_pad = N // P
    tok = lambda dim: pl.BlockSpec((None, None, T, dim), lambda b, h, i: (b, h, i, 0))  # noqa: E731
    grp = lambda dim: pl.BlockSpec((None, None, G, dim), lambda b, h, i: (b, h, i, 0))  # noqa: E731
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, i: (0,) * len(shape))  # noqa: E731
    order = ("q_w", "q_b", "q_ln_scale", "q_ln_bias", "k_w", "k_b", "k_ln_scale", "k_ln_bias")
    pr = [params[n].astype(q.dtype).reshape((d, d) if n.endswith("_w") else (1, d)) for n in order]
    in_specs = [tok(d), tok(d), tok(dv), pl.BlockSpec((None, 1, T), lambda b, h, i: (i, 0, 0)), grp(d)]
    in_specs += [full(x.shape) for x in pr]
    kernel = functools.partial(_kernel, P=P, G=G, scale=scale, opts=opts)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, H, C_pad, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, C_pad, dv), jnp.float32)),
        grid=(B, H, n_t),
        in_specs=in_specs,
        out_specs=(grp(d), grp(dv)),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform, gpu_warps(P=P, d=d, dv=dv, group=G)[0]),
        name="eva_chunk_stats",
    )(q, k, v, valid_rows, eps, *pr)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform):
    B, H, C, P, _ = q_ch.shape
    C_pad = -(-C // G) * G
    padc = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, C_pad - C)) + ((0, 0),) * (x.ndim - 3))  # noqa: E731
    flat = lambda x: padc(x).reshape(B, H, C_pad * P, x.shape[-1])  # noqa: E731
    valid = jnp.pad(jnp.broadcast_to(k_valid, (C, P)), ((0, C_pad - C), (0, 0))).astype(jnp.float32)
    valid_rows = valid.reshape(C_pad // G, 1, G * P)
    cd = compute_dtype(q_ch, k_ch, v_ch)  # the reference's: q, k, v, noise and parameters enter in it
    k_hat, beta = _pallas_stats(flat(q_ch.astype(cd)), flat(k_ch.astype(cd)), flat(v_ch.astype(cd)), valid_rows,
                                padc(noise.astype(cd)), params, P=P, G=G, scale=scale, opts=opts,
                                interpret=interpret, platform=platform)
    return k_hat[:, :, :C], beta[:, :, :C]


def _stats_fwd(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform):
    out = _stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform)
    return out, (q_ch, k_ch, v_ch, k_valid, params, noise)


def _stats_bwd(opts, scale, G, interpret, platform, res, g):
    q_ch, k_ch, v_ch, k_valid, params, noise = res
    f = lambda q, k, v, p, n: chunk_summaries(q, k, v, k_valid, p, n, opts, scale)  # noqa: E731
    _, vjp = jax.vjp(f, q_ch, k_ch, v_ch, params, noise)
    dq, dk, dv, dp, dn = vjp(g)
    return dq, dk, dv, None, dp, dn


_stats.defvjp(_stats_fwd, _stats_bwd)


def eva_chunk_stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts: EVAOptions, scale: float, *,
                    group: int = GROUP, interpret: bool = False, platform: str | None = None):
    """Same contract as :func:`pallas_kernels.eva_chunks_ref.chunk_summaries` (q_ch, k_ch [B,H,C,P,d],
    v_ch [B,H,C,P,dv], k_valid [C,P], noise [B,H,C,d] or None) -> (k̂ [B,H,C,d], β [B,H,C,dv]).

    ``platform`` ('tpu' | 'cuda' | 'gpu' | 'rocm'; default: the default backend) picks the compiler
    parameters (Mosaic TPU, or Triton on GPU); ignored in interpret mode."""
    platform = platform or jax.default_backend()
    if not interpret:
        if platform == "cpu":
            raise ValueError("eva_chunk_stats: Pallas runs on CPU only with interpret=True")
        check_supported(q_ch.shape[-2], q_ch.shape[-1], v_ch.shape[-1], platform)
    if noise is None:
        noise = jnp.zeros(q_ch.shape[:3] + (q_ch.shape[-1],), jnp.float32)
    return _stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, group, interpret, platform)


def make_stats_fn(*, interpret: bool = False, group: int = GROUP, platform: str | None = None):
    """A drop-in ``stats_fn`` for EVA's ``eva_forward`` / ``eva_stream``."""

    def stats_fn(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale):
        return eva_chunk_stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, group=group,
                               interpret=interpret, platform=platform)

    return stats_fn


__all__ = ["DTYPES", "GROUP", "PLATFORMS", "check_supported", "eva_chunk_stats", "eva_chunk_stats_reference",
           "gpu_warps", "gpu_words", "make_stats_fn", "unsupported_reasons", "vmem_bytes"]

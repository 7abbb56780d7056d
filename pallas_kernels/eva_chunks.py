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

Backward (``custom_vjp``): the chunk-level half of Phase A (means, projections, LayerNorms, ``ω = µ + ε``:
``O(C·d²)`` after the ``O(L·d)`` means) is autodiff of the reference's :func:`chunk_proposals` in XLA; the
token-level half, β's weights over each chunk's keys, is a second kernel (``eva_chunk_stats_bwd``, the same grid
and tiles): the forward of a differentiated call also writes ``ω`` (compute dtype) and each chunk's log-sum-exp of
``ℓ`` (fp32), from which it recomputes the weights (flash style), and returns ``dv``, ``dω`` and the logits' share
of ``dk`` (fp32), so ``dω`` then joins the cotangent of ``k̂`` in the chunk-level VJP, which adds the means' shares
of ``dq`` and ``dk``. Products in the compute dtype as in the forward (``dβ`` and ``ω`` cast to it, the weights
and their gradient cast down before their products), fp32 accumulation.

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

from pallas_kernels import lazy_triton
from pallas_kernels.eva_chunks_ref import LN_EPS, NEG, EVAOptions, chunk_proposals, chunk_summaries
from pallas_kernels.precision import compute_dtype
from pallas_kernels.precision import dot_nn as _nn
from pallas_kernels.precision import dot_nt as _nt
from pallas_kernels.precision import dot_tn as _tn

GROUP = 16  # chunks per kernel step (multiple of 8 for TPU sublanes, >= 16 for Triton dots)

eva_chunk_stats_reference = chunk_summaries


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


PLATFORMS = ("tpu", "cuda")
DTYPES = ("float32", "bfloat16")
VMEM_LIMIT_BYTES = 16 * 2**20  # Mosaic's default scoped VMEM limit (this kernel sets none)
REG_WORDS_LIMIT = 192  # live fp32 tile words per thread the GPU estimate allows (of 255 registers), as eva_attend's


def gpu_words(*, P: int, d: int, dv: int, group: int = GROUP, backward: bool = False) -> int:
    """Live fp32 tile words of one GPU step: the key tile ``[T, d]`` (live from its means through the logits) and
    one other token tile (the queries, ``k ⊙ k`` for the norms, or the values: each loaded or made where it is used),
    ``T = G·P``, plus three ``[G, T]`` tiles (segment matrix, logits, weights). The ``backward`` step holds the key
    tile and one other (the values, then the key gradient) and a fourth ``[G, T]`` tile (the weights' gradient). An
    estimate, not a measurement."""
    T = group * P
    return 2 * T * max(d, dv) + (4 if backward else 3) * group * T


def gpu_warps(*, P: int, d: int, dv: int, group: int = GROUP, backward: bool = False) -> tuple[int, float]:
    """(num_warps, words per thread): 4 warps where :func:`gpu_words` fits :data:`REG_WORDS_LIMIT`, else 8 (chunks
    of 8: heads of 64 take 4 warps at 176 words, heads of 128 take 8 at 152; backward: 192 and 160)."""
    words = gpu_words(P=P, d=d, dv=dv, group=group, backward=backward)
    warps = 4 if words / 128 <= REG_WORDS_LIMIT else 8
    return warps, words / (32 * warps)


def vmem_bytes(*, P: int, d: int, dv: int, group: int = GROUP, backward: bool = False) -> int:
    """VMEM estimate of one step: double-buffered blocks (q, k, v, validity, ε in; k̂, β out), the
    parameter blocks, and the (G, T) f32 temporaries (segment matrix, logits, weights); fp32 blocks. ``backward``:
    k, v, validity, ω, dβ in; dk, dv, dω out; four temporaries."""
    T = group * P
    pad = lambda r, c: (-(-r // 8) * 8) * (-(-c // 128) * 128) * 4  # noqa: E731
    if backward:
        blocks = 2 * pad(T, d) + 2 * pad(T, dv) + pad(1, T) + 2 * pad(group, d) + pad(group, dv)
        return 2 * blocks + 4 * pad(group, T)
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
    if platform in ("cuda", "rocm"):
        reasons += lazy_triton.missing()
    if platform == "cuda" and not (_is_pow2(P) and _is_pow2(d) and _is_pow2(dv)):
        reasons.append(f"GPU (Triton) blocks need power-of-two chunk_size and head dims; got P={P}, d={d}, dv={dv}")
    elif platform == "cuda":
        for step in (False, True):
            warps, words = gpu_warps(P=P, d=d, dv=dv, group=group, backward=step)
            if words > REG_WORDS_LIMIT:
                reasons.append(f"register estimate {words:.0f} words per thread at {warps} warps exceeds "
                               f"{REG_WORDS_LIMIT} (P={P}, d={d}, dv={dv}, group={group}"
                               f"{', backward kernel' if step else ''})")
                break
    if platform == "tpu":
        need = max(vmem_bytes(P=P, d=d, dv=dv, group=group, backward=b) for b in (False, True))
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


def _segments(G: int, P: int):
    """The (G, T) segment mask: token t belongs to chunk g of the tile."""
    T = G * P
    t_idx = jax.lax.broadcasted_iota(jnp.int32, (G, T), 1)
    start = jax.lax.broadcasted_iota(jnp.int32, (G, T), 0) * P  # no integer division (no sign op on Mosaic)
    return (t_idx >= start) & (t_idx < start + P)


def _rf_coefficients(scale: float, opts: EVAOptions) -> tuple[float, float]:
    """(a, b) of the log-feature ``ℓ = a·(ω·k) − b·½‖k‖²`` (eva_chunks_ref.rf_log_feature)."""
    return (scale, scale) if opts.rf_scale == "released" else (scale**0.5, scale)


def _logits(seg, valid, omega, k, scale: float, opts: EVAOptions):
    """The log-features ``ℓ`` of a tile, fp32 (G, T) (masked off each chunk's tokens and at padding), and the mask:
    ``omega`` (G, d) and ``k`` (T, d) in the compute dtype; ``valid`` (1, T)."""
    dots = _nt(omega, k)  # (G, T)
    kf = k.astype(jnp.float32)
    sq = 0.5 * _nt(jnp.ones((1, k.shape[1]), jnp.float32), kf * kf)  # (1, T): ½‖k_t‖², a row of fp32 norms
    if opts.rf_scale == "released":
        ell = scale * (dots - sq)
    else:
        ell = (scale**0.5) * dots - scale * sq
    mask = seg & (valid > 0.5)
    return jnp.where(mask, ell, NEG), mask


def _kernel(q_ref, k_ref, v_ref, valid_ref, eps_ref, qw_ref, qb_ref, qg_ref, qbeta_ref, kw_ref, kb_ref, kg_ref,
            kbeta_ref, khat_ref, beta_ref, *saved, P: int, G: int, scale: float, opts: EVAOptions):
    """Phase A of a tile of G chunks; ``saved`` (the forward of a differentiated call): also ω in the compute dtype
    and each chunk's log-sum-exp of ``ℓ`` (fp32), for the backward kernel."""
    cd = k_ref.dtype  # the compute dtype: every product's operands (module docstring)
    seg = _segments(G, P)
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
    omega = (mu + eps_ref[...].astype(jnp.float32)).astype(cd)
    ell, mask = _logits(seg, valid_ref[...], omega, k, scale, opts)
    m = jnp.max(ell, axis=1, keepdims=True)
    p = jnp.where(mask, jnp.exp(ell - m), 0.0)
    den = jnp.maximum(jnp.sum(p, axis=1, keepdims=True), 1e-30)
    beta = jnp.dot(p.astype(cd), v_ref[...], preferred_element_type=jnp.float32) / den
    khat_ref[...] = k_hat.astype(khat_ref.dtype)
    beta_ref[...] = beta.astype(beta_ref.dtype)
    if saved:
        saved[0][...] = omega.astype(saved[0].dtype)
        saved[1][...] = m + jnp.log(den)


def _bwd_kernel(k_ref, v_ref, valid_ref, omega_ref, lse_ref, dbeta_ref, dk_ref, dv_ref, domega_ref, *, P: int,
                G: int, scale: float, opts: EVAOptions):
    """The token-level backward of one tile of G chunks: from ``dβ`` (G, dv) and the weights
    ``w = softmax_p(ℓ) = exp(ℓ − lse)`` recomputed from the forward's ω and log-sum-exp: ``dv_t = Σ_g w_gt dβ_g``,
    ``dℓ = w ⊙ (v·dβ − Σ_p w v·dβ)``, then through ``ℓ = a·(ω·k) − b·½‖k‖²``: ``dω_g = a Σ_t dℓ_gt k_t`` and the
    key gradient of the logits ``dk_t = a Σ_g dℓ_gt ω_g − b (Σ_g dℓ_gt) k_t`` (the means' share is added outside)."""
    cd = k_ref.dtype
    seg = _segments(G, P)
    k, omega, dbeta = k_ref[...], omega_ref[...], dbeta_ref[...]
    ell, mask = _logits(seg, valid_ref[...], omega, k, scale, opts)
    w = jnp.where(mask, jnp.exp(ell - lse_ref[...]), 0.0)
    v = v_ref[...]
    dw = _nt(dbeta, v)  # (G, T): v_t · dβ_g
    dv_ref[...] = _tn(w.astype(cd), dbeta).astype(dv_ref.dtype)
    dl = w * (dw - jnp.sum(w * dw, axis=1, keepdims=True))  # zero off the segment and at padding (w = 0 there)
    a, b = _rf_coefficients(scale, opts)
    ddot = (a * dl).astype(cd)
    domega_ref[...] = _nn(ddot, k)
    dsq = _tn(dl, jnp.ones((G, 1), jnp.float32))  # (T, 1): Σ_g dℓ_gt, one chunk's entry per token
    dk_ref[...] = _tn(ddot, omega) - b * dsq * k.astype(jnp.float32)


def _compiler_params(platform, warps: int = 4):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    if platform in ("gpu", "cuda", "rocm"):
        return lazy_triton.CompilerParams(num_warps=warps, num_stages=2)
    return None


def _valid_spec(valid_rows, T: int):
    """The tile's validity row: of ``[N/T, 1, T]`` (one for the batch), or of ``[B, N/T, 1, T]`` (per batch row: a
    packed row's chunk members)."""
    if valid_rows.ndim == 4:
        return pl.BlockSpec((None, None, 1, T), lambda b, h, i: (b, i, 0, 0))
    return pl.BlockSpec((None, 1, T), lambda b, h, i: (i, 0, 0))


def _valid_rows(k_valid, C: int, C_pad: int, P: int, G: int):
    """The validity rows of ``k_valid`` ([C, P], or per batch row [B, 1, C, P] / [B, C, P]) padded to C_pad chunks,
    fp32: ``[C_pad/G, 1, G·P]`` or ``[B, C_pad/G, 1, G·P]``."""
    if k_valid.ndim <= 2:
        valid = jnp.pad(jnp.broadcast_to(k_valid, (C, P)), ((0, C_pad - C), (0, 0))).astype(jnp.float32)
        return valid.reshape(C_pad // G, 1, G * P)
    valid = k_valid.reshape((k_valid.shape[0], C, P))  # a head axis of one is dropped
    valid = jnp.pad(valid, ((0, 0), (0, C_pad - C), (0, 0))).astype(jnp.float32)
    return valid.reshape(valid.shape[0], C_pad // G, 1, G * P)


def _pallas_stats(q, k, v, valid_rows, eps, params, *, P, G, scale, opts, interpret, platform, save=False):
    """q, k: [B,H,N,d]; v: [B,H,N,dv]; N = C_pad·P; valid_rows [N/T, 1, T] or [B, N/T, 1, T] f32 (:func:`_valid_rows`);
    eps [B,H,C_pad,d]; all but the
    validity rows in one compute dtype (the parameters are cast to it here). -> (k̂, β) fp32 [B,H,C_pad,·], and
    with ``save`` ω [B,H,C_pad,d] in the compute dtype and the log-sum-exps [B,H,C_pad,1] fp32."""
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
    in_specs = [tok(d), tok(d), tok(dv), _valid_spec(valid_rows, T), grp(d)]
    in_specs += [full(x.shape) for x in pr]
    kernel = functools.partial(_kernel, P=P, G=G, scale=scale, opts=opts)
    out_shape = [jax.ShapeDtypeStruct((B, H, C_pad, d), jnp.float32),
                 jax.ShapeDtypeStruct((B, H, C_pad, dv), jnp.float32)]
    out_specs = [grp(d), grp(dv)]
    if save:
        out_shape += [jax.ShapeDtypeStruct((B, H, C_pad, d), q.dtype),
                      jax.ShapeDtypeStruct((B, H, C_pad, 1), jnp.float32)]
        out_specs += [grp(d), grp(1)]
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(B, H, n_t),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform, gpu_warps(P=P, d=d, dv=dv, group=G)[0]),
        name="eva_chunk_stats",
    )(q, k, v, valid_rows, eps, *pr)


def _run(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform, save):
    B, H, C, P, _ = q_ch.shape
    C_pad = -(-C // G) * G
    padc = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, C_pad - C)) + ((0, 0),) * (x.ndim - 3))  # noqa: E731
    flat = lambda x: padc(x).reshape(B, H, C_pad * P, x.shape[-1])  # noqa: E731
    valid_rows = _valid_rows(k_valid, C, C_pad, P, G)
    cd = compute_dtype(q_ch, k_ch, v_ch)  # the reference's: q, k, v, noise and parameters enter in it
    out = _pallas_stats(flat(q_ch.astype(cd)), flat(k_ch.astype(cd)), flat(v_ch.astype(cd)), valid_rows,
                        padc(noise.astype(cd)), params, P=P, G=G, scale=scale, opts=opts, interpret=interpret,
                        platform=platform, save=save)
    return (out[0][:, :, :C], out[1][:, :, :C]), out[2:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform):
    return _run(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform, False)[0]


def _stats_fwd(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform):
    out, saved = _run(q_ch, k_ch, v_ch, k_valid, params, noise, opts, scale, G, interpret, platform, True)
    return out, (q_ch, k_ch, v_ch, k_valid, params, noise) + tuple(saved)


def _pallas_stats_bwd(k, v, valid_rows, omega, lse, dbeta, *, P, G, scale, opts, interpret, platform):
    """k: [B,H,N,d], v: [B,H,N,dv], omega [B,H,C_pad,d], dbeta [B,H,C_pad,dv] in the compute dtype; lse
    [B,H,C_pad,1] fp32; valid_rows as :func:`_pallas_stats` takes them -> (dk of the logits [B,H,N,d] fp32, dv [B,H,N,dv],
    dω [B,H,C_pad,d] fp32)."""
    B, H, N, d = k.shape
    dv = v.shape[-1]
    T = G * P
    tok = lambda dim: pl.BlockSpec((None, None, T, dim), lambda b, h, i: (b, h, i, 0))  # noqa: E731
    grp = lambda dim: pl.BlockSpec((None, None, G, dim), lambda b, h, i: (b, h, i, 0))  # noqa: E731
    kernel = functools.partial(_bwd_kernel, P=P, G=G, scale=scale, opts=opts)
    warps = gpu_warps(P=P, d=d, dv=dv, group=G, backward=True)[0]
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, H, N, d), jnp.float32), jax.ShapeDtypeStruct((B, H, N, dv), v.dtype),
                   jax.ShapeDtypeStruct(omega.shape, jnp.float32)),
        grid=(B, H, N // T),
        in_specs=[tok(d), tok(dv), _valid_spec(valid_rows, T), grp(d), grp(1), grp(dv)],
        out_specs=(tok(d), tok(dv), grp(d)),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform, warps),
        name="eva_chunk_stats_bwd",
    )(k, v, valid_rows, omega, lse, dbeta)


def _stats_bwd(opts, scale, G, interpret, platform, res, g):
    """Phase A's backward: the chunk-level half (means, projections, LayerNorms, ω = µ + ε: O(C·d²)) by autodiff of
    the reference's :func:`chunk_proposals` in XLA, the token-level half (β's weights over the chunk's keys: the
    O(L·d) part) by :func:`_bwd_kernel`, whose ``dω`` enters the chunk-level VJP with the cotangent of ``k̂``."""
    q_ch, k_ch, v_ch, k_valid, params, noise, omega_k, lse = res
    dk_hat, dbeta = g
    B, H, C, P, d = q_ch.shape
    cd = compute_dtype(q_ch, k_ch, v_ch)
    chunk_level = lambda q, k, p, n: chunk_proposals(q, k, p, n, opts, dtype=cd)  # noqa: E731
    (_, omega), vjp = jax.vjp(chunk_level, q_ch.astype(cd), k_ch.astype(cd), params, noise)
    C_pad = -(-C // G) * G
    padc = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, C_pad - C)) + ((0, 0),) * (x.ndim - 3))  # noqa: E731
    flat = lambda x: padc(x).reshape(B, H, C_pad * P, x.shape[-1])  # noqa: E731
    # the weights from the forward's own ω and log-sum-exps (the kernel's rounding, not XLA's)
    dk_tok, dv, domega = _pallas_stats_bwd(flat(k_ch.astype(cd)), flat(v_ch.astype(cd)),
                                           _valid_rows(k_valid, C, C_pad, P, G), omega_k, lse,
                                           padc(dbeta.astype(cd)), P=P, G=G, scale=scale, opts=opts,
                                           interpret=interpret, platform=platform)
    unflat = lambda x: x.reshape(B, H, C_pad, P, x.shape[-1])[:, :, :C]  # noqa: E731
    dq, dk_means, dp, dn = vjp((dk_hat, domega[:, :, :C].astype(omega.dtype)))
    dk = dk_means.astype(jnp.float32) + unflat(dk_tok)
    return (dq.astype(q_ch.dtype), dk.astype(k_ch.dtype), unflat(dv).astype(v_ch.dtype), None, dp,
            dn.astype(noise.dtype))


_stats.defvjp(_stats_fwd, _stats_bwd)


def eva_chunk_stats(q_ch, k_ch, v_ch, k_valid, params, noise, opts: EVAOptions, scale: float, *,
                    group: int = GROUP, interpret: bool = False, platform: str | None = None):
    """Same contract as :func:`pallas_kernels.eva_chunks_ref.chunk_summaries` (q_ch, k_ch [B,H,C,P,d],
    v_ch [B,H,C,P,dv], k_valid [C,P] or per batch row [B,1,C,P] (a packed row's chunk members: the validity
    rows are then per batch row, the kernels otherwise the same), noise [B,H,C,d] or None) -> (k̂ [B,H,C,d], β [B,H,C,dv]).

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

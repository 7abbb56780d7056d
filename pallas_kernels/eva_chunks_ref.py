"""Pure-JAX reference of EVA's Phase A, the per-chunk control-variate statistics (docs/methods/eva.md §2.3, §8.1).

This is the computation :mod:`pallas_kernels.eva_chunks` must match and the XLA path of
EVA attention method (which imports it from here: one copy of the math). It imports only JAX and the
precision helpers beside it. :class:`EVAOptions` (the static options of EVA's pure functions) lives here because
the reference takes it.

Precision (DESIGN.md §7): the products take the compute dtype (the inputs' dtype: bfloat16 stays bfloat16) with
float32 accumulation: the projections of the chunk means (means summed in float32, then cast; the parameters cast
to the compute dtype), ``ω·k`` (``ω`` cast) and ``Σ_p w_p v_p`` (the unnormalised weights cast, as a flash kernel
casts P, and the sum normalised after).
The squared key norms, the LayerNorms, the log-features and their softmax stay float32, and so do the outputs
``k̂``, ``β`` (statistics carried into EVA's decoding state). Under float32 inputs every cast is the identity.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.precision import acc_einsum, compute_dtype, float_dtype

NEG = -1e30  # finite mask value (§2.7): -inf gives NaN for all-padding chunks
LN_EPS = 1e-5


# ---------------------------------------------------------------------------
# static options
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EVAOptions:
    """Static (hashable) options of the pure functions."""

    causal: bool
    W: int  # local block size; 0 = no local part (test-only)
    e_l: int  # left window extension
    e_r: int  # right window extension
    partition: str  # 'full' | 'disjoint'
    chunk_logit: str  # 'rep' | 'exact_lse'
    chunk_rep: str  # 'learned' | 'identity'
    adaptive_proj: str  # 'qk' | 'no-ln' | 'none'
    mu_mode: str  # 'sum' | 'half'
    rf_scale: str  # 'released' | 'principled'
    use_rpe: bool
    rpe_buckets: int
    rpe_max_distance: int
    attn_dropout: float
    logit_budget: int  # max materialized logits (B*H*Tq*(Tk+C)) per lax.map step (as resolved for the platform)
    keep_budget: int = 1 << 28  # max attention weights a full pass keeps for its backward (else recomputed;
    # negative: never kept)


def layer_norm(x, scale, bias):
    """LayerNorm over the last axis (eps 1e-5, affine), in fp32."""
    x = x.astype(jnp.float32)
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + LN_EPS) * scale + bias


def rf_log_feature(x, omega, scale: float, rf_scale: str):
    """log ξ(x, ω) of the positive random feature, with the layer's scaling (§9.2).

    'released':   s (ω·x − ½‖x‖²);   'principled': √s ω·x − (s/2)‖x‖²;   scale=1: ω·x − ½‖x‖².
    x: [..., P, d]; omega: [..., d] (broadcast over P). ``ω·x`` takes ω in x's dtype (float32 accumulation); the
    norms are float32."""
    dot = acc_einsum("...pd,...d->...p", x, omega.astype(x.dtype))
    xf = x.astype(float_dtype(x))
    sq = 0.5 * jnp.sum(xf * xf, axis=-1)
    if rf_scale == "released":
        return scale * (dot - sq)
    return math.sqrt(scale) * dot - scale * sq


def representatives(q_bar, k_bar, params, opts: EVAOptions, norm=layer_norm, dtype=None):
    """(k̂_c, µ_c) from the chunk means [B,H,C,d]. Linear (+LN) shared across heads. ``norm``: the LayerNorm
    (:func:`layer_norm`; an implementation may pass its own form of the same arithmetic). ``dtype``: the compute
    dtype (default: the means'): the means and the float32 parameters are cast to it before the projection, which
    accumulates in float32."""
    cd = q_bar.dtype if dtype is None else dtype
    if opts.chunk_rep == "identity":
        k_hat, q_hat = k_bar, q_bar
    else:

        def proj(x, w, b, g, beta, use_ln):
            y = acc_einsum("...d,de->...e", x.astype(cd), w.astype(cd)) + b.astype(cd)
            return norm(y, g.astype(cd), beta.astype(cd)) if use_ln else y

        use_ln = opts.adaptive_proj != "no-ln"
        k_hat = proj(k_bar, params["k_w"], params["k_b"], params["k_ln_scale"], params["k_ln_bias"], use_ln)
        if opts.adaptive_proj == "none":
            return k_hat, jnp.zeros_like(k_hat)
        q_hat = proj(q_bar, params["q_w"], params["q_b"], params["q_ln_scale"], params["q_ln_bias"], use_ln)
    mu = q_hat + k_hat if opts.mu_mode == "sum" else 0.5 * (q_hat + k_hat)
    return k_hat, mu


def chunk_beta(omega, k_ch, v_ch, k_valid, scale: float, rf_scale: str):
    """β_c = Σ_p softmax_p(log ξ(k_p, ω_c)) v_p. k_ch: [B,H,C,P,d], omega [B,H,C,d],
    k_valid [C,P] (or broadcastable to [B,H,C,P]). Under a compute dtype narrower than float32 (bf16 v) the
    weights are formed as a flash kernel forms them: unnormalised (max-subtracted) weights cast to v's dtype for the
    sum (float32 accumulation), divided by their float32 total after it, the order of the kernel
    (:mod:`pallas_kernels.eva_chunks`); float32 takes the normalised softmax as written."""
    logits = jnp.where(k_valid, rf_log_feature(k_ch, omega, scale, rf_scale), NEG)
    if v_ch.dtype != float_dtype(v_ch):
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        p = jnp.where(k_valid, jnp.exp(logits - m), 0.0)
        den = jnp.maximum(jnp.sum(p, axis=-1), 1e-30)
        return acc_einsum("...p,...pd->...d", p.astype(v_ch.dtype), v_ch) / den[..., None]
    w = jax.nn.softmax(logits, axis=-1)
    w = jnp.where(k_valid, w, 0.0)
    return jnp.einsum("...p,...pd->...d", w, v_ch)


def chunk_proposals(q_ch, k_ch, params, noise, opts: EVAOptions, norm=layer_norm, dtype=None):
    """Phase A's chunk-level half: (k̂ [B,H,C,d], ω [B,H,C,d]) from the chunk means of q_ch, k_ch [B,H,C,P,d]
    (``dtype``: the compute dtype, default theirs; ``noise`` None: ω = µ). :func:`chunk_summaries` is this, then
    :func:`chunk_beta`."""
    cd = compute_dtype(q_ch, k_ch) if dtype is None else dtype
    q_ch, k_ch = (x.astype(cd) for x in (q_ch, k_ch))
    sd = float_dtype(q_ch)
    P = q_ch.shape[-2]
    q_bar = jnp.sum(q_ch, axis=-2, dtype=sd) / P
    k_bar = jnp.sum(k_ch, axis=-2, dtype=sd) / P
    k_hat, mu = representatives(q_bar, k_bar, params, opts, norm, dtype=cd)
    return k_hat, (mu if noise is None else mu + noise.astype(cd))


def chunk_summaries(q_ch, k_ch, v_ch, k_valid, params, noise, opts: EVAOptions, scale: float, norm=layer_norm):
    """Phase A. q_ch, k_ch: [B,H,C,P,d]; v_ch: [B,H,C,P,dv] (padding rows zero);
    k_valid: [C,P]; noise: [B,H,C,d] or None (deterministic: ω = µ); ``norm``: see :func:`representatives`.
    Returns (k̂ [B,H,C,d], β [B,H,C,dv]) in float32. Chunk means divide by P even if padded (§9.11).
    Precision: the module docstring (q, k, v are cast to their common compute dtype; the noise joins ω in it)."""
    cd = compute_dtype(q_ch, k_ch, v_ch)
    q_ch, k_ch, v_ch = (x.astype(cd) for x in (q_ch, k_ch, v_ch))
    k_hat, omega = chunk_proposals(q_ch, k_ch, params, noise, opts, norm, dtype=cd)
    return k_hat, chunk_beta(omega, k_ch, v_ch, k_valid, scale, opts.rf_scale)

eva_chunk_stats_reference = chunk_summaries

__all__ = ["LN_EPS", "NEG", "EVAOptions", "chunk_beta", "chunk_proposals", "chunk_summaries",
           "eva_chunk_stats_reference", "layer_norm", "representatives", "rf_log_feature"]

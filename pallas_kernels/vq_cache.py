"""Transformer-VQ "compressive VQ cache attention" as a Pallas kernel (spec transformer-vq.md §9, v1 forward).

The reference it must match is :func:`longctx.attention.transformer_vq.causal_parallel` with
``reduction='serial'`` (spec §2.6: lag-2 per-code cache, exact previous block, causal present block,
one shared softmax), re-exported here as :func:`vq_cache_attention_reference`.

Kernel layout: grid ``(B·H, R)``, dimension semantics ``("parallel", "arbitrary")``; step ``r`` computes
query block ``r``. The carried band is prepended to ``k̂, v, z`` as extended block 0 (so extended block
``e`` is block ``e-1``); step ``r`` reads extended blocks ``r`` (previous, with a validity row) and ``r+1``
(present). VMEM scratch carries the per-code running mean ``μ [S, Dv]`` and the count ``N`` (as a row
``[8, S]`` for the logits and as a column ``[S, 128]`` for the fold), initialised from the carried state at
``r = 0``. Body per step:

1. ``s^c = q_u·Cᵀ + ℓ(N)`` (``ℓ = log N``, ``-1e30`` where ``N = 0``), the cache state after block ``r-2``;
2. ``s^p = q_u·k̂_{r-1}ᵀ + BD[:, :L]`` masked by the previous block's validity (band / start of sequence);
3. ``s^r = q_u·k̂_rᵀ + BD[:, L:]`` with the causal mask and the ragged-tail validity;
4. one softmax (row max, ``a = exp(s - m)``, ``den``), ``o = Σ (a/den)·values``;
5. fold block ``r-1`` into ``(μ, N)`` through a one-hot ``[S, L]`` matmul (after the output: lag 2).

Stage 0 stays in XLA: the blocked queries, the extended key/value/code arrays and the band bias
``BD [B·H, R, L, 2L]`` (``rel_bias`` of the ``[T, M+1]`` band scores, i.e. zero beyond ``d > M``).
Because BD and the band validity are precomputed, any ``1 <= M <= L`` works (spec §9 only needs ``M = L``).

Final state: when ``T % L == 0`` and ``M == L`` the kernel's last fold *is* the new carried aggregate
(written at the last step); otherwise the new aggregate is computed in XLA (``_final_state``).

Backward (v1): ``custom_vjp`` whose backward is ``jax.vjp`` of the jnp reference (recomputation).
No lse output yet (only needed by a v2 flash-style backward).

Limits: Dv is one full block (no Dv tiling), fp32 compute (inputs are cast; the output is cast back to
the reference dtype); CPU runs only with ``interpret=True``; the GPU two-phase design of §9 is not here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from longctx.attention.transformer_vq import (
    NEG,
    _final_state,
    _pad_left,
    _pad_to,
    causal_parallel,
    float_dtype,
    rel_bias,
)

vq_cache_attention_reference = functools.partial(causal_parallel, reduction="serial")

LANES = 128
SUB = 8


def _nt(a, b):
    """a @ b.T (contract the last dims), f32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _kernel(q_ref, kp_ref, kr_ref, vp_ref, vr_ref, zp_ref, validp_ref, validr_ref, c_ref, bias_ref,
            mu0_ref, n0row_ref, n0col_ref,
            o_ref, mufin_ref, nfin_ref,
            mu_s, nrow_s, ncol_s, *, L: int, S: int):
    r = pl.program_id(1)

    @pl.when(r == 0)
    def _init():
        mu_s[...] = mu0_ref[...]
        nrow_s[...] = n0row_ref[...]
        ncol_s[...] = n0col_ref[...]

    q = q_ref[...]
    vp = vp_ref[...]
    vr = vr_ref[...]
    valid_p = validp_ref[...] > 0.5  # (1, L)
    valid_r = validr_ref[...] > 0.5  # (1, L)

    # 1. cache logits over the state after block r-2
    n_row = nrow_s[0:1, :]  # (1, S)
    has = n_row > 0.0
    s_c = _nt(q, c_ref[...]) + jnp.where(has, jnp.log(jnp.maximum(n_row, 1.0)), NEG)
    # 2. previous block (exact), 3. present block (causal)
    s_p = _nt(q, kp_ref[...]) + bias_ref[:, :L]
    s_r = _nt(q, kr_ref[...]) + bias_ref[:, L:]
    row = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
    mask_r = (col <= row) & valid_r

    # 4. one softmax over the three groups (same op order as the reference's _softmax_mix)
    s_c = jnp.where(has, s_c, NEG)
    s_p = jnp.where(valid_p, s_p, NEG)
    s_r = jnp.where(mask_r, s_r, NEG)
    m = jnp.maximum(jnp.maximum(jnp.max(s_c, axis=1, keepdims=True), jnp.max(s_p, axis=1, keepdims=True)),
                    jnp.max(s_r, axis=1, keepdims=True))
    a_c = jnp.where(has, jnp.exp(s_c - m), 0.0)
    a_p = jnp.where(valid_p, jnp.exp(s_p - m), 0.0)
    a_r = jnp.where(mask_r, jnp.exp(s_r - m), 0.0)
    den = (jnp.sum(a_c, axis=1, keepdims=True) + jnp.sum(a_p, axis=1, keepdims=True)
           + jnp.sum(a_r, axis=1, keepdims=True))
    inv = 1.0 / jnp.maximum(den, 1e-30)
    mu = mu_s[...]
    out = _nn(a_c * inv, mu) + _nn(a_p * inv, vp) + _nn(a_r * inv, vr)
    o_ref[...] = out.astype(o_ref.dtype)

    # 5. fold block r-1 (extended block r) into (mu, N): lag 2 for the next query block
    codes = jax.lax.broadcasted_iota(jnp.int32, (S, L), 0)
    onehot_t = ((codes == zp_ref[...]) & valid_p).astype(jnp.float32)  # [S, L]
    blk_sum = _nn(onehot_t, vp)  # [S, Dv]
    cnt_row = _nt(jnp.ones((SUB, L), jnp.float32), onehot_t)  # [8, S], all rows equal
    cnt_col = _nn(onehot_t, jnp.ones((L, LANES), jnp.float32))  # [S, 128], all lanes equal
    n_old = ncol_s[...]
    n_new = n_old + cnt_col
    scale_old = n_old[:, 0:1] / jnp.maximum(n_new[:, 0:1], 1.0)
    mu_s[...] = mu * scale_old + blk_sum / jnp.maximum(n_new[:, 0:1], 1.0)
    ncol_s[...] = n_new
    nrow_s[...] = nrow_s[...] + cnt_row

    @pl.when(r == pl.num_programs(1) - 1)
    def _final():
        mufin_ref[...] = mu_s[...]
        nfin_ref[...] = nrow_s[...]


def _compiler_params(platform):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=48 * 2**20)
    return None


def _scratch(S, Dv):
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM((S, Dv), jnp.float32), pltpu.VMEM((SUB, S), jnp.float32),
            pltpu.VMEM((S, LANES), jnp.float32)]


def _pallas_forward(qb, kx, vx, zx, validx, C, bias, mu0, n0row, n0col, *, H, L, interpret, platform):
    """qb [BH, R·L, Dk]; kx [BH, (R+1)L, Dk]; vx [BH, (R+1)L, Dv]; zx [BH, R+1, 1, L] int32;
    validx [R+1, 1, L] f32; C [H, S, Dk]; bias [BH, R, L, 2L]; mu0 [BH, S, Dv]; n0row [BH, 8, S];
    n0col [BH, S, 128]. Returns o [BH, R·L, Dv], μ_fin [BH, S, Dv], N_fin [BH, 8, S]."""
    BH, RL, Dk = qb.shape
    R = RL // L
    S = C.shape[1]
    Dv = vx.shape[-1]
    blk = lambda dim, off: pl.BlockSpec((None, L, dim), lambda b, r: (b, r + off, 0))  # noqa: E731
    per_bh = lambda shape: pl.BlockSpec((None,) + shape, lambda b, r: (b, 0, 0))  # noqa: E731
    in_specs = [
        blk(Dk, 0),  # q_u block r
        blk(Dk, 0), blk(Dk, 1),  # k̂: extended blocks r (previous) and r+1 (present)
        blk(Dv, 0), blk(Dv, 1),  # v
        pl.BlockSpec((None, None, 1, L), lambda b, r: (b, r, 0, 0)),  # z of the previous block, lane-dense
        pl.BlockSpec((None, 1, L), lambda b, r: (r, 0, 0)),  # validity, previous
        pl.BlockSpec((None, 1, L), lambda b, r: (r + 1, 0, 0)),  # validity, present
        pl.BlockSpec((None, S, Dk), lambda b, r: (jax.lax.rem(b, H), 0, 0)),  # codebook of head b % H
        pl.BlockSpec((None, None, L, 2 * L), lambda b, r: (b, r, 0, 0)),  # band bias
        per_bh((S, Dv)), per_bh((SUB, S)), per_bh((S, LANES)),  # initial state
    ]
    out_specs = (blk(Dv, 0), per_bh((S, Dv)), per_bh((SUB, S)))
    out_shape = (jax.ShapeDtypeStruct((BH, RL, Dv), jnp.float32),
                 jax.ShapeDtypeStruct((BH, S, Dv), jnp.float32),
                 jax.ShapeDtypeStruct((BH, SUB, S), jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, L=L, S=S),
        out_shape=out_shape,
        grid=(BH, R),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=_scratch(S, Dv),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform),
        name="vq_cache_attention",
    )(qb, kx, kx, vx, vx, zx, validx, validx, C, bias, mu0, n0row, n0col)


def _forward(q_u, bd, k_hat, v, C, agg_mu, agg_n, band_k, band_v, z, band_z, pos, *, L, M, interpret, platform):
    """Kernel forward: returns (o [B,H,T,Dv], new agg_mu, new agg_n) in the reference dtype."""
    B, H, T, Dk = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    dt = float_dtype(q_u, v)
    f32 = jnp.float32
    R = -(-T // L)
    Tp = R * L
    BH = B * H

    def flat(x):
        return x.reshape((BH,) + x.shape[2:])

    qb = flat(_pad_to(q_u.astype(f32), 2, Tp))
    kx = flat(jnp.concatenate([_pad_left(band_k.astype(f32), 2, L), _pad_to(k_hat.astype(f32), 2, Tp)], axis=2))
    vx = flat(jnp.concatenate([_pad_left(band_v.astype(f32), 2, L), _pad_to(v.astype(f32), 2, Tp)], axis=2))
    zx = flat(jnp.concatenate([_pad_left(band_z, 2, L), _pad_to(z, 2, Tp)], axis=2).astype(jnp.int32))
    zx = zx.reshape(BH, R + 1, 1, L)
    band_pos = pos - L + jnp.arange(L)
    band_valid = (band_pos >= 0) & (jnp.arange(L) >= L - M)
    validx = jnp.concatenate([band_valid, jnp.arange(Tp) < T]).astype(f32).reshape(R + 1, 1, L)
    bdb = _pad_to(bd.astype(f32), 2, Tp).reshape(B, H, R, L, bd.shape[-1])
    i = jnp.arange(L)[:, None]
    jj = jnp.arange(2 * L)[None, :]
    bias = flat(rel_bias(bdb, L + i - jj, M))  # [BH, R, L, 2L]
    n0 = flat(agg_n.astype(f32))
    n0row = jnp.broadcast_to(n0[:, None, :], (BH, SUB, S))
    n0col = jnp.broadcast_to(n0[:, :, None], (BH, S, LANES))
    o, mu_fin, n_fin = _pallas_forward(qb, kx, vx, zx, validx, jax.lax.stop_gradient(C).astype(f32), bias,
                                       flat(agg_mu.astype(f32)), n0row, n0col, H=H, L=L, interpret=interpret,
                                       platform=platform)
    o = o.reshape(B, H, Tp, Dv)[:, :, :T].astype(dt)
    if T % L == 0 and M == L:  # the kernel's last fold is exactly the new carried aggregate
        new_mu = mu_fin.reshape(B, H, S, Dv).astype(dt)
        new_n = n_fin[:, 0].reshape(B, H, S).astype(dt)
    else:
        state = {"pos": pos, "band_k": band_k.astype(dt), "band_v": band_v.astype(dt), "band_z": band_z,
                 "agg_mu": agg_mu.astype(dt), "agg_n": agg_n.astype(dt)}
        st = _final_state(state, k_hat.astype(dt), z, v.astype(dt), T, M, S)
        new_mu, new_n = st["agg_mu"], st["agg_n"]
    return o, new_mu, new_n


def _reference(q_u, bd, k_hat, v, C, agg_mu, agg_n, band_k, band_v, z, band_z, pos, *, L, M):
    state = {"pos": pos, "band_k": band_k, "band_v": band_v, "band_z": band_z, "agg_mu": agg_mu, "agg_n": agg_n}
    o, st = causal_parallel(q_u, bd, k_hat, z, v, C, state, L=L, M=M, reduction="serial")
    return o, st["agg_mu"], st["agg_n"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13, 14, 15))
def _core(q_u, bd, k_hat, v, C, agg_mu, agg_n, band_k, band_v, z, band_z, pos, L, M, interpret, platform):
    return _forward(q_u, bd, k_hat, v, C, agg_mu, agg_n, band_k, band_v, z, band_z, pos, L=L, M=M,
                    interpret=interpret, platform=platform)


def _core_fwd(*args):
    return _core(*args), args[:12]


def _core_bwd(L, M, interpret, platform, res, g):
    floats, ints = res[:9], res[9:]
    _, vjp = jax.vjp(lambda *fl: _reference(*fl, *ints, L=L, M=M), *floats)
    zero_int = tuple(np.zeros(np.shape(x), jax.dtypes.float0) for x in ints)
    return tuple(vjp(g)) + zero_int


_core.defvjp(_core_fwd, _core_bwd)


def vq_cache_attention(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, interpret: bool = False,
                       platform: str | None = None):
    """Same contract as ``causal_parallel(q_u, bd, k_hat, z, v, C, state, L=L, M=M, reduction='serial')``:
    q_u, k_hat [B,H,T,Dk]; bd [B,H,T,M+1]; z int32 [B,H,T]; v [B,H,T,Dv]; C [H,S,Dk]; state as in
    ``transformer_vq.empty_state`` (band of M tokens). Requires 1 <= M <= L. Returns (o [B,H,T,Dv], new_state).

    ``platform`` ('tpu'; default: the default backend) picks the Mosaic compiler parameters; ignored when
    ``interpret=True``. The backward pass is ``jax.vjp`` of the jnp reference (spec §9 v1)."""
    if not 1 <= M <= L:
        raise ValueError(f"vq_cache_attention needs 1 <= M <= L, got M={M}, L={L}")
    platform = platform or jax.default_backend()
    if not interpret and platform == "cpu":
        raise ValueError("vq_cache_attention: Pallas runs on CPU only with interpret=True")
    if not interpret and platform != "tpu":
        raise ValueError(f"vq_cache_attention: only the TPU (Mosaic) kernel exists; got platform={platform!r}")
    T = q_u.shape[2]
    dt = float_dtype(q_u, v)
    o, agg_mu, agg_n = _core(q_u, bd, k_hat, v, C, state["agg_mu"].astype(dt), state["agg_n"].astype(dt),
                             state["band_k"].astype(dt), state["band_v"].astype(dt), z, state["band_z"],
                             state["pos"], L, M, interpret, platform)
    ek = jnp.concatenate([state["band_k"].astype(dt), k_hat.astype(dt)], axis=2)
    ev = jnp.concatenate([state["band_v"].astype(dt), v.astype(dt)], axis=2)
    ez = jnp.concatenate([state["band_z"], z], axis=2)
    new_state = {"pos": state["pos"] + T, "band_k": ek[:, :, T:], "band_v": ev[:, :, T:], "band_z": ez[:, :, T:],
                 "agg_mu": agg_mu, "agg_n": agg_n}
    return o, new_state


__all__ = ["vq_cache_attention", "vq_cache_attention_reference"]

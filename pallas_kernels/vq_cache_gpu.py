"""Transformer-VQ "compressive VQ cache attention", GPU form: Pallas-Triton kernels (docs/methods/transformer_vq.md §9,
"GPU (Pallas-Triton, H100)" and "Backward (v2)").

It computes exactly what :func:`pallas_kernels.vq_cache_ref.vq_cache_attention_reference` computes (the §2.6 serial
form: lag-2 per-code cache, exact previous block, causal present block, one shared softmax) and has the same
contract as :func:`pallas_kernels.vq_cache.vq_cache_attention` (which calls this module for ``platform='cuda'``).
It imports only JAX, NumPy, Pallas and the reference module.

The TPU kernel folds block ``n-1`` into a ``[S, tv]`` VMEM carry after each query block (a sequential grid axis).
Triton grids are parallel and a ``[S, tv]`` f32 carry does not fit in registers, so the GPU form has two phases:

* **Phase 1 (XLA, differentiated by JAX).** Per-block per-code means and counts of the values (the reference's
  ``code_summary``: a one-hot ``[S, L]`` matmul per block), the serial prefix merge over the blocks starting from
  the carried ``agg_mu, agg_n`` (``prefix_reduce(..., 'serial')``), lagged by two blocks exactly as the reference:
  query block ``n`` reads ``μ̄_n, N̄_n`` = carried agg ⊕ band ⊕ blocks ``0..n-2``. It gives ``μ̄ [BH, R, S_p, Dv]``
  (stored in the storage dtype: bf16 when the inputs and the state are bf16) and ``ℓ = log N̄ [BH, R, S_p]`` f32
  (``NEG`` where ``N̄ = 0`` and on the padded codes; ``S_p`` = S rounded up to the code chunk), and the key validity
  ``[(R+1)·L]`` (invalid band slots, padding keys). No band bias is formed in XLA: the kernels take the band scores
  ``bd [BH, R·L, M+1]`` f32 (``bd[i, d] = (q_i + v')·r'_d``, the query's relative-position terms) and gather each
  tile's bias with index arithmetic, ``bd[i, L + i - j]`` (previous block) or ``bd[i, i - j]`` (present block)
  where that distance is at most M, else 0, with the causal and validity masks from iotas. No ``[.., L, L]`` or
  ``[.., L, 2L]`` array exists outside the kernels, forward or backward
  (tests/attention/test_transformer_vq_export.py reads the exported program).
* **Phase 2 forward kernel** ``vq_cache_gpu_fwd``: grid ``(BH, R·L/tq, Dv/tv)``, all parallel. One online softmax
  (running max ``m``, sum ``l``, accumulator ``[tq, tv]``, all f32) over the codes in chunks of ``ts`` (scores
  ``q_u·Cᵀ + ℓ``, values ``μ̄``), then the previous block in key tiles of ``tq``, then the present block up to the
  diagonal tile (each with its gathered band bias). Writes ``o`` (f32) and the row log-sum-exp.

**Backward** (``jax.custom_vjp``; flash-style recompute of the probabilities from the saved ``lse``,
``Δ = rowsum(dO ⊙ O)`` in XLA, ``dS = P ⊙ (dP − Δ)``). Every program owns its output blocks, so no kernel relies
on a sequential grid:

* ``vq_cache_gpu_bwd_q`` -- grid ``(BH, R·L/tq)``, query-major: ``dP = dO·Wᵀ`` accumulated over the Dv tiles for
  each code chunk / key tile, ``dq = dS^c·C + dS^p·k̂_{n-1} + dS^r·k̂_n`` and the band scores' gradient
  ``dbd [BH, R·L, M+1]``: ``dbd[i, d]`` is dS at the one key at distance ``d`` from query ``i``, scattered by index
  arithmetic (every entry written once: a query row's distances ``0..M`` are its present keys up to the diagonal
  and its previous block); it reaches ``q + v'`` and ``r'`` through ``band_scores``' autodiff, in XLA;
* ``vq_cache_gpu_bwd_kv`` -- grid ``(BH, (R+1)·L/tq, Dv/tv)``, key-tile-major over the extended key array (band
  prepended): a key tile of extended block ``e`` is seen by query block ``e`` (as previous block) and by query
  block ``e-1`` (as present block, the query tiles at or below the diagonal); it loops over exactly those query
  tiles for ``dv_local = Pᵀ·dO`` (its Dv tile) and, in the ``Dv``-tile-0 program, from the same ``P``,
  ``dk̂ = dSᵀ·q_u`` with ``dS = P ⊙ (dO·vᵀ − Δ)`` (``dO·vᵀ`` accumulated over the Dv tiles);
* ``vq_cache_gpu_bwd_mu`` -- grid ``(BH, R, S_p/ts, Dv/tv)``, code-chunk-major: ``dμ̄_n = P^{c}ᵀ·dO`` over the
  query tiles of block ``n``; it flows back to ``v`` and the carried ``agg_mu`` through Phase 1 by JAX autodiff.

No gradient reaches the codebook, the codes or the counts (as in the TPU kernel and §9). The new carried
state is computed in XLA by the reference's ``final_state``.

Dtypes: q_u, k̂, v (and the band) are stored in bf16 when all of them are bf16, otherwise f32 (never round a
wider input); the custom_vjp takes them in f32 so every cotangent is f32 and rounded once at the input.
``q·k̂ᵀ``, ``P·V``, ``P·μ̄``, ``dO·Vᵀ``, ``Pᵀ·dO`` and ``dSᵀ·q`` use storage-dtype operands with f32 accumulation
(bf16 tensor cores); the cache scores ``q_u·Cᵀ`` and ``dS^c·C`` take the codebook as given: bf16 operands when the
caller passes a bf16 codebook with bf16 storage (the layer does: its compute dtype), else f32 (a f32 codebook is
never rounded, as the reference); softmax statistics, the band scores, ``dS``, ``dq``, ``dk̂``, ``dv``, ``dμ̄`` and
``o`` are f32. With bf16 storage and a f32 codebook the kernel therefore differs from the f32 reference by bf16
rounding of ``μ̄``, ``P`` and ``dO`` (about 2⁻⁹ relative), not more.

**Tiles and budget** (:func:`choose_tiles`, :func:`tile_budget`). ``tq`` (query rows = key-tile width) is the
largest of 64/32/16 dividing L, ``ts = min(64, next_pow2(S))`` codes per chunk, ``tv`` the largest of
128/64/32/16 dividing Dv whose four kernels fit the budget; ``num_warps`` 4, or 8 where the register estimate
needs it; ``num_stages = 2``. Per program the estimate counts (a) shared memory: the resident operands (q tile and
its f32 copy, or the key tile / code chunk) plus ``num_stages`` × the dot operands loaded per loop step (key or code
tile, value / μ̄ / dO tiles, bias tile), against ``SMEM_LIMIT_BYTES`` = 227 KiB (H100's per-block maximum), and
(b) registers: the live f32 tiles (accumulators, scores, probabilities, dP, dS) divided over ``32·num_warps``
threads, against ``REG_WORDS_LIMIT`` = 128 words per thread (half of the 255 hardware registers, the rest left to
addresses, MMA fragments and temporaries). The gathered bias tile is counted as a [tq, tq] f32 load per key tile.
At the paper's shapes (L = S = 512, Dk = 128, Dv = 1536 or 4096; ``tq = ts = 64``) bf16 takes ``tv = 128`` with
every kernel at or below 144 KiB and 128 words per thread; fp32 takes ``tv = 64`` (``bwd_kv`` at 192 KiB, 8 warps).
It is an estimate for refusing clearly too large tiles, not a measurement. The earlier form of these kernels (bias
arrays ``BP, BR [BH, R, L, L]`` built in XLA) was compiled and tested on an H200 (jax 0.11.2); the gathered-bias
form here is tested in interpret mode and lowered for 'cuda' (with the MLIR verifier) but not yet compiled or
timed on a GPU.

Support (:func:`unsupported_reasons`): ``'cuda'`` needs ``L % 16 == 0`` (``tq ≥ 16``, the Triton dot minimum),
``Dk`` a power of two ≥ 16 (loaded whole), ``Dv % 16 == 0`` and a tile plan within the budget, and explicit
``block_*`` tiles of at least 16; ``'interpret'`` (CPU, Pallas interpret mode) takes any shape (tiles fall back to
the whole block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.precision import dot_nn as _dot
from pallas_kernels.precision import dot_nt as _dot_nt
from pallas_kernels.precision import dot_tn as _dot_tn
from pallas_kernels.vq_cache_ref import (
    KERNEL_DTYPES,
    NEG,
    cast_state,
    code_summary,
    final_state,
    float_dtype,
    input_reasons,
    log_count,
    pad_left,
    pad_to,
    prefix_reduce,
)

f32 = jnp.float32
HALF_NEG = NEG / 2  # a bias / log-count below this is a masked entry
DTYPES = KERNEL_DTYPES
SMEM_LIMIT_BYTES = 227 * 1024  # H100: maximum dynamic shared memory per thread block
REG_WORDS_LIMIT = 128  # live f32 tile words per thread the estimate allows (of 255 registers)
TQ_CANDIDATES = (64, 32, 16)
TV_CANDIDATES = (128, 64, 32, 16)
TS_MAX = 64
NUM_STAGES = 2
KINDS = ("fwd", "bwd_q", "bwd_kv", "bwd_mu")


# ----------------------------------------------------------------------------- tiles and budget
def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def tile_budget(kind: str, *, tq: int, ts: int, tv: int, Dk: int, in_dtype=f32, num_warps: int = 4,
                num_stages: int = NUM_STAGES) -> tuple[int, float]:
    """(shared-memory bytes, live f32 tile words per thread) of one program of kernel ``kind`` (see the module
    docstring for what is counted)."""
    isz = jnp.dtype(in_dtype).itemsize
    q_res = tq * Dk * isz + (tq * Dk * 4 if isz != 4 else 0)  # q tile and its f32 copy (cache scores)
    if kind == "fwd":
        stage = max(ts * Dk * 4 + ts * tv * isz + ts * 4,  # code chunk, μ̄ chunk, ℓ
                    tq * Dk * isz + tq * tv * isz + tq * tq * 4)  # key tile, value tile, bias tile
        smem = q_res + num_stages * stage
        words = tq * tv + 2 * tq * max(ts, tq) + 2 * tq  # acc, scores + probabilities, m and l
    elif kind == "bwd_q":
        inner = tq * tv * isz + max(ts, tq) * tv * isz  # dO tile and μ̄ / v tile of the dP loop
        outer = max(ts * Dk * 4, tq * Dk * isz + tq * tq * 4)  # code chunk or key tile + bias tile
        smem = q_res + num_stages * inner + outer
        words = tq * Dk + 4 * tq * max(ts, tq)  # dq, scores/probabilities, dP, dS
    elif kind == "bwd_kv":
        # every query tile: its q tile and gathered bias tile, then the dO tile (dv loop) or, in the Dv-tile-0
        # program, the dO and v tiles of the dP loop over the Dv tiles (dk loop); the key tile stays resident
        stage = tq * Dk * isz + tq * tq * 4 + 2 * tq * tv * isz
        smem = tq * Dk * isz + num_stages * stage
        words = tq * tv + tq * Dk + 4 * tq * tq  # the Dv-tile-0 program: dv, dk, scores/P, dP, dS
    elif kind == "bwd_mu":
        stage = tq * Dk * 4 + tq * tv * isz + tq * 4  # q tile (f32), dO tile, lse
        smem = ts * Dk * 4 + ts * 4 + num_stages * stage
        words = ts * tv + 2 * tq * ts  # dμ̄ accumulator, scores + probabilities
    else:
        raise ValueError(f"unknown kernel {kind!r}; allowed: {', '.join(KINDS)}")
    return int(smem), words / (32 * num_warps)


def _warps_for(kind, **kw) -> tuple[int, int, float]:
    """(num_warps, smem bytes, words per thread): 4 warps, or 8 where 4 exceed the register estimate."""
    for w in (4, 8):
        smem, words = tile_budget(kind, num_warps=w, **kw)
        if words <= REG_WORDS_LIMIT:
            return w, smem, words
    return 8, smem, words


def _fits(*, tq, ts, tv, Dk, in_dtype, kinds) -> tuple[bool, dict]:
    plan = {}
    ok = True
    for kind in kinds:
        w, smem, words = _warps_for(kind, tq=tq, ts=ts, tv=tv, Dk=Dk, in_dtype=in_dtype)
        plan[kind] = {"num_warps": w, "smem_bytes": smem, "words_per_thread": words}
        ok &= smem <= SMEM_LIMIT_BYTES and words <= REG_WORDS_LIMIT
    return ok, plan


def choose_tiles(*, L: int, S: int, Dk: int, Dv: int, in_dtype=f32, with_grad: bool = True,
                 block_q: int | None = None, block_s: int | None = None, block_v: int | None = None) -> dict:
    """The tile plan: ``tq`` (query rows and key-tile width), ``ts`` (codes per chunk), ``tv`` (Dv tile), the padded
    code count ``Sp``, per-kernel ``num_warps`` / budget (``plan``) and ``fits`` (every kernel within the budget).
    Explicit ``block_*`` arguments override the choice (tests use small tiles in interpret mode)."""
    tq = block_q or next((t for t in TQ_CANDIDATES if L % t == 0), L)
    ts = block_s or min(TS_MAX, max(16, _next_pow2(S)))  # at least 16 (a Triton dot); padded codes are masked
    kinds = KINDS if with_grad else ("fwd",)
    if block_v is not None:
        tvs = [block_v]
    else:
        tvs = [t for t in TV_CANDIDATES if Dv % t == 0] or [Dv]
    for tv in tvs:
        ok, plan = _fits(tq=tq, ts=ts, tv=tv, Dk=Dk, in_dtype=in_dtype, kinds=kinds)
        if ok:
            break
    Sp = -(-S // ts) * ts
    return {"tq": tq, "ts": ts, "tv": tv, "Sp": Sp, "fits": ok, "plan": plan, "num_stages": NUM_STAGES}


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def unsupported_reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype=f32,
                        with_grad: bool = True) -> list[str]:
    """Why the GPU form cannot serve these shapes on ``platform`` ('cuda' | 'interpret'); empty when it can."""
    reasons = input_reasons(L=L, M=M, dtype=dtype)
    if platform == "interpret":
        return reasons
    if platform != "cuda":
        reasons.append(f"the GPU form has no {platform} lowering (Pallas-Triton, cuda only)")
        return reasons
    if L % 16:
        reasons.append(f"Triton tiles need block_len % 16 == 0 (got L={L})")
    if Dk < 16 or Dk & (Dk - 1):
        reasons.append(f"Triton needs a power-of-two key dim >= 16 (got Dk={Dk})")
    if Dv % 16:
        reasons.append(f"Triton needs value dim % 16 == 0 (got Dv={Dv})")
    if not reasons:
        in_dtype = jnp.bfloat16 if _dtype_name(dtype) == "bfloat16" else f32
        t = choose_tiles(L=L, S=S, Dk=Dk, Dv=Dv, in_dtype=in_dtype, with_grad=with_grad)
        if not t["fits"]:
            worst = max(t["plan"].values(), key=lambda p: p["smem_bytes"])
            reasons.append(f"GPU tile budget exceeded at the smallest Dv tile tv={t['tv']} (tq={t['tq']}, "
                           f"ts={t['ts']}, Dk={Dk}): {worst['smem_bytes'] / 1024:.0f} KiB shared memory "
                           f"(limit {SMEM_LIMIT_BYTES // 1024} KiB) / {worst['words_per_thread']:.0f} words per "
                           f"thread (limit {REG_WORDS_LIMIT})")
    return reasons


# ----------------------------------------------------------------------------- kernel bodies
def _ds(i, n):
    return pl.ds(pl.multiple_of(i * n, n), n)


def _code_operands(q, ck):
    """The operands of ``q·Cᵀ``: the codebook as passed (the compute dtype when the caller gives it so), the query
    in its dtype when they match, else both float32 (a float32 codebook is never rounded)."""
    return (q, ck) if q.dtype == ck.dtype else (q.astype(f32), ck.astype(f32))


def _band(bd_ref, row0, key0, off, *, shape, M, ref_row0=0):
    """The band bias of the query rows ``row0 + a`` of a block (rows ``row0 + a - ref_row0`` of ``bd_ref``)
    against the keys ``key0 + b`` of the previous (``off = L``) or present (``off = 0``) block, gathered from the
    band scores with index arithmetic: ``bd[row, d]`` at the distance ``d = off + (row0 + a) - (key0 + b)`` where
    ``0 <= d <= M``, else 0 (no ``[L, L]`` bias exists outside the kernel). Returns (bias [tq, tk] f32, the rows
    ``row0 + a``, d, in_band)."""
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    d = off + rows - (key0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1))
    ok = (d >= 0) & (d <= M)
    b = pltriton.load(bd_ref.at[rows - ref_row0, jnp.where(ok, d, 0)], mask=ok, other=0.0)
    return b, rows, d, ok


def _causal(row0, key0, shape):
    """Key ``key0 + b`` at or before query ``row0 + a`` (the same block)."""
    return (key0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            <= row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0))


def _fwd_kernel(q_ref, c_ref, mu_ref, ell_ref, kp_ref, vp_ref, okp_ref, kr_ref, vr_ref, okr_ref, bd_ref,
                o_ref, lse_ref, *, tq: int, ts: int, n_s: int, nq: int, L: int, M: int):
    it = jax.lax.rem(pl.program_id(1), nq)  # query tile inside its block
    q = q_ref[...]
    tv = o_ref.shape[-1]
    row0 = it * tq

    def update(carry, s, valid, vals):
        m, l, acc = carry
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        acc = alpha[:, None] * acc + _dot(p.astype(vals.dtype), vals)
        return m_new, alpha * l + jnp.sum(p, axis=1), acc

    def cache(c, carry):
        el = ell_ref[_ds(c, ts)][None, :]
        s = _dot_nt(*_code_operands(q, c_ref[_ds(c, ts), :])) + el
        return update(carry, s, el > HALF_NEG, mu_ref[_ds(c, ts), :])

    def local(k_ref, v_ref, ok_ref, off):
        def body(kt, carry):
            b, _, _, _ = _band(bd_ref, row0, kt * tq, off, shape=(tq, tq), M=M, ref_row0=row0)
            valid = ok_ref[_ds(kt, tq)][None, :] > 0.5
            if off == 0:
                valid = valid & _causal(row0, kt * tq, (tq, tq))
            s = _dot_nt(q, k_ref[_ds(kt, tq), :]) + b
            return update(carry, s, valid, v_ref[_ds(kt, tq), :])

        return body

    carry = (jnp.full((tq,), NEG, f32), jnp.zeros((tq,), f32), jnp.zeros((tq, tv), f32))
    carry = jax.lax.fori_loop(0, n_s, cache, carry)
    carry = jax.lax.fori_loop(0, nq, local(kp_ref, vp_ref, okp_ref, L), carry)
    carry = jax.lax.fori_loop(0, it + 1, local(kr_ref, vr_ref, okr_ref, 0), carry)  # up to the diagonal tile
    m, l, acc = carry
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _bwd_q_kernel(q_ref, c_ref, mu_ref, ell_ref, kp_ref, vp_ref, okp_ref, kr_ref, vr_ref, okr_ref, bd_ref,
                  lse_ref, dl_ref, do_ref, dq_ref, dbd_ref, *, tq: int, ts: int, tv: int, n_s: int, nq: int,
                  n_tv: int, L: int, M: int):
    it = jax.lax.rem(pl.program_id(1), nq)
    q = q_ref[...]
    lse = lse_ref[...][:, None]
    dl = dl_ref[...][:, None]
    row0 = it * tq

    def dp(w_ref, r, n):  # dO · w[rows r]ᵀ accumulated over the Dv tiles: [tq, n]
        def body(j, acc):
            return acc + _dot_nt(do_ref[:, _ds(j, tv)], w_ref[r, _ds(j, tv)])

        return jax.lax.fori_loop(0, n_tv, body, jnp.zeros((tq, n), f32))

    def cache(c, dq):
        el = ell_ref[_ds(c, ts)][None, :]
        qc, ck = _code_operands(q, c_ref[_ds(c, ts), :])
        p = jnp.where(el > HALF_NEG, jnp.exp(_dot_nt(qc, ck) + el - lse), 0.0)
        ds = p * (dp(mu_ref, _ds(c, ts), ts) - dl)
        return dq + _dot(ds.astype(ck.dtype), ck)

    def local(k_ref, v_ref, ok_ref, off):
        def body(kt, dq):
            b, rows, d, in_band = _band(bd_ref, row0, kt * tq, off, shape=(tq, tq), M=M, ref_row0=row0)
            valid = ok_ref[_ds(kt, tq)][None, :] > 0.5
            if off == 0:
                valid = valid & _causal(row0, kt * tq, (tq, tq))
            k = k_ref[_ds(kt, tq), :]
            p = jnp.where(valid, jnp.exp(_dot_nt(q, k) + b - lse), 0.0)
            ds = p * (dp(v_ref, _ds(kt, tq), tq) - dl)
            # dbd[a, d] = dS at the one key at distance d of query a (every 0 <= d <= M is written once: the
            # previous block for d > a, the present block up to the diagonal for d <= a); the lanes out of the
            # band go to the spare column M + 1, which is dropped
            pltriton.store(dbd_ref.at[rows - row0, jnp.where(in_band, d, M + 1)], ds, mask=in_band)
            return dq + _dot(ds.astype(k.dtype), k)

        return body

    dq = jax.lax.fori_loop(0, n_s, cache, jnp.zeros(dq_ref.shape, f32))
    dq = jax.lax.fori_loop(0, nq, local(kp_ref, vp_ref, okp_ref, L), dq)
    dq = jax.lax.fori_loop(0, it + 1, local(kr_ref, vr_ref, okr_ref, 0), dq)
    dq_ref[...] = dq


def _bwd_kv_kernel(k_ref, v_ref, ok_ref, qp_ref, lsep_ref, dlp_ref, dop_ref, bdp_ref, qr_ref, lser_ref, dlr_ref,
                   dor_ref, bdr_ref, dk_ref, dv_ref, *, tq: int, nq: int, R: int, L: int, M: int, tv: int,
                   n_tv: int):
    u, j = pl.program_id(1), pl.program_id(2)
    e = jax.lax.div(u, nq)  # extended block of this key tile (0: the carried band)
    kt = jax.lax.rem(u, nq)
    # integer arithmetic, not jnp.where: Pallas-Triton lowers a select of scalar constants to an i1 value, and a
    # loop bound of that type fails the Triton verifier (e is in [0, R])
    n_prev = nq * jnp.minimum(R - e, 1)  # query block e sees it as its previous block (all its query tiles)
    lo_pres = kt + (nq - kt) * jnp.maximum(1 - e, 0)  # query block e-1 sees it as present block: tiles kt..nq-1
    k = k_ref[...]
    key_ok = ok_ref[...][None, :] > 0.5
    key0 = kt * tq

    def probs(q_ref, lse_ref, bd_ref, off, qt):
        r = _ds(qt, tq)
        b, _, _, _ = _band(bd_ref, qt * tq, key0, off, shape=(tq, tq), M=M)
        valid = key_ok
        if off == 0:
            valid = valid & _causal(qt * tq, key0, (tq, tq))
        q = q_ref[r, :]
        return q, jnp.where(valid, jnp.exp(_dot_nt(q, k) + b - lse_ref[r][:, None]), 0.0)

    def dv_body(q_ref, lse_ref, do_ref, bd_ref, off):
        def body(qt, dv):
            _, p = probs(q_ref, lse_ref, bd_ref, off, qt)
            do = do_ref[_ds(qt, tq), _ds(j, tv)]
            return dv + _dot_tn(p.astype(do.dtype), do)

        return body

    def dkv_body(q_ref, lse_ref, dl_ref, do_ref, bd_ref, off):  # the Dv-tile-0 program: one P for dv and dk
        def body(qt, carry):
            dv, dk = carry
            q, p = probs(q_ref, lse_ref, bd_ref, off, qt)
            r = _ds(qt, tq)
            do = do_ref[r, _ds(j, tv)]
            dv = dv + _dot_tn(p.astype(do.dtype), do)

            def dp(jj, acc):  # dO · vᵀ over the Dv tiles
                return acc + _dot_nt(do_ref[r, _ds(jj, tv)], v_ref[:, _ds(jj, tv)])

            dpv = jax.lax.fori_loop(0, n_tv, dp, jnp.zeros((tq, tq), f32))
            ds = p * (dpv - dl_ref[r][:, None])
            return dv, dk + _dot_tn(ds.astype(q.dtype), q)

        return body

    @pl.when(j == 0)
    def _():
        carry = (jnp.zeros(dv_ref.shape, f32), jnp.zeros(dk_ref.shape, f32))
        carry = jax.lax.fori_loop(0, n_prev, dkv_body(qp_ref, lsep_ref, dlp_ref, dop_ref, bdp_ref, L), carry)
        dv, dk = jax.lax.fori_loop(lo_pres, nq, dkv_body(qr_ref, lser_ref, dlr_ref, dor_ref, bdr_ref, 0), carry)
        dv_ref[...] = dv
        dk_ref[...] = dk

    @pl.when(j > 0)
    def _():
        dv = jax.lax.fori_loop(0, n_prev, dv_body(qp_ref, lsep_ref, dop_ref, bdp_ref, L),
                               jnp.zeros(dv_ref.shape, f32))
        dv_ref[...] = jax.lax.fori_loop(lo_pres, nq, dv_body(qr_ref, lser_ref, dor_ref, bdr_ref, 0), dv)


def _bwd_mu_kernel(c_ref, ell_ref, q_ref, lse_ref, do_ref, dmu_ref, *, tq: int, nq: int):
    ck = c_ref[...]
    el = ell_ref[...][None, :]
    valid = el > HALF_NEG

    def body(qt, acc):
        r = _ds(qt, tq)
        s = _dot_nt(*_code_operands(q_ref[r, :], ck)) + el
        p = jnp.where(valid, jnp.exp(s - lse_ref[r][:, None]), 0.0)
        do = do_ref[r, :]
        return acc + _dot_tn(p.astype(do.dtype), do)

    dmu_ref[...] = jax.lax.fori_loop(0, nq, body, jnp.zeros(dmu_ref.shape, f32))


# ----------------------------------------------------------------------------- pallas_calls
def _params(cfg, kind):
    if cfg["interpret"]:
        return None
    return pltriton.CompilerParams(num_warps=dict(cfg["warps"]).get(kind, 4), num_stages=cfg["num_stages"])


def _fwd_call(q, C, mu, ell, kx, vx, kval, bd, cfg):
    """q [BH, R·L, Dk]; C [H, Sp, Dk]; mu [BH, R, Sp, Dv]; ell [BH, R, Sp] f32; kx [BH, (R+1)L, Dk];
    vx [BH, (R+1)L, Dv]; kval [(R+1)L] f32 (1: a valid key); bd [BH, R·L, M+1] f32 (band scores).
    Returns o [BH, R·L, Dv] f32, lse [BH, R·L] f32."""
    BH, RL, Dk = q.shape
    H, L, M, tq, ts, tv, Sp = (cfg[k] for k in ("H", "L", "M", "tq", "ts", "tv", "Sp"))
    Dv = vx.shape[-1]
    nq = L // tq
    blk = lambda t: jax.lax.div(t, nq)  # noqa: E731  (query block of query tile t)
    in_specs = [
        pl.BlockSpec((None, tq, Dk), lambda b, t, j: (b, t, 0)),
        pl.BlockSpec((None, Sp, Dk), lambda b, t, j: (jax.lax.rem(b, H), 0, 0)),
        pl.BlockSpec((None, None, Sp, tv), lambda b, t, j: (b, blk(t), 0, j)),
        pl.BlockSpec((None, None, Sp), lambda b, t, j: (b, blk(t), 0)),
        pl.BlockSpec((None, L, Dk), lambda b, t, j: (b, blk(t), 0)),  # previous block = extended block n
        pl.BlockSpec((None, L, tv), lambda b, t, j: (b, blk(t), j)),
        pl.BlockSpec((L,), lambda b, t, j: (blk(t),)),
        pl.BlockSpec((None, L, Dk), lambda b, t, j: (b, blk(t) + 1, 0)),  # present block = extended block n+1
        pl.BlockSpec((None, L, tv), lambda b, t, j: (b, blk(t) + 1, j)),
        pl.BlockSpec((L,), lambda b, t, j: (blk(t) + 1,)),
        pl.BlockSpec((None, tq, M + 1), lambda b, t, j: (b, t, 0)),
    ]
    out_specs = [pl.BlockSpec((None, tq, tv), lambda b, t, j: (b, t, j)),
                 pl.BlockSpec((None, tq), lambda b, t, j: (b, t))]  # every Dv tile writes the same lse
    return pl.pallas_call(
        functools.partial(_fwd_kernel, tq=tq, ts=ts, n_s=Sp // ts, nq=nq, L=L, M=M),
        out_shape=(jax.ShapeDtypeStruct((BH, RL, Dv), f32), jax.ShapeDtypeStruct((BH, RL), f32)),
        grid=(BH, RL // tq, Dv // tv),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "fwd"),
        name="vq_cache_gpu_fwd",
    )(q, C, mu, ell, kx, vx, kval, kx, vx, kval, bd)


def _bwd_q_call(q, C, mu, ell, kx, vx, kval, bd, lse, delta, do, cfg):
    BH, RL, Dk = q.shape
    H, L, M, tq, ts, tv, Sp = (cfg[k] for k in ("H", "L", "M", "tq", "ts", "tv", "Sp"))
    Dv = vx.shape[-1]
    nq = L // tq
    blk = lambda t: jax.lax.div(t, nq)  # noqa: E731
    rows = lambda w: pl.BlockSpec((None, tq, w), lambda b, t: (b, t, 0))  # noqa: E731
    vec = pl.BlockSpec((None, tq), lambda b, t: (b, t))
    in_specs = [
        rows(Dk),
        pl.BlockSpec((None, Sp, Dk), lambda b, t: (jax.lax.rem(b, H), 0, 0)),
        pl.BlockSpec((None, None, Sp, Dv), lambda b, t: (b, blk(t), 0, 0)),
        pl.BlockSpec((None, None, Sp), lambda b, t: (b, blk(t), 0)),
        pl.BlockSpec((None, L, Dk), lambda b, t: (b, blk(t), 0)),
        pl.BlockSpec((None, L, Dv), lambda b, t: (b, blk(t), 0)),
        pl.BlockSpec((L,), lambda b, t: (blk(t),)),
        pl.BlockSpec((None, L, Dk), lambda b, t: (b, blk(t) + 1, 0)),
        pl.BlockSpec((None, L, Dv), lambda b, t: (b, blk(t) + 1, 0)),
        pl.BlockSpec((L,), lambda b, t: (blk(t) + 1,)),
        rows(M + 1), vec, vec, rows(Dv),
    ]
    out_specs = [rows(Dk), rows(M + 2)]
    shp = lambda *s: jax.ShapeDtypeStruct(s, f32)  # noqa: E731
    dq, dbd = pl.pallas_call(
        functools.partial(_bwd_q_kernel, tq=tq, ts=ts, tv=tv, n_s=Sp // ts, nq=nq, n_tv=Dv // tv, L=L, M=M),
        out_shape=(shp(BH, RL, Dk), shp(BH, RL, M + 2)),
        grid=(BH, RL // tq),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "bwd_q"),
        name="vq_cache_gpu_bwd_q",
    )(q, C, mu, ell, kx, vx, kval, kx, vx, kval, bd, lse, delta, do)
    return dq, dbd[..., : M + 1]


def _bwd_kv_call(q, kx, vx, kval, lse, delta, do, bd, cfg):
    BH, RL, Dk = q.shape
    L, M, tq, tv = cfg["L"], cfg["M"], cfg["tq"], cfg["tv"]
    Dv = do.shape[-1]
    nq = L // tq
    R = RL // L
    prev = lambda u: jnp.minimum(jax.lax.div(u, nq), R - 1)  # noqa: E731  (query block e, clamped)
    pres = lambda u: jnp.maximum(jax.lax.div(u, nq) - 1, 0)  # noqa: E731  (query block e-1, clamped)

    def role(blk):
        return [pl.BlockSpec((None, L, Dk), lambda b, u, j: (b, blk(u), 0)),
                pl.BlockSpec((None, L), lambda b, u, j: (b, blk(u))),
                pl.BlockSpec((None, L), lambda b, u, j: (b, blk(u))),
                pl.BlockSpec((None, L, Dv), lambda b, u, j: (b, blk(u), 0)),
                pl.BlockSpec((None, L, M + 1), lambda b, u, j: (b, blk(u), 0))]

    in_specs = [pl.BlockSpec((None, tq, Dk), lambda b, u, j: (b, u, 0)),
                pl.BlockSpec((None, tq, Dv), lambda b, u, j: (b, u, 0)),
                pl.BlockSpec((tq,), lambda b, u, j: (u,))] + role(prev) + role(pres)
    out_specs = [pl.BlockSpec((None, tq, Dk), lambda b, u, j: (b, u, 0)),  # written by the Dv-tile-0 program
                 pl.BlockSpec((None, tq, tv), lambda b, u, j: (b, u, j))]
    n_ext = RL + L
    return pl.pallas_call(
        functools.partial(_bwd_kv_kernel, tq=tq, nq=nq, R=R, L=L, M=M, tv=tv, n_tv=Dv // tv),
        out_shape=(jax.ShapeDtypeStruct((BH, n_ext, Dk), f32), jax.ShapeDtypeStruct((BH, n_ext, Dv), f32)),
        grid=(BH, n_ext // tq, Dv // tv),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "bwd_kv"),
        name="vq_cache_gpu_bwd_kv",
    )(kx, vx, kval, q, lse, delta, do, bd, q, lse, delta, do, bd)


def _bwd_mu_call(q, C, ell, lse, do, cfg):
    BH, RL, Dk = q.shape
    H, L, tq, ts, tv, Sp = (cfg[k] for k in ("H", "L", "tq", "ts", "tv", "Sp"))
    Dv = do.shape[-1]
    R = RL // L
    in_specs = [
        pl.BlockSpec((None, ts, Dk), lambda b, n, c, j: (jax.lax.rem(b, H), c, 0)),
        pl.BlockSpec((None, None, ts), lambda b, n, c, j: (b, n, c)),
        pl.BlockSpec((None, L, Dk), lambda b, n, c, j: (b, n, 0)),
        pl.BlockSpec((None, L), lambda b, n, c, j: (b, n)),
        pl.BlockSpec((None, L, tv), lambda b, n, c, j: (b, n, j)),
    ]
    return pl.pallas_call(
        functools.partial(_bwd_mu_kernel, tq=tq, nq=L // tq),
        out_shape=jax.ShapeDtypeStruct((BH, R, Sp, Dv), f32),
        grid=(BH, R, Sp // ts, Dv // tv),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, ts, tv), lambda b, n, c, j: (b, n, c, j)),
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "bwd_mu"),
        name="vq_cache_gpu_bwd_mu",
    )(C, ell, q, lse, do)


# ----------------------------------------------------------------------------- custom_vjp
class _Cfg(dict):
    """Static kernel configuration (hashable, for nondiff_argnums)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _store(cfg, *xs):
    sdt = jnp.dtype(cfg["sdt"])
    return tuple(x.astype(sdt) for x in xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attend(q, kx, vx, bd, kval, mu, ell, C, cfg):
    q, kx, vx, mu = _store(cfg, q, kx, vx, mu)
    return _fwd_call(q, C, mu, ell, kx, vx, kval, bd, cfg)[0]


def _attend_fwd(q, kx, vx, bd, kval, mu, ell, C, cfg):
    q, kx, vx, mu = _store(cfg, q, kx, vx, mu)
    o, lse = _fwd_call(q, C, mu, ell, kx, vx, kval, bd, cfg)
    return o, (q, kx, vx, bd, kval, mu, ell, C, o, lse)


def _attend_bwd(cfg, res, do):
    q, kx, vx, bd, kval, mu, ell, C, o, lse = res
    do = do.astype(f32)
    delta = jnp.sum(do * o, axis=-1)  # Δ = rowsum(dO ⊙ O)
    (do_s,) = _store(cfg, do)
    dq, dbd = _bwd_q_call(q, C, mu, ell, kx, vx, kval, bd, lse, delta, do_s, cfg)
    dkx, dvx = _bwd_kv_call(q, kx, vx, kval, lse, delta, do_s, bd, cfg)
    dmu = _bwd_mu_call(q, C, ell, lse, do_s, cfg)
    return dq, dkx, dvx, dbd, None, dmu, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _storage_dtype(*xs):
    return jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in xs) else f32


def vq_cache_attention(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, interpret: bool = False,
                       block_q: int | None = None, block_s: int | None = None, block_v: int | None = None):
    """Same contract as ``vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, state, L=L, M=M)`` and
    :func:`pallas_kernels.vq_cache.vq_cache_attention`: q_u, k_hat [B,H,T,Dk]; bd [B,H,T,M+1]; z int32 [B,H,T];
    v [B,H,T,Dv]; C [H,S,Dk]; state with a band of M tokens; 1 <= M <= L. Returns (o [B,H,T,Dv], new_state).
    A bfloat16 codebook with bfloat16 q, k̂, v makes the cache scores bfloat16 products (float32 accumulation);
    a float32 codebook is used as given.

    Compiled for 'cuda' (Triton) unless ``interpret=True`` (Pallas interpret mode, any backend). ``block_q``,
    ``block_s``, ``block_v`` override the tiles of :func:`choose_tiles`."""
    B, H, T, Dk = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    dt = float_dtype(q_u, v)
    reasons = unsupported_reasons("interpret" if interpret else "cuda", L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dt)
    if reasons:
        raise ValueError("vq_cache_attention (GPU form) cannot run: " + "; ".join(reasons))
    sdt = _storage_dtype(q_u, k_hat, v, state["band_k"], state["band_v"])  # never round a wider input
    tiles = choose_tiles(L=L, S=S, Dk=Dk, Dv=Dv, in_dtype=sdt, block_q=block_q, block_s=block_s, block_v=block_v)
    tq, ts, tv, Sp = tiles["tq"], tiles["ts"], tiles["tv"], tiles["Sp"]
    if L % tq or Dv % tv:
        raise ValueError(f"vq_cache_attention (GPU form): block_q={tq} must divide L={L} and block_v={tv} Dv={Dv}")
    small = {k: t for k, t in (("block_q", tq), ("block_s", ts), ("block_v", tv)) if t < 16}
    if small and not interpret:
        raise ValueError("vq_cache_attention (GPU form): Triton dots need tiles of at least 16 (got "
                         + ", ".join(f"{k}={t}" for k, t in small.items()) + "); smaller tiles run in interpret mode")
    R = -(-T // L)
    Tp = R * L
    BH = B * H
    st = cast_state(state, dt)
    pos = st["pos"]

    # Stage 0 / Phase 1 (XLA): extended arrays (band = extended block 0), lag-2 per-code cache, key validity.
    kx = jnp.concatenate([pad_left(st["band_k"], 2, L), pad_to(k_hat.astype(dt), 2, Tp)], axis=2)
    vx = jnp.concatenate([pad_left(st["band_v"], 2, L), pad_to(v.astype(dt), 2, Tp)], axis=2)
    zx = jnp.concatenate([pad_left(st["band_z"], 2, L), pad_to(z, 2, Tp)], axis=2)
    band_pos = pos - L + jnp.arange(L)
    band_valid = (band_pos >= 0) & (jnp.arange(L) >= L - M)  # left padding of the M-slot band is invalid
    validx = jnp.concatenate([band_valid, jnp.arange(Tp) < T]).reshape(R + 1, L)
    vb = vx.reshape(B, H, R + 1, L, Dv)[:, :, :R]
    zb = zx.reshape(B, H, R + 1, L)[:, :, :R]
    bmu, bn = code_summary(zb, vb, validx[:R], S)  # extended blocks 0..R-1
    agg_n = jax.lax.stop_gradient(st["agg_n"])
    items_mu = jnp.concatenate([st["agg_mu"][:, :, None], bmu[:, :, : R - 1]], axis=2)
    items_n = jnp.concatenate([agg_n[:, :, None], bn[:, :, : R - 1]], axis=2)
    cmu, cn = prefix_reduce(items_mu, items_n, "serial")  # [B,H,R,S,Dv], [B,H,R,S]: cache of query block n
    ell = pad_to(log_count(jax.lax.stop_gradient(cn)).astype(f32), 3, Sp, NEG)
    cmu = pad_to(cmu, 3, Sp)
    cdt = C.dtype if C.dtype == sdt else f32  # the cache scores' operands (a float32 codebook is not rounded)
    Cp = pad_to(jax.lax.stop_gradient(C).astype(cdt), 1, Sp)
    bdp = pad_to(bd.astype(f32), 2, Tp)  # [B,H,Tp,M+1]: the kernels gather the band bias from it

    def flat(x):
        return x.reshape((BH,) + x.shape[2:])

    cfg = _Cfg(H=H, L=L, M=M, tq=tq, ts=ts, tv=tv, Sp=Sp, sdt=jnp.dtype(sdt).name, interpret=bool(interpret),
               num_stages=tiles["num_stages"], warps=tuple((k, p["num_warps"]) for k, p in tiles["plan"].items()))
    o = _attend(flat(pad_to(q_u.astype(dt), 2, Tp)), flat(kx), flat(vx), flat(bdp), validx.reshape(-1).astype(f32),
                flat(cmu.astype(f32)), flat(ell), Cp, cfg)
    o = o.reshape(B, H, Tp, Dv)[:, :, :T].astype(dt)
    new_state = final_state(st, k_hat.astype(dt), z, v.astype(dt), T, M, S)
    return o, new_state


__all__ = ["DTYPES", "REG_WORDS_LIMIT", "SMEM_LIMIT_BYTES", "choose_tiles", "tile_budget", "unsupported_reasons",
           "vq_cache_attention"]

"""Transformer-VQ "compressive VQ cache attention" as Pallas Mosaic GPU kernels for Hopper, forward and backward
(docs/methods/transformer_vq.md §9).

It computes what :func:`pallas_kernels.vq_cache_ref.vq_cache_attention_reference` computes (the §2.6 serial form:
lag-2 per-code cache, exact previous block, causal present block, one shared softmax) and has the contract of
:func:`pallas_kernels.vq_cache_gpu.vq_cache_attention` (the Triton form: same operands, same outputs, the new
carried state from the reference's ``final_state``). It imports JAX, the reference and the FMA Mosaic GPU kernel's
module (its wgmma and online-softmax helpers).

Phase 1 (XLA, differentiated by JAX) is the reference's own :func:`~pallas_kernels.vq_cache_ref.block_inputs`:
the extended key / value arrays (the carried band as extended block 0), the key validity, the lag-2 cache of
every query block ``μ̄ [BH, R, S_p, Dv]`` (stored in the compute dtype) and ``ℓ = log N̄`` (f32, ``NEG`` where the
count is 0 and on the padded codes, ``S_p`` = S rounded up to the tile).

**Forward** (``plgpu.kernel``, grid ``(R·L/t, BH)``: one program per (query tile of ``t`` = 64 rows, row), one
warpgroup):

* the query tile ``[t, Dk]`` is brought once by TMA into shared memory;
* the value width is a loop inside the program over slices of ``tv`` (:func:`value_slice`: Dv where Dv <= 256,
  else the widest of 256 / 128 / 64 dividing Dv), not a grid axis. Each slice runs three ``plgpu.emit_pipeline`` s,
  each a two-slot TMA ring: the code chunks (``Cᵀ [Dk, t]`` of the row's head, ``μ̄``'s ``[t, tv]`` slice,
  ``ℓ [t]``), the previous block's key tiles (``k̂ᵀ [Dk, t]``, the value slice ``[t, tv]``, the key validity
  ``[t]``, the band-bias box ``[t, t]``) and the present block's key tiles up to the diagonal (``it + 1`` steps,
  ``it`` the query tile's index in its block: a dynamic grid);
* each step: ``S = q kᵀ`` by wgmma (compute-dtype operands, f32 accumulator), the bias and the masks, the online
  softmax (running max and sum, f32), ``P`` (compute dtype) staged in shared memory and ``acc · α + P V`` by wgmma;
  the f32 accumulator ``[t, tv]``, the max and the sum are the pipelines' carry (registers);
* per slice ``o = acc / l`` (rounded once to the compute dtype) to global memory by TMA; after the last slice
  ``lse = m + log l`` (f32).

**Band bias.** The Triton form gathers ``bd[i, L + i - j]`` (previous block) or ``bd[i, i - j]`` (present block)
per element; Mosaic GPU has no gather from memory into registers and a TMA box is not skewed, so the band scores
reach the kernels laid out again by query tile: ``SK [BH, R·L, E + 2t]`` f32 with ``SK[i, c] = bd[i, E - c + a]``
(``a = i mod t``; 0 where ``E - c + a`` is outside ``0..M``; ``E`` = the largest multiple of ``t`` not above
``M + t - 1``), built in XLA by a gather from ``bd [BH, R·L, M + 1]`` (:func:`band_table`; at L = M = 512: 640
columns against 513). The bias of query tile ``r0`` against key tile ``k0`` of the previous (``off = L``) or
present (``off = 0``) block, at the tile distance ``base = off + r0 - k0`` (a multiple of ``t``), is the plain box
``SK[r0 : r0 + t, E - base : E - base + t]``: ``bias[a, b] = bd[r0 + a, base + a - b]``. A tile pair with
``base > E`` has no key in the band and reads the spare last box (zeros); the iota test ``0 <= base + a - b <= M``
masks the rest (and is the present block's causal mask). No ``[.., L, L]`` or ``[.., L, 2L]`` array exists in
global memory, forward or backward.

**Backward** (``jax.custom_vjp``, FlashAttention-2 style: ``P`` recomputed from the saved ``lse``,
``Δ = rowsum(dO ⊙ O)`` in XLA, ``dS = P ⊙ (dP − Δ)``), three kernels, the value width a loop in each
(slices of at most :data:`TV_BACKWARD` = 128: their rings hold two slices of dO and of the values):

* ``vq_cache_mgpu_dq`` (the forward's grid): per key step ``P`` once, ``dP = Σ_j dO_j W_jᵀ`` by an inner
  pipeline over the value slices (``W`` = μ̄ or the values, transposed), ``dq += dS k`` (f32 carry) and, for the
  local keys, the band box's gradient ``dS`` (masked to the band) stored by TMA into ``dSK`` at the box the
  forward read (every box of a query tile's rows is written exactly once: the tile distances 0..E each occur once
  among its previous and present key tiles; out-of-band pairs write the spare box, dropped). ``dSK`` reaches
  ``bd`` through the transpose of :func:`band_table`'s gather (XLA);
* ``vq_cache_mgpu_dkv`` (grid over the extended key tiles, keys-major ``Sᵀ = k qᵀ``): one pipeline over the query
  tiles that see the key tile (all of query block ``e`` for which it is the previous block, the tiles at or after
  it of block ``e - 1`` for which it is the present block): ``dk = Σ dSᵀ q`` (``dPᵀ`` by the inner slice
  pipeline), then per value slice ``dv_j = Σ Pᵀ dO_j``;
* ``vq_cache_mgpu_dmu`` (grid over (query block, code chunk)): per value slice ``dμ̄_j = Σ P^cᵀ dO_j`` over the
  block's query tiles (no two programs write one chunk: no atomics, unlike the Triton form). ``dμ̄`` flows back to
  ``v`` and the carried ``agg_mu`` through Phase 1 by JAX autodiff.

So ``P`` is computed ``n_tv = Dv / tv`` times in the forward and, in the backward, once for ``dq``, once for
``dk`` and ``n_tv_b = Dv / tv_b`` times for ``dv`` and ``dμ̄``, because a ``[t, Dv]`` f32 accumulator (384 KiB at
Dv = 1536) fits neither the registers nor the shared memory: at the enwik8 config (Dv = 1536) 6 forward passes
(``tv = 256``) and 12 for ``dv`` / ``dμ̄`` (``tv_b = 128``). The Triton form instead keeps the accumulator in the
output block in global memory (read and written per key step); which costs less on a GPU has not been measured.
No gradient reaches the codebook, the codes or the counts (as in the Triton form and §9).

Departures, named (from the Triton form, from an FA3-style kernel, and those jax 0.10.2's Mosaic GPU interpret
mode forces, as in :mod:`pallas_kernels.fma_blocks_mgpu`):

* the score recomputation per value slice and the band table ``SK`` above;
* the codebook is cast to the storage dtype (wgmma's operands share one dtype; the Triton form keeps a float32
  codebook float32 for bfloat16 queries); the layer passes it in the compute dtype;
* transposed operands (the keys, the codebook, μ̄, the values, q, dO, ``SK``) are transposed in XLA, ``P`` and
  ``dS`` go through shared memory, and each ``P V`` goes into a fresh accumulator added to the rescaled one: the
  interpret mode runs wgmma only on untransformed shared-memory operands (no ``transpose_ref`` view, no register
  operand) and does not run ``pl.run_state`` (``plgpu.ACC.init``, in-place accumulation); the pipelines have no
  ``out_specs`` (predicated stores, not run by the interpret mode): outputs leave through the programs' own TMA
  stores, waited for before their staging tile is reused;
* the dP inner pipeline re-reads ``dO``'s slices for every key step (the ``[t, Dv]`` dO tile does not fit in
  shared memory beside the rings at Dv = 1536);
* one warpgroup per program, no warp specialisation, separate pipelines per phase (their rings drain at the phase
  boundaries).

**Packed rows** (``packed``, docs/methods/transformer_vq.md §2.8 and §9, "Packed rows"): as the Triton form
(:mod:`pallas_kernels.vq_cache_gpu`), a static switch (an unpacked row's kernels are unchanged) that takes
``xla.kernel_packed``'s per-row-block caches (they replace Phase 1's) and document arrays, as float32 vectors
(document starts, exact below 2^24): per query its document ``qdoc``, whether it reads its block's cache
``qcache`` and its own window's start ``qwin`` (extended positions), per extended key its document ``kdoc`` (−1:
none). The query tile's ``qdoc`` / ``qcache`` come once into shared memory, the key tiles' ``kdoc`` ride the key
pipelines beside the key validity (every key valid: ``kdoc`` says whose it is). Every score is masked to the
query's document (``qdoc == kdoc``), the code chunks to the queries with ``qcache`` (forward, dq, dμ̄); the dk/dv
kernel takes ``dS`` for ``dk`` only where the key lies in the query's own window (``key >= qwin``) and its dk
pipeline also visits the query tiles of block ``e + 1`` (whose windows reach two blocks back: ``dk`` only, no band
bias at that distance, their ``dv`` being the cache's, through ``dμ̄``). The new state is the caller's
(``state.packed_final_state``).

Dtypes: q, k̂, v, the band, μ̄, dO and the codebook are stored in the compute dtype, bfloat16 when q, k̂, v and the
band are all bfloat16, else float32 (never round a wider input), and reach the custom_vjp in it (Phase 1 forms them
so: no float32 copy of a bfloat16 operand; the cache means are cast down from the float32 statistics); the kernels
write ``o``, dq, dk̂, dv and dμ̄ in that dtype (each rounded once from its f32 accumulator, in registers). Float32
stays only for the accumulators and the declared statistics (:data:`STATISTICS`): ``lse``, Δ, ℓ, the key validity,
the document arrays and the band table ``SK`` with its gradient (the band scores arrive float32 from the layer's
``acc_einsum`` and are added to the float32 scores, never a product's operand). On cuda float32 operands are refused
(wgmma would round them to tf32); interpret mode runs them exactly.

Support (:func:`unsupported_reasons`): on ``cuda`` compute capability 9.0 where known, ``L % 64 == 0``, ``Dk`` a
multiple of 64 up to 256, ``Dv`` a multiple of 64, bfloat16, each kernel's shared memory within an SM's 227 KiB
(:func:`smem_bytes`, an estimate; with gradients the backward kernels' too: Dk = 128 fits, 192 and 256 do not).
Interpret mode (``InterpretGPUParams``, a CPU simulation of shared memory, TMA, barriers and wgmma) takes any tile
``t`` dividing L and any value slice dividing Dv.

Tested (tests/kernels/test_vq_cache_mgpu.py, interpret mode on a CPU): values and final state against the
reference in float32 and bfloat16 at ragged lengths, carried state, M < L, one and several value-width slices,
several code chunks; gradients against autodiff of the reference; packed rows (outputs and gradients against the
packed XLA form, from the empty and a carried state, float32 and bfloat16); the kernels' operands and outputs in
the compute dtype but the statistics; the band table; the refusals; ``jax.export`` for cuda at the enwik8 config's
shapes, forward and gradient, unpacked and packed (the Mosaic GPU lowering runs on a CPU host and checks each
kernel's shared memory). Nothing here compiled or ran on a GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fma_blocks_mgpu import _matmul, _online_step, _rows, _store, interpret_params
from pallas_kernels.precision import statistic
from pallas_kernels.vq_cache_ref import NEG, block_inputs, final_state, input_reasons, log_count, pad_to

f32 = jnp.float32
HALF_NEG = NEG / 2
TILE = 64  # query rows = key-tile width = codes per chunk (wgmma's 64-row granule)
TV_CANDIDATES = (256, 128, 64)
TV_BACKWARD = 128  # the backward's value slice at most (the dq and dk passes' rings hold two slices' dO and W)
MAX_HEAD = 256
SMEM_LIMIT_BYTES = 232448  # an H100 SM's shared memory one block may use (227 KiB)
GPU_DTYPES = ("bfloat16",)


def value_slice(Dv: int, widest: int = TV_CANDIDATES[0]) -> int:
    """The value-width slice one pass accumulates: Dv where Dv <= ``widest``, else the widest of
    :data:`TV_CANDIDATES` up to ``widest`` dividing Dv (a ``[64, tv]`` f32 accumulator: ``tv / 2`` registers a
    thread). The forward takes up to 256, the backward up to :data:`TV_BACKWARD` (its rings hold more tiles)."""
    if Dv <= widest:
        return Dv
    return next((t for t in TV_CANDIDATES if t <= widest and Dv % t == 0), Dv)


def band_width(M: int, t: int = TILE) -> int:
    """``E``: the largest multiple of ``t`` not above ``M + t - 1`` (the largest tile distance with a key in the
    band); the bias table has ``E + t`` columns."""
    return (M + t - 1) // t * t


def smem_bytes(Dk: int, tv: int, tv_b: int | None = None, t: int = TILE, itemsize: int = 2) -> dict:
    """Shared memory of each kernel's largest phase (an estimate from the tiles it allocates, the two-slot rings
    included; the Mosaic GPU lowering checks the exact figure when it lowers: ``jax.export`` for cuda raises where
    it does not fit): ``fwd`` at the forward's slice ``tv``, the backward's (``dq``, ``dkv``, ``dmu``) at
    ``tv_b`` (default ``min(tv, TV_BACKWARD)``). A packed row's document tiles (``[t]`` f32: two a query tile,
    one per ring slot of the key or query tiles) are counted always; outputs are staged in the compute dtype."""
    i, tb = itemsize, min(tv, TV_BACKWARD) if tv_b is None else tv_b
    stat, bias, tile = t * 4, t * t * 4, t * t * i
    inner = 2 * 2 * t * tb * i  # the dP pass: dO and W slices
    docs = 2 * stat + 2 * 2 * stat  # a packed row: the query tile's two, a ring's two slots of one or two more
    return {
        "fwd": docs + max(t * Dk * i + tile + 2 * ((Dk * t + t * tv) * i + bias + stat),
                          t * Dk * i + t * tv * i + stat),
        "dq": docs + t * Dk * i + 2 * stat + tile + bias + 2 * (2 * Dk * t * i + stat + bias) + inner,
        "dkv": docs + t * Dk * i + stat + 2 * tile + max(2 * (2 * Dk * t * i + 2 * stat + bias) + inner,
                                                          2 * (Dk * t * i + stat + bias + t * tb * i) + t * tb * i),
        "dmu": docs + t * Dk * i + stat + tile + 2 * (Dk * t * i + stat + t * tb * i) + t * tb * i,
    }


def _major(cc) -> int:
    """The major version of a compute capability given as ``(major, minor)`` or a string like ``"9.0"``."""
    return int(cc[0]) if isinstance(cc, tuple) else int(str(cc).split(".")[0])


def unsupported_reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype=f32,
                        with_grad: bool = True, compute_capability=None, block: int | None = None) -> list[str]:
    """Why the Mosaic GPU kernels (the backward's too where ``with_grad``) cannot serve these shapes on
    ``platform`` ('cuda' | 'interpret' | other). ``compute_capability``: ``(major, minor)`` or ``"9.0"`` where the
    caller knows the device."""
    out = input_reasons(L=L, M=M, dtype=dtype)
    t = TILE if block is None else block
    if platform == "interpret":
        if L % t:
            out.append(f"the tile t={t} must divide block_len L={L}")
        return out
    if platform != "cuda":
        out.append(f"the Mosaic GPU kernel runs on cuda (Hopper), not {platform}")
        return out
    if compute_capability is not None and _major(compute_capability) != 9:
        out.append(f"needs compute capability 9.0 (Hopper) for wgmma and TMA, got {compute_capability}")
    if t != TILE:
        out.append(f"tile {t}: the cuda kernel uses {TILE}-row tiles (wgmma's granule)")
    if L % TILE:
        out.append(f"block_len L={L} must be a multiple of {TILE} (wgmma query tiles)")
    if Dk % 64 or not 64 <= Dk <= MAX_HEAD:
        out.append(f"key dim Dk={Dk} must be a multiple of 64 in [64, {MAX_HEAD}] (wgmma tiles)")
    if Dv % 64:
        out.append(f"value dim Dv={Dv} must be a multiple of 64 (wgmma tiles)")
    name = jnp.dtype(dtype).name
    if name not in GPU_DTYPES:
        out.append(f"dtype {name}: wgmma operands in {GPU_DTYPES} (float32 would be rounded to tf32)")
    if not Dk % 64 and not Dv % 64:
        smem = smem_bytes(Dk, value_slice(Dv))
        for kind in ("fwd", "dq", "dkv", "dmu") if with_grad else ("fwd",):
            if smem[kind] > SMEM_LIMIT_BYTES:
                out.append(f"Dk={Dk}, Dv={Dv}: the {kind} kernel needs ~{smem[kind] >> 10} KiB of shared memory "
                           f"(estimate), more than an SM's {SMEM_LIMIT_BYTES >> 10} KiB")
    return out


# ----------------------------------------------------------------------------- the forward kernel
def _forward_call(q, ct, mu, ell, kt, vx, kval, sk, docs=None, *, H: int, L: int, M: int, t: int, tv: int,
                  interpret):
    """q [BH, R·L, Dk]; ct [H, Dk, Sp] (the codebook transposed); mu [BH, R, Sp, Dv]; ell [BH, R, Sp] f32;
    kt [BH, Dk, (R+1)·L] (the extended keys transposed); vx [BH, (R+1)·L, Dv]; kval [(R+1)·L] f32 (1: a valid
    key); sk [BH, R·L, E + 2t] f32 (the band bias table, :func:`band_table`); ``docs`` (a packed row): ``qdoc``,
    ``qcache`` [BH, R·L] and ``kdoc`` [BH, (R+1)·L] f32 (:func:`vq_cache_attention`). Returns o [BH, R·L, Dv]
    (q's dtype) and lse [BH, R·L] f32. Grid (R·L/t, BH); the value width is a loop inside the program."""
    BH, RL, Dk = q.shape
    Dv, Sp = vx.shape[-1], ct.shape[-1]
    nq, n_s, n_tv = L // t, Sp // t, Dv // tv
    E = sk.shape[-1] - 2 * t
    dtype = q.dtype

    packed = docs is not None

    def body(q_ref, ct_ref, mu_ref, ell_ref, kt_ref, vx_ref, kval_ref, sk_ref, *refs):
        (qd_ref, qc_ref, kd_ref), refs = (refs[:3], refs[3:]) if packed else ((None,) * 3, refs)
        o_ref, lse_ref, q_s, p_s, bar = refs[:5]
        qt = jax.lax.axis_index("qt")
        bh = jax.lax.axis_index("bh")
        n = jax.lax.div(qt, nq)  # query block
        it = jax.lax.rem(qt, nq)  # query tile inside its block
        r0 = it * t
        rows = pl.ds(qt * t, t)
        plgpu.copy_gmem_to_smem(q_ref.at[bh, rows], q_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        qd_s, qc_s = _load_query_docs(refs[5:], (qd_ref, qc_ref), bh, rows)

        def cache(idx, ct_t, mu_t, ell_t, carry):
            el = _rows(ell_t, (t, t), 1)
            valid = _reads_cache(el > HALF_NEG, qc_s, 0)
            return _online_step(carry, _matmul(q_s, ct_t, (t, t)) + el, valid, mu_t, p_s)

        def local(off):
            def step(idx, kt_t, v_t, ok_t, sk_t, *rest):
                base = off + r0 - idx[0] * t  # tile distance: bias[a, b] = bd[r0 + a, base + a - b]
                d = base + jax.lax.broadcasted_iota(jnp.int32, (t, t), 0) - jax.lax.broadcasted_iota(
                    jnp.int32, (t, t), 1)
                in_band = (d >= 0) & (d <= M)
                valid = _same_document(_rows(ok_t, (t, t), 1) > 0.5, qd_s, rest[:-1], 0)
                if off == 0:
                    valid = valid & (d >= 0)  # causal: key k0 + b at or before query r0 + a
                s = _matmul(q_s, kt_t, (t, t)) + jnp.where(in_band, sk_t[...], 0.0)
                return _online_step(rest[-1], s, valid, v_t, p_s)

            return step

        def bias_col(off):  # the SK box of key tile s (the spare one where the tile is outside the band)
            return lambda s: (qt, _band_col(off + r0 - s * t, E, t))

        def slice_pass(j, lse_carry):
            del lse_carry
            carry = (jnp.zeros((t, tv), f32), jnp.full((t,), NEG, f32), jnp.zeros((t,), f32))
            carry = plgpu.emit_pipeline(
                cache, grid=(n_s,), max_concurrent_steps=min(2, n_s), init_carry=carry,
                in_specs=[plgpu.BlockSpec((Dk, t), lambda c: (0, c)), plgpu.BlockSpec((t, tv), lambda c: (c, j)),
                          plgpu.BlockSpec((t,), lambda c: (c,))],
            )(ct_ref.at[jax.lax.rem(bh, H)], mu_ref.at[bh, n], ell_ref.at[bh, n])
            for off, blk, steps in ((L, n, nq), (0, n + 1, it + 1)):  # previous block; present, to the diagonal
                key = lambda s, b=blk: (b * nq + s,)  # noqa: E731
                carry = plgpu.emit_pipeline(
                    local(off), grid=(steps,), max_concurrent_steps=2, init_carry=carry,
                    in_specs=[plgpu.BlockSpec((Dk, t), lambda s, b=blk: (0, b * nq + s)),
                              plgpu.BlockSpec((t, tv), lambda s, b=blk: (b * nq + s, j)),
                              plgpu.BlockSpec((t,), key), plgpu.BlockSpec((t, t), bias_col(off))]
                    + [plgpu.BlockSpec((t,), key)] * packed,
                )(kt_ref.at[bh], vx_ref.at[bh], kval_ref, sk_ref.at[bh], *([kd_ref.at[bh]] if packed else []))
            acc, m_i, l_i = carry
            l_i = jnp.maximum(l_i, 1e-30)
            o = acc / jax.lax.broadcast_in_dim(l_i, acc.shape, [0])
            pl.run_scoped(lambda o_s: _store(o_s, o.astype(dtype), o_ref.at[bh, rows, pl.ds(j * tv, tv)]),
                          plgpu.SMEM((t, tv), dtype))
            return m_i + jnp.log(l_i)

        lse = jax.lax.fori_loop(0, n_tv, slice_pass, jnp.zeros((t,), f32))
        pl.run_scoped(lambda s: _store(s, lse, lse_ref.at[bh, rows]), plgpu.SMEM((t,), f32))

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, RL, Dv), dtype), jax.ShapeDtypeStruct((BH, RL), f32)),
        scratch_types=(plgpu.SMEM((t, Dk), dtype), plgpu.SMEM((t, t), dtype), plgpu.Barrier(num_barriers=1))
        + _query_doc_scratch(packed, 2, t),
        grid=(RL // t, BH),
        grid_names=("qt", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        kernel_name="vq_cache_mgpu_fwd",
    )(q, ct, mu, ell, kt, vx, kval, sk, *_doc_args(docs, "qdoc", "qcache", "kdoc"))


# ----------------------------------------------------------------------------- packed rows: the documents
def _doc_args(docs, *names):
    """The document arrays a kernel takes, in this order (none for an unpacked row)."""
    return [] if docs is None else [docs[name] for name in names]


def _query_doc_scratch(packed: bool, n: int, t: int) -> tuple:
    """A packed row's scratch for ``n`` per-query document tiles ``[t]`` f32 and their barrier (none unpacked)."""
    return (plgpu.SMEM((t,), f32),) * n + (plgpu.Barrier(num_barriers=n),) if packed else ()


def _load_query_docs(scratch, refs, bh, rows):
    """A packed row: the per-query document arrays ``refs`` ([BH, R·L] f32) of this program's query tile, brought
    once by TMA into the scratch of :func:`_query_doc_scratch`; returns their tiles (Nones where unpacked)."""
    if not scratch:
        return (None,) * len(refs)
    tiles, bar = scratch[:len(refs)], scratch[len(refs)]
    for i, (src, dst) in enumerate(zip(refs, tiles)):
        plgpu.copy_gmem_to_smem(src.at[bh, rows], dst, bar.at[i])
    for i in range(len(refs)):
        plgpu.barrier_wait(bar.at[i])
    return tuple(tiles)


def _reads_cache(valid, qc_s, axis: int):
    """``valid`` and, for a packed row (``qc_s`` given: the queries' ``qcache`` laid along ``axis``), only the
    queries that read their block's cache (the cache is their document's)."""
    return valid if qc_s is None else valid & (_rows(qc_s, valid.shape, axis) > 0.5)


def _same_document(valid, qd_s, kd, axis: int):
    """``valid`` and, for a packed row (``qd_s`` given: the queries' documents laid along ``axis``; ``kd``: the
    one-element tuple of the keys' document tile, laid along the other axis), the key's document the query's."""
    if qd_s is None:
        return valid
    return valid & (_rows(qd_s, valid.shape, axis) == _rows(kd[0], valid.shape, 1 - axis))


# ----------------------------------------------------------------------------- the backward kernels
def _dp_slices(do_ref, w_ref, do_index, w_index, *, t: int, tv: int, n_tv: int, keys_major: bool = False):
    """``dP = Σ_j dO_j W_jᵀ`` over the value-width slices (an inner two-slot pipeline: the value width is a loop,
    not held whole): query-major ``dO_j [t, tv] · Wᵀ_j [tv, t]`` or, ``keys_major``, ``W_j [t, tv] · dOᵀ_j [tv, t]``
    (``do_ref`` then the transposed dO, ``w_ref`` the untransposed values). Returns the f32 ``[t, t]`` tile."""
    def step(idx, do_t, w_t, acc):
        return acc + (_matmul(w_t, do_t, (t, t)) if keys_major else _matmul(do_t, w_t, (t, t)))

    shapes = ((tv, t), (t, tv)) if keys_major else ((t, tv), (tv, t))
    return plgpu.emit_pipeline(
        step, grid=(n_tv,), max_concurrent_steps=min(2, n_tv), init_carry=jnp.zeros((t, t), f32),
        in_specs=[plgpu.BlockSpec(shapes[0], do_index), plgpu.BlockSpec(shapes[1], w_index)],
    )(do_ref, w_ref)


def _dq_call(q, do, lse, delta, ct, c, mut, ell, kt, k, vt, kval, sk, docs=None, *, H, L, M, t, tv, interpret):
    """The query-side backward, grid ``(R·L/t, BH)`` as the forward: per key step (code chunks, previous block,
    present block to the diagonal) ``P`` once from ``lse``, ``dP`` over the value slices, ``dS = P ⊙ (dP − Δ)``,
    ``dq += dS k`` (f32 carry) and, for the local keys, the band-bias tile's gradient ``dS`` (masked to the band)
    stored into ``dSK`` (each box of the table written once: the tile distances 0..E each occur once per query
    tile). Operands as the forward's plus the untransposed ``c [H, Sp, Dk]``, ``k [BH, (R+1)L, Dk]``, the
    transposed values ``mut [BH, R, Dv, Sp]``, ``vt [BH, Dv, (R+1)L]`` and ``do [BH, R·L, Dv]``, ``delta``.
    ``docs``: the forward's. Returns dq [BH, R·L, Dk] (q's dtype), dSK [BH, R·L, E + 2t] (f32: the band table's
    gradient, a statistic as the table)."""
    BH, RL, Dk = q.shape
    Dv, Sp = do.shape[-1], ct.shape[-1]
    nq, n_s, n_tv = L // t, Sp // t, Dv // tv
    E = sk.shape[-1] - 2 * t
    dtype = q.dtype

    packed = docs is not None

    def body(q_ref, do_ref, lse_ref, dl_ref, ct_ref, c_ref, mut_ref, ell_ref, kt_ref, k_ref, vt_ref, kval_ref,
             sk_ref, *refs):
        (qd_ref, qc_ref, kd_ref), refs = (refs[:3], refs[3:]) if packed else ((None,) * 3, refs)
        dq_ref, dsk_ref, q_s, lse_s, dl_s, ds_s, dsk_s, bar = refs[:8]
        qt = jax.lax.axis_index("qt")
        bh = jax.lax.axis_index("bh")
        n, it = jax.lax.div(qt, nq), jax.lax.rem(qt, nq)
        r0 = it * t
        rows = pl.ds(qt * t, t)
        for i, (src, dst) in enumerate(((q_ref.at[bh, rows], q_s), (lse_ref.at[bh, rows], lse_s),
                                        (dl_ref.at[bh, rows], dl_s))):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(3):
            plgpu.barrier_wait(bar.at[i])
        qd_s, qc_s = _load_query_docs(refs[8:], (qd_ref, qc_ref), bh, rows)

        def grad_step(s, valid, k_t, dp, dq):  # dS from P and dP; dq += dS k
            p = jnp.where(valid, jnp.exp(s - _rows(lse_s, (t, t), 0)), 0.0)
            ds = p * (dp - _rows(dl_s, (t, t), 0))
            ds_s[...] = ds.astype(dtype)
            plgpu.commit_smem()
            return ds, dq + _matmul(ds_s, k_t, (t, Dk))

        def cache(idx, ct_t, c_t, ell_t, dq):
            el = _rows(ell_t, (t, t), 1)
            dp = _dp_slices(do_ref.at[bh], mut_ref.at[bh, n], lambda j: (qt, j), lambda j: (j, idx[0]), t=t, tv=tv,
                            n_tv=n_tv)
            valid = _reads_cache(el > HALF_NEG, qc_s, 0)
            return grad_step(_matmul(q_s, ct_t, (t, t)) + el, valid, c_t, dp, dq)[1]

        def local(off, blk):
            def step(idx, kt_t, k_t, ok_t, sk_t, *rest):
                dq = rest[-1]
                base = off + r0 - idx[0] * t
                d = base + jax.lax.broadcasted_iota(jnp.int32, (t, t), 0) - jax.lax.broadcasted_iota(
                    jnp.int32, (t, t), 1)
                in_band = (d >= 0) & (d <= M)
                valid = _same_document(_rows(ok_t, (t, t), 1) > 0.5, qd_s, rest[:-1], 0)
                if off == 0:
                    valid = valid & (d >= 0)
                s = _matmul(q_s, kt_t, (t, t)) + jnp.where(in_band, sk_t[...], 0.0)
                key = blk * nq + idx[0]
                dp = _dp_slices(do_ref.at[bh], vt_ref.at[bh], lambda j: (qt, j), lambda j: (j, key), t=t, tv=tv,
                                n_tv=n_tv)
                ds, dq = grad_step(s, valid, k_t, dp, dq)
                dsk_s[...] = jnp.where(in_band, ds, 0.0)  # the bias tile's gradient (its box, or the spare one)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dsk_s, dsk_ref.at[bh, rows, pl.ds(_band_col(base, E, t) * t, t)])
                plgpu.wait_smem_to_gmem(0)
                return dq

            return step

        dq = plgpu.emit_pipeline(
            cache, grid=(n_s,), max_concurrent_steps=min(2, n_s), init_carry=jnp.zeros((t, Dk), f32),
            in_specs=[plgpu.BlockSpec((Dk, t), lambda c: (0, c)), plgpu.BlockSpec((t, Dk), lambda c: (c, 0)),
                      plgpu.BlockSpec((t,), lambda c: (c,))],
        )(ct_ref.at[jax.lax.rem(bh, H)], c_ref.at[jax.lax.rem(bh, H)], ell_ref.at[bh, n])
        for off, blk, steps in ((L, n, nq), (0, n + 1, it + 1)):
            key = lambda s, b=blk: (b * nq + s,)  # noqa: E731
            dq = plgpu.emit_pipeline(
                local(off, blk), grid=(steps,), max_concurrent_steps=2, init_carry=dq,
                in_specs=[plgpu.BlockSpec((Dk, t), lambda s, b=blk: (0, b * nq + s)),
                          plgpu.BlockSpec((t, Dk), lambda s, b=blk: (b * nq + s, 0)),
                          plgpu.BlockSpec((t,), key),
                          plgpu.BlockSpec((t, t), lambda s, o=off: (qt, _band_col(o + r0 - s * t, E, t)))]
                + [plgpu.BlockSpec((t,), key)] * packed,
            )(kt_ref.at[bh], k_ref.at[bh], kval_ref, sk_ref.at[bh], *([kd_ref.at[bh]] if packed else []))
        pl.run_scoped(lambda dq_s: _store(dq_s, dq.astype(dtype), dq_ref.at[bh, rows]), plgpu.SMEM((t, Dk), dtype))

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, RL, Dk), dtype), jax.ShapeDtypeStruct(sk.shape, f32)),
        scratch_types=(plgpu.SMEM((t, Dk), dtype), plgpu.SMEM((t,), f32), plgpu.SMEM((t,), f32),
                       plgpu.SMEM((t, t), dtype), plgpu.SMEM((t, t), f32), plgpu.Barrier(num_barriers=3))
        + _query_doc_scratch(packed, 2, t),
        grid=(RL // t, BH), grid_names=("qt", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret, kernel_name="vq_cache_mgpu_dq",
    )(q, do, lse, delta, ct, c, mut, ell, kt, k, vt, kval, sk, *_doc_args(docs, "qdoc", "qcache", "kdoc"))


def _dkv_call(k, v, kval, qt_, q, do, dot, lse, delta, skt, docs=None, *, L, M, t, tv, interpret):
    """The key-side backward, grid ``((R+1)·L/t, BH)`` over the extended key tiles, keys-major (``Sᵀ = k qᵀ``):
    a key tile of extended block ``e`` is seen by query block ``e`` (as its previous block: all its query tiles)
    and by query block ``e - 1`` (as its present block: the query tiles at or after the key tile), one pipeline
    over those query tiles. ``dk = Σ dSᵀ q`` (``dPᵀ`` over the value slices, ``Pᵀ`` once a query tile), then per
    value slice ``dv_j = Σ Pᵀ dO_j`` (``Pᵀ`` again per slice: the ``[t, Dv]`` f32 accumulator is held one slice
    at a time). ``qt_ [BH, Dk, R·L]``, ``dot [BH, Dv, R·L]`` the transposes; ``skt [BH, E + 2t, R·L]`` the band
    table transposed. ``docs`` (a packed row: ``kdoc``, ``qdoc``, ``qwin``): every ``P`` masked to the query's
    document, ``dk`` takes ``dS`` only where the key lies in the query's own window (``qwin``), and the dk pipeline
    also visits the query tiles of block ``e + 1`` (whose windows reach two blocks back: ``dk`` only, no band
    bias at that distance; their ``dv`` is the cache's, through ``dμ̄``). Returns dk [BH, (R+1)L, Dk],
    dv [BH, (R+1)L, Dv] (k's dtype)."""
    BH, EL, Dk = k.shape
    Dv, RL = v.shape[-1], q.shape[1]
    nq, n_tv, R = L // t, Dv // tv, RL // L
    E = skt.shape[1] - 2 * t
    dtype = k.dtype

    packed = docs is not None

    def body(k_ref, v_ref, kval_ref, qt_ref, q_ref, do_ref, dot_ref, lse_ref, dl_ref, skt_ref, *refs):
        (kd_ref, qd_ref, qw_ref), refs = (refs[:3], refs[3:]) if packed else ((None,) * 3, refs)
        dk_ref, dv_ref, k_s, ok_s, pt_s, dst_s, bar = refs[:7]
        u = jax.lax.axis_index("kt")
        bh = jax.lax.axis_index("bh")
        e, kt = jax.lax.div(u, nq), jax.lax.rem(u, nq)
        k0 = kt * t
        rows = pl.ds(u * t, t)
        plgpu.copy_gmem_to_smem(k_ref.at[bh, rows], k_s, bar.at[0])
        plgpu.copy_gmem_to_smem(kval_ref.at[rows], ok_s, bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
        if packed:  # the key tile's documents
            kd_s = refs[7]
            plgpu.copy_gmem_to_smem(kd_ref.at[bh, rows], kd_s, bar.at[2])
            plgpu.barrier_wait(bar.at[2])
        # integer arithmetic (no select of scalar constants): the previous-block role exists for e < R, the
        # present-block role (query tiles kt .. nq-1 of block e - 1) for e >= 1, and (packed) the two-back role
        # (all query tiles of block e + 1, dk only) for e < R - 1
        n_prev = nq * jnp.minimum(R - e, 1)
        n_steps = n_prev + (nq - kt) * jnp.minimum(e, 1)
        n_dk = n_steps + nq * jnp.minimum(jnp.maximum(R - 1 - e, 0), 1) * packed

        def two_back(s, at_two, otherwise):  # packed: the steps past n_steps are the two-back role's
            return jnp.where(s < n_steps, otherwise, at_two) if packed else otherwise

        def qtile(s):  # the query tile (of R·L/t) of step s
            return two_back(s, (e + 1) * nq + s - n_steps,
                            jnp.where(s < n_prev, e * nq + s, (e - 1) * nq + kt + s - n_prev))

        def base_of(s):  # the tile distance of step s's query tile from the key tile (multiple of t)
            return two_back(s, 2 * L, jnp.where(s < n_prev, L, 0)) + jax.lax.rem(qtile(s), nq) * t - k0

        def probs_t(s, qt_t, lse_t, skt_t, qd):  # Pᵀ [keys, queries] of step s
            d = base_of(s) + jax.lax.broadcasted_iota(jnp.int32, (t, t), 1) - jax.lax.broadcasted_iota(
                jnp.int32, (t, t), 0)
            in_band = (d >= 0) & (d <= M)  # never at two blocks back (d > L >= M)
            valid = (_rows(ok_s, (t, t), 0) > 0.5) & ((s < n_prev) | (d >= 0))
            valid = _same_document(valid, qd[0] if qd else None, (kd_s,) if packed else (), 1)
            st = _matmul(k_s, qt_t, (t, t)) + jnp.where(in_band, skt_t[...], 0.0)
            return jnp.where(valid, jnp.exp(st - _rows(lse_t, (t, t), 1)), 0.0)

        def bias_box(s):
            return (_band_col(base_of(s), E, t), qtile(s))

        per_query = plgpu.BlockSpec((t,), lambda s: (qtile(s),))
        common = [plgpu.BlockSpec((Dk, t), lambda s: (0, qtile(s))), per_query,
                  plgpu.BlockSpec((t, t), bias_box)] + [per_query] * packed
        docs_in = [qd_ref.at[bh]] if packed else []

        def dk_step(idx, qt_t, lse_t, skt_t, *rest):
            qd, (q_t, dl_t, *qw), dk = rest[:packed], rest[packed:-1], rest[-1]
            pt = probs_t(idx[0], qt_t, lse_t, skt_t, qd)
            dpt = _dp_slices(dot_ref.at[bh], v_ref.at[bh], lambda j: (j, qtile(idx[0])), lambda j: (u, j), t=t,
                             tv=tv, n_tv=n_tv, keys_major=True)
            dst = pt * (dpt - _rows(dl_t, (t, t), 1))
            if packed:  # the keys before the query's own window take no dS (its document's grid caches them)
                key_at = (u * t + jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)).astype(f32)
                dst = jnp.where(key_at >= _rows(qw[0], (t, t), 1), dst, 0.0)
            dst_s[...] = dst.astype(dtype)
            plgpu.commit_smem()
            return dk + _matmul(dst_s, q_t, (t, Dk))

        dk = plgpu.emit_pipeline(
            dk_step, grid=(n_dk,), max_concurrent_steps=2, init_carry=jnp.zeros((t, Dk), f32),
            in_specs=common + [plgpu.BlockSpec((t, Dk), lambda s: (qtile(s), 0)), per_query]
            + [per_query] * packed,
        )(qt_ref.at[bh], lse_ref.at[bh], skt_ref.at[bh], *docs_in, q_ref.at[bh], dl_ref.at[bh],
          *([qw_ref.at[bh]] if packed else []))
        pl.run_scoped(lambda dk_s: _store(dk_s, dk.astype(dtype), dk_ref.at[bh, rows]), plgpu.SMEM((t, Dk), dtype))

        def dv_slice(j, c):
            def dv_step(idx, qt_t, lse_t, skt_t, *rest):
                qd, do_t, dv = rest[:packed], rest[-2], rest[-1]
                pt_s[...] = probs_t(idx[0], qt_t, lse_t, skt_t, qd).astype(dtype)
                plgpu.commit_smem()
                return dv + _matmul(pt_s, do_t, (t, tv))

            dv = plgpu.emit_pipeline(
                dv_step, grid=(n_steps,), max_concurrent_steps=2, init_carry=jnp.zeros((t, tv), f32),
                in_specs=common + [plgpu.BlockSpec((t, tv), lambda s: (qtile(s), j))],
            )(qt_ref.at[bh], lse_ref.at[bh], skt_ref.at[bh], *docs_in, do_ref.at[bh])
            pl.run_scoped(lambda dv_s: _store(dv_s, dv.astype(dtype), dv_ref.at[bh, rows, pl.ds(j * tv, tv)]),
                          plgpu.SMEM((t, tv), dtype))
            return c

        jax.lax.fori_loop(0, n_tv, dv_slice, 0)

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, EL, Dk), dtype), jax.ShapeDtypeStruct((BH, EL, Dv), dtype)),
        scratch_types=(plgpu.SMEM((t, Dk), dtype), plgpu.SMEM((t,), f32), plgpu.SMEM((t, t), dtype),
                       plgpu.SMEM((t, t), dtype), plgpu.Barrier(num_barriers=2 + packed))
        + (plgpu.SMEM((t,), f32),) * packed,
        grid=(EL // t, BH), grid_names=("kt", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret, kernel_name="vq_cache_mgpu_dkv",
    )(k, v, kval, qt_, q, do, dot, lse, delta, skt, *_doc_args(docs, "kdoc", "qdoc", "qwin"))


def _dmu_call(c, ell, qt_, do, lse, docs=None, *, H, L, t, tv, interpret):
    """The codes' backward, grid ``(R·Sp/t, BH)`` over (query block n, code chunk): per value slice
    ``dμ̄_j = Σ P^cᵀ dO_j`` over the block's query tiles (keys-major ``Sᵀ = C qᵀ + ℓ``; ``P^cᵀ`` once per slice).
    ``docs`` (a packed row): ``qcache``, only the queries that read their block's cache. Returns dμ̄
    [BH, R, Sp, Dv] (the codebook's dtype, the compute dtype). No two programs write one chunk: no atomics."""
    Sp, Dk = c.shape[1:]
    BH, RL, Dv = do.shape
    nq, n_s, n_tv, R = L // t, Sp // t, Dv // tv, RL // L
    dtype = c.dtype

    packed = docs is not None

    def body(c_ref, ell_ref, qt_ref, do_ref, lse_ref, *refs):
        qc_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
        dmu_ref, c_s, ell_s, pt_s, bar = refs
        g = jax.lax.axis_index("chunk")
        bh = jax.lax.axis_index("bh")
        n, ch = jax.lax.div(g, n_s), jax.lax.rem(g, n_s)
        codes = pl.ds(ch * t, t)
        plgpu.copy_gmem_to_smem(c_ref.at[jax.lax.rem(bh, H), codes], c_s, bar.at[0])
        plgpu.copy_gmem_to_smem(ell_ref.at[bh, n, codes], ell_s, bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])

        def dmu_slice(j, carry):
            def step(idx, qt_t, lse_t, do_t, *rest):
                el = _rows(ell_s, (t, t), 0)
                st = _matmul(c_s, qt_t, (t, t)) + el
                valid = _reads_cache(el > HALF_NEG, rest[0] if packed else None, 1)
                acc = rest[-1]
                pt_s[...] = jnp.where(valid, jnp.exp(st - _rows(lse_t, (t, t), 1)), 0.0).astype(dtype)
                plgpu.commit_smem()
                return acc + _matmul(pt_s, do_t, (t, tv))

            acc = plgpu.emit_pipeline(
                step, grid=(nq,), max_concurrent_steps=min(2, nq), init_carry=jnp.zeros((t, tv), f32),
                in_specs=[plgpu.BlockSpec((Dk, t), lambda s: (0, n * nq + s)),
                          plgpu.BlockSpec((t,), lambda s: (n * nq + s,)),
                          plgpu.BlockSpec((t, tv), lambda s: (n * nq + s, j))]
                + [plgpu.BlockSpec((t,), lambda s: (n * nq + s,))] * packed,
            )(qt_ref.at[bh], lse_ref.at[bh], do_ref.at[bh], *([qc_ref.at[bh]] if packed else []))
            pl.run_scoped(lambda s: _store(s, acc.astype(dtype), dmu_ref.at[bh, n, codes, pl.ds(j * tv, tv)]),
                          plgpu.SMEM((t, tv), dtype))
            return carry

        jax.lax.fori_loop(0, n_tv, dmu_slice, 0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((BH, R, Sp, Dv), dtype),
        scratch_types=(plgpu.SMEM((t, Dk), dtype), plgpu.SMEM((t,), f32), plgpu.SMEM((t, t), dtype),
                       plgpu.Barrier(num_barriers=2)),
        grid=(R * n_s, BH), grid_names=("chunk", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret, kernel_name="vq_cache_mgpu_dmu",
    )(c, ell, qt_, do, lse, *_doc_args(docs, "qcache"))


def band_table(bd, *, M: int, t: int):
    """``SK [BH, R·L, E + 2t]`` f32 from the band scores ``bd [BH, R·L, M + 1]``: ``SK[i, c] = bd[i, E - c + a]``
    (``a = i mod t``), 0 outside ``0..M`` (module docstring); the last ``t`` columns are the spare box the tiles
    outside the band read (zeros) and the backward writes (dropped). A gather in XLA, differentiable (its
    transpose adds each entry back once: the map is one-to-one on the band)."""
    BH, RL, _ = bd.shape
    E = band_width(M, t)
    a = jnp.arange(t)[:, None]
    dist = E - jnp.arange(E + 2 * t)[None, :] + a  # [t, E + 2t]
    ok = (dist >= 0) & (dist <= M)
    x = bd.reshape(BH, RL // t, t, M + 1)
    g = jnp.take_along_axis(x, jnp.broadcast_to(jnp.clip(dist, 0, M), (BH, RL // t, t, E + 2 * t)), axis=-1)
    return jnp.where(ok, g, 0.0).reshape(BH, RL, E + 2 * t)


def _band_col(base, E: int, t: int):
    """The column box of ``SK`` holding the bias of a tile pair at distance ``base`` (a multiple of ``t``): box
    ``(E - base) / t``, or the spare box ``(E + t) / t`` where ``base > E`` (no key of the tile in the band)."""
    return jnp.where(base <= E, jax.lax.div(E - jnp.minimum(base, E), t), (E + t) // t)


# ----------------------------------------------------------------------------- custom_vjp
class _Cfg(NamedTuple):
    """The static configuration of one call (nondiff_argnums: hashable)."""

    H: int
    L: int
    M: int
    t: int  # tile rows
    tv: int  # the forward's value slice
    tv_b: int  # the backward's value slice
    interpret: bool


# The float32 operands and outputs of the kernels, each a declared statistic (none is a product's operand: they are
# added to or compared with float32 scores): tests/kernels/test_vq_cache_mgpu.py fails on any other float32
# operand or output of the kernels on bfloat16 inputs.
STATISTICS = {
    "lse": "the row log-sum-exp [BH, R·L] (softmax statistic, saved for the backward)",
    "delta": "Δ = rowsum(dO ⊙ O) [BH, R·L] (softmax statistic of the backward)",
    "ell": "ℓ = log N̄ [BH, R, S_p], the cache's log counts added to the code scores",
    "kval": "the key validity [(R+1)·L] (0 / 1)",
    "band table": "SK [BH, R·L, E + 2t] and its gradient dSK: the band scores (q + v')·r'ᵀ (float32 from the "
                  "layer's acc_einsum, as every form takes them), added to the float32 scores, never a product's "
                  "operand; laid out per query tile by a gather (module docstring)",
    "documents": "a packed row's qdoc, qcache, qwin [BH, R·L] and kdoc [BH, (R+1)·L]: document starts and flags as "
                 "float32 (exact below 2^24), compared in shared memory",
}


def _run_forward(q, kx, vx, bd, kval, mu, ell, C, cfg, docs):
    interpret = interpret_params() if cfg.interpret else False
    return _forward_call(q, jnp.swapaxes(C, 1, 2), mu, ell, jnp.swapaxes(kx, 1, 2), vx, kval,
                         band_table(bd, M=cfg.M, t=cfg.t), docs, H=cfg.H, L=cfg.L, M=cfg.M, t=cfg.t,
                         tv=cfg.tv, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attend(q, kx, vx, bd, kval, mu, ell, C, cfg, docs=None):
    """q, kx, vx, mu and C in the storage dtype (their cotangents too: each gradient is written by its kernel in
    that dtype, rounded once); bd, kval, ell and the documents f32 (:data:`STATISTICS`). Returns o (storage
    dtype)."""
    return _run_forward(q, kx, vx, bd, kval, mu, ell, C, cfg, docs)[0]


def _attend_fwd(q, kx, vx, bd, kval, mu, ell, C, cfg, docs=None):
    o, lse = _run_forward(q, kx, vx, bd, kval, mu, ell, C, cfg, docs)
    return o, (q, kx, vx, bd, kval, mu, ell, C, o, lse, docs)


def _attend_bwd(cfg, res, do):
    q, kx, vx, bd, kval, mu, ell, C, o, lse, docs = res
    with statistic("delta = rowsum(dO * O), a softmax statistic of the backward"):
        delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1)
    do = do.astype(q.dtype)
    kw = dict(L=cfg.L, t=cfg.t, tv=cfg.tv_b, interpret=interpret_params() if cfg.interpret else False)
    table = functools.partial(band_table, M=cfg.M, t=cfg.t)
    sk, table_vjp = jax.vjp(table, bd)
    tr = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    dq, dsk = _dq_call(q, do, lse, delta, tr(C), C, tr(mu), ell, tr(kx), kx, tr(vx), kval, sk, docs, H=cfg.H,
                       M=cfg.M, **kw)
    dkx, dvx = _dkv_call(kx, vx, kval, tr(q), q, do, tr(do), lse, delta, tr(sk), docs, M=cfg.M, **kw)
    dmu = _dmu_call(C, ell, tr(q), do, lse, docs, H=cfg.H, **kw)
    (dbd,) = table_vjp(dsk)
    return dq, dkx, dvx, dbd, None, dmu, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def vq_cache_attention(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, interpret: bool = False,
                       block: int | None = None, block_v: int | None = None, compute_capability=None,
                       packed: dict | None = None):
    """Same contract as :func:`pallas_kernels.vq_cache_gpu.vq_cache_attention`: q_u, k_hat [B,H,T,Dk];
    bd [B,H,T,M+1]; z int32 [B,H,T]; v [B,H,T,Dv]; C [H,S,Dk]; state with a band of M tokens; 1 <= M <= L.
    Returns (o [B,H,T,Dv] in the storage dtype, new_state). Compiled for cuda (Mosaic GPU) unless ``interpret``
    (Mosaic GPU's interpret mode on any backend). ``block``: the tile ``t`` (64 on cuda; interpret mode takes any
    divisor of L); ``block_v``: the value-width slice (default :func:`value_slice`).

    ``packed`` (a packed row, docs/methods/transformer_vq.md §2.8, §9): the caller's per-block caches and
    document arrays (``longctx.attention.transformer_vq.xla.kernel_packed``: ``cmu``, ``cn``, ``qdoc``,
    ``qwin``, ``qcache``, ``kdoc``) replace Phase 1's cache and the key validity, as in the Triton form: every
    product is masked to the query's document, a query reads its block's cache only where ``qcache``, and ``dk̂``
    takes ``dS`` only from the queries whose own window holds the key (the key-side kernel also visits the row
    block after the next). The state's band still forms extended block 0; its ``pos`` is not read. Returns
    (o, None): the caller forms the packed row's new state."""
    B, H, T, Dk = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    t = TILE if block is None else block
    sdt = jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in (q_u, k_hat, v, state["band_k"], state["band_v"])) \
        else f32  # never round a wider input
    reasons = unsupported_reasons("interpret" if interpret else "cuda", L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=sdt,
                                  compute_capability=compute_capability, block=t)
    if reasons:
        raise ValueError("vq_cache_attention (Mosaic GPU form) cannot run: " + "; ".join(reasons))
    # q, k̂, v, the band and the codebook in the storage dtype from the start (no float32 copy of a bf16 operand)
    p = block_inputs(q_u, None, k_hat, z, v, C, state, L=L, M=M, compute=sdt)
    R = p["qb"].shape[2]
    Tp, BH, Sp = R * L, B * H, -(-S // t) * t
    tv = value_slice(Dv) if block_v is None else block_v
    if Dv % tv or (not interpret and (tv % 64 or tv > TV_CANDIDATES[0])):
        raise ValueError(f"vq_cache_attention (Mosaic GPU form): block_v={tv} must divide Dv={Dv} (on cuda: a "
                         f"multiple of 64 up to {TV_CANDIDATES[0]})")
    flat = lambda x: x.reshape(BH, -1, x.shape[-1])  # noqa: E731  ([B, H, blocks, L, D] -> [BH, blocks·L, D])
    cmu, cn, validx, docs = p["cmu"], p["cn"], p["validx"], None
    if packed is not None:  # the caller's caches; every key's validity is its document's (kdoc)
        cmu, cn, validx = packed["cmu"], packed["cn"], jnp.ones_like(validx)
        docs = {name: jnp.broadcast_to(packed[name][:, None], (B, H) + packed[name].shape[1:]).reshape(BH, -1)
                .astype(f32) for name in ("qdoc", "qwin", "qcache", "kdoc")}
    ell = pad_to(log_count(jax.lax.stop_gradient(cn)).astype(f32), 3, Sp, NEG).reshape(BH, R, Sp)
    cmu = pad_to(cmu, 3, Sp).astype(sdt).reshape(BH, R, Sp, Dv)  # the cache means: a product's operand
    Cp = pad_to(p["Cs"], 1, Sp)
    cfg = _Cfg(H=H, L=L, M=M, t=t, tv=tv, tv_b=value_slice(tv, TV_BACKWARD), interpret=bool(interpret))
    bdp = pad_to(bd.astype(f32), 2, Tp).reshape(BH, Tp, M + 1)  # band scores: a statistic (STATISTICS)
    o = _attend(flat(p["qb"]), flat(p["kx"]), flat(p["vx"]), bdp, validx.reshape(-1).astype(f32), cmu, ell, Cp,
                cfg, docs)
    o = o.reshape(B, H, Tp, Dv)[:, :, :T]
    if packed is not None:
        return o, None
    dt = p["state"]["agg_mu"].dtype
    new_state = final_state(p["state"], k_hat.astype(dt), z, v.astype(dt), T, M, S)
    return o, new_state


__all__ = ["GPU_DTYPES", "SMEM_LIMIT_BYTES", "STATISTICS", "TILE", "band_table", "band_width", "smem_bytes", "unsupported_reasons",
           "value_slice", "vq_cache_attention"]

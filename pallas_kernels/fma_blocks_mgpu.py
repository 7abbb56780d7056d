"""FMA "multilevel blocks" forward and backward as Pallas Mosaic GPU kernels for Hopper (docs/methods/fma.md §8).

It computes what :func:`pallas_kernels.fma_blocks_ref.attend_blocks` computes on full passes of FMA (packed coarse
slots, static block offset 0, no dropout) and has the operands of the Triton kernel
:mod:`pallas_kernels.fma_blocks` (``q, k [BH, n_pad, d]`` with ``q`` pre-scaled, ``v [BH, n_pad, dv]``, the level
summaries ``kall [BH, R, d], vall [BH, R, dv]``, the slot table ``idx [nb, C]`` and its bias ``cbias [nb, C]``).
It imports JAX, its reference and, for the refusals both kernels share, the Triton kernel's module.

Why this kernel. A fine query block of FMA is a flash-attention query tile: its keys are a few contiguous key
tiles of the same K/V arrays (own block with the causal mask, previous block, next block when bidirectional) and
its coarse slots, all under one online softmax. Transformer-VQ's cache attention (``vq_cache_gpu.py``) gathers a
per-element band bias ``bd[i, L + i - j]`` from a ``[tq, M + 1]`` table inside the kernel and has value widths of
1536 / 4096 whose f32 accumulator does not fit in registers; EVA's (``eva_attend.py``) mixes per-chunk RFA
statistics into the softmax. Neither maps onto a wgmma tile loop as directly.

Design (one program per ``(fine block, row)``: ``plgpu.kernel`` grid ``(nb, BH)``, one warpgroup):

* the query tile (``m`` = 64 or 128 rows, one fine block) is copied once by TMA into shared memory;
* **fine pipeline** ``plgpu.emit_pipeline`` over ``w`` key steps (2 causal: previous, own; 3 bidirectional:
  + next), each step a ``[d, m]`` tile of the transposed keys and an ``[m, dv]`` value tile of the row's arrays
  brought by TMA into a ``min(2, w)``-slot ring (the block index clamped into range; an out-of-range block is
  masked whole);
* **coarse pipeline** ``plgpu.emit_pipeline`` over ``C_pad / tc`` slot tiles (``tc`` = :data:`SLOT_TILE` = 64) of
  the block's pre-gathered slots with their bias row (``[tc]`` f32, TMA into shared memory), up to 2 in flight;
* each step: ``S = q kᵀ`` by ``wgmma`` (compute-dtype operands from shared memory, f32 accumulator), the mask
  (key range, causal, slot bias), the online-softmax update of the running max and sum (f32; masked entries are
  exactly 0, so a fully masked first step is harmless), ``P`` (compute dtype) stored to a shared-memory tile and
  ``acc = acc · exp(m_old − m_new) + P V`` with ``P V`` by ``wgmma`` into a fresh f32 accumulator; the f32
  accumulator ``[m, dv]``, the running max and sum are the pipelines' carry (registers);
* epilogue: ``o = acc / max(l, 1e-30)`` in the compute dtype and ``lse = m + log l`` (f32, the backward's
  residual) through shared memory to global memory by TMA.

Backward (``jax.custom_vjp``, FlashAttention-2 style: probabilities recomputed from ``lse``, ``Δ = rowsum(dO ⊙ O)``
in XLA, ``dS = P ⊙ (dP − Δ)``), two kernels on the forward's grid, each a pipeline as above with f32 carries:

* **dq** (per query block): the fine steps give ``dq += dS k``; the coarse steps also the block's slot gradients
  ``dkc = dSᵀ q``, ``dvc = Pᵀ dO`` (f32, stored by TMA per slot tile into ``[BH, nb, C_pad, *]``; the slots are
  per-block copies, so no two programs write one row and no atomics are needed; XLA's transpose of the gather
  adds them into the summaries' gradients). ``Pᵀ`` and ``dSᵀ`` are recomputed keys-major (``Sᵀ = k qᵀ``) rather
  than transposed (below);
* **dk/dv** (per fine key block ``j``, keys-major): the query blocks that see it (``j + 1``, ``j``, and
  bidirectional ``j − 1``), ``dv += Pᵀ dO``, ``dk += dSᵀ q``.

Packed rows (docs/methods/fma.md §2.7): ``docs``, the document of every query, key and slot (the Triton kernel's
three vectors, here float32 ids, exact below 2^24), reach shared memory as the statistics do (the queries' with the
query tile, the keys' and the slots' as one more operand of each pipeline step); a key or slot counts for a query
only where the ids are equal, compared along the axes each step lays them (query- or keys-major).

Gradients are returned in the compute dtype, each rounded once from its f32 accumulator; the slot bias gets a zero
gradient (a constant table, as in the Triton kernel).

Departures from the Triton kernel and from an FA3-style Hopper kernel, named:

* the coarse slots are gathered in XLA into per-block copies ``[BH, nb, d, C_pad]`` (keys, transposed) and
  ``[BH, nb, C_pad, dv]`` before the call (the Triton kernel reads them by index from the summaries; Hopper's TMA
  has no row gather, and per-row copies are not written yet): each call moves ``nb · C_pad · (d + dv)`` more
  elements;
* transposed operands are transposed in XLA (forward: the keys, ``[BH, d, n_pad]``; backward: q, k, v, dO and
  the slots), ``P`` and ``dS`` go through shared memory, and the backward's coarse steps compute their scores
  twice (query- and keys-major): Mosaic GPU's interpret mode (jax 0.10.2) runs wgmma only on untransformed
  shared-memory operands (no ``transpose_ref`` view, no register operand), does not run ``pl.run_state``, nor the
  predicated stores of ``emit_pipeline``'s ``out_specs``, so the code the CPU tests run is the code a GPU would
  run only in this form. On a GPU, ``transpose_ref`` views and ``P`` from registers accumulated in place
  (``pl.run_state`` with ``plgpu.ACC.init``) would save the transposes, the shared-memory round trips and one
  ``[m, dv]`` add a step;
* one warpgroup per program, no warp specialisation (a producer warpgroup as in JAX's ``attention_mgpu.py`` is
  the next step once a GPU can measure it);

Support (:func:`unsupported_reasons`): on ``cuda`` ``m`` in :data:`MGPU_M` (wgmma's 64-row granule), ``d, dv``
multiples of 64 up to 256, the f32 accumulator and score tile within :data:`REG_WORDS` registers a thread
(``m · (dv + m) / 128``, a warpgroup's 128 threads: an estimate of what fits beside the rest under the 255-register
limit, not a measurement; it refuses ``m = 128`` with ``dv = 128``), bfloat16 / float16 operands (float32 operands
would make wgmma round to tf32), the largest kernel phase's shared memory within an SM's 227 KiB
(:func:`smem_bytes`, an estimate; the lowering checks the exact figure), compute capability 9.0 where known.
Interpret mode (``interpret=True``: ``InterpretGPUParams()`` of Mosaic GPU's interpret mode, which simulates shared
memory, TMA, barriers and wgmma on a CPU) refuses none of these and runs float32 exactly.

Tested (tests/kernels/test_fma_blocks_mgpu.py, interpret mode on a CPU): values against ``attend_blocks`` in
float32 and bfloat16, causal and bidirectional, with and without coarse slots, ragged ``n_valid``; gradients in
q, k, v, kall, vall against autodiff of the reference; packed rows (``docs``) in value and gradient; the refusals;
``jax.export`` of forward and gradient for ``cuda`` on a CPU host (Pallas' Mosaic GPU lowering runs; no GPU
compiled or ran them). Nothing here ran on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fma_blocks
from pallas_kernels.fma_blocks_ref import NEG

f32 = jnp.float32
MGPU_M = (64, 128)  # fine block rows = query tile rows (wgmma granule: 64 rows a warpgroup)
SLOT_TILE = 64  # coarse slots per key step
MAX_HEAD = 256
REG_WORDS = 192  # f32 registers a thread for the [m, dv] accumulator and the [m, m] scores (estimate)
GPU_DTYPES = ("bfloat16", "float16")


def interpret_params():
    """Mosaic GPU's interpret mode (a CPU simulation of the kernel): the value the kernel's ``interpret=`` takes."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


SMEM_LIMIT_BYTES = 232448  # an H100 SM's shared memory one block may use (227 KiB)


def smem_bytes(m: int, d: int, dv: int, itemsize: int = 2, coarse_ring: int = 2) -> int:
    """Shared memory the largest of the three kernels' phases holds at once (an estimate from the tiles each
    allocates, pipeline rings included: 2 fine steps, ``coarse_ring`` = min(2, slot tiles) coarse ones; the Mosaic
    GPU lowering checks the exact figure against the device's limit when it lowers: ``jax.export`` for cuda raises
    where it does not fit; at the four shapes checked beyond the limit the estimate was 0.6 to 0.9 % below the
    lowering's figure)."""
    i, t, r = itemsize, SLOT_TILE, coarse_ring
    fwd = (m * d + m * dv + m * m + m * t) * i + 4 * m + 2 * max((d + dv) * m * i, (d + dv) * t * i + 4 * t)
    dq_base = 2 * (m * d + m * dv) * i + 8 * m
    dq_fine = m * m * i + 2 * (2 * d + dv) * m * i
    dq_coarse = 3 * t * m * i + t * (d + dv) * 4 + r * (2 * t * (d + dv) * i + 4 * t)
    dkv = m * (d + dv) * i + 2 * m * m * i + max(4 * m * (d + dv) * i + 16 * m, m * max(d, dv) * 4)
    return max(fwd, dq_base + max(dq_fine, dq_coarse, m * d * 4), dkv)


def hopper_reasons(compute_capability) -> list[str]:
    """The refusal of a device other than Hopper: ``compute_capability`` ``(major, minor)`` or a string like
    ``"9.0"`` (None: unknown, served)."""
    cc = compute_capability
    if cc is None or (cc[0] if isinstance(cc, tuple) else int(str(cc).split(".")[0])) == 9:
        return []
    return [f"needs compute capability 9.0 (Hopper) for wgmma and TMA, got {cc}"]


def unsupported_reasons(platform: str, *, m: int, d: int, dv: int, dtype=None, coarse_kind=None,
                        q_block0_static=True, dropout: float = 0.0, compute_capability=None, coarse_slots=None,
                        **_) -> list[str]:
    """Why the Mosaic GPU kernels (forward and backward) cannot serve these shapes on ``platform`` ('cuda' |
    'interpret' | other). ``compute_capability``: ``(major, minor)`` or a string like ``"9.0"`` where the caller
    knows the device; ``coarse_slots``: the packed slots a block has, where known (unknown: the shared-memory
    estimate assumes two slot tiles in flight)."""
    # the operands both kernels refuse (FMA-linear's statistics, streaming offsets, dropout): the Triton kernel's
    # platform-free reasons
    out = fma_blocks.unsupported_reasons("interpret", m=m, d=d, dv=dv, coarse_kind=coarse_kind,
                                         q_block0_static=q_block0_static, dropout=dropout)
    if platform == "interpret":
        return out
    if platform != "cuda":
        out.append(f"Mosaic GPU kernels run on cuda (Hopper), not {platform}")
        return out
    out += hopper_reasons(compute_capability)
    if m not in MGPU_M:
        out.append(f"fine block m={m} not in {MGPU_M} (one wgmma query tile of 64-row granules)")
    if d % 64 or dv % 64 or not (64 <= d <= MAX_HEAD and 64 <= dv <= MAX_HEAD):
        out.append(f"head dims d={d}, dv={dv} must be multiples of 64 in [64, {MAX_HEAD}] (wgmma tiles)")
    if m * (dv + m) // 128 > REG_WORDS:
        out.append(f"m={m}, dv={dv}: the f32 accumulator and scores need {m * (dv + m) // 128} registers a thread "
                   f"of one warpgroup (limit {REG_WORDS}, an estimate)")
    ring = 2 if coarse_slots is None else min(2, -(-coarse_slots // SLOT_TILE))
    if (smem := smem_bytes(m, d, dv, coarse_ring=ring)) > SMEM_LIMIT_BYTES:
        out.append(f"m={m}, d={d}, dv={dv}: ~{smem >> 10} KiB of shared memory (estimate) is more than an SM's "
                   f"{SMEM_LIMIT_BYTES >> 10} KiB")
    if dtype is not None and jnp.dtype(dtype).name not in GPU_DTYPES:
        out.append(f"dtype {jnp.dtype(dtype).name}: wgmma operands in {GPU_DTYPES} (float32 would be rounded to tf32)")
    return out


def _online_step(carry, s, valid, v_smem, p_smem):
    """One key step of the online softmax: scores ``s [m, t]`` (f32), mask ``valid``, values ``v_smem [t, dv]``,
    ``p_smem [m, t]`` (compute dtype) the probabilities' staging buffer."""
    acc, m_i, l_i = carry
    s = jnp.where(valid, s, NEG)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.where(valid, jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    # P through shared memory, then P V into a fresh accumulator added to the rescaled one: Mosaic GPU's interpret
    # mode runs neither a register operand of wgmma nor ``pl.run_state`` (``ACC.init(acc)``, in-place accumulation)
    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()
    pv = _matmul(p_smem, v_smem, (p.shape[0], acc.shape[1]))
    acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
    return acc, m_new, l_i


def _store(smem, x, gmem):
    """Registers ``x`` to global memory ``gmem`` through the shared-memory tile ``smem`` (TMA), waited for."""
    smem[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)


def _window_mask(qblk, kblk, *, m: int, nb: int, n_valid: int, causal: bool, keys_major: bool = False):
    """Which keys of fine block ``kblk`` the queries of fine block ``qblk`` see (traced ints): ``[m queries,
    m keys]``, or ``[m keys, m queries]`` with ``keys_major``. Out-of-range blocks (the clamped pipeline steps)
    see nothing."""
    qpos = qblk * m + jax.lax.broadcasted_iota(jnp.int32, (m, m), 1 if keys_major else 0)
    kpos = kblk * m + jax.lax.broadcasted_iota(jnp.int32, (m, m), 0 if keys_major else 1)
    valid = (kblk >= 0) & (kblk < nb) & (qblk >= 0) & (qblk < nb) & (kpos < n_valid)
    if causal:
        valid = valid & (kpos <= qpos)
    return valid


def _matmul(a, b, shape):
    """``a @ b`` by wgmma (both in shared memory) into a zeroed f32 accumulator of ``shape``."""
    def mm(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(mm, plgpu.ACC(shape, f32))




def _dims(q, v, kct, m: int, causal: bool):
    """(BH, n_pad, d, dv, nb, compute dtype, fine key steps w, coarse slot tiles) of a call's operands."""
    BH, n_pad, d = q.shape
    return (BH, n_pad, d, v.shape[-1], n_pad // m, q.dtype, 2 if causal else 3,
            0 if kct is None else kct.shape[3] // SLOT_TILE)


def _same(a_ref, b_ref, shape):
    """Packed rows: where the documents ``a_ref`` (laid along axis 0 of ``shape``) and ``b_ref`` (along axis 1) are
    equal (f32 ids in shared memory, one load per use as :func:`_rows`)."""
    return _rows(a_ref, shape, 0) == _rows(b_ref, shape, 1)


def _forward_call(q, kt, v, kct, vc, cb, docs=None, *, m: int, causal: bool, n_valid: int, interpret):
    """q [BH, n_pad, d]; kt [BH, d, n_pad] (the keys transposed); v [BH, n_pad, dv]; kct [BH, nb, d, C_pad],
    vc [BH, nb, C_pad, dv], cb [nb, C_pad] f32 (or all three None); ``docs`` (packed rows, :func:`_doc_operands`;
    or None). Returns o [BH, n_pad, dv] (compute dtype), lse [BH, n_pad] f32."""
    BH, n_pad, d, dv, nb, dtype, w, n_c = _dims(q, v, kct, m, causal)
    has_docs = docs is not None
    n_docs = (2 + bool(n_c)) * has_docs

    def body(q_ref, kt_ref, v_ref, *rest):
        n_in = 3 * bool(n_c) + n_docs
        ins, (o_ref, lse_ref), scr = rest[:n_in], rest[n_in:n_in + 2], rest[n_in + 2:]
        kct_ref, vc_ref, cb_ref = ins[:3] if n_c else (None,) * 3
        doc_refs = ins[3 * bool(n_c):]
        q_smem, o_smem, lse_smem, pf_smem = scr[:4]
        pc_smem = scr[4] if n_c else None
        bar = scr[4 + bool(n_c)]
        blk = jax.lax.axis_index("blk")
        bh = jax.lax.axis_index("bh")
        rows = pl.ds(blk * m, m)
        plgpu.copy_gmem_to_smem(q_ref.at[bh, rows], q_smem, bar.at[0])
        if has_docs:
            qd_smem = scr[-1]
            plgpu.copy_gmem_to_smem(doc_refs[0].at[bh, rows], qd_smem, bar.at[1])
            plgpu.barrier_wait(bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        carry = (jnp.zeros((m, dv), f32), jnp.full((m,), NEG, f32), jnp.zeros((m,), f32))

        def key_block(s):  # step s reads fine block blk + s - 1 (previous, own, next), clamped into range
            return jnp.clip(blk + s - 1, 0, nb - 1)

        def fine(idx, kt_smem, v_smem, *rest):
            *kd_smem, carry = rest
            valid = _window_mask(blk, blk + idx[0] - 1, m=m, nb=nb, n_valid=n_valid, causal=causal)
            if has_docs:
                valid = valid & _same(qd_smem, kd_smem[0], (m, m))
            return _online_step(carry, _matmul(q_smem, kt_smem, (m, m)), valid, v_smem, pf_smem)

        carry = plgpu.emit_pipeline(
            fine, grid=(w,), max_concurrent_steps=min(2, w), init_carry=carry,
            in_specs=[plgpu.BlockSpec((d, m), lambda s: (0, key_block(s))),
                      plgpu.BlockSpec((m, dv), lambda s: (key_block(s), 0))]
                     + [plgpu.BlockSpec((m,), lambda s: (key_block(s),))] * has_docs,
        )(kt_ref.at[bh], v_ref.at[bh], *((doc_refs[1].at[bh],) if has_docs else ()))

        if n_c:
            def coarse(idx, kt_smem, v_smem, b_smem, *rest):
                *sd_smem, carry = rest
                bias = _rows(b_smem, (m, SLOT_TILE), 1)
                s = _matmul(q_smem, kt_smem, (m, SLOT_TILE)) + bias
                valid = bias > NEG / 2
                if has_docs:
                    valid = valid & _same(qd_smem, sd_smem[0], (m, SLOT_TILE))
                return _online_step(carry, s, valid, v_smem, pc_smem)

            carry = plgpu.emit_pipeline(
                coarse, grid=(n_c,), max_concurrent_steps=min(2, n_c), init_carry=carry,
                in_specs=[plgpu.BlockSpec((d, SLOT_TILE), lambda c: (0, c)),
                          plgpu.BlockSpec((SLOT_TILE, dv), lambda c: (c, 0)),
                          plgpu.BlockSpec((SLOT_TILE,), lambda c: (c,))]
                         + [plgpu.BlockSpec((SLOT_TILE,), lambda c: (c,))] * has_docs,
            )(kct_ref.at[bh, blk], vc_ref.at[bh, blk], cb_ref.at[blk],
              *((doc_refs[2].at[bh, blk],) if has_docs else ()))

        acc, m_i, l_i = carry
        l_i = jnp.maximum(l_i, 1e-30)
        o_smem[...] = (acc / jax.lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
        lse_smem[...] = m_i + jnp.log(l_i)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bh, rows])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bh, rows])
        plgpu.wait_smem_to_gmem(0)

    args = (q, kt, v) + ((kct, vc, cb) if n_c else ()) + (tuple(docs[:2 + bool(n_c)]) if has_docs else ())
    p_bufs = (plgpu.SMEM((m, m), dtype),) + ((plgpu.SMEM((m, SLOT_TILE), dtype),) if n_c else ())
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, n_pad, dv), dtype), jax.ShapeDtypeStruct((BH, n_pad), f32)),
        scratch_types=(plgpu.SMEM((m, d), dtype), plgpu.SMEM((m, dv), dtype), plgpu.SMEM((m,), f32), *p_bufs,
                       plgpu.Barrier(num_barriers=2)) + ((plgpu.SMEM((m,), f32),) if has_docs else ()),
        grid=(nb, BH),
        grid_names=("blk", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        kernel_name="fma_blocks_mgpu_fwd",
    )(*args)


def _rows(ref, shape, axis):
    """A statistic ``ref [n]`` (f32, in shared memory) loaded and laid along ``axis`` of the 2-D ``shape``. One load
    per use: a value laid along both axes would need two register layouts (Mosaic GPU's layout inference fails)."""
    return jax.lax.broadcast_in_dim(ref[...], shape, [axis])


def _dq_call(q, qt, do, dot, lse, delta, kt, vt, k, kct, vct, kc, vc, cb, docs=None, *, m, causal, n_valid,
             interpret):
    """The query-side backward, grid ``(nb, BH)`` as the forward: ``dq [BH, n_pad, d]`` and the blocks' slot
    gradients ``dkc [BH, nb, C_pad, d]``, ``dvc [BH, nb, C_pad, dv]`` (all f32; the slot gradients are the
    per-block copies', so no two programs write one row: no atomics). ``*t`` operands are the transposes;
    ``docs``: the forward's."""
    BH, n_pad, d, dv, nb, dtype, w, n_c = _dims(q, do, kct, m, causal)
    t = SLOT_TILE
    has_docs = docs is not None
    n_docs = (2 + bool(n_c)) * has_docs

    def body(*refs):
        n_in = 9 + 5 * bool(n_c) + n_docs
        ins, outs, scr = refs[:n_in], refs[n_in:n_in + 1 + 2 * bool(n_c)], refs[n_in + 1 + 2 * bool(n_c):]
        q_ref, qt_ref, do_ref, dot_ref, lse_ref, dl_ref, kt_ref, vt_ref, k_ref = ins[:9]
        doc_refs = ins[n_in - n_docs:]
        q_s, qt_s, do_s, dot_s, lse_s, dl_s, bar = scr[:7]  # the phases' own tiles are scoped (shared memory reused)
        qd_s = scr[7] if has_docs else None
        blk = jax.lax.axis_index("blk")
        bh = jax.lax.axis_index("bh")
        rows = pl.ds(blk * m, m)
        loads = ((q_ref.at[bh, rows], q_s), (qt_ref.at[bh, :, rows], qt_s), (do_ref.at[bh, rows], do_s),
                 (dot_ref.at[bh, :, rows], dot_s), (lse_ref.at[bh, rows], lse_s), (dl_ref.at[bh, rows], dl_s))
        if has_docs:
            loads += ((doc_refs[0].at[bh, rows], qd_s),)
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(len(loads)):
            plgpu.barrier_wait(bar.at[i])

        def probs(s, valid, shape, axis):  # P (or Pᵀ) and dS (or dSᵀ) given dP
            return jnp.where(valid, jnp.exp(s - _rows(lse_s, shape, axis)), 0.0)

        def fine_phase(ds_s):
            def fine(idx, kt_t, vt_t, k_t, *rest):
                *kd_t, dq = rest
                valid = _window_mask(blk, blk + idx[0] - 1, m=m, nb=nb, n_valid=n_valid, causal=causal)
                if has_docs:
                    valid = valid & _same(qd_s, kd_t[0], (m, m))
                p = probs(_matmul(q_s, kt_t, (m, m)), valid, (m, m), 0)
                ds_s[...] = (p * (_matmul(do_s, vt_t, (m, m)) - _rows(dl_s, (m, m), 0))).astype(dtype)
                plgpu.commit_smem()
                return dq + _matmul(ds_s, k_t, (m, d))

            return plgpu.emit_pipeline(
                fine, grid=(w,), max_concurrent_steps=min(2, w), init_carry=jnp.zeros((m, d), f32),
                in_specs=[plgpu.BlockSpec((d, m), lambda s: (0, jnp.clip(blk + s - 1, 0, nb - 1))),
                          plgpu.BlockSpec((dv, m), lambda s: (0, jnp.clip(blk + s - 1, 0, nb - 1))),
                          plgpu.BlockSpec((m, d), lambda s: (jnp.clip(blk + s - 1, 0, nb - 1), 0))]
                         + [plgpu.BlockSpec((m,), lambda s: (jnp.clip(blk + s - 1, 0, nb - 1),))] * has_docs,
            )(kt_ref.at[bh], vt_ref.at[bh], k_ref.at[bh], *((doc_refs[1].at[bh],) if has_docs else ()))

        dq = pl.run_scoped(fine_phase, plgpu.SMEM((m, m), dtype))

        if n_c:
            kct_ref, vct_ref, kc_ref, vc_ref, cb_ref = ins[9:14]
            dkc_ref, dvc_ref = outs[1:]

            # the slot gradients leave through the step's own TMA stores (the pipeline's out_specs would issue
            # predicated stores, which the interpret mode does not run), waited for before the staging tiles are
            # reused
            def coarse(idx, kct_t, vct_t, kc_t, vc_t, b_t, *rest):
                sd_t, (dq, pt_s, dst_s, dsc_s, dkc_s, dvc_s) = rest[:has_docs], rest[has_docs:]
                bias, bias_t = _rows(b_t, (m, t), 1), _rows(b_t, (t, m), 0)
                valid, valid_t = bias > NEG / 2, bias_t > NEG / 2
                if has_docs:
                    valid = valid & _same(qd_s, sd_t[0], (m, t))
                    valid_t = valid_t & _same(sd_t[0], qd_s, (t, m))
                p = probs(_matmul(q_s, kct_t, (m, t)) + bias, valid, (m, t), 0)
                dsc_s[...] = (p * (_matmul(do_s, vct_t, (m, t)) - _rows(dl_s, (m, t), 0))).astype(dtype)
                # the slots' gradients need Pᵀ and dSᵀ as wgmma's left operand: recomputed keys-major
                pt = probs(_matmul(kc_t, qt_s, (t, m)) + bias_t, valid_t, (t, m), 1)
                pt_s[...] = pt.astype(dtype)
                dst_s[...] = (pt * (_matmul(vc_t, dot_s, (t, m)) - _rows(dl_s, (t, m), 1))).astype(dtype)
                plgpu.commit_smem()
                dvc_s[...] = _matmul(pt_s, do_s, (t, dv))
                dkc_s[...] = _matmul(dst_s, q_s, (t, d))
                plgpu.commit_smem()
                slots = pl.ds(idx[0] * t, t)
                plgpu.copy_smem_to_gmem(dkc_s, dkc_ref.at[bh, blk, slots])
                plgpu.copy_smem_to_gmem(dvc_s, dvc_ref.at[bh, blk, slots])
                dq = dq + _matmul(dsc_s, kc_t, (m, d))
                plgpu.wait_smem_to_gmem(0)
                return dq

            def coarse_phase(*tiles):
                return plgpu.emit_pipeline(
                    lambda idx, *a: coarse(idx, *a, *tiles), grid=(n_c,), max_concurrent_steps=min(2, n_c),
                    init_carry=dq,
                    in_specs=[plgpu.BlockSpec((d, t), lambda c: (0, c)), plgpu.BlockSpec((dv, t), lambda c: (0, c)),
                              plgpu.BlockSpec((t, d), lambda c: (c, 0)), plgpu.BlockSpec((t, dv), lambda c: (c, 0)),
                              plgpu.BlockSpec((t,), lambda c: (c,))]
                             + [plgpu.BlockSpec((t,), lambda c: (c,))] * has_docs,
                )(kct_ref.at[bh, blk], vct_ref.at[bh, blk], kc_ref.at[bh, blk], vc_ref.at[bh, blk], cb_ref.at[blk],
                  *((doc_refs[2].at[bh, blk],) if has_docs else ()))

            dq = pl.run_scoped(coarse_phase, plgpu.SMEM((t, m), dtype), plgpu.SMEM((t, m), dtype),
                               plgpu.SMEM((m, t), dtype), plgpu.SMEM((t, d), f32), plgpu.SMEM((t, dv), f32))

        pl.run_scoped(lambda dq_s: _store(dq_s, dq, outs[0].at[bh, rows]), plgpu.SMEM((m, d), f32))

    args = (q, qt, do, dot, lse, delta, kt, vt, k) + ((kct, vct, kc, vc, cb) if n_c else ())
    args += tuple(docs[:2 + bool(n_c)]) if has_docs else ()
    out_type = (jax.ShapeDtypeStruct((BH, n_pad, d), f32),)
    if n_c:
        out_type += (jax.ShapeDtypeStruct(kc.shape, f32), jax.ShapeDtypeStruct(vc.shape, f32))
    scratch = (plgpu.SMEM((m, d), dtype), plgpu.SMEM((d, m), dtype), plgpu.SMEM((m, dv), dtype),
               plgpu.SMEM((dv, m), dtype), plgpu.SMEM((m,), f32), plgpu.SMEM((m,), f32),
               plgpu.Barrier(num_barriers=6 + has_docs)) + ((plgpu.SMEM((m,), f32),) if has_docs else ())
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(nb, BH), grid_names=("blk", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret, kernel_name="fma_blocks_mgpu_dq",
    )(*args)


def _dkv_call(k, v, qt, q, dot, do, lse, delta, docs=None, *, m, causal, n_valid, interpret):
    """The key-side backward, grid ``(nb, BH)`` over fine key blocks ``j``: the query blocks that see block ``j``
    (``j + 1`` as its previous block, ``j`` itself, and bidirectional ``j - 1`` as its next block), keys-major
    (``Sᵀ = k qᵀ``), ``dv = Σ Pᵀ dO``, ``dk = Σ dSᵀ q``, f32; ``docs``: the forward's."""
    BH, n_pad, d = k.shape
    dv = v.shape[-1]
    nb = n_pad // m
    dtype = k.dtype
    w = 2 if causal else 3
    has_docs = docs is not None

    def body(k_ref, v_ref, qt_ref, q_ref, dot_ref, do_ref, lse_ref, dl_ref, *rest):
        doc_refs, (dk_ref, dv_ref, k_s, v_s, pt_s, dst_s, bar, *kd_s) = rest[:2 * has_docs], rest[2 * has_docs:]
        j = jax.lax.axis_index("blk")
        bh = jax.lax.axis_index("bh")
        rows = pl.ds(j * m, m)
        plgpu.copy_gmem_to_smem(k_ref.at[bh, rows], k_s, bar.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[bh, rows], v_s, bar.at[1])
        if has_docs:
            plgpu.copy_gmem_to_smem(doc_refs[1].at[bh, rows], kd_s[0], bar.at[2])
            plgpu.barrier_wait(bar.at[2])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])

        def qblock(r):  # step r reads query block j + 1 - r (whose previous, own, next block j is), clamped
            return jnp.clip(j + 1 - r, 0, nb - 1)

        def step(idx, qt_t, q_t, dot_t, do_t, lse_t, dl_t, *rest):
            *qd_t, carry = rest
            dk, dvv = carry
            valid = _window_mask(j + 1 - idx[0], j, m=m, nb=nb, n_valid=n_valid, causal=causal, keys_major=True)
            if has_docs:
                valid = valid & _same(kd_s[0], qd_t[0], (m, m))
            pt = jnp.where(valid, jnp.exp(_matmul(k_s, qt_t, (m, m)) - _rows(lse_t, (m, m), 1)), 0.0)
            pt_s[...] = pt.astype(dtype)
            dst_s[...] = (pt * (_matmul(v_s, dot_t, (m, m)) - _rows(dl_t, (m, m), 1))).astype(dtype)
            plgpu.commit_smem()
            return dk + _matmul(dst_s, q_t, (m, d)), dvv + _matmul(pt_s, do_t, (m, dv))

        dk, dvv = plgpu.emit_pipeline(
            step, grid=(w,), max_concurrent_steps=min(2, w),
            init_carry=(jnp.zeros((m, d), f32), jnp.zeros((m, dv), f32)),
            in_specs=[plgpu.BlockSpec((d, m), lambda r: (0, qblock(r))), plgpu.BlockSpec((m, d), lambda r: (qblock(r), 0)),
                      plgpu.BlockSpec((dv, m), lambda r: (0, qblock(r))),
                      plgpu.BlockSpec((m, dv), lambda r: (qblock(r), 0)),
                      plgpu.BlockSpec((m,), lambda r: (qblock(r),)), plgpu.BlockSpec((m,), lambda r: (qblock(r),))]
                     + [plgpu.BlockSpec((m,), lambda r: (qblock(r),))] * has_docs,
        )(qt_ref.at[bh], q_ref.at[bh], dot_ref.at[bh], do_ref.at[bh], lse_ref.at[bh], dl_ref.at[bh],
          *((doc_refs[0].at[bh],) if has_docs else ()))
        pl.run_scoped(lambda dk_s: _store(dk_s, dk, dk_ref.at[bh, rows]), plgpu.SMEM((m, d), f32))
        pl.run_scoped(lambda dv_s: _store(dv_s, dvv, dv_ref.at[bh, rows]), plgpu.SMEM((m, dv), f32))

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, n_pad, d), f32), jax.ShapeDtypeStruct((BH, n_pad, dv), f32)),
        scratch_types=(plgpu.SMEM((m, d), dtype), plgpu.SMEM((m, dv), dtype), plgpu.SMEM((m, m), dtype),
                       plgpu.SMEM((m, m), dtype),
                       plgpu.Barrier(num_barriers=2 + has_docs)) + ((plgpu.SMEM((m,), f32),) if has_docs else ()),
        grid=(nb, BH), grid_names=("blk", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret, kernel_name="fma_blocks_mgpu_dkv",
    )(k, v, qt, q, dot, do, lse, delta, *(tuple(docs[:2]) if has_docs else ()))


def _t(x):
    """The last two axes swapped (wgmma operands without transposed views: module docstring)."""
    return None if x is None else jnp.swapaxes(x, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _blocks(q, k, v, kc, vc, cb, docs, m, causal, n_valid, interpret):
    return _forward_call(q, _t(k), v, _t(kc), vc, cb, docs, m=m, causal=causal, n_valid=n_valid,
                         interpret=interpret)[0]


def _blocks_fwd(q, k, v, kc, vc, cb, docs, m, causal, n_valid, interpret):
    o, lse = _forward_call(q, _t(k), v, _t(kc), vc, cb, docs, m=m, causal=causal, n_valid=n_valid,
                           interpret=interpret)
    return o, (q, k, v, kc, vc, cb, docs, o, lse)


def _blocks_bwd(m, causal, n_valid, interpret, res, do):
    q, k, v, kc, vc, cb, docs, o, lse = res
    dt = q.dtype
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1)  # Δ = rowsum(dO ⊙ O)
    do = do.astype(dt)
    kw = dict(m=m, causal=causal, n_valid=n_valid, interpret=interpret)
    dq, *dslots = _dq_call(q, _t(q), do, _t(do), lse, delta, _t(k), _t(v), k, _t(kc), _t(vc), kc, vc, cb, docs, **kw)
    dk, dv = _dkv_call(k, v, _t(q), q, _t(do), do, lse, delta, docs, **kw)
    dkc, dvc = (x.astype(dt) for x in dslots) if dslots else (None, None)
    return (dq.astype(dt), dk.astype(dt), dv.astype(dt), dkc, dvc, None if cb is None else jnp.zeros_like(cb), None)


_blocks.defvjp(_blocks_fwd, _blocks_bwd)


def _gather_slots(kall, vall, idx, cbias):
    """The blocks' coarse slots as per-block copies ``[BH, nb, C_pad, *]`` and their bias ``[nb, C_pad]`` (f32), the
    slots padded to a multiple of :data:`SLOT_TILE` (pad slots read row 0, masked by bias NEG)."""
    R, C = kall.shape[1], idx.shape[1]
    Cp = -(-C // SLOT_TILE) * SLOT_TILE
    idx = jnp.pad(jnp.clip(idx, 0, R - 1), ((0, 0), (0, Cp - C)))
    cb = jnp.pad(cbias.astype(f32), ((0, 0), (0, Cp - C)), constant_values=NEG)
    return jnp.take(kall, idx, axis=1), jnp.take(vall, idx, axis=1), cb


def _doc_operands(docs, C_pad: int):
    """``docs = (qdoc [BH, n_pad], kdoc [BH, n_pad], sdoc [BH, nb, C] or None)`` (int) as the kernels read them:
    float32 ids (exact below 2^24; loaded into shared memory as the statistics are), the slots' padded to
    ``C_pad`` with document -2 (the padding's never equal a query's: queries -1, keys and slots -2)."""
    qd, kd, sd = docs
    out = (qd.astype(f32), kd.astype(f32))
    if sd is not None and C_pad:
        out += (jnp.pad(sd, ((0, 0), (0, 0), (0, C_pad - sd.shape[-1])), constant_values=-2).astype(f32),)
    return out


def fma_blocks_mgpu(q, k, v, kall, vall, idx, cbias, *, m: int, causal: bool, n_valid: int, interpret=False,
                    docs=None):
    """FMA attention of the fine blocks on the kernel layout: q, k [BH, n_pad, d] (q pre-scaled), v [BH, n_pad, dv],
    kall [BH, R, d], vall [BH, R, dv], idx [nb, C] int32, cbias [nb, C] (or kall = vall = idx = cbias = None: no
    coarse slots). Returns [BH, n_pad, dv] in the compute dtype (the common dtype of q, k, v and the summaries).
    ``interpret``: True runs Mosaic GPU's interpret mode on any backend (:func:`interpret_params`); an
    ``InterpretGPUParams`` is passed as given. ``docs`` (a packed row laid out again, docs/methods/fma.md §2.7;
    None: one sequence): ``(qdoc [BH, n_pad], kdoc [BH, n_pad], sdoc [BH, nb, C] or None)``, the document of every
    query, key and coarse slot's group (:func:`pallas_kernels.fma_blocks.fma_blocks_forward`'s); a key or slot
    counts for a query only where its document is the query's."""
    BH, n_pad, d = q.shape
    dv = v.shape[-1]
    operands = [q, k, v] + ([] if kall is None else [kall, vall])
    dt = jnp.result_type(*operands)
    platform = "interpret" if interpret else "cuda"
    reasons = unsupported_reasons(platform, m=m, d=d, dv=dv, dtype=dt, coarse_slots=0 if idx is None else idx.shape[1])
    if n_pad % m:
        reasons.append(f"n_pad={n_pad} is not a multiple of m={m}")
    if reasons:
        raise ValueError("fma_blocks_mgpu cannot run: " + "; ".join(reasons))
    if interpret is True:
        interpret = interpret_params()
    q, k, v = (x.astype(dt) for x in (q, k, v))
    kc = vc = cb = None
    if kall is not None and idx.shape[1]:
        kc, vc, cb = _gather_slots(kall.astype(dt), vall.astype(dt), idx, cbias)
    if docs is not None:
        docs = _doc_operands(docs, 0 if kc is None else kc.shape[2])
    return _blocks(q, k, v, kc, vc, cb, docs, m, bool(causal), int(n_valid), interpret or False)


__all__ = ["MGPU_M", "REG_WORDS", "SLOT_TILE", "SMEM_LIMIT_BYTES", "smem_bytes", "fma_blocks_mgpu", "interpret_params", "unsupported_reasons"]

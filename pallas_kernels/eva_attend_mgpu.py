"""EVA's Phase B (the local window and the chunk summaries in one softmax, docs/methods/eva.md §8.3) as Pallas
Mosaic GPU kernels for Hopper: forward and backward.

It computes what :func:`pallas_kernels.eva_attend.eva_attend` computes and takes its operands (``q`` pre-scaled
``[BH, Lp, d]``, ``k [BH, Lp, d]``, ``v [BH, Lp, dv]``, the chunk summaries ``k̂ [BH, ≥C, d]``, ``β [BH, ≥C, dv]``,
the local bias tiles ``[Hb, n_lt, W, W]`` or None) and returns its outputs (``o [BH, Lp, dv]`` in the compute
dtype, ``lse [BH, Lp]`` fp32); the reference is :func:`pallas_kernels.eva_attend_ref.eva_attend_reference`. It
imports JAX, that reference's helpers, the Triton kernel's module (the refusals both share), the dropout hash and
the Mosaic GPU helpers of :mod:`pallas_kernels.fma_blocks_mgpu` (wgmma into a scoped accumulator, a statistic laid
along an axis, a tile stored through shared memory, interpret mode's params).

Design (``t`` = :data:`TILE` = 64 rows, wgmma's granule; in interpret mode ``min(64, W)``):

* **forward**, ``plgpu.kernel`` grid ``(Lp / t, BH)``, one warpgroup a program, one query tile of window block
  ``i``: the tile is copied once by TMA into shared memory; a **local pipeline** (``plgpu.emit_pipeline``, a ring of
  two) runs over the ``n_lt · W / t`` key tiles of the block's window (key blocks ``i + offsets``, tile index clamped
  into range, an out-of-range tile masked whole), each step bringing the transposed keys ``[d, t]``, the values
  ``[t, dv]`` and the bias tile ``[t, t]`` of that (query rows, window slots) pair by TMA; then a **chunk pipeline**
  over the ``Cp / t`` chunk tiles (``k̂ᵀ [d, t]``, ``β [t, dv]``) continues the same running max, sum and ``[t, dv]``
  f32 accumulator (the carry), so the local keys and the chunks share one online softmax (eq. 16). ``S = q kᵀ`` and
  ``P V`` are wgmma products of compute-dtype operands into f32 accumulators; every mask (key in range and valid,
  the window's bounds, causal, the chunk's validity, causal chunk visibility ``(c + 1) P <= n``, the disjoint
  partition) is computed from iota inside the kernel. Epilogue: ``o = acc / l`` (compute dtype) and
  ``lse = m + log l`` (f32) by TMA.
* **backward** (``jax.custom_vjp``, FlashAttention-2: probabilities recomputed from ``lse``, ``Δ = rowsum(dO ⊙ O)``
  in XLA less the ``lse`` cotangent, ``dS = P ⊙ (dP − Δ)``), two kernels:
  *query side*, the forward's grid: ``dq`` from the local and chunk pipelines (``dq += dS k``, ``dq += dS k̂``);
  *key side*, grid ``(Lp / t + Cp / t, BH)``: the first ``Lp / t`` programs are key tiles, each a pipeline over the
  ``n_lt · W / t`` query tiles that see it (keys-major: ``Sᵀ = k qᵀ``), ``dv += Pᵀ dO``, ``dk += dSᵀ q``, and the
  bias gradient of that (window slots, query rows) tile; the last ``Cp / t`` programs are chunk tiles, each a
  pipeline over all query tiles, ``dβ += Pᵀ dO``, ``dk̂ += dSᵀ q``. Gradients leave in f32 and are rounded once.
* **attention dropout** (``dropout_rate``, ``seeds``): the Triton kernel's counter-hash mask
  (:mod:`pallas_kernels.hash_dropout`, absolute query and key indices, chunk ``c`` at ``CHUNK_KEY_BASE + c``)
  drawn from iota inside every kernel (the row's seed reaches shared memory beside the query tile), on the
  weights the accumulator takes (the normaliser keeps them all); backward ``dV += (P ⊙ D)ᵀ dO``,
  ``dS = P ⊙ (D ⊙ dP − Δ)``.
* **packed rows** (``segments``; EVA's ``packed.py`` lays the documents out again on the window grid): the Triton
  kernel's document operands, int32 rows repeated per head (``[BH, Lp]`` each position's own index and its
  document as a query and as a key, ``[BH, Cp]`` each chunk's own index and document; none: -2, -1, -3, so they
  never meet). A query tile's own positions and documents reach shared memory with the tile; each local step's
  keys' and each chunk step's chunks' come with that step as ``[t]`` TMA blocks; the key side's programs load their
  own key or chunk tile's once and take the query tiles' with each step. A key or chunk counts only for a query of
  its document; causal chunk visibility, the disjoint partition and the dropout counters take the documents' own
  indices; the window and causal masks of local keys stay the layout's (a document keeps its window there).

Departures from the Triton kernel (:mod:`pallas_kernels.eva_attend`), named:

* the bias tiles enter as the Triton kernel's ``[Hb, n_lt, W, W]`` operand, laid out by XLA as ``[Hb, W, n_lt·W]``
  (and transposed for the key side) so that one ``[t, t]`` TMA block is one step's bias; no ``[.., T, W]`` bias
  array exists. The bias *gradient* leaves as one ``[t, t]`` f32 tile per (key tile, step),
  ``[BH, Lp / t, n_lt·W / t, t, t]`` (``O(Lp · n_lt · W)`` a row), summed by XLA: the Triton kernel adds it
  atomically, and Mosaic GPU's interpret mode (jax 0.10.2) does not run TMA reduction stores;
* the pipelines' grids are static: causal calls score every chunk tile and every window key tile (masked), and
  the key side's chunk programs take every query tile, where the Triton kernel skips the chunk tiles no query of
  the block sees;
* transposed operands are transposed in XLA (``kᵀ``, ``k̂ᵀ``; backward: ``qᵀ``, ``vᵀ``, ``βᵀ``, ``dOᵀ``), ``P`` and
  ``dS`` go through shared memory, and ``P V`` is accumulated into a fresh accumulator added to the rescaled one:
  the interpret mode runs wgmma only on untransformed shared-memory operands and not ``pl.run_state`` (as in
  :mod:`pallas_kernels.fma_blocks_mgpu`);
* one warpgroup a program, no warp specialisation;
* packed rows: the document operands are repeated per head in XLA (``[BH, ·]``, where the Triton kernel indexes
  ``[B, ·]`` by ``bh // heads``), and ``chunk_base`` (a carried state's chunks first) is not read: the static
  grids have no causal skip for it to order.

Support (:func:`unsupported_reasons`): on ``cuda`` ``W`` a multiple of 64, ``d, dv`` multiples of 64 up to
:data:`MAX_HEAD`, bfloat16 / float16 operands (float32 would make wgmma round to tf32), shared memory within an
SM's (an estimate), compute capability 9.0 where known; the representative chunk logit only. Interpret mode
(``InterpretGPUParams``, simulating shared memory, TMA, barriers and wgmma on a CPU) runs float32 exactly and
tiles of ``min(64, W)``.

Tested (tests/kernels/test_eva_attend_mgpu.py, interpret mode on a CPU): values and gradients against the
reference (fp32, bf16; causal, bidirectional with overlap, shared and per-head bias, the disjoint partition,
ragged lengths, attention dropout, packed rows with a carried document's chunks) and ``jax.export`` for ``cuda`` at
configs/wikitext103/eva_16l.py's shapes (its training step's dropout included; a packed row's). Nothing here has compiled or run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import eva_attend, hash_dropout
from pallas_kernels.eva_attend_ref import NEG, local_offsets
from pallas_kernels.fma_blocks_mgpu import _matmul, _rows, _store, interpret_params
from pallas_kernels.precision import compute_dtype

f32 = jnp.float32
TILE = 64  # query, key and chunk tile rows (wgmma: 64 rows a warpgroup)
MAX_HEAD = 128
GPU_DTYPES = ("bfloat16", "float16")
SMEM_LIMIT_BYTES = 232448  # an H100 SM's shared memory one block may use (227 KiB)
_SEMANTICS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def smem_bytes(d: int, dv: int, t: int = TILE, itemsize: int = 2) -> int:
    """Shared memory of the largest kernel (the key side's key programs: the key and value tiles, a ring of two
    steps of ``qᵀ, q, dOᵀ, dO, lse, Δ`` and the bias tile, ``Pᵀ`` and ``dSᵀ`` staging and the f32 bias-gradient
    tile): an estimate; the lowering checks the exact figure."""
    i = itemsize
    step = (2 * t * d + 2 * t * dv + t * t) * i + 8 * t
    return t * (d + dv) * i + 2 * step + 2 * t * t * i + 4 * t * t


def unsupported_reasons(platform: str, *, W: int, d: int, dv: int, e_l: int = 0, e_r: int = 0,
                        chunk_logit: str = "rep", dtype=None, segments: bool = False,
                        compute_capability=None, **_) -> list[str]:
    """Why the kernels cannot serve a call on ``platform`` ('cuda' | 'interpret' | other), one line a reason
    (``segments``: a packed row, served; accepted for the declaration's callers)."""
    # the operands both kernels refuse (no window, the exact chunk log-sum-exp, extensions beyond a window): the
    # Triton kernel's platform-free reasons
    out = eva_attend.unsupported_reasons("interpret", W=W, d=d, dv=dv, C=0, e_l=e_l, e_r=e_r, chunk_logit=chunk_logit)
    if platform == "interpret" and W > TILE and W % TILE:  # the tile is min(TILE, W) here, which must divide W
        out.append(f"window_size={W}: a multiple of {TILE} where it exceeds {TILE} (the kernels' query and key "
                   "tiles)")
    if platform == "interpret" or out:
        return out
    if platform != "cuda":
        return out + [f"Mosaic GPU kernels run on cuda (Hopper), not {platform}"]
    if compute_capability is not None:
        cc = compute_capability
        major = cc[0] if isinstance(cc, tuple) else int(str(cc).split(".")[0])
        if major != 9:
            out.append(f"needs compute capability 9.0 (Hopper) for wgmma and TMA, got {cc}")
    if W % TILE:
        out.append(f"window_size={W}: a multiple of {TILE} (wgmma's 64-row query and key tiles)")
    if d % 64 or dv % 64 or not (64 <= d <= MAX_HEAD and 64 <= dv <= MAX_HEAD):
        out.append(f"head dims d={d}, dv={dv} must be multiples of 64 in [64, {MAX_HEAD}] (wgmma tiles)")
    elif (smem := smem_bytes(d, dv)) > SMEM_LIMIT_BYTES:
        out.append(f"d={d}, dv={dv}: ~{smem >> 10} KiB of shared memory (estimate) exceeds an SM's "
                   f"{SMEM_LIMIT_BYTES >> 10} KiB")
    if dtype is not None and jnp.dtype(dtype).name not in GPU_DTYPES:
        out.append(f"dtype {jnp.dtype(dtype).name}: wgmma operands in {GPU_DTYPES} (float32 would be rounded to tf32)")
    return out


# ----------------------------------------------------------------------------- masks from iota
def _pos(g, qt, ot, keys_major: bool):
    """Query indices of tile ``qt`` and key (or chunk) indices of tile ``ot``, ``[t, t]`` each, laid query-major
    (queries along axis 0) or keys-major."""
    t = g["t"]
    ax_q, ax_o = (1, 0) if keys_major else (0, 1)
    return (qt * t + jax.lax.broadcasted_iota(jnp.int32, (t, t), ax_q),
            ot * t + jax.lax.broadcasted_iota(jnp.int32, (t, t), ax_o))


def _dropout(g, seed_ref, n, m):
    """The dropout multiplier ``keep / (1 − rate)`` of queries ``n`` on key indices ``m`` (``[t, t]`` int32; a chunk
    ``c`` is ``CHUNK_KEY_BASE + c``) with the row's seed ``seed_ref [t]`` (int32, every entry the row's), or None
    without dropout: :func:`pallas_kernels.hash_dropout.multiplier`, the Triton kernel's and the reference's mask."""
    if not g["rate"]:
        return None
    return hash_dropout.multiplier(_rows(seed_ref, n.shape, 0), n, m, g["rate"])


def _documents(seg, shape, keys_major: bool):
    """A packed row's tile operands ``seg = (query rows' own positions, their documents, the columns' (keys' or
    chunks') own indices, their documents)``, int32 ``[t]`` refs in shared memory, laid out as the scores (queries
    along axis 0, or along axis 1 keys-major): ``(own query positions, own column indices, same document)``, one
    load per use (:func:`pallas_kernels.fma_blocks_mgpu._rows`)."""
    ax_q, ax_o = (1, 0) if keys_major else (0, 1)
    q_rel, _, o_rel, _ = seg
    return _rows(q_rel, shape, ax_q), _rows(o_rel, shape, ax_o), _same_document(seg, shape, keys_major)


def _same_document(seg, shape, keys_major: bool):
    """Whether each query and column of the tile lie in one document (``seg`` as :func:`_documents`). Used alone
    where the own positions would be unused: a load whose value nothing reads leaves Mosaic GPU's layout inference
    without a solution (a packed row without dropout failed to lower)."""
    ax_q, ax_o = (1, 0) if keys_major else (0, 1)
    _, q_doc, _, o_doc = seg
    return _rows(q_doc, shape, ax_q) == _rows(o_doc, shape, ax_o)


def _local_valid(g, qt, kt, keys_major: bool = False, seed_ref=None, seg=None):
    """Which keys of key tile ``kt`` the queries of query tile ``qt`` see (traced tile indices, unclamped):
    ``[t queries, t keys]`` (or keys-major). In range, valid (``< L``), inside the query block's window, causal;
    a packed row (``seg``, :func:`_documents`'s operands): also of the query's document (the layout keeps a
    document's window and causal order in layout positions, so those masks stay the layout's), the dropout
    counters at the documents' own positions. Returns ``(valid, dropout multiplier or None)``."""
    t, qpos, kpos = g["t"], *_pos(g, qt, kt, keys_major)
    blk = jax.lax.div(qt * t, jnp.int32(g["W"]))
    lo, hi = blk * g["W"] - g["e_l"], (blk + 1) * g["W"] + g["e_r"]
    valid = (kt >= 0) & (kt < g["n_t"]) & (qt >= 0) & (qt < g["n_t"])
    valid = valid & (kpos < g["L"]) & (kpos >= lo) & (kpos < hi)
    if g["causal"]:
        valid = valid & (kpos <= qpos)
    if seg is not None:  # the documents' own positions feed only the dropout counters
        if g["rate"]:
            qpos, kpos, same = _documents(seg, qpos.shape, keys_major)
        else:
            same = _same_document(seg, qpos.shape, keys_major)
        valid = valid & same
    return valid, _dropout(g, seed_ref, qpos, kpos)


def _chunk_valid(g, qt, ct, keys_major: bool = False, seed_ref=None, seg=None):
    """Which chunks of chunk tile ``ct`` the queries of query tile ``qt`` see: ``[t, t]`` (or keys-major), and the
    dropout multiplier (or None). A packed row (``seg``, :func:`_documents`'s operands): the chunks of the query's
    document, causal visibility, the disjoint partition and the dropout counters by the document's own query
    position and chunk index."""
    t, P, W = g["t"], g["P"], g["W"]
    n, c = _pos(g, qt, ct, keys_major)
    valid = (c < g["C"]) & (qt >= 0) & (qt < g["n_t"])
    if seg is not None:  # the own positions and chunk indices: only where a mask or the dropout reads them
        if g["causal"] or g["disjoint"] or g["rate"]:
            n, c, same = _documents(seg, n.shape, keys_major)
        else:
            same = _same_document(seg, n.shape, keys_major)
        valid = valid & same
    if g["causal"]:
        valid = valid & ((c + 1) * P <= n)
    if g["disjoint"]:
        blk = jax.lax.div(n, jnp.int32(W)) if seg is not None else jax.lax.div(qt * t, jnp.int32(W))  # own block
        lo, hi = jnp.maximum(blk * W - g["e_l"], 0), (blk + 1) * W + g["e_r"]
        valid = valid & ~((c * P < hi) & ((c + 1) * P > lo))
    return valid, _dropout(g, seed_ref, n, hash_dropout.CHUNK_KEY_BASE + c)


def _softmax_step(carry, s, valid, mult, v_smem, p_smem):
    """One key step of the online softmax: scores ``s [t, t]`` (f32), mask ``valid``, dropout multiplier ``mult``
    (or None: on the weights the accumulator takes, not on the normaliser), values ``v_smem``, ``p_smem`` the
    probabilities' staging tile (compute dtype). ``P V`` goes into a fresh accumulator added to the rescaled one
    (module docstring)."""
    acc, m_old, l_old = carry
    m_new = jnp.maximum(m_old, jnp.max(jnp.where(valid, s, NEG), axis=1))
    p = jnp.where(valid, jnp.exp(s - _rows_of(m_new, s.shape)), 0.0)  # masked entries exactly 0
    p_smem[...] = (p if mult is None else p * mult).astype(p_smem.dtype)
    plgpu.commit_smem()
    scale = jnp.exp(m_old - m_new)
    acc = acc * _rows_of(scale, acc.shape) + _matmul(p_smem, v_smem, (p.shape[0], acc.shape[1]))
    return acc, m_new, l_old * scale + jnp.sum(p, axis=1)


def _rows_of(x, shape):
    """A per-row value ``x [t]`` (registers) laid along axis 0 of ``shape``."""
    return jax.lax.broadcast_in_dim(x, shape, [0])


def _key_tile(g, qt, s):
    """Key tile (unclamped) of step ``s`` of query tile ``qt``'s local pipeline: the window's key blocks
    ``blk + offsets[0] ..`` cut into tiles."""
    per = g["W"] // g["t"]
    return (jax.lax.div(qt, jnp.int32(per)) + g["offsets"][0]) * per + s


def _clamp(x, n):
    return jnp.clip(x, 0, n - 1)


def _head(g, bh):
    """The bias tile's head of row ``bh``."""
    return jax.lax.rem(bh, jnp.int32(g["heads"])) if g["Hb"] > 1 else 0


# ----------------------------------------------------------------------------- forward
def _unpack(rest, has_bias: bool, has_seeds: bool, packed: bool, t: int):
    """A query-side body's refs after its fixed operands: ``(bias ref, seeds ref, a packed row's five document
    refs, outputs and scratch, the seeds' shared-memory tile, the query tile's own positions and documents in
    shared memory (the last scratch), (query tile, row, the tile's rows))``; absent ones None."""
    n_in = has_bias + has_seeds
    bias_ref = rest[0] if has_bias else None
    sd_ref = rest[has_bias] if has_seeds else None
    seg_refs = rest[n_in:n_in + 5] if packed else None
    tail = rest[n_in + 5 * packed:]
    n_extra = has_seeds + 2 * packed
    extra = tail[len(tail) - n_extra:]
    sd_s = extra[0] if has_seeds else None
    qseg_s = tuple(extra[has_seeds:]) if packed else None
    qt = jax.lax.axis_index("qt")
    return (bias_ref, sd_ref, seg_refs, tail[:len(tail) - n_extra], sd_s, qseg_s,
            (qt, jax.lax.axis_index("bh"), pl.ds(qt * t, t)))


def _extra_scratch(has_seeds: bool, packed: bool, t: int):
    """A query-side kernel's scratch after its own: the row's seed tile, the query tile's own positions and
    documents (int32 ``[t]`` each)."""
    return (plgpu.SMEM((t,), jnp.int32),) * (has_seeds + 2 * packed)


def _query_loads(sd_ref, seg_refs, sd_s, qseg_s, bh, rows):
    """The copies into shared memory a query-side program starts with beyond its tiles: the row's seed, a packed
    row's query positions and documents (``(source, destination)`` pairs)."""
    out = ((sd_ref.at[bh], sd_s),) if sd_s is not None else ()
    if seg_refs is not None:
        out += ((seg_refs[0].at[bh, rows], qseg_s[0]), (seg_refs[1].at[bh, rows], qseg_s[1]))
    return out


def _seg_steps(seg_refs, bh, tile, t: int, chunk: bool):
    """A packed row's per-step operands of a query-side pipeline: the keys' (or the chunks') own indices and
    documents, ``[t]`` blocks at tile ``tile(step)`` (specs, refs); ``([], [])`` for one sequence."""
    if seg_refs is None:
        return [], []
    rel, doc = (seg_refs[3], seg_refs[4]) if chunk else (seg_refs[0], seg_refs[2])
    return [plgpu.BlockSpec((t,), lambda s: (tile(s),))] * 2, [rel.at[bh], doc.at[bh]]


def _seg_of(qseg_s, step_tiles):
    """A score tile's packed-row operands (:func:`_documents`) from the query tile's and a step's refs, or None."""
    return None if qseg_s is None else (qseg_s[0], qseg_s[1], *step_tiles)


def _forward_call(g, q, kt, v, kht, beta, bias, seeds, seg, interpret):
    """q [BH, Lp, d]; kt [BH, d, Lp]; v [BH, Lp, dv]; kht [BH, d, Cp]; beta [BH, Cp, dv]; bias [Hb, W, n_lt·W] or
    None; seeds [BH, t] int32 (dropout) or None; ``seg`` (a packed row, :func:`eva_attend_mgpu`'s layout) or None.
    Returns o [BH, Lp, dv] (compute dtype), lse [BH, Lp] f32."""
    BH, Lp, d = q.shape
    dv, t, dtype = v.shape[-1], g["t"], q.dtype
    n_loc, n_c, per = g["n_loc"], kht.shape[-1] // t, g["W"] // t
    has_bias, has_seeds, packed = bias is not None, seeds is not None, seg is not None

    def body(q_ref, kt_ref, v_ref, kht_ref, beta_ref, *rest):
        bias_ref, sd_ref, seg_refs, (o_ref, lse_ref, q_s, o_s, lse_s, p_s, bar), sd_s, qseg_s, (qt, bh, rows) = \
            _unpack(rest, has_bias, has_seeds, packed, t)
        loads = ((q_ref.at[bh, rows], q_s),) + _query_loads(sd_ref, seg_refs, sd_s, qseg_s, bh, rows)
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(len(loads)):
            plgpu.barrier_wait(bar.at[i])
        carry = (jnp.zeros((t, dv), f32), jnp.full((t,), NEG, f32), jnp.zeros((t,), f32))

        def local(idx, kt_t, v_t, *rest):
            *tiles, carry = rest
            s = _matmul(q_s, kt_t, (t, t))
            if has_bias:
                s = s + tiles[0][...].astype(f32)
            valid = _local_valid(g, qt, _key_tile(g, qt, idx[0]), seed_ref=sd_s,
                                 seg=_seg_of(qseg_s, tiles[has_bias:]))
            return _softmax_step(carry, s, *valid, v_t, p_s)

        key = lambda s: _clamp(_key_tile(g, qt, s), g["n_t"])  # noqa: E731
        specs = [plgpu.BlockSpec((d, t), lambda s: (0, key(s))), plgpu.BlockSpec((t, dv), lambda s: (key(s), 0))]
        args = [kt_ref.at[bh], v_ref.at[bh]]
        if has_bias:
            specs.append(plgpu.BlockSpec((t, t), lambda s: (jax.lax.rem(qt, jnp.int32(per)), s)))
            args.append(bias_ref.at[_head(g, bh)])
        seg_specs, seg_args = _seg_steps(seg_refs, bh, key, t, chunk=False)
        carry = plgpu.emit_pipeline(local, grid=(n_loc,), max_concurrent_steps=min(2, n_loc), init_carry=carry,
                                    in_specs=specs + seg_specs)(*args, *seg_args)

        def chunk(idx, kht_t, beta_t, *rest):
            *tiles, carry = rest
            s = _matmul(q_s, kht_t, (t, t))
            valid = _chunk_valid(g, qt, idx[0], seed_ref=sd_s, seg=_seg_of(qseg_s, tiles))
            return _softmax_step(carry, s, *valid, beta_t, p_s)

        seg_specs, seg_args = _seg_steps(seg_refs, bh, lambda c: c, t, chunk=True)
        carry = plgpu.emit_pipeline(
            chunk, grid=(n_c,), max_concurrent_steps=min(2, n_c), init_carry=carry,
            in_specs=[plgpu.BlockSpec((d, t), lambda c: (0, c)), plgpu.BlockSpec((t, dv), lambda c: (c, 0))]
            + seg_specs,
        )(kht_ref.at[bh], beta_ref.at[bh], *seg_args)

        acc, m_i, l_i = carry
        l_i = jnp.maximum(l_i, 1e-30)
        _store(o_s, (acc / jax.lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype), o_ref.at[bh, rows])
        _store(lse_s, m_i + jnp.log(l_i), lse_ref.at[bh, rows])

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, Lp, dv), dtype), jax.ShapeDtypeStruct((BH, Lp), f32)),
        scratch_types=(plgpu.SMEM((t, d), dtype), plgpu.SMEM((t, dv), dtype), plgpu.SMEM((t,), f32),
                       plgpu.SMEM((t, t), dtype), plgpu.Barrier(num_barriers=2 + 2 * packed))
                      + _extra_scratch(has_seeds, packed, t),
        grid=(Lp // t, BH), grid_names=("qt", "bh"), compiler_params=_SEMANTICS, interpret=interpret,
        kernel_name="eva_attend_mgpu_fwd",
    )(q, kt, v, kht, beta, *((bias,) if has_bias else ()), *((seeds,) if has_seeds else ()), *(seg or ()))


# ----------------------------------------------------------------------------- backward
def _probs(s, valid, mult, lse_ref, dl_ref, dp, axis):
    """``P ⊙ D`` and ``dS = P ⊙ (D ⊙ dP − Δ)`` (f32) of scores ``s`` with the statistics laid along ``axis`` (the
    queries'); ``D`` the dropout multiplier ``mult`` (None: 1)."""
    p = jnp.where(valid, jnp.exp(s - _rows(lse_ref, s.shape, axis)), 0.0)
    if mult is None:
        return p, p * (dp - _rows(dl_ref, s.shape, axis))
    return p * mult, p * (mult * dp - _rows(dl_ref, s.shape, axis))


def _dq_call(g, q, do, lse, delta, kt, vt, k, kht, btt, kh, bias, seeds, seg, interpret):
    """The query-side backward, the forward's grid: dq [BH, Lp, d] f32. ``*t`` operands are transposes; ``bias``,
    ``seeds`` and ``seg`` as the forward's."""
    BH, Lp, d = q.shape
    dv, t, dtype = do.shape[-1], g["t"], q.dtype
    n_loc, n_c, per = g["n_loc"], kh.shape[1] // t, g["W"] // t
    has_bias, has_seeds, packed = bias is not None, seeds is not None, seg is not None

    def body(q_ref, do_ref, lse_ref, dl_ref, kt_ref, vt_ref, k_ref, kht_ref, btt_ref, kh_ref, *rest):
        bias_ref, sd_ref, seg_refs, (dq_ref, q_s, do_s, lse_s, dl_s, ds_s, bar), sd_s, qseg_s, (qt, bh, rows) = \
            _unpack(rest, has_bias, has_seeds, packed, t)
        loads = ((q_ref.at[bh, rows], q_s), (do_ref.at[bh, rows], do_s), (lse_ref.at[bh, rows], lse_s),
                 (dl_ref.at[bh, rows], dl_s)) + _query_loads(sd_ref, seg_refs, sd_s, qseg_s, bh, rows)
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(len(loads)):
            plgpu.barrier_wait(bar.at[i])

        def step(s, valid_mult, vt_t, k_t, dq):
            _, ds = _probs(s, *valid_mult, lse_s, dl_s, _matmul(do_s, vt_t, (t, t)), 0)
            ds_s[...] = ds.astype(dtype)
            plgpu.commit_smem()
            return dq + _matmul(ds_s, k_t, (t, d))

        def local(idx, kt_t, vt_t, k_t, *rest):
            *tiles, dq = rest
            s = _matmul(q_s, kt_t, (t, t))
            if has_bias:
                s = s + tiles[0][...].astype(f32)
            valid = _local_valid(g, qt, _key_tile(g, qt, idx[0]), seed_ref=sd_s,
                                 seg=_seg_of(qseg_s, tiles[has_bias:]))
            return step(s, valid, vt_t, k_t, dq)

        key = lambda s: _clamp(_key_tile(g, qt, s), g["n_t"])  # noqa: E731
        specs = [plgpu.BlockSpec((d, t), lambda s: (0, key(s))), plgpu.BlockSpec((dv, t), lambda s: (0, key(s))),
                 plgpu.BlockSpec((t, d), lambda s: (key(s), 0))]
        args = [kt_ref.at[bh], vt_ref.at[bh], k_ref.at[bh]]
        if has_bias:
            specs.append(plgpu.BlockSpec((t, t), lambda s: (jax.lax.rem(qt, jnp.int32(per)), s)))
            args.append(bias_ref.at[_head(g, bh)])
        seg_specs, seg_args = _seg_steps(seg_refs, bh, key, t, chunk=False)
        dq = plgpu.emit_pipeline(local, grid=(n_loc,), max_concurrent_steps=min(2, n_loc),
                                 init_carry=jnp.zeros((t, d), f32), in_specs=specs + seg_specs)(*args, *seg_args)

        def chunk(idx, kht_t, btt_t, kh_t, *rest):
            *tiles, dq = rest
            valid = _chunk_valid(g, qt, idx[0], seed_ref=sd_s, seg=_seg_of(qseg_s, tiles))
            return step(_matmul(q_s, kht_t, (t, t)), valid, btt_t, kh_t, dq)

        seg_specs, seg_args = _seg_steps(seg_refs, bh, lambda c: c, t, chunk=True)
        dq = plgpu.emit_pipeline(
            chunk, grid=(n_c,), max_concurrent_steps=min(2, n_c), init_carry=dq,
            in_specs=[plgpu.BlockSpec((d, t), lambda c: (0, c)), plgpu.BlockSpec((dv, t), lambda c: (0, c)),
                      plgpu.BlockSpec((t, d), lambda c: (c, 0))] + seg_specs,
        )(kht_ref.at[bh], btt_ref.at[bh], kh_ref.at[bh], *seg_args)
        pl.run_scoped(lambda dq_s: _store(dq_s, dq, dq_ref.at[bh, rows]), plgpu.SMEM((t, d), f32))

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((BH, Lp, d), f32),
        scratch_types=(plgpu.SMEM((t, d), dtype), plgpu.SMEM((t, dv), dtype), plgpu.SMEM((t,), f32),
                       plgpu.SMEM((t,), f32), plgpu.SMEM((t, t), dtype), plgpu.Barrier(num_barriers=5 + 2 * packed))
                      + _extra_scratch(has_seeds, packed, t),
        grid=(Lp // t, BH), grid_names=("qt", "bh"), compiler_params=_SEMANTICS, interpret=interpret,
        kernel_name="eva_attend_mgpu_dq",
    )(q, do, lse, delta, kt, vt, k, kht, btt, kh, *((bias,) if has_bias else ()), *((seeds,) if has_seeds else ()),
      *(seg or ()))


def _dkey_call(g, k, v, kh, beta, qt_, q, dot, do, lse, delta, bias_t, seeds, seg, interpret):
    """The key-side backward, grid ``(Lp / t + Cp / t, BH)``: key-tile programs (dk, dv and the bias gradient's
    tiles) then chunk-tile programs (dk̂, dβ), keys-major. ``bias_t``: the forward's bias layout transposed
    ``[Hb, n_lt·W, W]`` or None; ``seeds`` and ``seg`` the forward's (a packed row: the program's own keys' or
    chunks' indices and documents reach shared memory once, the query tiles' come with each step). Returns f32 ``(dk, dv, dk̂, dβ, dbias tiles [BH, Lp/t, n_loc, t, t] or None)``."""
    BH, Lp, d = k.shape
    dv, t, dtype = v.shape[-1], g["t"], k.dtype
    n_t, n_loc, n_ct, per = g["n_t"], g["n_loc"], kh.shape[1] // t, g["W"] // t
    has_bias, has_seeds, packed = bias_t is not None, seeds is not None, seg is not None

    def body(k_ref, v_ref, kh_ref, beta_ref, qt_ref, q_ref, dot_ref, do_ref, lse_ref, dl_ref, *rest):
        bias_ref = rest[0] if has_bias else None
        sd_ref = rest[has_bias] if has_seeds else None
        n_in = has_bias + has_seeds
        seg_refs = rest[n_in:n_in + 5] if packed else None
        outs, bar = rest[n_in + 5 * packed:-1], rest[-1]
        dk_ref, dv_ref, dkh_ref, dbeta_ref = outs[:4]
        db_ref = outs[4] if has_bias else None
        j = jax.lax.axis_index("j")
        bh = jax.lax.axis_index("bh")
        q_specs = lambda tile: [  # noqa: E731  (the query side of a step: qᵀ, q, dOᵀ, dO, lse, Δ; a packed
            # row's query positions and documents)
            plgpu.BlockSpec((d, t), lambda r: (0, tile(r))), plgpu.BlockSpec((t, d), lambda r: (tile(r), 0)),
            plgpu.BlockSpec((dv, t), lambda r: (0, tile(r))), plgpu.BlockSpec((t, dv), lambda r: (tile(r), 0))
        ] + [plgpu.BlockSpec((t,), lambda r: (tile(r),))] * (2 + 2 * packed)
        q_args = (qt_ref.at[bh], q_ref.at[bh], dot_ref.at[bh], do_ref.at[bh], lse_ref.at[bh], dl_ref.at[bh])
        if packed:
            q_args += (seg_refs[0].at[bh], seg_refs[1].at[bh])

        def program(src_k, src_v, src_seg, valid_fn, tile, n_steps, bias_spec, dk_out, dv_out, k_s, v_s, pt_s,
                    dst_s, *rest):
            sd_s = rest[0] if has_seeds else None
            own_s = rest[has_seeds:has_seeds + 2 * packed]  # a packed row: the program's own indices, documents
            db_s = rest[-1] if len(rest) > has_seeds + 2 * packed else None
            loads = ((src_k, k_s), (src_v, v_s)) + (((sd_ref.at[bh], sd_s),) if has_seeds else ())
            loads += tuple(zip(src_seg, own_s))
            for i, (src, dst) in enumerate(loads):
                plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            for i in range(len(loads)):
                plgpu.barrier_wait(bar.at[i])

            def step(idx, qt_t, q_t, dot_t, do_t, lse_t, dl_t, *rest):
                *tiles, (dk, dvv) = rest
                qseg, b_t = tiles[:2 * packed], tiles[2 * packed:]
                st = _matmul(k_s, qt_t, (t, t))
                if b_t:
                    st = st + b_t[0][...].astype(f32)
                seg_t = (*qseg, *own_s) if packed else None
                pt, dst = _probs(st, *valid_fn(idx[0], sd_s, seg_t), lse_t, dl_t, _matmul(v_s, dot_t, (t, t)), 1)
                pt_s[...] = pt.astype(dtype)
                dst_s[...] = dst.astype(dtype)
                if db_s is not None:
                    db_s[...] = dst
                plgpu.commit_smem()
                if db_s is not None:
                    plgpu.copy_smem_to_gmem(db_s, db_ref.at[bh, j, idx[0]])
                out = dk + _matmul(dst_s, q_t, (t, d)), dvv + _matmul(pt_s, do_t, (t, dv))
                if db_s is not None:
                    plgpu.wait_smem_to_gmem(0)
                return out

            dk, dvv = plgpu.emit_pipeline(
                step, grid=(n_steps,), max_concurrent_steps=min(2, n_steps),
                init_carry=(jnp.zeros((t, d), f32), jnp.zeros((t, dv), f32)),
                in_specs=q_specs(tile) + bias_spec[:1])(*q_args, *bias_spec[1:])
            pl.run_scoped(lambda s: _store(s, dk, dk_out), plgpu.SMEM((t, d), f32))
            pl.run_scoped(lambda s: _store(s, dvv, dv_out), plgpu.SMEM((t, dv), f32))

        tiles = (plgpu.SMEM((t, d), dtype), plgpu.SMEM((t, dv), dtype), plgpu.SMEM((t, t), dtype),
                 plgpu.SMEM((t, t), dtype)) + (plgpu.SMEM((t,), jnp.int32),) * (has_seeds + 2 * packed)

        @pl.when(j < n_t)
        def _keys():  # key tile j of key block kb: the query tiles of blocks kb - offsets (step r: offset r // per)
            kb, jc = jax.lax.div(j, jnp.int32(per)), jax.lax.rem(j, jnp.int32(per))
            offs = g["offsets"]

            def qtile(r):  # unclamped
                o = offs[0] + jax.lax.div(r, jnp.int32(per)) if len(offs) > 1 else offs[0]
                return (kb - o) * per + jax.lax.rem(r, jnp.int32(per))

            bias_spec = []
            if has_bias:
                bias_spec = [plgpu.BlockSpec((t, t), lambda r: (jax.lax.div(r, jnp.int32(per)) * per + jc,
                                                                  jax.lax.rem(r, jnp.int32(per)))),
                             bias_ref.at[_head(g, bh)]]
            rows = pl.ds(j * t, t)
            pl.run_scoped(
                lambda *s: program(k_ref.at[bh, rows], v_ref.at[bh, rows],
                                   () if not packed else (seg_refs[0].at[bh, rows], seg_refs[2].at[bh, rows]),
                                   lambda r, sd, sg: _local_valid(g, qtile(r), j, keys_major=True, seed_ref=sd,
                                                                  seg=sg),
                                   lambda r: _clamp(qtile(r), n_t), n_loc, bias_spec, dk_ref.at[bh, rows],
                                   dv_ref.at[bh, rows], *s),
                *tiles, *((plgpu.SMEM((t, t), f32),) if has_bias else ()))

        @pl.when(j >= n_t)
        def _chunks():  # chunk tile ct: every query tile
            ct = j - n_t
            rows = pl.ds(ct * t, t)
            pl.run_scoped(
                lambda *s: program(kh_ref.at[bh, rows], beta_ref.at[bh, rows],
                                   () if not packed else (seg_refs[3].at[bh, rows], seg_refs[4].at[bh, rows]),
                                   lambda r, sd, sg: _chunk_valid(g, r, ct, keys_major=True, seed_ref=sd, seg=sg),
                                   lambda r: r,
                                   n_t, [], dkh_ref.at[bh, rows], dbeta_ref.at[bh, rows], *s),
                *tiles)

    Cp = kh.shape[1]
    out_type = (jax.ShapeDtypeStruct((BH, Lp, d), f32), jax.ShapeDtypeStruct((BH, Lp, dv), f32),
                jax.ShapeDtypeStruct((BH, Cp, d), f32), jax.ShapeDtypeStruct((BH, Cp, dv), f32))
    if has_bias:
        out_type += (jax.ShapeDtypeStruct((BH, n_t, n_loc, t, t), f32),)
    res = plgpu.kernel(
        body, out_type=out_type, scratch_types=(plgpu.Barrier(num_barriers=3 + 2 * packed),),
        grid=(n_t + n_ct, BH), grid_names=("j", "bh"), compiler_params=_SEMANTICS, interpret=interpret,
        kernel_name="eva_attend_mgpu_dkey",
    )(k, v, kh, beta, qt_, q, dot, do, lse, delta, *((bias_t,) if has_bias else ()), *((seeds,) if has_seeds else ()),
      *(seg or ()))
    return tuple(res) + ((None,) if not has_bias else ())


def _bias_grad(db, g, BH: int, Hb: int):
    """The key side's bias-gradient tiles ``[BH, Lp/t, n_loc, t, t]`` (keys-major: key slot, query row) summed over
    the key blocks and the rows of a head (all heads where the table is shared): ``[Hb, n_lt, W, W]`` f32."""
    t, per, n_lt = g["t"], g["W"] // g["t"], len(g["offsets"])
    nq = db.shape[1] // per
    db = db.reshape(BH // g["heads"], g["heads"], nq, per, n_lt, per, t, t).sum(axis=(0, 2))  # [h, jc, o, rq, a, b]
    if Hb == 1:
        db = db.sum(axis=0, keepdims=True)
    return jnp.transpose(db, (0, 2, 3, 5, 1, 4)).reshape(Hb, n_lt, g["W"], g["W"])


# ----------------------------------------------------------------------------- differentiable entry
def _t(x):
    """The last two axes swapped (wgmma operands without transposed views: module docstring)."""
    return jnp.swapaxes(x, -1, -2)


def _bias_layout(bias, n_lt: int):
    """``[Hb, n_lt, W, W]`` -> ``[Hb, W, n_lt·W]``: query row, then the window's key slot (one TMA block a step)."""
    Hb, _, W, _ = bias.shape
    return jnp.transpose(bias, (0, 2, 1, 3)).reshape(Hb, W, n_lt * W)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attend(q, k, v, kh, beta, bias, seeds, seg, g, interpret):
    return _attend_fwd(q, k, v, kh, beta, bias, seeds, seg, g, interpret)[0]


def _attend_fwd(q, k, v, kh, beta, bias, seeds, seg, g, interpret):
    b2 = None if bias is None else _bias_layout(bias, len(g["offsets"]))
    o, lse = _forward_call(g, q, _t(k), v, _t(kh), beta, b2, seeds, seg, interpret)
    return (o, lse), (q, k, v, kh, beta, bias, seeds, seg, o, lse)


def _attend_bwd(g, interpret, res, cts):
    q, k, v, kh, beta, bias, seeds, seg, o, lse = res
    do = cts[0].astype(v.dtype)  # dO in the compute dtype (a product operand)
    # Δ = rowsum(dO ⊙ O), less the lse cotangent (it enters as a shift of Δ); f32, a statistic
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1) - cts[1].astype(f32)
    b2 = None if bias is None else _bias_layout(bias, len(g["offsets"]))
    dq = _dq_call(g, q, do, lse, delta, _t(k), _t(v), k, _t(kh), _t(beta), kh, b2, seeds, seg, interpret)
    dk, dv, dkh, dbeta, db = _dkey_call(g, k, v, kh, beta, _t(q), q, _t(do), do, lse, delta,
                                        None if b2 is None else _t(b2), seeds, seg, interpret)
    dbias = None if bias is None else _bias_grad(db, g, q.shape[0], bias.shape[0]).astype(bias.dtype)
    cast = lambda x, ref: x.astype(ref.dtype)  # noqa: E731
    return cast(dq, q), cast(dk, k), cast(dv, v), cast(dkh, kh), cast(dbeta, beta), dbias, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _to_hashable(g: dict):
    return tuple(sorted(g.items()))


def eva_attend_mgpu(q, k, v, k_hat, beta, bias, *, W: int, e_l: int, e_r: int, P: int, L: int, causal: bool,
                    disjoint: bool, heads: int, interpret=False, dropout_rate: float = 0.0, seeds=None,
                    segments=None, chunk_base: int = 0, **_tiles):
    """Phase B by the Mosaic GPU kernels; :func:`pallas_kernels.eva_attend.eva_attend`'s contract (its operands,
    ``(o [BH, Lp, dv], lse [BH, Lp])``, differentiable in q, k, v, k̂, β and the bias). ``interpret``: True runs
    Mosaic GPU's interpret mode (any backend); an ``InterpretGPUParams`` is passed as given. ``dropout_rate`` > 0
    with ``seeds`` (int32 ``[BH]``): attention dropout by the Triton kernel's hash mask (absolute query and key
    indices, chunk ``c`` at ``CHUNK_KEY_BASE + c``) on the normalised weights, the same in the backward.

    ``segments`` (a packed row laid out again on the window grid by EVA's ``packed.py``; None: one sequence): the
    Triton kernel's operand, int32 ``(rel [B, Lp], q_doc [B, Lp], k_doc [B, Lp], c_rel [B, C], c_doc [B, C])``
    with ``B = BH / heads`` (each position's own index in its document, its document as a query and as a key, each
    chunk's own index and document; negative: none), ``L = Lp`` and all ``C = k_hat.shape[1]`` chunks given; the
    masks and dropout counters as the Triton kernel takes them. ``chunk_base`` (the carried state's chunks first)
    only orders the Triton kernel's causal skip: these kernels score every chunk tile, so it is not read; nor are
    ``_tiles`` (the Triton kernel's tile settings and platform)."""
    BH, Lp, d = q.shape
    dv = v.shape[-1]
    C = -(-L // P) if segments is None else k_hat.shape[1]
    dtype = compute_dtype(q, k, v)
    reasons = unsupported_reasons("interpret" if interpret else "cuda", W=W, d=d, dv=dv, e_l=e_l, e_r=e_r,
                                  dtype=dtype)
    if segments is not None and (L != Lp or segments[0].shape[0] * heads != BH):
        reasons.append(f"a packed row takes L = Lp (got L={L}, Lp={Lp}) and segments of BH / heads rows (got "
                       f"{segments[0].shape[0]} for {BH} / {heads})")
    if not 0.0 <= dropout_rate < 1.0 or (dropout_rate > 0) != (seeds is not None):
        reasons.append(f"dropout_rate={dropout_rate} needs seeds (and seeds a rate in (0, 1))")
    t = min(TILE, W) if interpret else TILE
    if W % t or Lp % W or Lp < L:
        reasons.append(f"padded length {Lp} must be a multiple of W={W} (itself of the tile {t}) and >= L={L}")
    offsets = local_offsets(e_l, e_r)
    if bias is not None and bias.shape[1] != len(offsets):
        reasons.append(f"bias has {bias.shape[1]} tiles for {len(offsets)} key-block offsets")
    if reasons:
        raise ValueError("eva_attend_mgpu cannot run: " + "; ".join(reasons))
    if interpret is True:
        interpret = interpret_params()
    Cp = -(-C // t) * t
    q, k, v, k_hat, beta = (x.astype(dtype) for x in (q, k, v, k_hat, beta))
    kh = jnp.pad(k_hat[:, :C], ((0, 0), (0, Cp - C), (0, 0)))
    bt = jnp.pad(beta[:, :C], ((0, 0), (0, Cp - C), (0, 0)))
    bias = None if bias is None else bias.astype(dtype)
    g = dict(t=t, W=W, P=P, L=L, C=C, n_t=Lp // t, n_loc=len(offsets) * W // t, offsets=offsets, causal=bool(causal),
             disjoint=bool(disjoint), e_l=e_l, e_r=e_r, heads=heads, Hb=1 if bias is None else bias.shape[0],
             rate=float(dropout_rate))
    sd = None if seeds is None else jnp.broadcast_to(jnp.asarray(seeds, jnp.int32).reshape(BH, 1), (BH, t))
    seg = None if segments is None else _seg_operands(segments, heads, C, Cp)
    return _attend(q, k, v, kh, bt, bias, sd, seg, _Geo(g), interpret or False)


def _seg_operands(segments, heads: int, C: int, Cp: int):
    """:func:`eva_attend_mgpu`'s ``segments`` as the kernels read them: int32 rows per (batch row, head) ``[BH, ·]``
    (the queries' own positions (also the keys'), the queries' documents, the keys', the chunks' own indices and
    documents, the chunks' padded to ``Cp``); a negative document is none, distinct for queries (-2), keys (-1)
    and chunks (-3) so that none of them ever meet (the Triton kernel's)."""
    rel, q_doc, k_doc, c_rel, c_doc = (jnp.asarray(x, jnp.int32) for x in segments)
    q_doc, k_doc, c_doc = (jnp.where(x < 0, none, x) for x, none in ((q_doc, -2), (k_doc, -1), (c_doc, -3)))
    pad_c = lambda x, fill: jnp.pad(x[:, :C], ((0, 0), (0, Cp - C)), constant_values=fill)  # noqa: E731
    rows = (rel, q_doc, k_doc, pad_c(c_rel, 0), pad_c(c_doc, -3))
    return tuple(jnp.repeat(x, heads, axis=0) for x in rows)


class _Geo(dict):
    """The static geometry (a hashable dict: a ``custom_vjp`` non-differentiable argument)."""

    def __hash__(self):
        return hash(_to_hashable(self))

"""Pallas kernel "FMA multilevel blocks" (docs/methods/fma.md §8): forward and FlashAttention-2-style backward
kernels, lowered for GPU (Triton) and TPU (Mosaic); interpret mode on a CPU.

The reference it must match is :func:`pallas_kernels.fma_blocks_ref.attend_blocks` (operands on the kernel's
``[BH, ...]`` layout: :func:`_ref_blocks`). This module imports JAX, NumPy and its reference only (never ``longctx``).

Operands: ``q, k [BH, n_pad, d]`` (``q`` pre-scaled), ``v [BH, n_pad, dv]``, the level summaries
``kall [BH, R, d], vall [BH, R, dv]`` (all levels' summary rows, concatenated), the summary row of every coarse slot
of each fine block ``idx [nb, C_pad]`` (int32, ``nb = n_pad / m``) and the slots' static bias ``cbias [nb, C_pad]``
(beta_l on valid slots, NEG on masked and pad slots). A fine query block reads its own key block (causal mask), the
previous one and, bidirectional, the next one, all from the same K/V arrays (an out-of-range block is masked), and
its coarse slots by index from the summaries: no per-block copy of the slots exists outside the kernel.

Packed rows (docs/methods/fma.md §2.7, a row of documents laid out again): ``docs = (qdoc, kdoc, sdoc)``, the
document of every query row, key and coarse slot's group (int32), are three more inputs read beside the operands
they mask (:class:`_Docs`: a column per query row, one row of ids per fine key block, the slot table's shape); a
key or slot counts for a query only where the ids are equal, in the forward, dq and dk/dv kernels alike.

Kernels, each on grid ``(BH, nb / G)``: a program loops over ``G`` consecutive fine blocks (``blocks_per_program``,
:func:`program_blocks`), reading their rows as one tile and the fine blocks just before and after them as single
blocks (clamped index maps).

* **forward**: per fine query block one online softmax over the segments current (first, so the running max is
  finite), previous, next, coarse. Writes ``o`` and the per-row log-sum-exp ``lse`` (fp32), kept with the inputs as
  the backward's residuals.
* **dq** (the forward's grid): probabilities recomputed from the saved ``lse`` over the same segments,
  ``dS = P (dO Vᵀ - Δ)`` with ``Δ = rowsum(dO ⊙ O)`` (computed in JAX); writes ``dq`` and adds the gradient of the
  block's coarse slots (``dSᵀ q``, ``Pᵀ dO``, fp32) into the summaries' gradients ``dkall, dvall`` (fp32, R + 1
  rows: row R takes the masked slots' zero contributions and is dropped; on GPU one flat ``[(R + 1) w]`` buffer per
  row, the atomic adds' target), rounded once to the compute dtype.
* **dk/dv**: per key block ``j``, the query blocks that see it: ``j`` itself (causal mask), ``j + 1`` (whose
  "previous" block ``j`` is) and, bidirectional, ``j - 1`` (whose "next" block ``j`` is); ``dv = Σ Pᵀ dO``,
  ``dk = Σ dSᵀ q``.

Coarse access by lowering (:class:`_Slots`): on GPU (Triton) and in interpret mode a block's slot tile is one
indexed load ``kall[idx, :]`` of the summaries passed whole (pointer arithmetic), and the dq kernel adds the slot
gradients with atomic adds into zero-filled buffers (programs run concurrently; a block's valid slots read distinct
rows; the adds' order, so the gradients' last bits, may vary between runs). On TPU (Mosaic) the slot table sits in
SMEM, the rows are copied one by one into a VMEM tile, and the gradients stay resident in VMEM over the block axis
(``arbitrary``: a core runs a row's programs in order), added row by row. Interpret mode runs the TPU form when
given ``platform='tpu'``.

Dtypes (DESIGN.md §7): q, k, v, the summaries and ``dO`` in the compute dtype (fp32 or bf16, one dtype; the
entry casts mixed operands to their common type); every dot takes its operands as they are (``P``, ``dS`` and
``dO`` cast down to the compute dtype) with fp32 accumulation (``preferred_element_type``); scores, softmax
statistics (``lse``, ``Δ``, the static bias) and accumulators fp32; the activations and gradients written
(``o``, ``dq``, ``dk``, ``dv``, ``dkall``, ``dvall``) in the compute dtype, each rounded once from its fp32 accumulator. Masks use the finite
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

from pallas_kernels import lazy_triton as pltriton
from pallas_kernels.fma_blocks_ref import NEG, attend_blocks
from pallas_kernels.precision import dot_nn as _nn
from pallas_kernels.precision import dot_nt as _nt
from pallas_kernels.precision import dot_tn as _tn

f32 = jnp.float32
SUPPORTED_M = (8, 16, 32, 64, 128, 256)
GPU_M = (16, 32, 64, 128)
GPU_MAX_HEAD = 256


TPU_VMEM_SUMMARIES = 32 << 20  # bytes of VMEM the TPU form may give a row's summaries and their gradients


def unsupported_reasons(platform: str, *, m: int, d: int, dv: int, coarse_kind=None, q_block0_static=True,
                        dropout: float = 0.0, summary_rows: int = 0, itemsize: int = 4, **_) -> list[str]:
    """Why the kernel (forward and backward) cannot serve these shapes on ``platform``
    ('tpu' | 'cuda' | 'rocm' | 'interpret'). ``summary_rows``: the level summaries' rows R where known (the TPU
    form holds a row's summaries, double-buffered, and their fp32 gradients in VMEM)."""
    out = []
    vmem = summary_rows * (d + dv) * (2 * itemsize + 2 * 4)
    if platform == "tpu" and vmem > TPU_VMEM_SUMMARIES:
        out.append(f"{summary_rows} summary rows need ~{vmem >> 20} MiB of VMEM on TPU (the summaries and their "
                   f"gradients are held whole per row; limit {TPU_VMEM_SUMMARIES >> 20} MiB)")
    if coarse_kind not in (None, "packed"):
        out.append(f"coarse operand {coarse_kind!r} (FMA-linear) is not computed by the kernel, only FMA's packed slots")
    if not q_block0_static:
        out.append("streaming/decoding calls (a traced block offset) use the reference")
    if dropout > 0:
        out.append("no attention dropout in the kernel")
    if platform == "interpret":
        return out
    if platform in ("cuda", "rocm"):
        out += pltriton.missing()
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




def _fine_scores(q, k, qblk, kblk, in_range, *, m: int, causal: bool, n_valid: int, same=None):
    """Scores [m, m] of query block ``qblk`` against key block ``kblk`` (traced ints) and their mask (``same``
    [m, m]: where the query and the key are of one document, packed rows; None: one sequence)."""
    s = _nt(q, k)
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
    kpos = kblk * m + cols
    valid = (kpos >= 0) & (kpos < n_valid) & in_range
    if causal:
        valid = valid & (kpos <= qblk * m + rows)
    if same is not None:
        valid = valid & same
    return jnp.where(valid, s, NEG), valid


def _coarse_scores(q, kc, cb, same=None):
    """Scores [m, C_pad] of a query block against its coarse slots (bias ``cb [1, C_pad]``) and their mask
    (``same`` [m, C_pad]: where the query and the slot's group are of one document, packed rows)."""
    s = _nt(q, kc) + cb
    valid = jnp.broadcast_to(cb > NEG / 2, s.shape)
    if same is not None:
        valid = valid & same
    return jnp.where(valid, s, NEG), valid


class _Docs:
    """A program's documents (packed rows laid out again, docs/methods/fma.md §2.7): the document of each query row
    of its G blocks (``q [G m, 1]`` int32), of each key of its fine key blocks (``k``: {offset: ref}, ``[G, 1, m]``
    for its own blocks, ``[1, 1, m]`` for the blocks just before and after them) and, with coarse slots, of each
    slot's group (``s [G, C_pad]``). A key or slot counts for a query only where their documents are equal (the
    caller's padding never equals: queries -1, keys and slots -2)."""

    def __init__(self, q, k, s=None):
        self.q, self.k, self.s = q, k, s

    def query(self, g: int, m: int):
        return self.q[pl.ds(g * m, m), :]  # [m, 1]

    def keys(self, g: int, G: int, off: int):
        """The documents ``[1, m]`` of fine key block ``g + off`` (as :func:`_tile`)."""
        t = g + off
        if t < 0:
            return self.k[-1][0]
        if t >= G:
            return self.k[1][0]
        return self.k[0][t]

    def same_keys(self, g: int, G: int, off: int, m: int):
        return self.query(g, m) == self.keys(g, G, off)  # [m, m]

    def same_slots(self, g: int, m: int):
        return self.query(g, m) == self.s[pl.ds(g, 1), :]  # [m, C_pad]


def _tile(cur_ref, prev_ref, next_ref, g: int, G: int, m: int, off: int):
    """The m-row tile of fine block ``g + off`` (off in -1, 0, 1) of a program holding blocks ``g = 0..G-1`` in
    ``cur_ref`` ([G m, *]); the blocks just before and after them come from ``prev_ref`` / ``next_ref`` ([m, *])."""
    t = g + off
    if t < 0:
        return prev_ref[...]
    if t >= G:
        return next_ref[...]
    return cur_ref[pl.ds(t * m, m), :]


class _Slots:
    """A program's view of the coarse operands: the level summaries ``kall [R, d]``, ``vall [R, dv]`` of its row
    (whole), the slot rows ``idx`` and bias ``cb`` of its G blocks (``[G, C_pad]``) and, for the dq kernel, the
    fp32 summary gradients ``dkall, dvall`` (R + 1 rows: row R takes the masked slots' zero contributions; flat on
    GPU).

    ``gather`` (GPU, interpret mode): a block's ``[C_pad, d]`` tile is one indexed load of ``kall`` (pointer
    arithmetic on the Triton lowering), its gradient one atomic add (programs of one row run concurrently).
    Otherwise (TPU): ``idx`` sits in SMEM, the slots are copied row by row into a VMEM scratch tile, and the
    gradient rows are added into ``dkall`` / ``dvall``, resident in VMEM across the (sequential) block axis."""

    def __init__(self, refs, gather: bool, scratch=()):
        self.kall, self.vall, self.idx, self.cb = refs
        self.gather = gather
        self.scratch = scratch

    def bias(self, g: int):
        return self.cb[pl.ds(g, 1), :]  # [1, C_pad]

    def _rows(self, g: int):
        return self.idx[g, :]  # [C_pad] int32

    def _gather_index(self, g: int, width: int, rows=None):
        rows = self._rows(g) if rows is None else rows
        C = rows.shape[0]
        return (jnp.broadcast_to(rows[:, None], (C, width)), jax.lax.broadcasted_iota(jnp.int32, (C, width), 1))

    def tiles(self, g: int):
        """The block's coarse keys and values ``[C_pad, d]``, ``[C_pad, dv]``."""
        if self.gather:
            return tuple(ref[self._gather_index(g, ref.shape[-1])] for ref in (self.kall, self.vall))
        out = []
        for ref, buf in zip((self.kall, self.vall), self.scratch):
            for c in range(buf.shape[0]):
                buf[pl.ds(c, 1), :] = ref[pl.ds(self.idx[g, c], 1), :]
            out.append(buf[...])
        return tuple(out)

    def add_grads(self, g: int, dkc, dvc, dkall, dvall):
        """Add one block's slot gradients ``[C_pad, *]`` (fp32) into the summaries' gradients."""
        if self.gather:
            trash = self.kall.shape[0]  # row R
            rows = jnp.where(self.cb[g, :] > NEG / 2, self._rows(g), trash)  # valid rows of a block are distinct
            for ref, val in ((dkall, dkc), (dvall, dvc)):  # flat [(R + 1) w] buffers: element row * w + col
                w = val.shape[-1]
                r, c = self._gather_index(g, w, rows)
                pltriton.atomic_add(ref, r * w + c, val)
            return
        for ref, val in ((dkall, dkc), (dvall, dvc)):
            for c in range(val.shape[0]):  # masked slots add exact zeros
                row = pl.ds(self.idx[g, c], 1)
                ref[row, :] = ref[row, :] + val[c:c + 1, :]


def _split_q_refs(refs, causal: bool, has_coarse: bool, n_extra: int, gather: bool, n_out: int,
                  has_docs: bool = False):
    """(q, {offset: (k, v)} of the fine segments, _Slots or None, extra inputs, outputs, _Docs or None)."""
    q_ref = refs[0]
    offs = (0, -1) if causal else (0, -1, 1)
    kv = {0: (refs[1], refs[2]), -1: (refs[3], refs[4]), 1: (refs[5], refs[6]) if not causal else (None, None)}
    rest = refs[1 + 2 * len(offs):]
    slots = docs = None
    if has_coarse:
        slots, rest = rest[:4], rest[4:]
    if has_docs:
        n_doc = 1 + len(offs) + has_coarse
        d = rest[:n_doc]
        docs, rest = _Docs(d[0], dict(zip(offs, d[1:1 + len(offs)])), d[-1] if has_coarse else None), rest[n_doc:]
    extra, rest = rest[:n_extra], rest[n_extra:]
    if has_coarse and gather and n_out == 3:
        rest = rest[2:]  # the dq kernel: the zero-filled gradient buffers its outputs alias
    outs, scratch = rest[:n_out], rest[n_out:]
    if has_coarse:
        slots = _Slots(slots, gather, scratch)
    return q_ref, offs, kv, slots, extra, outs, docs


def _segment(kv, off, g, G, m):
    """(key tile, value tile) of the fine segment ``off`` (-1 previous, 0 own, 1 next) of block ``g``."""
    k_cur, v_cur = kv[0]
    k_side, v_side = kv[off] if off else (None, None)
    prev_next = (k_side, None) if off < 0 else (None, k_side)
    vprev_next = (v_side, None) if off < 0 else (None, v_side)
    return _tile(k_cur, *prev_next, g, G, m, off), _tile(v_cur, *vprev_next, g, G, m, off)


# ----------------------------------------------------------------------------- forward / dq kernels
def _fwd_kernel(*refs, m: int, G: int, nb: int, causal: bool, n_valid: int, has_coarse: bool, gather: bool,
                has_docs: bool = False):
    q_ref, offs, kv, slots, _, (o_ref, lse_ref), docs = _split_q_refs(refs, causal, has_coarse, 0, gather, 2,
                                                                      has_docs)
    pid = pl.program_id(1)

    def online(carry, s, valid, vals):
        mi, li, acc = carry
        m_new = jnp.maximum(mi, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(mi - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        li = alpha * li + jnp.sum(p, axis=1, keepdims=True)
        return m_new, li, alpha * acc + _nn(p.astype(vals.dtype), vals)

    for g in range(G):
        b = pid * G + g
        rows = pl.ds(g * m, m)
        q = q_ref[rows, :]
        carry = (jnp.full((m, 1), NEG, f32), jnp.zeros((m, 1), f32), jnp.zeros((m, o_ref.shape[-1]), f32))
        for off in offs:  # own block first, so the running max is finite
            k, v = _segment(kv, off, g, G, m)
            s, valid = _fine_scores(q, k, b, b + off, (b + off >= 0) & (b + off < nb), m=m, causal=causal,
                                    n_valid=n_valid, same=None if docs is None else docs.same_keys(g, G, off, m))
            carry = online(carry, s, valid, v)
        if slots is not None:
            kc, vc = slots.tiles(g)
            s, valid = _coarse_scores(q, kc, slots.bias(g), None if docs is None else docs.same_slots(g, m))
            carry = online(carry, s, valid, vc)
        mi, li, acc = carry
        li = jnp.maximum(li, 1e-30)  # a row with no valid key (none in practice): output 0, as the reference
        o_ref[rows, :] = (acc / li).astype(o_ref.dtype)
        lse_ref[rows, :] = mi + jnp.log(li)


def _dq_kernel(*refs, m: int, G: int, nb: int, causal: bool, n_valid: int, has_coarse: bool, gather: bool,
               has_docs: bool = False):
    n_out = 3 if has_coarse else 1
    q_ref, offs, kv, slots, (do_ref, lse_ref, dl_ref), outs, docs = _split_q_refs(refs, causal, has_coarse, 3,
                                                                                  gather, n_out, has_docs)
    dq_ref = outs[0]
    pid = pl.program_id(1)
    if slots is not None and not gather:  # TPU: the summaries' gradients stay resident over the block axis
        @pl.when(pid == 0)
        def _():
            outs[1][...] = jnp.zeros(outs[1].shape, f32)
            outs[2][...] = jnp.zeros(outs[2].shape, f32)

    for g in range(G):
        b = pid * G + g
        rows = pl.ds(g * m, m)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows, :], dl_ref[rows, :]

        def probs_and_ds(s, valid, vals, do=do, lse=lse, delta=delta):
            p = jnp.where(valid, jnp.exp(s - lse), 0.0)
            return p, p * (_nt(do, vals) - delta)

        dq = jnp.zeros((m, q.shape[-1]), f32)
        for off in offs:
            k, v = _segment(kv, off, g, G, m)
            s, valid = _fine_scores(q, k, b, b + off, (b + off >= 0) & (b + off < nb), m=m, causal=causal,
                                    n_valid=n_valid, same=None if docs is None else docs.same_keys(g, G, off, m))
            _, ds = probs_and_ds(s, valid, v)
            dq = dq + _nn(ds.astype(k.dtype), k)
        if slots is not None:
            kc, vc = slots.tiles(g)
            s, valid = _coarse_scores(q, kc, slots.bias(g), None if docs is None else docs.same_slots(g, m))
            p, ds = probs_and_ds(s, valid, vc)
            dq = dq + _nn(ds.astype(kc.dtype), kc)
            slots.add_grads(g, _tn(ds.astype(q.dtype), q), _tn(p.astype(do.dtype), do), outs[1], outs[2])
        dq_ref[rows, :] = dq.astype(dq_ref.dtype)


# ----------------------------------------------------------------------------- dk / dv kernel
def _dkv_kernel(*refs, m: int, G: int, nb: int, causal: bool, n_valid: int, has_docs: bool = False):
    """Key blocks ``j = pid G + g``; the query blocks that read block j: j itself (its own block), j + 1 (its
    previous block) and, bidirectional, j - 1 (its next block). ``has_docs`` (packed rows): the keys' documents
    ``[G, 1, m]`` follow the keys and values, and each query-side source carries its rows' documents."""
    k_ref, v_ref = refs[0], refs[1]
    kdoc_ref = refs[2] if has_docs else None
    refs = refs[3:] if has_docs else refs[2:]
    offs = (0, 1) if causal else (0, 1, -1)
    n_src = 2 if causal else 3  # query-side sources: own G blocks, the block after them, (the block before them)
    ns = 5 if has_docs else 4  # q, dO, lse, delta (and the rows' documents)
    src = [refs[ns * t: ns * (t + 1)] for t in range(n_src)]
    dk_ref, dv_ref = refs[ns * n_src:]
    own, after = src[0], src[1]
    before = src[2] if not causal else (None,) * ns
    pid = pl.program_id(1)
    for g in range(G):
        j = pid * G + g
        rows = pl.ds(g * m, m)
        k, v = k_ref[rows, :], v_ref[rows, :]
        dk = jnp.zeros((m, k.shape[-1]), f32)
        dv = jnp.zeros((m, v.shape[-1]), f32)
        for off in offs:
            q, do, lse, delta, *qdoc = (_tile(c, b_, a, g, G, m, off) for c, b_, a in zip(own, before, after))
            i = j + off
            same = (qdoc[0] == kdoc_ref[g]) if has_docs else None  # [m, 1] == [1, m]
            s, valid = _fine_scores(q, k, i, j, (i >= 0) & (i < nb), m=m, causal=causal, n_valid=n_valid,
                                    same=same)
            p = jnp.where(valid, jnp.exp(s - lse), 0.0)
            dv = dv + _tn(p.astype(do.dtype), do)
            ds = p * (_nt(do, v) - delta)
            dk = dk + _tn(ds.astype(q.dtype), q)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)
        dv_ref[rows, :] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_call wrappers
def gpu_tiles(m: int, num_warps: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the GPU lowering: as given, else the rule (4 warps up to ``m = 64`` rows, 8
    at 128; 2 stages)."""
    return (num_warps or (4 if m <= 64 else 8), num_stages or 2)


def program_blocks(requested: int | None, nb: int) -> int:
    """The fine blocks one program loops over: the largest divisor of ``nb`` not above ``requested`` among the
    powers of two (None or 0: 1)."""
    want = max(1, requested or 1)
    G = 1
    while G * 2 <= want and nb % (G * 2) == 0:
        G *= 2
    return G


def _compiler_params(platform, m: int, tiles=(None, None), sequential_blocks: bool = False):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary" if sequential_blocks else "parallel"))
    if platform in ("gpu", "cuda"):
        warps, stages = gpu_tiles(m, *tiles)
        return pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    return None


def _call(kernel, grid, specs, out_specs, outs, interpret, platform, m, tiles=(None, None), *, scratch=(),
          aliases=None, sequential_blocks=False):
    params = None if interpret else _compiler_params(platform, m, tiles, sequential_blocks)
    return pl.pallas_call(kernel, grid=grid, in_specs=specs, out_specs=out_specs, out_shape=outs,
                          interpret=interpret, compiler_params=params, scratch_shapes=tuple(scratch),
                          input_output_aliases=aliases or {})


def _rows_specs(m: int, G: int, nb: int, width: int, offs=(0,)):
    """BlockSpecs of an ``[BH, n_pad, width]`` operand for programs of G blocks: ``0`` the program's own G blocks,
    ``-1`` the block before them, ``1`` the block after them (clamped; an out-of-range block is masked)."""
    out = []
    for off in offs:
        if off == 0:
            out.append(pl.BlockSpec((None, G * m, width), lambda bh, i: (bh, i, 0)))
        elif off < 0:
            out.append(pl.BlockSpec((None, m, width), lambda bh, i: (bh, jnp.maximum(i * G - 1, 0), 0)))
        else:
            out.append(pl.BlockSpec((None, m, width), lambda bh, i: (bh, jnp.minimum((i + 1) * G, nb - 1), 0)))
    return out


def _block_row_specs(m: int, G: int, nb: int, offs=(0,)):
    """BlockSpecs of a ``[BH, nb, 1, m]`` operand (one row of m per fine block) for programs of G blocks, as
    :func:`_rows_specs`: ``0`` the program's own G blocks, ``-1`` / ``1`` the blocks just before / after them."""
    out = []
    for off in offs:
        if off == 0:
            out.append(pl.BlockSpec((None, G, 1, m), lambda bh, i: (bh, i, 0, 0)))
        elif off < 0:
            out.append(pl.BlockSpec((None, 1, 1, m), lambda bh, i: (bh, jnp.maximum(i * G - 1, 0), 0, 0)))
        else:
            out.append(pl.BlockSpec((None, 1, 1, m), lambda bh, i: (bh, jnp.minimum((i + 1) * G, nb - 1), 0, 0)))
    return out


def _doc_operands(docs, m: int, nb: int):
    """The kernels' layouts of ``docs = (qdoc [BH, n_pad], kdoc [BH, n_pad], sdoc [BH, nb, C_pad] or None)``: the
    queries' as a column per row ``[BH, n_pad, 1]``, the keys' as one row per fine block ``[BH, nb, 1, m]``."""
    qdoc, kdoc, sdoc = docs
    BH = qdoc.shape[0]
    return qdoc.reshape(BH, nb * m, 1), kdoc.reshape(BH, nb, 1, m), sdoc


def _qside(kernel, q, k, v, coarse, extra, outs, out_specs, *, m, G, causal, n_valid, interpret, platform,
           tiles=(None, None), grads=False, docs=None):
    """Run a kernel on the query side's grid ``(BH, nb / G)``: G query blocks per program, their fine key blocks,
    the coarse operands ``(kall, vall, idx, cbias)`` (or None), the documents ``docs`` of a packed row
    (:func:`_doc_operands`; or None) and ``extra`` per-query-row inputs ``[BH, n_pad, *]``. ``grads``: the kernel
    also writes the summaries' fp32 gradients (the dq kernel)."""
    BH, n_pad, d = q.shape
    dv = v.shape[-1]
    nb = n_pad // m
    offs = (0, -1) if causal else (0, -1, 1)
    specs = _rows_specs(m, G, nb, d)
    args = [q]
    for kspec, vspec in zip(_rows_specs(m, G, nb, d, offs), _rows_specs(m, G, nb, dv, offs)):
        specs += [kspec, vspec]
        args += [k, v]
    has_coarse = coarse is not None
    gather = platform != "tpu"
    scratch, aliases, outs, out_specs = [], {}, list(outs), list(out_specs)
    if has_coarse:
        kall, vall, idx, cbias = coarse
        R, C = kall.shape[1], idx.shape[-1]
        whole = lambda w: pl.BlockSpec((None, R, w), lambda bh, i: (bh, 0, 0))  # noqa: E731
        table = pl.BlockSpec((None, G, C), lambda bh, i: (i, 0, 0))
        idx_spec = table
        if not gather:
            from jax.experimental.pallas import tpu as pltpu

            idx_spec = pl.BlockSpec((None, G, C), lambda bh, i: (i, 0, 0), memory_space=pltpu.SMEM)
            scratch = [pltpu.VMEM((C, d), kall.dtype), pltpu.VMEM((C, dv), vall.dtype)]
        specs += [whole(d), whole(dv), idx_spec, table]
        args += [kall, vall, idx.reshape(nb // G, G, C), cbias.reshape(nb // G, G, C)]
    if docs is not None:
        qdoc, kdoc, sdoc = _doc_operands(docs, m, nb)
        specs += _rows_specs(m, G, nb, 1) + _block_row_specs(m, G, nb, offs)
        args += [qdoc] + [kdoc] * len(offs)
        if has_coarse:
            specs.append(pl.BlockSpec((None, None, G, C), lambda bh, i: (bh, i, 0, 0)))
            args.append(sdoc.reshape(BH, nb // G, G, C))
    for arr in extra:
        specs += _rows_specs(m, G, nb, arr.shape[-1])
        args.append(arr)
    if has_coarse and grads:
        if gather:  # concurrent programs add atomically into zero-filled buffers, one flat [(R + 1) w] per row
            gshape = [jax.ShapeDtypeStruct((BH, (R + 1) * w), f32) for w in (d, dv)]
            gspecs = [pl.BlockSpec((None, (R + 1) * w), lambda bh, i: (bh, 0)) for w in (d, dv)]
            aliases = {len(args): len(outs), len(args) + 1: len(outs) + 1}
            specs += gspecs
            args += [jnp.zeros(s.shape, f32) for s in gshape]
        else:
            gshape = [jax.ShapeDtypeStruct((BH, R + 1, w), f32) for w in (d, dv)]
            gspecs = [pl.BlockSpec((None, R + 1, w), lambda bh, i: (bh, 0, 0)) for w in (d, dv)]
        outs += gshape
        out_specs += gspecs
    body = functools.partial(kernel, m=m, G=G, nb=nb, causal=causal, n_valid=n_valid, has_coarse=has_coarse,
                             gather=gather, has_docs=docs is not None)
    call = _call(body, (BH, nb // G), specs, out_specs, outs, interpret, platform, m, tiles, scratch=scratch,
                 aliases=aliases, sequential_blocks=has_coarse and grads and not gather)
    return call(*args)


def _check(q, v, m, interpret, platform, kall=None):
    """The platform the lowering targets (interpret mode: as given, which picks the form of the coarse access:
    'tpu' the TPU's, else the GPU's); raises ValueError on refused shapes."""
    if interpret:
        return platform
    platform = platform or {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    rows = 0 if kall is None else kall.shape[1]
    reasons = unsupported_reasons(platform, m=m, d=q.shape[-1], dv=v.shape[-1], summary_rows=rows,
                                  itemsize=q.dtype.itemsize)
    if reasons:
        raise ValueError(f"fma_blocks: unsupported on {platform}: " + "; ".join(reasons))
    return platform


def fma_blocks_forward(q, k, v, kall, vall, idx, cbias, *, m: int, causal: bool, n_valid: int,
                       interpret: bool = False, platform: str | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, blocks_per_program: int | None = None, docs=None):
    """q, k [BH, n_pad, d] (q pre-scaled), v [BH, n_pad, dv]; the level summaries kall [BH, R, d], vall [BH, R, dv],
    the summary row of every coarse slot ``idx [nb, C_pad]`` (int32, in [0, R)) and its bias ``cbias [nb, C_pad]``
    (or kall = None: fine level only). Returns ``(o [BH, n_pad, dv], lse [BH, n_pad, 1])``: ``o`` in the operands'
    (compute) dtype, ``lse`` f32.
    ``docs`` (a packed row laid out again, docs/methods/fma.md §2.7; None: one sequence): ``(qdoc [BH, n_pad],
    kdoc [BH, n_pad], sdoc [BH, nb, C_pad] or None)`` int32, the document of every query, key and coarse slot's
    group; a key or slot counts for a query only where its document is the query's (the padding's never are).
    ``platform`` ('tpu' | 'cuda'; None: the default backend) picks the lowering (and its compiler parameters:
    ``num_warps``, ``num_stages``, None: :func:`gpu_tiles`' rule); interpret mode runs the GPU form's coarse
    access; ``blocks_per_program``: fine blocks per program (:func:`blocks_per_program`); shapes the kernel does
    not support there raise ValueError naming the reasons."""
    platform = _check(q, v, m, interpret, platform, kall)
    BH, n_pad, _ = q.shape
    dv = v.shape[-1]
    G = program_blocks(blocks_per_program, n_pad // m)
    outs = [jax.ShapeDtypeStruct((BH, n_pad, dv), v.dtype), jax.ShapeDtypeStruct((BH, n_pad, 1), f32)]
    nb = n_pad // m
    out_specs = _rows_specs(m, G, nb, dv) + _rows_specs(m, G, nb, 1)
    coarse = None if kall is None else (kall, vall, idx, cbias)
    o, lse = _qside(_fwd_kernel, q, k, v, coarse, [], outs, out_specs, m=m, G=G, causal=causal, n_valid=n_valid,
                    interpret=interpret, platform=platform, tiles=(num_warps, num_stages), docs=docs)
    return o, lse


def fma_blocks_backward(q, k, v, kall, vall, idx, cbias, o, lse, do, *, m: int, causal: bool, n_valid: int,
                        interpret: bool = False, platform: str | None = None, num_warps: int | None = None,
                        num_stages: int | None = None, blocks_per_program: int | None = None, docs=None):
    """Gradients ``(dq, dk, dv, dkall, dvall)`` (the operands' dtype; ``dkall = dvall = None`` without coarse
    slots) of the forward's ``o`` for the cotangent ``do [BH, n_pad, dv]``, from its residuals ``o, lse``. The
    summaries' gradients are accumulated in fp32 inside the dq kernel and rounded once. ``docs``: the forward's."""
    platform = _check(q, v, m, interpret, platform, kall)
    BH, n_pad, d = q.shape
    dvd = v.shape[-1]
    nb = n_pad // m
    G = program_blocks(blocks_per_program, nb)
    do = do.astype(f32)
    delta = jnp.sum(do * o.astype(f32), axis=-1, keepdims=True)  # a statistic: fp32
    do = do.astype(v.dtype)
    tiles = (num_warps, num_stages)
    kw = dict(m=m, G=G, causal=causal, n_valid=n_valid, interpret=interpret, platform=platform, tiles=tiles)
    outs = [jax.ShapeDtypeStruct((BH, n_pad, d), q.dtype)]
    coarse = None if kall is None else (kall, vall, idx, cbias)
    res = _qside(_dq_kernel, q, k, v, coarse, [do, lse, delta], outs, _rows_specs(m, G, nb, d), grads=True,
                 docs=docs, **kw)
    dq, dkall, dvall = res[0], None, None
    if kall is not None:
        R = kall.shape[1]
        dkall, dvall = (g.reshape(BH, R + 1, -1)[:, :R].astype(a.dtype) for g, a in ((res[1], kall), (res[2], vall)))

    offs = (0, 1) if causal else (0, 1, -1)
    specs = _rows_specs(m, G, nb, d) + _rows_specs(m, G, nb, dvd)
    args = [k, v]
    qside = (q, do, lse, delta)
    if docs is not None:  # the keys' documents, and each query-side source's rows'
        qdoc, kdoc, _ = _doc_operands(docs, m, nb)
        specs += _block_row_specs(m, G, nb)
        args.append(kdoc)
        qside += (qdoc,)
    for off in offs:  # the query blocks j + off read key block j
        for arr in qside:
            specs += _rows_specs(m, G, nb, arr.shape[-1], (off,))
            args.append(arr)
    outs = [jax.ShapeDtypeStruct((BH, n_pad, d), k.dtype), jax.ShapeDtypeStruct((BH, n_pad, dvd), v.dtype)]
    out_specs = _rows_specs(m, G, nb, d) + _rows_specs(m, G, nb, dvd)
    body = functools.partial(_dkv_kernel, m=m, G=G, nb=nb, causal=causal, n_valid=n_valid, has_docs=docs is not None)
    dk, dv = _call(body, (BH, nb // G), specs, out_specs, outs, interpret, platform, m, tiles)(*args)
    return dq, dk, dv, dkall, dvall


# ----------------------------------------------------------------------------- differentiable entry
def _ref_blocks(q, k, v, kall, vall, idx, cbias, m, causal, n_valid, logit_budget, docs=None):
    """The reference on the kernel's operands ([BH, ...] layout; ``docs`` as :func:`fma_blocks_forward`'s) ->
    [BH, n_pad, dv]."""
    BH, n_pad, d = q.shape
    nb = n_pad // m
    back = 0 if causal else m
    kp = jnp.pad(k, ((0, 0), (m, back), (0, 0)))[None]
    vp = jnp.pad(v, ((0, 0), (m, back), (0, 0)))[None]
    coarse = None if kall is None else ("packed", kall[None], vall[None], idx, cbias)
    if docs is not None:  # each of the BH rows its own batch row (the documents differ per row)
        qdoc, kdoc, sdoc = docs
        kd = jnp.pad(kdoc, ((0, 0), (m, back)), constant_values=-2)
        coarse = None if kall is None else ("packed", kall[:, None], vall[:, None], idx, cbias)
        out = attend_blocks(q.reshape(BH, 1, nb, m, d), kp[0][:, None], vp[0][:, None], coarse, q_block0=0,
                            n_valid=n_valid, causal=causal, logit_budget=logit_budget, docs=(qdoc, kd, sdoc))
        return out.reshape(BH, n_pad, -1)
    out = attend_blocks(q.reshape(1, BH, nb, m, d), kp, vp, coarse, q_block0=0, n_valid=n_valid, causal=causal,
                        logit_budget=logit_budget)
    return out.reshape(BH, n_pad, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _blocks(q, k, v, kall, vall, idx, cbias, docs, m, causal, n_valid, interpret, platform, knobs):
    return _blocks_fwd(q, k, v, kall, vall, idx, cbias, docs, m, causal, n_valid, interpret, platform, knobs)[0]


def _knob_kw(knobs):
    return dict(num_warps=knobs[0], num_stages=knobs[1], blocks_per_program=knobs[2])


def _blocks_fwd(q, k, v, kall, vall, idx, cbias, docs, m, causal, n_valid, interpret, platform, knobs):
    o, lse = fma_blocks_forward(q, k, v, kall, vall, idx, cbias, m=m, causal=causal, n_valid=n_valid,
                                interpret=interpret, platform=platform, docs=docs, **_knob_kw(knobs))
    return o, (q, k, v, kall, vall, idx, cbias, docs, o, lse)


def _blocks_bwd(m, causal, n_valid, interpret, platform, knobs, res, g):
    q, k, v, kall, vall, idx, cbias, docs, o, lse = res
    dq, dk, dv, dkall, dvall = fma_blocks_backward(q, k, v, kall, vall, idx, cbias, o, lse, g, m=m, causal=causal,
                                                   n_valid=n_valid, interpret=interpret, platform=platform,
                                                   docs=docs, **_knob_kw(knobs))
    cast = lambda x, ref: None if ref is None else x.astype(ref.dtype)  # noqa: E731
    return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dkall, kall), cast(dvall, vall), None,
            None if cbias is None else jnp.zeros_like(cbias), None)


_blocks.defvjp(_blocks_fwd, _blocks_bwd)


def fma_blocks(q, k, v, kall, vall, idx, cbias, m, causal, n_valid, interpret, logit_budget=None, platform=None,
               num_warps=None, num_stages=None, blocks_per_program=None, docs=None):
    """The kernel's output ``o [BH, n_pad, dv]`` (the operands' common dtype), differentiable in q, k, v and the
    level summaries kall, vall by the backward kernels (operands as :func:`fma_blocks_forward`, ``docs`` the
    documents of a packed row included; mixed dtypes are cast to their common type). ``logit_budget`` is the
    reference's and unused here (the kernels hold one block's scores at a time); ``num_warps``, ``num_stages``:
    the GPU lowering's (None: :func:`gpu_tiles`' rule); ``blocks_per_program``: fine blocks per program
    (:func:`program_blocks`)."""
    del logit_budget
    ops = [x for x in (q, k, v, kall, vall) if x is not None]
    dt = jnp.result_type(*ops)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    if kall is not None:
        kall, vall = kall.astype(dt), vall.astype(dt)
        idx, cbias = jnp.asarray(idx, jnp.int32), jnp.asarray(cbias, f32)
    if docs is not None:
        docs = tuple(None if x is None else jnp.asarray(x, jnp.int32) for x in docs)
        if kall is None:
            docs = docs[:2] + (None,)
    return _blocks(q, k, v, kall, vall, idx, cbias, docs, m, causal, n_valid, interpret, platform,
                   (num_warps, num_stages, blocks_per_program))


def make_attend(*, interpret: bool, platform: str = "interpret", num_warps: int | None = None,
                num_stages: int | None = None, blocks_per_program: int | None = None):
    """An ``attend_blocks``-compatible function that runs the kernel on full-pass FMA operands
    (static block offset 0, packed or no coarse slots, no dropout) and the reference otherwise
    (streaming steps, FMA-linear statistics) -- the caller resolved that the kernel applies. The packed slots'
    summaries ``kall, vall`` reach the kernel whole, with the slot table ``idx`` (padded for the platform: pad
    slots read row 0 and are masked by their bias); no per-block copy of the slots is made. ``num_warps``,
    ``num_stages``: the GPU lowering's (None: :func:`gpu_tiles`' rule); ``blocks_per_program``: fine blocks per
    program (:func:`program_blocks`). ``docs`` (a packed row laid out again, :func:`attend_blocks`' ``(qdoc [B,
    nb m], kdoc like kp's positions, sdoc [B, nb, C])``) reach the kernel per (row, head) on its layout."""
    platform_ = None if platform == "interpret" else platform

    def attend(qb, kp, vp, coarse, *, q_block0, n_valid, causal, drop_key=None, attn_dropout=0.0,
               logit_budget=1 << 24, docs=None):
        kind = None if coarse is None else coarse[0]
        if (kind not in (None, "packed") or not isinstance(q_block0, int) or q_block0 != 0
                or not isinstance(n_valid, int) or (drop_key is not None and attn_dropout > 0)):
            return attend_blocks(qb, kp, vp, coarse, q_block0=q_block0, n_valid=n_valid, causal=causal,
                                 drop_key=drop_key, attn_dropout=attn_dropout, logit_budget=logit_budget, docs=docs)
        B, H, nb, m, d = qb.shape
        dv = vp.shape[-1]
        BH = B * H
        q = qb.reshape(BH, nb * m, d)
        k = kp[:, :, m:m + nb * m].reshape(BH, nb * m, d)
        v = vp[:, :, m:m + nb * m].reshape(BH, nb * m, dv)
        kall = vall = idx = cb = None
        if kind == "packed":
            _, kall, vall, idx, bias = coarse
            R, C = kall.shape[2], idx.shape[1]
            Cp = _c_pad(C, platform)
            idx = jnp.pad(jnp.clip(idx, 0, R - 1), ((0, 0), (0, Cp - C)))
            cb = jnp.pad(bias, ((0, 0), (0, Cp - C)), constant_values=NEG)
            kall, vall = kall.reshape(BH, R, d), vall.reshape(BH, R, dv)
        if docs is not None:
            docs = kernel_docs(docs, H, m, nb, None if kind != "packed" else idx.shape[1])
        out = fma_blocks(q, k, v, kall, vall, idx, cb, m, causal, n_valid, interpret, logit_budget, platform_,
                         num_warps, num_stages, blocks_per_program, docs=docs)
        return out.reshape(B, H, nb, m, dv)

    return attend


def kernel_docs(docs, H: int, m: int, nb: int, c_pad=None):
    """:func:`attend_blocks`' ``docs`` (``qdoc [B, nb m]``, ``kdoc`` laid out as ``kp`` with one block in front,
    ``sdoc [B, nb, C]`` or None) on the kernels' ``[BH, ...]`` layout: ``(qdoc [BH, nb m], kdoc [BH, nb m], sdoc
    [BH, nb, c_pad])`` (each row's documents repeated over its H heads; the pad slots of document -2)."""
    qd, kd, sd = docs
    rep = lambda x: jnp.repeat(x.astype(jnp.int32), H, axis=0)  # noqa: E731
    kd = kd[:, m:m + nb * m]
    if sd is None or c_pad is None:
        return rep(qd), rep(kd), None
    sd = jnp.pad(sd, ((0, 0), (0, 0), (0, c_pad - sd.shape[-1])), constant_values=-2)
    return rep(qd), rep(kd), rep(sd)


__all__ = ["GPU_M", "SUPPORTED_M", "fma_blocks", "fma_blocks_backward", "fma_blocks_forward", "gpu_tiles",
           "kernel_docs", "make_attend", "program_blocks", "unsupported_reasons"]

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
* **Phase 2 forward kernel** ``vq_cache_gpu_fwd``: grid ``(BH, R·L/tq)``, all parallel; the value width ``Dv``
  is not a grid axis, so each query tile computes its scores and probabilities once. One online softmax (running
  max ``m`` and sum ``l``, f32) over the codes in chunks of ``ts`` (scores ``q_u·Cᵀ + ℓ``, values ``μ̄``), then
  the previous block in key tiles of ``tq``, then the present block up to the diagonal tile (each with its gathered
  band bias); each such key step rescales the accumulator by ``exp(m_old − m_new)`` and adds ``P·V``. Two paths,
  chosen statically by the number of value-width slices ``n_tv = Dv/tv``, sharing that step:

  - ``n_tv = 1`` (one slice, e.g. Dv = 64, or 128 in bf16): the accumulator ``[tq, Dv]`` f32 is in the loop carry
    (registers) with ``m`` and ``l``; ``o`` is written once at the end and never read back;
  - ``n_tv > 1`` (the configs' Dv = 1536 / 4096, whose ``[tq, Dv]`` f32 accumulator does not fit in registers):
    the program's own f32 output block ``[tq, Dv]`` is the accumulator; after each key step's probabilities a loop
    over the slices re-reads, rescales and re-writes one ``[tq, tv]`` slice (zeroed first, normalised last).

  Writes ``o`` (f32) and the row log-sum-exp.

**Cost of the several-slice path** (arithmetic, not a measurement). The output block is read and written once
per key step: ``2·tq·Dv·4`` bytes, 768 KiB at tq = 64, Dv = 1536. At L = S = 512, tq = ts = 64 a query tile takes
S_p/ts + L/tq + (it + 1) = 8 + 8 + 1..8 key steps (20.5 on average, 24 at most); at T = 32k, B = H = 8 there are
B·H·T/tq = 32768 query tiles, so one forward moves 32768 × 20.5 × 786432 B ≈ 528 GB (≈ 618 GB at 24 steps per
tile) through L2 / HBM where the block is not held in L2, plus ≈ 39 GB for zeroing and normalising
(3·tq·Dv·4 B per tile). ``bwd_kv``'s dv block costs the same per (key tile, query tile) pair, 12.5 pairs per
query tile on average: ≈ 322 GB. That is the price of computing the scores once instead of once per Dv tile (a
Dv grid axis recomputes ``q·k̂ᵀ``, the band gather and the softmax ``n_tv`` times); which is faster has not been
measured. This path also relies on each Triton thread re-reading exactly the output elements it wrote itself (the
load and the store of a slice use the same pointer tensor, hence, presumably, the same layout): a read-after-write
on global memory inside one program with no barrier, which interpret mode cannot check.

**Backward** (``jax.custom_vjp``; flash-style recompute of the probabilities from the saved ``lse``,
``Δ = rowsum(dO ⊙ O)`` in XLA, ``dS = P ⊙ (dP − Δ)``), two passes, neither with a value-width grid axis:

* ``vq_cache_gpu_bwd_q`` -- the query-side pass, grid ``(BH, R·L/tq)``: for each code chunk / key tile, ``P``
  once, then a loop over the value-width slices for ``dP = dO·Wᵀ`` and, for a code chunk, ``dμ̄_n += P^cᵀ·dO``;
  ``dq = dS^c·C + dS^p·k̂_{n-1} + dS^r·k̂_n`` and the band scores' gradient ``dbd [BH, R·L, M+1]``: ``dbd[i, d]``
  is dS at the one key at distance ``d`` from query ``i``, scattered by index arithmetic (every entry written once:
  a query row's distances ``0..M`` are its present keys up to the diagonal and its previous block); it reaches
  ``q + v'`` and ``r'`` through ``band_scores``' autodiff, in XLA. ``dμ̄ [BH, R, S_p, Dv]`` (f32) gets one
  contribution per query tile of block ``n`` (``L/tq`` of them): atomic adds into a zeros array that the output
  aliases, so on a GPU the order of those few float32 additions, and their rounding, may differ from run to run
  (interpret mode adds them in grid order). It flows back to ``v`` and the carried ``agg_mu`` through Phase 1 by
  JAX autodiff;
* ``vq_cache_gpu_bwd_kv`` -- the key-side pass, grid ``(BH, (R+1)·L/tq)``, key-tile-major over the extended key
  array (band prepended): a key tile of extended block ``e`` is seen by query block ``e`` (as previous block) and
  by query block ``e-1`` (as present block, the query tiles at or below the diagonal); for each of exactly those
  query tiles it computes ``P`` once, then ``dv += Pᵀ·dO`` and ``dO·vᵀ`` per value-width slice, and adds
  ``dk̂ += dSᵀ·q_u``. As in the forward, ``dv [tq, Dv]`` f32 is in the loop carry and written once where
  ``n_tv = 1``, and is the program's own f32 output block, updated one slice at a time, where ``n_tv > 1``.

So ``P`` is computed once per (query tile, key step) in the forward, and twice in the backward for the local keys
(once per pass) and once for the codes; the value width costs its ``P·V``-shaped products and, where ``n_tv > 1``,
the accumulator traffic above.

No gradient reaches the codebook, the codes or the counts (as in the TPU kernel and §9). The new carried
state is computed in XLA by the reference's ``final_state``.

**Packed rows** (``packed``, docs/methods/transformer_vq.md §2.8 and §9): a static switch (an unpacked row's kernels
are the ones above, unchanged). The caller gives Phase 1's per-block caches itself (each row block's document's own,
restarting at documents) and per-query / per-key document arrays: every score is masked to the query's document,
a query reads its block's cache only where that cache is its document's, ``dk̂`` takes ``dS`` only where the key
lies in the query's own window (``qwin``), and the key-side pass also visits the row block after the next (those
queries' windows reach two blocks back: ``dk̂`` only, no band bias at that distance). Those visits load the same
tiles per step as the other two, so :func:`tile_budget` counts them already; the document arrays are int32 vectors.

Dtypes: q_u, k̂, v (and the band) are stored in bf16 when all of them are bf16, otherwise f32 (never round a
wider input); the custom_vjp takes them in f32 so every cotangent is f32 and rounded once at the input.
``q·k̂ᵀ``, ``P·V``, ``P·μ̄``, ``dO·Vᵀ``, ``Pᵀ·dO`` and ``dSᵀ·q`` use storage-dtype operands with f32 accumulation
(bf16 tensor cores); the cache scores ``q_u·Cᵀ`` and ``dS^c·C`` take the codebook as given: bf16 operands when the
caller passes a bf16 codebook with bf16 storage (the layer does: its compute dtype), else f32 (a f32 codebook is
never rounded, as the reference); softmax statistics, the band scores, ``dS``, ``dq``, ``dk̂``, ``dv``, ``dμ̄`` and
``o`` are f32. With bf16 storage and a f32 codebook the kernel therefore differs from the f32 reference by bf16
rounding of ``μ̄``, ``P`` and ``dO`` (about 2⁻⁹ relative), not more.

**Tiles and budget** (:func:`choose_tiles`, :func:`tile_budget`). ``tq`` (query rows = key-tile width) is the
largest of 64/32/16 dividing L, ``ts = min(64, next_pow2(S))`` codes per chunk, ``tv`` (the value-width slice of
the loops inside the programs) the largest of 128/64/32/16 dividing Dv whose three kernels fit the budget;
``num_warps`` 4, or 8 where the register estimate needs it; ``num_stages = 2``. Per program the estimate counts
(a) shared memory: the resident operands (q tile and its f32 copy, or the key tile) plus ``num_stages`` × (the
operands one key step loads: key / query or code tile, bias tile; plus those one value-width slice of that step
loads: value / μ̄ / dO slices and, where ``n_tv > 1``, the f32 output / dv slice updated in place; where
``n_tv = 1`` the accumulator is not staged), against ``SMEM_LIMIT_BYTES`` = 227 KiB (H100's per-block maximum),
and (b) registers: the live f32 tiles (the ``[tq, Dv]`` accumulator of o / dv where ``n_tv = 1``, else the slice
being updated; dq / dk, scores, probabilities, dP, dS, the ``P^cᵀ·dO`` slice) divided over ``32·num_warps``
threads, against ``REG_WORDS_LIMIT`` = 128 words per thread (half of the 255 hardware registers, the rest left to
addresses, MMA fragments and temporaries). The gathered bias tile is counted as a [tq, tq] f32 load per key tile.
At the paper's shapes (L = S = 512, Dk = 128, Dv = 1536 or 4096; ``tq = ts = 64``) bf16 takes ``tv = 128``
(8 warps each; at most 208.5 KiB, 128 words per thread); fp32 takes ``tv = 64`` (``bwd_kv`` at 224 KiB, 8 warps).
At one slice (L = S = 512, ``tq = ts = 64``): Dk = Dv = 64 at most 144 KiB (fp32, the backward; 4 warps forward,
8 backward); Dk = Dv = 128 in bf16 at most 176.5 KiB (8 warps, the forward at 65 words per thread, the backward
at 128); Dk = Dv = 128 in fp32 does not fit one slice (both backward kernels at 256 KiB) and takes two of 64. It is an
estimate for refusing clearly too large tiles, not a measurement. The earlier form of these kernels (bias arrays
``BP, BR [BH, R, L, L]`` built in XLA, a Dv grid axis, three backward kernels) was compiled and tested on an H200
(jax 0.11.2); the form here (gathered bias, value width looped inside the programs, two backward passes, the
accumulator in registers at one slice) is tested in interpret mode and lowered for 'cuda' (with the MLIR verifier)
but not yet compiled or timed on a GPU.

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

from pallas_kernels import lazy_triton as pltriton
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
KINDS = ("fwd", "bwd_q", "bwd_kv")


# ----------------------------------------------------------------------------- tiles and budget
def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def tile_budget(kind: str, *, tq: int, ts: int, tv: int, Dk: int, Dv: int, in_dtype=f32, num_warps: int = 4,
                num_stages: int = NUM_STAGES) -> tuple[int, float]:
    """(shared-memory bytes, live f32 tile words per thread) of one program of kernel ``kind`` (see the module
    docstring for what is counted): the resident tiles plus ``num_stages`` × (the tiles one key / query step
    loads + the tiles one value-width slice of that step loads). Where ``tv == Dv`` (one slice) the forward's
    accumulator and the key-side pass's dv are in the loop carry: counted as live words, no f32 output slice in
    shared memory; with several slices the f32 output / dv slice, re-read and re-written per step, is staged too."""
    isz = jnp.dtype(in_dtype).itemsize
    q_res = tq * Dk * isz + (tq * Dk * 4 if isz != 4 else 0)  # q tile and its f32 copy (cache scores)
    code_step = ts * Dk * 4 + ts * 4  # code chunk (f32 at most), ℓ
    key_step = tq * Dk * isz + tq * tq * 4  # key (or query) tile, gathered bias tile
    w = max(ts, tq)  # key-step width (a code chunk or a key tile)
    acc_slice = 0 if tv == Dv else tq * tv * 4  # the f32 output / dv slice updated in place (several slices)
    if kind == "fwd":
        resident, step = q_res, max(code_step, key_step)
        slice_ = w * tv * isz + acc_slice  # μ̄ / value slice (+ the output slice)
        # the accumulator [tq, Dv] (one slice) or the output slice being rescaled; scores + probabilities; m, l, α
        words = tq * tv + 2 * w * tq + 3 * tq
    elif kind == "bwd_q":
        resident, step = q_res, max(code_step, key_step)
        slice_ = tq * tv * isz + w * tv * isz  # dO slice, μ̄ / value slice
        words = tq * Dk + 4 * tq * w + ts * tv  # dq; scores/probabilities, dP, dS; the Pᵀ·dO slice (dμ̄)
    elif kind == "bwd_kv":
        resident, step = tq * Dk * isz, key_step  # the key tile; a query tile and its bias tile per step
        slice_ = 2 * tq * tv * isz + acc_slice  # dO and value slices (+ the dv slice)
        words = tq * Dk + 4 * tq * tq + tq * tv  # dk; scores/probabilities, dP, dS; dv [tq, Dv] or its slice
    else:
        raise ValueError(f"unknown kernel {kind!r}; allowed: {', '.join(KINDS)}")
    return int(resident + num_stages * (step + slice_)), words / (32 * num_warps)


def _warps_for(kind, **kw) -> tuple[int, int, float]:
    """(num_warps, smem bytes, words per thread): 4 warps, or 8 where 4 exceed the register estimate."""
    for w in (4, 8):
        smem, words = tile_budget(kind, num_warps=w, **kw)
        if words <= REG_WORDS_LIMIT:
            return w, smem, words
    return 8, smem, words


def _fits(*, tq, ts, tv, Dk, Dv, in_dtype, kinds) -> tuple[bool, dict]:
    plan = {}
    ok = True
    for kind in kinds:
        w, smem, words = _warps_for(kind, tq=tq, ts=ts, tv=tv, Dk=Dk, Dv=Dv, in_dtype=in_dtype)
        plan[kind] = {"num_warps": w, "smem_bytes": smem, "words_per_thread": words}
        ok &= smem <= SMEM_LIMIT_BYTES and words <= REG_WORDS_LIMIT
    return ok, plan


def choose_tiles(*, L: int, S: int, Dk: int, Dv: int, in_dtype=f32, with_grad: bool = True,
                 block_q: int | None = None, block_s: int | None = None, block_v: int | None = None) -> dict:
    """The tile plan: ``tq`` (query rows and key-tile width), ``ts`` (codes per chunk), ``tv`` (value-width slice of
    the loops inside the programs; ``tv == Dv`` keeps the accumulators in registers), the padded code count ``Sp``,
    per-kernel ``num_warps`` / budget (``plan``) and ``fits`` (every kernel within the budget). Explicit
    ``block_*`` arguments override the choice (tests use small tiles in interpret mode)."""
    tq = block_q or next((t for t in TQ_CANDIDATES if L % t == 0), L)
    ts = block_s or min(TS_MAX, max(16, _next_pow2(S)))  # at least 16 (a Triton dot); padded codes are masked
    kinds = KINDS if with_grad else ("fwd",)
    if block_v is not None:
        tvs = [block_v]
    else:
        tvs = [t for t in TV_CANDIDATES if Dv % t == 0] or [Dv]
    for tv in tvs:
        ok, plan = _fits(tq=tq, ts=ts, tv=tv, Dk=Dk, Dv=Dv, in_dtype=in_dtype, kinds=kinds)
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
    reasons += pltriton.missing()
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
            reasons.append(f"GPU tile budget exceeded at the smallest value-width slice tv={t['tv']} (tq={t['tq']}, "
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


def _slices(n_tv: int, body, init):
    """``body(j, carry)`` over the value-width slices ``j = 0 .. n_tv-1`` (a loop inside the program: the scores
    and probabilities it uses are computed once, outside)."""
    return jax.lax.fori_loop(0, n_tv, body, init)


def _accumulator(out_ref, n_tv: int, tv: int):
    """The start of the f32 accumulator of the output block ``out_ref [tq, Dv]``: zeros for the loop carry where
    the value width is one slice (``n_tv == 1``); else None, the block itself zeroed one slice at a time (it
    accumulates in place)."""
    if n_tv == 1:
        return jnp.zeros(out_ref.shape, f32)

    def zero(j, c):
        out_ref[:, _ds(j, tv)] = jnp.zeros((out_ref.shape[0], tv), f32)
        return c

    _slices(n_tv, zero, 0)
    return None


def _documents(packed: bool, rest):
    """A kernel's trailing refs: (the packed row's per-query and per-key document refs, or Nones, and the
    outputs). Packed: the query's document (``qdoc``), whether it reads its block's cache (``qcache``) and the
    previous and present key blocks' documents."""
    if packed:
        return tuple(rest[:4]), rest[4:]
    return (None,) * 4, rest


def _same_document(valid, qd_ref, kd, rows=slice(None)):
    """``valid`` and, for a packed row (``qd_ref`` given), the key's document (``kd`` [tk]) the query's."""
    if qd_ref is None:
        return valid
    return valid & (kd[None, :] == qd_ref[rows][:, None])


def _fwd_kernel(q_ref, c_ref, mu_ref, ell_ref, kp_ref, vp_ref, okp_ref, kr_ref, vr_ref, okr_ref, bd_ref, *rest,
                tq: int, ts: int, tv: int, n_s: int, n_tv: int, nq: int, L: int, M: int, packed: bool = False):
    (qd_ref, qc_ref, kdp_ref, kdr_ref), (o_ref, lse_ref) = _documents(packed, rest)
    it = jax.lax.rem(pl.program_id(1), nq)  # query tile inside its block
    q = q_ref[...]
    row0 = it * tq
    # Where the value width is one slice (n_tv == 1) the accumulator [tq, Dv] f32 is in the loop carry and o is
    # written once at the end; otherwise (acc None) the f32 output block is the accumulator, rescaled and added to
    # one value-width slice at a time (re-read and re-written per key step: the module docstring gives the cost).

    def update(carry, s, valid, w_ref, rows):  # one code chunk / key tile: online softmax, then acc·α + P·W
        m, l, acc = carry
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)[:, None]
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        pw = p.astype(w_ref.dtype)

        def step(acc_cols, cols):  # one value-width slice: acc·α + P·W
            return alpha * acc_cols + _dot(pw, w_ref[rows, cols])

        if n_tv == 1:
            acc = step(acc, slice(None))
        else:
            def pv(j, c):
                cols = _ds(j, tv)
                o_ref[:, cols] = step(o_ref[:, cols], cols)
                return c

            _slices(n_tv, pv, 0)
        return m_new, alpha[:, 0] * l + jnp.sum(p, axis=1), acc

    def cache(c, carry):
        rows = _ds(c, ts)
        el = ell_ref[rows][None, :]
        s = _dot_nt(*_code_operands(q, c_ref[rows, :])) + el
        return update(carry, s, _reads_cache(el, qc_ref), mu_ref, rows)

    def local(k_ref, v_ref, ok_ref, kd_ref, off):
        def body(kt, carry):
            b, _, _, _ = _band(bd_ref, row0, kt * tq, off, shape=(tq, tq), M=M, ref_row0=row0)
            valid = ok_ref[_ds(kt, tq)][None, :] > 0.5
            if off == 0:
                valid = valid & _causal(row0, kt * tq, (tq, tq))
            valid = _same_document(valid, qd_ref, None if kd_ref is None else kd_ref[_ds(kt, tq)])
            s = _dot_nt(q, k_ref[_ds(kt, tq), :]) + b
            return update(carry, s, valid, v_ref, _ds(kt, tq))

        return body

    carry = (jnp.full((tq,), NEG, f32), jnp.zeros((tq,), f32), _accumulator(o_ref, n_tv, tv))
    carry = jax.lax.fori_loop(0, n_s, cache, carry)
    carry = jax.lax.fori_loop(0, nq, local(kp_ref, vp_ref, okp_ref, kdp_ref, L), carry)
    m, l, acc = jax.lax.fori_loop(0, it + 1, local(kr_ref, vr_ref, okr_ref, kdr_ref, 0), carry)  # to the diagonal
    if n_tv == 1:
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    else:
        def normalize(j, c):
            cols = _ds(j, tv)
            o_ref[:, cols] = o_ref[:, cols] / l[:, None]
            return c

        _slices(n_tv, normalize, 0)
    lse_ref[...] = m + jnp.log(l)


def _reads_cache(el, qc_ref):
    """The codes a query tile reads: those with a count (``el`` [1, ts], the log counts) and, for a packed row
    (``qc_ref`` given), only the queries of the document the block's cache is of."""
    valid = el > HALF_NEG
    return valid if qc_ref is None else valid & (qc_ref[...][:, None] > 0)


def _bwd_q_kernel(q_ref, c_ref, mu_ref, ell_ref, kp_ref, vp_ref, okp_ref, kr_ref, vr_ref, okr_ref, bd_ref,
                  lse_ref, dl_ref, do_ref, dmu_in_ref, *rest, tq: int, ts: int, tv: int,
                  n_s: int, nq: int, n_tv: int, L: int, M: int, packed: bool = False):
    del dmu_in_ref  # the zeros dmu_ref starts from (aliased)
    (qd_ref, qc_ref, kdp_ref, kdr_ref), (dq_ref, dbd_ref, dmu_ref) = _documents(packed, rest)
    it = jax.lax.rem(pl.program_id(1), nq)
    q = q_ref[...]
    lse = lse_ref[...][:, None]
    dl = dl_ref[...][:, None]
    row0 = it * tq

    def cache(c, dq):
        rows = _ds(c, ts)
        el = ell_ref[rows][None, :]
        qc, ck = _code_operands(q, c_ref[rows, :])
        p = jnp.where(_reads_cache(el, qc_ref), jnp.exp(_dot_nt(qc, ck) + el - lse), 0.0)
        pd = p.astype(do_ref.dtype)

        def body(j, acc):  # per value-width slice: dμ̄ += Pᵀ·dO (the block's query tiles add up) and dO·μ̄ᵀ
            cols = _ds(j, tv)
            do = do_ref[:, cols]
            pltriton.atomic_add(dmu_ref, (rows, cols), _dot_tn(pd, do))
            return acc + _dot_nt(do, mu_ref[rows, cols])

        ds = p * (_slices(n_tv, body, jnp.zeros((tq, ts), f32)) - dl)
        return dq + _dot(ds.astype(ck.dtype), ck)

    def local(k_ref, v_ref, ok_ref, kd_ref, off):
        def body(kt, dq):
            b, rows, d, in_band = _band(bd_ref, row0, kt * tq, off, shape=(tq, tq), M=M, ref_row0=row0)
            valid = ok_ref[_ds(kt, tq)][None, :] > 0.5
            if off == 0:
                valid = valid & _causal(row0, kt * tq, (tq, tq))
            valid = _same_document(valid, qd_ref, None if kd_ref is None else kd_ref[_ds(kt, tq)])
            keys = _ds(kt, tq)
            k = k_ref[keys, :]
            p = jnp.where(valid, jnp.exp(_dot_nt(q, k) + b - lse), 0.0)

            def dp(j, acc):  # dO · vᵀ over the value-width slices
                return acc + _dot_nt(do_ref[:, _ds(j, tv)], v_ref[keys, _ds(j, tv)])

            ds = p * (_slices(n_tv, dp, jnp.zeros((tq, tq), f32)) - dl)
            # dbd[a, d] = dS at the one key at distance d of query a (every 0 <= d <= M is written once: the
            # previous block for d > a, the present block up to the diagonal for d <= a); the lanes out of the
            # band go to the spare column M + 1, which is dropped
            pltriton.store(dbd_ref.at[rows - row0, jnp.where(in_band, d, M + 1)], ds, mask=in_band)
            return dq + _dot(ds.astype(k.dtype), k)

        return body

    dq = jax.lax.fori_loop(0, n_s, cache, jnp.zeros(dq_ref.shape, f32))
    dq = jax.lax.fori_loop(0, nq, local(kp_ref, vp_ref, okp_ref, kdp_ref, L), dq)
    dq = jax.lax.fori_loop(0, it + 1, local(kr_ref, vr_ref, okr_ref, kdr_ref, 0), dq)
    dq_ref[...] = dq


def _bwd_kv_kernel(k_ref, v_ref, ok_ref, qp_ref, lsep_ref, dlp_ref, dop_ref, bdp_ref, qr_ref, lser_ref, dlr_ref,
                   dor_ref, bdr_ref, *rest, tq: int, nq: int, R: int, L: int, M: int, tv: int,
                   n_tv: int, packed: bool = False):
    # packed: the key tile's documents, each role's query documents and window starts, and the queries of the row
    # block after the next (which see this key tile two blocks back: their window may reach it, their cache holds it)
    if packed:
        (kd_ref, qdp_ref, qwp_ref, qdr_ref, qwr_ref, qq_ref, lseq_ref, dlq_ref, doq_ref, qdq_ref, qwq_ref,
         dk_ref, dv_ref) = rest
        kd = kd_ref[...]
    else:
        (dk_ref, dv_ref), kd, qdp_ref, qwp_ref, qdr_ref, qwr_ref = rest, None, None, None, None, None
    u = pl.program_id(1)
    e = jax.lax.div(u, nq)  # extended block of this key tile (0: the carried band)
    kt = jax.lax.rem(u, nq)
    # integer arithmetic, not jnp.where: Pallas-Triton lowers a select of scalar constants to an i1 value, and a
    # loop bound of that type fails the Triton verifier (e is in [0, R])
    n_prev = nq * jnp.minimum(R - e, 1)  # query block e sees it as its previous block (all its query tiles)
    lo_pres = kt + (nq - kt) * jnp.maximum(1 - e, 0)  # query block e-1 sees it as present block: tiles kt..nq-1
    k = k_ref[...]
    key_ok = ok_ref[...][None, :] > 0.5
    key0 = kt * tq

    # dv [tq, Dv] f32 is in the loop carry where the value width is one slice (n_tv == 1), written once at the
    # end; otherwise (dv None) the f32 dv block is the accumulator, one value-width slice at a time
    # the keys' extended positions (packed only: an unpacked row's program is unchanged)
    key_at = u * tq + jax.lax.broadcasted_iota(jnp.int32, (tq, tq), 1) if packed else None

    def own_window(ds, qw_ref, r):
        """dS where the key is in the query's own window (packed: the keys before it take no dk̂, as in its
        cache: ``pallas_kernels`` callers' ``qwin``); all of it for an unpacked row."""
        return ds if qw_ref is None else jnp.where(key_at >= qw_ref[r][:, None], ds, 0.0)

    def role(q_ref, lse_ref, dl_ref, do_ref, bd_ref, off, qd_ref, qw_ref):
        def body(qt, carry):  # one P per query tile for dv and dk
            dk, dv = carry
            r = _ds(qt, tq)
            b, _, _, _ = _band(bd_ref, qt * tq, key0, off, shape=(tq, tq), M=M)
            valid = key_ok
            if off == 0:
                valid = valid & _causal(qt * tq, key0, (tq, tq))
            valid = _same_document(valid, qd_ref, kd, r)
            q = q_ref[r, :]
            p = jnp.where(valid, jnp.exp(_dot_nt(q, k) + b - lse_ref[r][:, None]), 0.0)
            pd = p.astype(do_ref.dtype)

            def step(dv_cols, cols):  # one value-width slice: (dv + Pᵀ·dO, dO·vᵀ)
                do = do_ref[r, cols]
                return dv_cols + _dot_tn(pd, do), _dot_nt(do, v_ref[:, cols])

            if n_tv == 1:
                dv, dpv = step(dv, slice(None))
            else:
                def sl(j, acc):
                    cols = _ds(j, tv)
                    dv_cols, dp = step(dv_ref[:, cols], cols)
                    dv_ref[:, cols] = dv_cols
                    return acc + dp

                dpv = _slices(n_tv, sl, jnp.zeros((tq, tq), f32))
            ds = own_window(p * (dpv - dl_ref[r][:, None]), qw_ref, r)
            return dk + _dot_tn(ds.astype(q.dtype), q), dv

        return body

    carry = (jnp.zeros(dk_ref.shape, f32), _accumulator(dv_ref, n_tv, tv))
    carry = jax.lax.fori_loop(0, n_prev, role(qp_ref, lsep_ref, dlp_ref, dop_ref, bdp_ref, L, qdp_ref, qwp_ref), carry)
    dk, dv = jax.lax.fori_loop(lo_pres, nq, role(qr_ref, lser_ref, dlr_ref, dor_ref, bdr_ref, 0, qdr_ref, qwr_ref),
                               carry)
    if packed:  # the row block after the next: dk̂ only (no band bias that far; its dv is the cache's)
        def two_back(qt, dk):
            r = _ds(qt, tq)
            q = qq_ref[r, :]
            valid = _same_document(key_ok, qdq_ref, kd, r)
            p = jnp.where(valid, jnp.exp(_dot_nt(q, k) - lseq_ref[r][:, None]), 0.0)
            dpv = _slices(n_tv, lambda j, acc: acc + _dot_nt(doq_ref[r, _ds(j, tv)], v_ref[:, _ds(j, tv)]),
                          jnp.zeros((tq, tq), f32))
            ds = own_window(p * (dpv - dlq_ref[r][:, None]), qwq_ref, r)
            return dk + _dot_tn(ds.astype(q.dtype), q)

        dk = jax.lax.fori_loop(0, nq * jnp.minimum(jnp.maximum(R - 1 - e, 0), 1), two_back, dk)
    dk_ref[...] = dk
    if n_tv == 1:
        dv_ref[...] = dv


# ----------------------------------------------------------------------------- pallas_calls
def _params(cfg, kind):
    if cfg["interpret"]:
        return None
    return pltriton.CompilerParams(num_warps=dict(cfg["warps"]).get(kind, 4), num_stages=cfg["num_stages"])


def _doc_specs(tq, L, blk):
    """BlockSpecs of a packed row's per-query documents (``qdoc``, ``qcache``: [BH, R·L]) at query tile t and of
    the per-key documents ([BH, (R+1)·L]) of the previous and present blocks of query block ``blk(t)``."""
    vec = pl.BlockSpec((None, tq), lambda b, t: (b, t))
    return [vec, vec, pl.BlockSpec((None, L), lambda b, t: (b, blk(t))),
            pl.BlockSpec((None, L), lambda b, t: (b, blk(t) + 1))]


def _doc_args(docs):
    """The per-query and per-key document arrays the forward and query-side kernels take (none: unpacked)."""
    return [] if docs is None else [docs["qdoc"], docs["qcache"], docs["kdoc"], docs["kdoc"]]


def _fwd_call(q, C, mu, ell, kx, vx, kval, bd, cfg, docs=None):
    """q [BH, R·L, Dk]; C [H, Sp, Dk]; mu [BH, R, Sp, Dv]; ell [BH, R, Sp] f32; kx [BH, (R+1)L, Dk];
    vx [BH, (R+1)L, Dv]; kval [(R+1)L] f32 (1: a valid key); bd [BH, R·L, M+1] f32 (band scores).
    Returns o [BH, R·L, Dv] f32, lse [BH, R·L] f32. Grid (BH, R·L/tq): the value width is a loop in the program."""
    BH, RL, Dk = q.shape
    H, L, M, tq, ts, tv, Sp = (cfg[k] for k in ("H", "L", "M", "tq", "ts", "tv", "Sp"))
    Dv = vx.shape[-1]
    nq = L // tq
    blk = lambda t: jax.lax.div(t, nq)  # noqa: E731  (query block of query tile t)
    in_specs = [
        pl.BlockSpec((None, tq, Dk), lambda b, t: (b, t, 0)),
        pl.BlockSpec((None, Sp, Dk), lambda b, t: (jax.lax.rem(b, H), 0, 0)),
        pl.BlockSpec((None, None, Sp, Dv), lambda b, t: (b, blk(t), 0, 0)),
        pl.BlockSpec((None, None, Sp), lambda b, t: (b, blk(t), 0)),
        pl.BlockSpec((None, L, Dk), lambda b, t: (b, blk(t), 0)),  # previous block = extended block n
        pl.BlockSpec((None, L, Dv), lambda b, t: (b, blk(t), 0)),
        pl.BlockSpec((L,), lambda b, t: (blk(t),)),
        pl.BlockSpec((None, L, Dk), lambda b, t: (b, blk(t) + 1, 0)),  # present block = extended block n+1
        pl.BlockSpec((None, L, Dv), lambda b, t: (b, blk(t) + 1, 0)),
        pl.BlockSpec((L,), lambda b, t: (blk(t) + 1,)),
        pl.BlockSpec((None, tq, M + 1), lambda b, t: (b, t, 0)),
    ]
    if docs is not None:
        in_specs += _doc_specs(tq, L, blk)
    out_specs = [pl.BlockSpec((None, tq, Dv), lambda b, t: (b, t, 0)),
                 pl.BlockSpec((None, tq), lambda b, t: (b, t))]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, tq=tq, ts=ts, tv=tv, n_s=Sp // ts, n_tv=Dv // tv, nq=nq, L=L, M=M,
                          packed=docs is not None),
        out_shape=(jax.ShapeDtypeStruct((BH, RL, Dv), f32), jax.ShapeDtypeStruct((BH, RL), f32)),
        grid=(BH, RL // tq),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "fwd"),
        name="vq_cache_gpu_fwd",
    )(q, C, mu, ell, kx, vx, kval, kx, vx, kval, bd, *_doc_args(docs))


def _bwd_q_call(q, C, mu, ell, kx, vx, kval, bd, lse, delta, do, cfg, docs=None):
    """The query-side pass: (dq [BH, R·L, Dk], dbd [BH, R·L, M+1], dμ̄ [BH, R, Sp, Dv]), all f32. The query tiles
    of a block add their share of dμ̄ with atomic adds into a zeros array (aliased to the output)."""
    BH, RL, Dk = q.shape
    H, L, M, tq, ts, tv, Sp = (cfg[k] for k in ("H", "L", "M", "tq", "ts", "tv", "Sp"))
    Dv = vx.shape[-1]
    nq = L // tq
    R = RL // L
    blk = lambda t: jax.lax.div(t, nq)  # noqa: E731
    rows = lambda w: pl.BlockSpec((None, tq, w), lambda b, t: (b, t, 0))  # noqa: E731
    vec = pl.BlockSpec((None, tq), lambda b, t: (b, t))
    dmu_spec = pl.BlockSpec((None, None, Sp, Dv), lambda b, t: (b, blk(t), 0, 0))
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
        rows(M + 1), vec, vec, rows(Dv), dmu_spec,
    ] + ([] if docs is None else _doc_specs(tq, L, blk))
    out_specs = [rows(Dk), rows(M + 2), dmu_spec]
    shp = lambda *s: jax.ShapeDtypeStruct(s, f32)  # noqa: E731
    dq, dbd, dmu = pl.pallas_call(
        functools.partial(_bwd_q_kernel, tq=tq, ts=ts, tv=tv, n_s=Sp // ts, nq=nq, n_tv=Dv // tv, L=L, M=M,
                          packed=docs is not None),
        out_shape=(shp(BH, RL, Dk), shp(BH, RL, M + 2), shp(BH, R, Sp, Dv)),
        grid=(BH, RL // tq),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases={14: 2},
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "bwd_q"),
        name="vq_cache_gpu_bwd_q",
    )(q, C, mu, ell, kx, vx, kval, kx, vx, kval, bd, lse, delta, do, jnp.zeros((BH, R, Sp, Dv), f32),
      *_doc_args(docs))
    return dq, dbd[..., : M + 1], dmu


def _bwd_kv_call(q, kx, vx, kval, lse, delta, do, bd, cfg, docs=None):
    """The key-side pass over the extended keys (band prepended): (dk̂ [BH, (R+1)L, Dk], dv [BH, (R+1)L, Dv]),
    f32. Grid (BH, (R+1)·L/tq): the value width is a loop in the program."""
    BH, RL, Dk = q.shape
    L, M, tq, tv = cfg["L"], cfg["M"], cfg["tq"], cfg["tv"]
    Dv = do.shape[-1]
    nq = L // tq
    R = RL // L
    prev = lambda u: jnp.minimum(jax.lax.div(u, nq), R - 1)  # noqa: E731  (query block e, clamped)
    pres = lambda u: jnp.maximum(jax.lax.div(u, nq) - 1, 0)  # noqa: E731  (query block e-1, clamped)

    def role(blk):
        return [pl.BlockSpec((None, L, Dk), lambda b, u: (b, blk(u), 0)),
                pl.BlockSpec((None, L), lambda b, u: (b, blk(u))),
                pl.BlockSpec((None, L), lambda b, u: (b, blk(u))),
                pl.BlockSpec((None, L, Dv), lambda b, u: (b, blk(u), 0)),
                pl.BlockSpec((None, L, M + 1), lambda b, u: (b, blk(u), 0))]

    in_specs = [pl.BlockSpec((None, tq, Dk), lambda b, u: (b, u, 0)),
                pl.BlockSpec((None, tq, Dv), lambda b, u: (b, u, 0)),
                pl.BlockSpec((tq,), lambda b, u: (u,))] + role(prev) + role(pres)
    args = [kx, vx, kval, q, lse, delta, do, bd, q, lse, delta, do, bd]
    if docs is not None:  # the key tile's documents; each role's query documents and windows; the two-back role
        nxt = lambda u: jnp.minimum(jax.lax.div(u, nq) + 1, R - 1)  # noqa: E731  (query block e+1, clamped)
        per_q = lambda blk: [pl.BlockSpec((None, L), lambda b, u: (b, blk(u)))] * 2  # noqa: E731
        in_specs += ([pl.BlockSpec((None, tq), lambda b, u: (b, u))] + per_q(prev) + per_q(pres)
                     + role(nxt)[:4] + per_q(nxt))
        qd, qw = docs["qdoc"], docs["qwin"]
        args += [docs["kdoc"], qd, qw, qd, qw, q, lse, delta, do, qd, qw]
    out_specs = [pl.BlockSpec((None, tq, Dk), lambda b, u: (b, u, 0)),
                 pl.BlockSpec((None, tq, Dv), lambda b, u: (b, u, 0))]
    n_ext = RL + L
    return pl.pallas_call(
        functools.partial(_bwd_kv_kernel, tq=tq, nq=nq, R=R, L=L, M=M, tv=tv, n_tv=Dv // tv,
                          packed=docs is not None),
        out_shape=(jax.ShapeDtypeStruct((BH, n_ext, Dk), f32), jax.ShapeDtypeStruct((BH, n_ext, Dv), f32)),
        grid=(BH, n_ext // tq),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=cfg["interpret"],
        compiler_params=_params(cfg, "bwd_kv"),
        name="vq_cache_gpu_bwd_kv",
    )(*args)


# ----------------------------------------------------------------------------- custom_vjp
class _Cfg(dict):
    """Static kernel configuration (hashable, for nondiff_argnums)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _store(cfg, *xs):
    sdt = jnp.dtype(cfg["sdt"])
    return tuple(x.astype(sdt) for x in xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attend(q, kx, vx, bd, kval, mu, ell, C, cfg, docs=None):
    q, kx, vx, mu = _store(cfg, q, kx, vx, mu)
    return _fwd_call(q, C, mu, ell, kx, vx, kval, bd, cfg, docs)[0]


def _attend_fwd(q, kx, vx, bd, kval, mu, ell, C, cfg, docs=None):
    q, kx, vx, mu = _store(cfg, q, kx, vx, mu)
    o, lse = _fwd_call(q, C, mu, ell, kx, vx, kval, bd, cfg, docs)
    return o, (q, kx, vx, bd, kval, mu, ell, C, o, lse, docs)


def _attend_bwd(cfg, res, do):
    q, kx, vx, bd, kval, mu, ell, C, o, lse, docs = res
    do = do.astype(f32)
    delta = jnp.sum(do * o, axis=-1)  # Δ = rowsum(dO ⊙ O)
    (do_s,) = _store(cfg, do)
    dq, dbd, dmu = _bwd_q_call(q, C, mu, ell, kx, vx, kval, bd, lse, delta, do_s, cfg, docs)
    dkx, dvx = _bwd_kv_call(q, kx, vx, kval, lse, delta, do_s, bd, cfg, docs)
    return dq, dkx, dvx, dbd, None, dmu, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _storage_dtype(*xs):
    return jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in xs) else f32


def vq_cache_attention(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, interpret: bool = False,
                       block_q: int | None = None, block_s: int | None = None, block_v: int | None = None,
                       packed: dict | None = None):
    """Same contract as ``vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, state, L=L, M=M)`` and
    :func:`pallas_kernels.vq_cache.vq_cache_attention`: q_u, k_hat [B,H,T,Dk]; bd [B,H,T,M+1]; z int32 [B,H,T];
    v [B,H,T,Dv]; C [H,S,Dk]; state with a band of M tokens; 1 <= M <= L. Returns (o [B,H,T,Dv], new_state).
    A bfloat16 codebook with bfloat16 q, k̂, v makes the cache scores bfloat16 products (float32 accumulation);
    a float32 codebook is used as given.

    Compiled for 'cuda' (Triton) unless ``interpret=True`` (Pallas interpret mode, any backend). ``block_q``,
    ``block_s``, ``block_v`` override the tiles of :func:`choose_tiles`.

    ``packed`` (a packed row, docs/methods/transformer_vq.md §2.8, §9): the caller's per-block caches and document
    arrays (``longctx.attention.transformer_vq.xla.kernel_packed``: ``cmu``, ``cn``, ``qdoc``, ``qwin``,
    ``qcache``, ``kdoc``) replace Phase 1's cache and the key validity: every product is masked to the query's
    document, and ``dk̂`` is taken only from the queries whose own window holds the key (``qwin``; the key-side
    pass also visits the row block after the next for them). The state's band keys and values still form extended
    block 0 (``kdoc`` says which of its slots the call continues); its ``pos`` is not read. Returns
    (o, None): the caller forms the packed row's new state."""
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
    if packed is None:
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
        docs = None
    else:  # the caller's caches; every key's validity is its document's (kdoc)
        cmu, cn = packed["cmu"], packed["cn"]
        validx = jnp.ones((R + 1, L), bool)
        docs = {name: jnp.broadcast_to(packed[name][:, None], (B, H) + packed[name].shape[1:]).reshape(BH, -1)
                for name in ("qdoc", "qwin", "qcache", "kdoc")}
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
                flat(cmu.astype(f32)), flat(ell), Cp, cfg, docs)
    o = o.reshape(B, H, Tp, Dv)[:, :, :T].astype(dt)
    if packed is not None:
        return o, None
    new_state = final_state(st, k_hat.astype(dt), z, v.astype(dt), T, M, S)
    return o, new_state


__all__ = ["DTYPES", "REG_WORDS_LIMIT", "SMEM_LIMIT_BYTES", "choose_tiles", "tile_budget", "unsupported_reasons",
           "vq_cache_attention"]

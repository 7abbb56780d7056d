"""Pallas kernel "eva_attend": EVA's Phase B, chunk scores and the local window in one online softmax
(docs/methods/eva.md §8.3), forward and backward kernels, lowered for TPU (Mosaic) and GPU (Triton).

The reference it must match is :func:`pallas_kernels.eva_attend_ref.eva_attend_reference` (operands described
there: ``q`` pre-scaled, ``k, v``, chunk summaries ``k̂, β`` from Phase A, local bias tiles). This module imports
only JAX, that reference and the dropout hash beside it (:mod:`pallas_kernels.hash_dropout`).

Kernels (``W`` = window = query tile, ``Tc`` = chunk tile, ``nq = Lp / W``, offsets = the key blocks a window
touches: ``(0,)``, ``(−1, 0)`` causal with overlap, ``(−1, 0, 1)`` bidirectional with overlap):

* **forward**, grid ``(BH, nq)``, both parallel: one query block; its local key blocks arrive through clamped
  index maps (out-of-range blocks masked); the chunk summaries are one full block each and the kernel loops over
  the chunk tiles its queries may see (causal: ``⌈min(C, (i+1)W/P − 1) / Tc⌉`` tiles, so chunks no query of the
  block sees are never scored); running max, sum and accumulator in fp32. Writes ``o`` and ``lse``.
* **backward**: two passes (flash-style, each recomputing a tile's probabilities once from the saved ``lse``,
  ``Δ = rowsum(dO ⊙ O)``). *Query side*, grid ``(BH, nq)`` as the forward: ``dq`` from the local and the visible
  chunk tiles; on TPU (query axis ``arbitrary``) the same chunk tiles also add their ``dk̂, dβ`` into resident
  ``[Cp, ·]`` fp32 output blocks, so a chunk tile costs five products in all. *Key side*: local ``dk, dv``, one key
  block per program, taking the ≤ 3 query blocks that see it, and the relative-position bias gradient summed inside
  the kernel into one ``[n_lt, W, W]`` block per row (XLA then sums the rows of a head): on TPU grid ``(BH, nq)``
  with the key axis ``arbitrary`` accumulating in the resident block; on GPU grid ``(BH, nq + Cp/Tc)``, whose first
  ``nq`` programs are the key blocks (bias gradient by atomic adds, so its fp32 sum order varies from run to run)
  and whose last ``Cp/Tc`` programs are the chunk tiles' ``dk̂, dβ``, each looping over the query blocks that see
  it (Triton grids have no sequential axis; every GPU gradient but the bias's is deterministic). Tile products
  (forward: 2 per tile): a local tile 3 + 4; a chunk tile 5 on TPU, 3 + 4 on GPU. ``dk̂, dβ`` then flow through
  Phase A by JAX autodiff.

Dtypes (DESIGN.md §7): fp32 or bf16 operands; :func:`eva_attend` casts q, k, v, k̂, β and the bias to their
compute dtype (that of q and v) and the kernels keep them there: every product takes operands in the compute dtype
with fp32 accumulation, the probabilities ``P`` and score gradients ``dS`` are cast down before their products (as
flash kernels do), ``dO`` enters in the compute dtype; softmax statistics, ``lse``, ``Δ`` and accumulators are fp32.
Outputs: ``o`` and ``dq, dk, dv`` in the compute dtype, ``lse``, the chunk gradients ``dk̂, dβ`` and the bias
gradient (accumulated across grid steps) in fp32. Under fp32 operands every cast is the identity. Only the ``rep``
chunk logit (eq. 16).

Attention dropout (``dropout_rate``, ``seeds``): on the normalised joint weights, as EVA's other implementations
apply it (the weights the accumulator takes are multiplied by ``D = keep / (1 − rate)``, the normaliser is not);
the keep bit of query ``n`` on local key ``m`` is the counter hash of :mod:`pallas_kernels.hash_dropout` of
(row seed, ``n``, ``m``), on chunk ``c`` of (row seed, ``n``, ``CHUNK_KEY_BASE + c``), all absolute indices, so the
backward kernels recompute the mask the forward used and plain JAX can draw it too. Backward: ``dV += (P ⊙ D)ᵀ dO``,
``dS = P ⊙ (D ⊙ dP − Δ)`` with the same ``Δ = rowsum(dO ⊙ O)``.

Packed rows (``segments``; EVA's ``packed.py`` lays the documents out again on the window grid): the kernels read
int32 rows beside the operands, each query block's own positions and documents, each local key block's, and the
chunks' own indices and documents; a key or chunk counts only for a query of its document, causal chunk visibility,
the disjoint partition and the dropout counters take the documents' own indices, and the window and causal masks of
local keys stay the layout's (a document keeps its window there). A carried state's chunks come first
(``chunk_base``): the causal loops take them for every query block. Without segments no such operand exists and
the programs are those of one sequence.

Tiles: on TPU a local block is one ``[W, W]`` score tile and chunk tiles hold up to 128 chunks; on GPU
(:func:`gpu_plan`) local blocks are scored in key sub-tiles and chunk tiles of 64 (heads up to 64) or 32 (larger
heads), and a window block's queries in sub-tiles of ``Tq`` rows (the window, halved while the register estimate
of the query-side pass exceeds :data:`REG_WORDS_LIMIT`), with 4 or 8 warps; the plan's tiles are the tiles the kernels
compile with, unless a call overrides them (:func:`eva_attend`'s tile and warp arguments: EVA's execution settings).

Support (:func:`unsupported_reasons`): ``W > 0``; GPU: ``W``, ``d``, ``dv`` powers of two in [16, 128] and the
register estimate within :data:`REG_WORDS_LIMIT` at a query sub-tile of at least 32 rows; TPU:
``W % 8 == 0``, ``d``, ``dv`` multiples of 128 or 64, and a VMEM estimate of the largest kernel's blocks
(double-buffered) below :data:`VMEM_LIMIT_BYTES` -- the chunk summaries are whole blocks, so this bounds ``C``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import hash_dropout
from pallas_kernels import lazy_triton as pltriton
from pallas_kernels.eva_attend_ref import NEG, eva_attend_reference, local_offsets
from pallas_kernels.precision import compute_dtype
from pallas_kernels.precision import dot_nn as _nn
from pallas_kernels.precision import dot_nt as _nt
from pallas_kernels.precision import dot_tn as _tn

f32 = jnp.float32
VMEM_LIMIT_BYTES = 48 * 2**20
REG_WORDS_LIMIT = 192  # live 32-bit tile words per thread the GPU estimate allows (of 255 registers)
PLATFORMS = ("tpu", "cuda")
DTYPES = ("float32", "bfloat16")
PLAN = -1  # a tile / warp setting that takes the plan's rule (gpu_plan on a GPU, whole windows on a TPU)


# ----------------------------------------------------------------------------- support
def chunk_tile(C: int, cap: int = 128) -> int:
    """Chunk tile Tc: a power of two in [16, cap] (Triton dots; TPU sublane-aligned); cap 64 or 32 on GPU."""
    return int(min(cap, max(16, 1 << max(C - 1, 1).bit_length())))


_chunk_tile_rule = chunk_tile  # the rule, for eva_attend (whose chunk_tile argument is an override)


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """The tiles the GPU (Triton) kernels compile with: query sub-tile ``Tq`` (rows of a window block scored at
    once), local key sub-tile ``Tk``, chunk tile ``Tc``, warps, and the register estimate (words per thread)."""

    Tq: int
    Tk: int
    Tc: int
    num_warps: int
    words: float


def gpu_key_tile(d: int, dv: int) -> int:
    """Key and chunk tiles on GPU: 64 for heads up to 64, 32 for larger heads (FlashAttention's Triton kernels take
    key blocks of 32 at head dim 128 for the same register budget)."""
    return 64 if max(d, dv) <= 64 else 32


def gpu_words(*, Tq: int, T: int, d: int, dv: int, itemsize: int = 4, dropout: bool = False) -> int:
    """Live 32-bit tile words of the costliest GPU kernel body, the query-side backward pass, per query sub-tile:
    the query ``[Tq, d]`` in the operand dtype (bf16 packs two per word), dO ``[Tq, dv]`` and the dq accumulator
    ``[Tq, d]`` in fp32, the key and value tiles ``[T, d + dv]`` (upcast to fp32 for the dots), and two ``[Tq, T]``
    fp32 tiles (scores then probabilities; dP then dS), a third with dropout (the keep multiplier)."""
    return int(Tq * d * itemsize / 4 + Tq * dv + Tq * d + T * (d + dv) + (3 if dropout else 2) * Tq * T)


def gpu_plan(*, W: int, d: int, dv: int, C: int, itemsize: int = 4, dropout: bool = False,
             limit: float | None = None) -> GpuPlan:
    """The GPU tiles: key and chunk tiles by :func:`gpu_key_tile`, then the largest query sub-tile (the window,
    halved down to 32 rows) whose :func:`gpu_words` at 4 or 8 warps is within ``limit`` (default
    :data:`REG_WORDS_LIMIT`); where none is, the smallest at 8 warps (``words`` then exceeds the limit: refused).
    An estimate for choosing tiles and warps and refusing clearly too large ones, not a measurement (no GPU has
    compiled these kernels yet). fp32 at W = 128: heads of 64 keep the whole window (192 words at 8 warps; with
    dropout sub-tiles of 64 rows, 128 words); heads of 128 take sub-tiles of 64 rows (144 words, 152 with
    dropout)."""
    limit = REG_WORDS_LIMIT if limit is None else limit
    T = gpu_key_tile(d, dv)
    Tk, Tc = min(W, T), chunk_tile(C, T)
    Tq = W
    while True:
        words = gpu_words(Tq=Tq, T=max(Tk, Tc), d=d, dv=dv, itemsize=itemsize, dropout=dropout)
        for warps in (4, 8):
            if words / (32 * warps) <= limit:
                return GpuPlan(Tq, Tk, Tc, warps, words / (32 * warps))
        if Tq // 2 < 32 or W % (Tq // 2):
            return GpuPlan(Tq, Tk, Tc, 8, words / (32 * 8))
        Tq //= 2


def _padded_bytes(rows: int, cols: int, itemsize: int) -> int:
    return (-(-rows // 8) * 8) * (-(-cols // 128) * 128) * itemsize


def vmem_bytes(*, W: int, d: int, dv: int, C: int, n_lt: int, itemsize: int = 4) -> int:
    """VMEM of the TPU query-side backward pass (the largest kernel: the forward's blocks, dO, lse, Δ and dq, and
    the fp32 chunk gradients resident across its query blocks): double-buffered blocks + in-body temporaries."""
    Cp = -(-C // chunk_tile(C)) * chunk_tile(C)
    blocks = (_padded_bytes(W, d, itemsize) * (1 + n_lt) + _padded_bytes(W, dv, itemsize) * (n_lt + 1)
              + _padded_bytes(Cp, d, itemsize) + _padded_bytes(Cp, dv, itemsize)
              + n_lt * _padded_bytes(W, W, 4) + 3 * _padded_bytes(W, 1, 4) + _padded_bytes(W, max(d, dv), 4)
              + _padded_bytes(Cp, d, 4) + _padded_bytes(Cp, dv, 4))
    temps = 4 * _padded_bytes(W, max(W, chunk_tile(C)), 4) + 3 * _padded_bytes(W, max(d, dv), 4)
    return 2 * blocks + temps


def unsupported_reasons(platform: str, *, W: int, d: int, dv: int, C: int, e_l: int = 0, e_r: int = 0,
                        chunk_logit: str = "rep", dtype=f32, dropout: bool = False, **_) -> list[str]:
    """Why the kernel cannot serve these shapes on ``platform`` ('tpu' | 'cuda' | 'rocm' | 'interpret');
    ``dropout``: the call applies attention dropout (one more tile in the GPU register estimate)."""
    out = []
    if W <= 0:
        out.append("needs a local window (window_size > 0)")
    if chunk_logit != "rep":
        out.append(f"chunk_logit={chunk_logit!r}: the kernel computes the representative-key logit 'rep' only")
    if e_l > W or e_r > W:
        out.append(f"window extensions e_l={e_l}, e_r={e_r} larger than the window W={W}")
    if jnp.dtype(dtype).name not in DTYPES:
        out.append(f"dtype {jnp.dtype(dtype).name} not supported (allowed: {', '.join(DTYPES)})")
    if platform == "interpret" or out:
        return out
    if platform not in PLATFORMS:
        out.append(f"no {platform} lowering (kernel platforms: {', '.join(PLATFORMS)})")
        return out
    if platform in ("cuda", "rocm"):
        out += pltriton.missing()
    if platform == "cuda":
        for name, x in (("window_size", W), ("head_dim", d), ("value_dim", dv)):
            if x & (x - 1) or not 16 <= x <= 128:
                out.append(f"{name}={x}: GPU (Triton) blocks need a power of two in [16, 128]")
        if not out:
            plan = gpu_plan(W=W, d=d, dv=dv, C=C, itemsize=jnp.dtype(dtype).itemsize, dropout=dropout)
            if plan.words > REG_WORDS_LIMIT:
                out.append(f"register estimate {plan.words:.0f} words per thread at {plan.num_warps} warps exceeds "
                           f"{REG_WORDS_LIMIT} (window {W}, query sub-tile {plan.Tq}, head {d}, value {dv})")
    else:
        if W % 8:
            out.append(f"window_size={W}: TPU blocks need a multiple of 8")
        for name, x in (("head_dim", d), ("value_dim", dv)):
            if x % 128 and x != 64:
                out.append(f"{name}={x}: TPU blocks want a multiple of 128 (or 64)")
        need = vmem_bytes(W=W, d=d, dv=dv, C=C, n_lt=len(local_offsets(e_l, e_r)),
                          itemsize=jnp.dtype(dtype).itemsize)
        if need > VMEM_LIMIT_BYTES:
            out.append(f"VMEM estimate {need / 2**20:.1f} MiB exceeds the {VMEM_LIMIT_BYTES / 2**20:.0f} MiB limit "
                       f"(C={C} chunk summaries are whole blocks; a shorter sequence or larger chunk_size fits)")
    return out


# ----------------------------------------------------------------------------- shared tile math
def _div(a, b: int):
    """a // b for non-negative traced ints (truncating division: Mosaic has no floor-division lowering here)."""
    return jax.lax.div(a, jnp.asarray(b, jnp.int32))


@dataclasses.dataclass(frozen=True)
class _Geo:
    """Static geometry: window W, chunk size P, valid length L, valid chunks C, chunk tile Tc, key-block offsets."""

    W: int
    P: int
    L: int
    C: int
    Tc: int
    Tk: int  # key sub-tile of a local block (W on TPU; the GPU plan's on GPU)
    Tq: int  # query sub-tile: rows of a window block scored at once (W on TPU; the GPU plan's on GPU)
    num_warps: int  # GPU only
    offsets: tuple[int, ...]
    causal: bool
    disjoint: bool
    e_l: int
    e_r: int
    has_bias: bool
    rate: float  # attention dropout (0: none; then no seed operand)
    packed: bool = False  # a packed row laid out again: the positions' and chunks' documents and own indices
    base: int = 0  # packed: chunks before the layout's (a carried state's), all visible to the causal skip


@dataclasses.dataclass(frozen=True)
class _Seg:
    """A score tile's packed-row operands (:func:`eva_attend`'s ``segments``): the query rows' own positions and
    documents ``[Tq, 1]``, and the columns' (keys' or chunks') own indices and documents ``[1, T]``."""

    q_rel: jax.Array
    q_doc: jax.Array
    c_rel: jax.Array
    c_doc: jax.Array


def _qpos(g: _Geo, i, r0: int, cols: int):
    """Absolute positions of rows ``r0 .. r0+Tq-1`` of query block ``i``: [Tq, cols]."""
    return i * g.W + r0 + jax.lax.broadcasted_iota(jnp.int32, (g.Tq, cols), 0)


def _local_scores(g: _Geo, q, k, bias, i, blk, in_range, c0: int, r0: int, seg: _Seg | None = None):
    """Scores and mask of rows ``r0 .. r0+Tq-1`` of query block ``i`` against keys ``c0 .. c0+Tk-1`` of key block
    ``blk`` (traced ints): [Tq, Tk]. ``seg`` (a packed row): only keys of the query's document (the layout keeps a
    document's window and causal order in layout positions, so the window and causal masks stay those)."""
    W, Tk = g.W, g.Tk
    s = _nt(q, k)
    if bias is not None:
        s = s + bias
    qpos = _qpos(g, i, r0, Tk)
    kpos = blk * W + c0 + jax.lax.broadcasted_iota(jnp.int32, (g.Tq, Tk), 1)
    valid = (kpos >= i * W - g.e_l) & (kpos < (i + 1) * W + g.e_r) & (kpos >= 0) & (kpos < g.L) & in_range
    if g.causal:
        valid = valid & (kpos <= qpos)
    if seg is not None:
        valid = valid & (seg.q_doc == seg.c_doc)
    return jnp.where(valid, s, NEG), valid


def _chunk_scores(g: _Geo, q, kh, i, c0, r0: int, seg: _Seg | None = None):
    """Scores and mask of rows ``r0 .. r0+Tq-1`` of query block ``i`` against chunks ``c0 .. c0+Tc-1``: [Tq, Tc].
    ``seg`` (a packed row): the chunks of the query's document, by the document's own query position and chunk
    index."""
    W, Tc, P = g.W, g.Tc, g.P
    s = _nt(q, kh)
    if seg is not None:
        valid = seg.q_doc == seg.c_doc
        if g.causal:
            valid = valid & ((seg.c_rel + 1) * P <= seg.q_rel)
        if g.disjoint:
            blk = _div(seg.q_rel, W)
            lo, hi = jnp.maximum(blk * W - g.e_l, 0), (blk + 1) * W + g.e_r
            valid = valid & ~((seg.c_rel * P < hi) & ((seg.c_rel + 1) * P > lo))
        return jnp.where(valid, s, NEG), valid
    qpos = _qpos(g, i, r0, Tc)
    cid = c0 + jax.lax.broadcasted_iota(jnp.int32, (g.Tq, Tc), 1)
    valid = cid < g.C
    if g.causal:
        valid = valid & (cid < _div(qpos, P))
    if g.disjoint:
        lo, hi = jnp.maximum(i * W - g.e_l, 0), (i + 1) * W + g.e_r
        valid = valid & ~((cid * P < hi) & ((cid + 1) * P > lo))
    return jnp.where(valid, s, NEG), valid


def _local_drop(g: _Geo, seed, i, r0: int, blk, c0: int, seg: _Seg | None = None):
    """Dropout multiplier of rows ``r0..`` of query block ``i`` on keys ``c0..`` of key block ``blk`` (key index:
    the absolute position; a packed row's: the document's own positions): [Tq, Tk] fp32, or None without dropout."""
    if seed is None:
        return None
    if seg is not None:
        return hash_dropout.multiplier(seed, seg.q_rel, seg.c_rel, g.rate)
    qpos = i * g.W + r0 + jax.lax.broadcasted_iota(jnp.int32, (g.Tq, 1), 0)
    kpos = blk * g.W + c0 + jax.lax.broadcasted_iota(jnp.int32, (1, g.Tk), 1)
    return hash_dropout.multiplier(seed, qpos, kpos, g.rate)


def _chunk_drop(g: _Geo, seed, i, r0: int, c0, seg: _Seg | None = None):
    """Dropout multiplier on chunks ``c0..`` (key index ``CHUNK_KEY_BASE + c``; a packed row's: the document's own
    position and chunk index): [Tq, Tc] fp32, or None."""
    if seed is None:
        return None
    if seg is not None:
        return hash_dropout.multiplier(seed, seg.q_rel, hash_dropout.CHUNK_KEY_BASE + seg.c_rel, g.rate)
    qpos = i * g.W + r0 + jax.lax.broadcasted_iota(jnp.int32, (g.Tq, 1), 0)
    cid = hash_dropout.CHUNK_KEY_BASE + c0 + jax.lax.broadcasted_iota(jnp.int32, (1, g.Tc), 1)
    return hash_dropout.multiplier(seed, qpos, cid, g.rate)


def _n_chunk_tiles(g: _Geo, i):
    """Chunk tiles query block ``i`` may see (causal: chunks c < ⌊n/P⌋ for its last query n)."""
    if not g.causal:
        return -(-g.C // g.Tc)
    nv = _div((i + 1) * g.W - 1, g.P)
    nv = jnp.minimum(g.C, nv if not g.base else g.base + nv)  # a packed row: the carried chunks first
    return _div(nv + g.Tc - 1, g.Tc)


def _first_query_block(g: _Geo, j):
    """The first query block that sees a chunk of tile ``j`` (causal; a packed row's carried chunks: the first
    block); 0 bidirectional."""
    if not g.causal:
        return 0
    if g.base:
        return _div((jnp.maximum(j * g.Tc - g.base, -1) + 1) * g.P, g.W)
    return _div((j * g.Tc + 1) * g.P, g.W)


def _online(carry, s, valid, vals, drop):
    """One tile of the online softmax; dropout (``drop``, the multiplier) scales the weights the accumulator takes,
    never the normaliser (dropout on the normalised weights)."""
    m, lsum, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    lsum = alpha * lsum + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + _nn((p if drop is None else p * drop).astype(vals.dtype), vals)
    return m_new, lsum, acc


def _dscores(p, dp, delta, drop):
    """dS = P ⊙ (D ⊙ dP − Δ) for dropout multiplier D (1 without dropout); Δ = rowsum(dO ⊙ O) either way."""
    return p * ((dp if drop is None else dp * drop) - delta)


@dataclasses.dataclass(frozen=True)
class _SegRefs:
    """A packed row's operands in a query-side kernel: the query block's own positions and documents ``[W, 1]``,
    each local key block's ``[(rel, doc)]`` as rows ``[1, W]``, and the chunks' own indices and documents
    ``[1, Cp]``."""

    q_rel: object
    q_doc: object
    keys: list
    c_rel: object
    c_doc: object

    def rows(self, rows):
        return self.q_rel[rows, :], self.q_doc[rows, :]

    def local(self, q, t: int, cols):
        rel, doc = self.keys[t]
        return _Seg(q[0], q[1], rel[:, cols], doc[:, cols])

    def chunks(self, q, ch):
        return _Seg(q[0], q[1], self.c_rel[:, ch], self.c_doc[:, ch])


def _split_refs(g: _Geo, refs, n_extra_in: int, n_out: int):
    """(q, [(k, v) per offset], kh, beta, bias, seed, packed-row operands or None, extra inputs, outputs)."""
    n_lt = len(g.offsets)
    q_ref = refs[0]
    kv = [(refs[1 + 2 * t], refs[2 + 2 * t]) for t in range(n_lt)]
    rest = refs[1 + 2 * n_lt:]
    kh_ref, beta_ref = rest[0], rest[1]
    rest = rest[2:]
    bias_ref = seed = segs = None
    if g.has_bias:
        bias_ref, rest = rest[0], rest[1:]
    if g.rate > 0:
        seed, rest = rest[0][...], rest[1:]
    if g.packed:
        keys = [(rest[2 + 2 * t], rest[3 + 2 * t]) for t in range(n_lt)]
        segs = _SegRefs(rest[0], rest[1], keys, rest[2 + 2 * n_lt], rest[3 + 2 * n_lt])
        rest = rest[4 + 2 * n_lt:]
    return (q_ref, kv, kh_ref, beta_ref, bias_ref, seed, segs, rest[:n_extra_in],
            rest[n_extra_in:n_extra_in + n_out])


def _bias(bias_ref, t: int, rows: slice, cols: slice):
    return None if bias_ref is None else bias_ref[t, rows, cols].astype(f32)


def _local_blocks(g: _Geo, i):
    nq = pl.num_programs(1)
    return [(i + o, (i + o >= 0) & (i + o < nq)) for o in g.offsets]


def _row_tiles(g: _Geo):
    return [(r0, slice(r0, r0 + g.Tq)) for r0 in range(0, g.W, g.Tq)]


# ----------------------------------------------------------------------------- forward kernel
def _fwd_kernel(*refs, g: _Geo):
    q_ref, kv, kh_ref, beta_ref, bias_ref, seed, segs, _, (o_ref, lse_ref) = _split_refs(g, refs, 0, 2)
    i = pl.program_id(1)
    dv = o_ref.shape[-1]
    for r0, rows in _row_tiles(g):
        q = q_ref[rows, :]
        qs = None if segs is None else segs.rows(rows)
        carry = (jnp.full((g.Tq, 1), NEG, f32), jnp.zeros((g.Tq, 1), f32), jnp.zeros((g.Tq, dv), f32))
        for t, ((blk, ok), (k_ref, v_ref)) in enumerate(zip(_local_blocks(g, i), kv)):
            for c0 in range(0, g.W, g.Tk):
                cols = slice(c0, c0 + g.Tk)
                sg = None if segs is None else segs.local(qs, t, cols)
                s, valid = _local_scores(g, q, k_ref[cols, :], _bias(bias_ref, t, rows, cols), i, blk, ok, c0, r0,
                                         sg)
                carry = _online(carry, s, valid, v_ref[cols, :], _local_drop(g, seed, i, r0, blk, c0, sg))

        def body(j, carry, q=q, r0=r0, qs=qs):
            c0 = pl.multiple_of(j * g.Tc, g.Tc)
            sg = None if segs is None else segs.chunks(qs, pl.ds(c0, g.Tc))
            s, valid = _chunk_scores(g, q, kh_ref[pl.ds(c0, g.Tc), :], i, c0, r0, sg)
            return _online(carry, s, valid, beta_ref[pl.ds(c0, g.Tc), :], _chunk_drop(g, seed, i, r0, c0, sg))

        m, lsum, acc = jax.lax.fori_loop(0, _n_chunk_tiles(g, i), body, carry)
        lsum = jnp.maximum(lsum, 1e-30)
        o_ref[rows, :] = (acc / lsum).astype(o_ref.dtype)
        lse_ref[rows, :] = m + jnp.log(lsum)


def _grad_tile(p_s, valid, lse, delta, do, vals, drop):
    """One score tile of the backward from its scores ``p_s``: P recomputed from the saved ``lse``, then
    ``(P ⊙ D, dS)`` (D the dropout multiplier, 1 without dropout)."""
    p = jnp.where(valid, jnp.exp(p_s - lse), 0.0)
    return (p if drop is None else p * drop), _dscores(p, _nt(do, vals), delta, drop)


# ----------------------------------------------------------------------------- query-side backward pass
def _dq_kernel(*refs, g: _Geo, chunk_grads: bool):
    """dq of one query block (its local key tiles, then its visible chunk tiles); with ``chunk_grads`` (TPU form,
    query axis ``arbitrary``) also the chunk gradients dk̂, dβ, accumulated across query blocks in resident
    ``[Cp, ·]`` output blocks from the same chunk tile (P and dS computed once for all three)."""
    n_out = 3 if chunk_grads else 1
    q_ref, kv, kh_ref, beta_ref, bias_ref, seed, segs, (do_ref, lse_ref, dl_ref), outs = _split_refs(g, refs, 3,
                                                                                                      n_out)
    dq_ref = outs[0]
    i = pl.program_id(1)
    if chunk_grads:
        dkh_ref, dbeta_ref = outs[1:]

        @pl.when(i == 0)
        def _():
            dkh_ref[...] = jnp.zeros(dkh_ref.shape, f32)
            dbeta_ref[...] = jnp.zeros(dbeta_ref.shape, f32)

    for r0, rows in _row_tiles(g):
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows, :], dl_ref[rows, :]
        qs = None if segs is None else segs.rows(rows)
        dq = jnp.zeros((g.Tq, dq_ref.shape[-1]), f32)
        for t, ((blk, ok), (k_ref, v_ref)) in enumerate(zip(_local_blocks(g, i), kv)):
            for c0 in range(0, g.W, g.Tk):
                cols = slice(c0, c0 + g.Tk)
                k = k_ref[cols, :]
                sg = None if segs is None else segs.local(qs, t, cols)
                s, valid = _local_scores(g, q, k, _bias(bias_ref, t, rows, cols), i, blk, ok, c0, r0, sg)
                _, ds = _grad_tile(s, valid, lse, delta, do, v_ref[cols, :],
                                   _local_drop(g, seed, i, r0, blk, c0, sg))
                dq = dq + _nn(ds.astype(k.dtype), k)

        def body(j, dq, q=q, do=do, lse=lse, delta=delta, r0=r0, qs=qs):
            c0 = pl.multiple_of(j * g.Tc, g.Tc)
            kh = kh_ref[pl.ds(c0, g.Tc), :]
            sg = None if segs is None else segs.chunks(qs, pl.ds(c0, g.Tc))
            s, valid = _chunk_scores(g, q, kh, i, c0, r0, sg)
            pd, ds = _grad_tile(s, valid, lse, delta, do, beta_ref[pl.ds(c0, g.Tc), :],
                                _chunk_drop(g, seed, i, r0, c0, sg))
            if chunk_grads:
                dkh_ref[pl.ds(c0, g.Tc), :] += _tn(ds.astype(q.dtype), q)
                dbeta_ref[pl.ds(c0, g.Tc), :] += _tn(pd.astype(do.dtype), do)
            return dq + _nn(ds.astype(kh.dtype), kh)

        dq_ref[rows, :] = jax.lax.fori_loop(0, _n_chunk_tiles(g, i), body, dq).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------- key-side backward pass
def _dkv_tiles(g: _Geo, j, nq, k_at, q_at, bias_ref, seed, emit, db_add):
    """dk, dv of local key block ``j`` over the ≤ 3 query blocks that see it, one key sub-tile at a time; the
    operands come through ``k_at(c0) -> (k, v, key rows' (rel, doc) or None)`` and ``q_at(t, i, r0) -> (q, dO, lse,
    Δ, query rows' (rel, doc) or None)`` (rows ``r0..`` of query block ``i = j − offsets[t]``, any rows where that
    block is out of range: masked; the (rel, doc) pairs of a packed row), the results leave through
    ``emit(c0, dk, dv)`` and, with a bias, each score tile's dS through ``db_add(t, r0, c0, dS)``."""
    for c0 in range(0, g.W, g.Tk):
        cols = slice(c0, c0 + g.Tk)
        k, v, ks = k_at(c0)
        dk = jnp.zeros((g.Tk, k.shape[-1]), f32)
        dv = jnp.zeros((g.Tk, v.shape[-1]), f32)
        for t, o in enumerate(g.offsets):
            i = j - o
            ok = (i >= 0) & (i < nq)
            for r0, rows in _row_tiles(g):
                q, do, lse, delta, qs = q_at(t, i, r0)
                sg = None if qs is None else _Seg(qs[0], qs[1], ks[0], ks[1])
                s, valid = _local_scores(g, q, k, _bias(bias_ref, t, rows, cols), i, j, ok, c0, r0, sg)
                pd, ds = _grad_tile(s, valid, lse, delta, do, v, _local_drop(g, seed, i, r0, j, c0, sg))
                dv = dv + _tn(pd.astype(do.dtype), do)
                dk = dk + _tn(ds.astype(q.dtype), q)
                if db_add is not None:
                    db_add(t, r0, c0, ds)
        emit(c0, dk, dv)


def _dkey_kernel_tpu(*refs, g: _Geo):
    """TPU key-side pass, grid ``(BH, nq)``: local dk, dv of key block ``j`` (the query blocks that see it arrive
    through clamped index maps) and, with a bias, its gradient summed over the row's key blocks in a resident
    ``[n_lt, W, W]`` output block (key axis ``arbitrary``)."""
    n_lt = len(g.offsets)
    n_per = 6 if g.packed else 4  # q, dO, lse, Δ (and a packed row's query positions and documents)
    k_ref, v_ref = refs[0], refs[1]
    per = [refs[2 + n_per * t: 2 + n_per * (t + 1)] for t in range(n_lt)]
    rest = refs[2 + n_per * n_lt:]
    bias_ref = seed = kseg = None
    if g.has_bias:
        bias_ref, rest = rest[0], rest[1:]
    if g.rate > 0:
        seed, rest = rest[0][...], rest[1:]
    if g.packed:  # the key block's own positions and documents, rows [1, W]
        kseg, rest = rest[:2], rest[2:]
    dk_ref, dv_ref = rest[0], rest[1]
    db_ref = rest[2] if g.has_bias else None
    j = pl.program_id(1)
    db_add = None
    if db_ref is not None:
        @pl.when(j == 0)
        def _():
            db_ref[...] = jnp.zeros(db_ref.shape, f32)

        def db_add(t, r0, c0, ds):
            db_ref[t, r0:r0 + g.Tq, c0:c0 + g.Tk] += ds

    def emit(c0, dk, dv):
        dk_ref[c0:c0 + g.Tk, :] = dk.astype(dk_ref.dtype)
        dv_ref[c0:c0 + g.Tk, :] = dv.astype(dv_ref.dtype)

    def k_at(c0):
        ks = None if kseg is None else tuple(r[:, c0:c0 + g.Tk] for r in kseg)
        return k_ref[c0:c0 + g.Tk, :], v_ref[c0:c0 + g.Tk, :], ks

    def q_at(t, i, r0):
        got = tuple(r[r0:r0 + g.Tq, :] for r in per[t])
        return got[:4] + ((got[4:] if g.packed else None),)

    _dkv_tiles(g, j, pl.num_programs(1), k_at, q_at, bias_ref, seed, emit, db_add)


def _dkey_kernel_gpu(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, kh_ref, beta_ref, *rest, g: _Geo, nq: int):
    """GPU key-side pass, grid ``(BH, nq + Cp/Tc)`` (Triton grids have no sequential axis): programs ``j < nq``
    take local key block ``j`` (dk, dv; the bias gradient added atomically into the row's ``[n_lt, W, W]`` block),
    programs ``j >= nq`` chunk tile ``j − nq``, looping over the query blocks that see it (dk̂, dβ). Operands are
    whole rows, sliced in the body."""
    rest = list(rest)
    bias_ref = rest.pop(0) if g.has_bias else None
    if g.has_bias:
        rest.pop(0)  # the zeros the bias gradient's output aliases
    seed = rest.pop(0)[...] if g.rate > 0 else None
    segs = None
    if g.packed:  # whole rows: the queries' (rel, doc) [Lp, 1], the keys' [1, Lp], the chunks' [1, Cp]
        segs, rest = rest[:6], rest[6:]
    dk_ref, dv_ref, dkh_ref, dbeta_ref = rest[:4]
    db_ref = rest[4] if g.has_bias else None
    j = pl.program_id(1)

    def q_seg(rows):
        return None if segs is None else (segs[0][rows, :], segs[1][rows, :])

    @pl.when(j < nq)
    def _():
        def q_at(t, i, r0):
            rows = pl.ds(pl.multiple_of(jnp.clip(i, 0, nq - 1) * g.W + r0, g.Tq), g.Tq)
            return q_ref[rows, :], do_ref[rows, :], lse_ref[rows, :], dl_ref[rows, :], q_seg(rows)

        def keys(c0):
            return pl.ds(pl.multiple_of(j * g.W + c0, g.Tk), g.Tk)

        def k_at(c0):
            ks = None if segs is None else (segs[2][:, keys(c0)], segs[3][:, keys(c0)])
            return k_ref[keys(c0), :], v_ref[keys(c0), :], ks

        def emit(c0, dk, dv):
            dk_ref[keys(c0), :] = dk.astype(dk_ref.dtype)
            dv_ref[keys(c0), :] = dv.astype(dv_ref.dtype)

        def db_add(t, r0, c0, ds):
            pltriton.atomic_add(db_ref, (pl.ds(t, 1), pl.ds(r0, g.Tq), pl.ds(c0, g.Tk)), ds[None])

        _dkv_tiles(g, j, nq, k_at, q_at, bias_ref, seed, emit, None if db_ref is None else db_add)

    @pl.when(j >= nq)
    def _():
        jc = j - nq
        ch = pl.ds(pl.multiple_of(jc * g.Tc, g.Tc), g.Tc)
        kh, beta = kh_ref[ch, :], beta_ref[ch, :]

        cs = None if segs is None else (segs[4][:, ch], segs[5][:, ch])

        def body(i, acc):
            for r0, _ in _row_tiles(g):
                rows = pl.ds(pl.multiple_of(i * g.W + r0, g.Tq), g.Tq)
                q, do = q_ref[rows, :], do_ref[rows, :]
                qs = q_seg(rows)
                sg = None if qs is None else _Seg(qs[0], qs[1], cs[0], cs[1])
                s, valid = _chunk_scores(g, q, kh, i, jc * g.Tc, r0, sg)
                pd, ds = _grad_tile(s, valid, lse_ref[rows, :], dl_ref[rows, :], do, beta,
                                    _chunk_drop(g, seed, i, r0, jc * g.Tc, sg))
                acc = (acc[0] + _tn(ds.astype(q.dtype), q), acc[1] + _tn(pd.astype(do.dtype), do))
            return acc

        init = (jnp.zeros((g.Tc, dkh_ref.shape[-1]), f32), jnp.zeros((g.Tc, dbeta_ref.shape[-1]), f32))
        dkh, dbeta = jax.lax.fori_loop(_first_query_block(g, jc), nq, body, init)
        dkh_ref[ch, :] = dkh
        dbeta_ref[ch, :] = dbeta


# ----------------------------------------------------------------------------- pallas_call wrappers
def _compiler_params(platform, semantics, g: _Geo | None = None):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT_BYTES)
    if platform in ("gpu", "cuda"):
        warps = 4 if g is None else g.num_warps
        return pltriton.CompilerParams(num_warps=warps, num_stages=2)
    return None


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, platform, semantics, aliases=None):
    g = kernel.keywords["g"]
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, input_output_aliases=aliases or {},
                          compiler_params=None if interpret else _compiler_params(platform, semantics, g))


def _seed_spec(seeds):
    """The row's dropout seed, a [1, 1] block of ``seeds [BH, 1, 1]`` (None without dropout)."""
    return [] if seeds is None else [pl.BlockSpec((None, 1, 1), lambda bh, i: (bh, 0, 0))]


def _bias_spec(bias, heads: int):
    """The bias tiles of the row's head (or the one table the heads share), a whole block."""
    hmap = (lambda bh, i: (bh % heads, 0, 0, 0)) if bias.shape[0] > 1 else (lambda bh, i: (0, 0, 0, 0))
    return pl.BlockSpec((None,) + bias.shape[1:], hmap)


def _row_block(shape):
    """A row's whole ``[·, ·]`` block of a ``[BH, ·, ·]`` operand (or ``[BH, ·, ·, ·]``)."""
    return pl.BlockSpec((None,) + tuple(shape[1:]), lambda bh, i: (bh,) + (0,) * (len(shape) - 1))


def _batch(bh, heads: int):
    """The batch row of grid row ``bh`` (a packed row's operands are per batch row, shared by its heads)."""
    return jax.lax.div(bh, jnp.asarray(heads, jnp.int32))


def _seg_query_spec(W: int, heads: int, shift: int = 0, nq: int = 0):
    """A query block's own positions or documents ``[W, 1]`` of ``[B, Lp, 1]``; ``shift``: block ``i − shift``
    (clamped to ``[0, nq)``), as the key-side pass takes the query blocks that see its key block."""
    if not shift:
        return pl.BlockSpec((None, W, 1), lambda bh, i: (_batch(bh, heads), i, 0))
    return pl.BlockSpec((None, W, 1), lambda bh, i: (_batch(bh, heads), jnp.clip(i - shift, 0, nq - 1), 0))


def _seg_key_spec(W: int, heads: int, offset: int, nq: int):
    """Key block ``i + offset``'s (clamped) own positions or documents, a row ``[1, W]`` of ``[B, nq, 1, W]``."""
    return pl.BlockSpec((None, None, 1, W),
                        lambda bh, i: (_batch(bh, heads), jnp.clip(i + offset, 0, nq - 1), 0, 0))


def _seg_row_spec(shape, heads: int):
    """A batch row's whole block of a ``[B, ·, ·]`` packed-row operand."""
    return pl.BlockSpec((None,) + tuple(shape[1:]), lambda bh, i: (_batch(bh, heads), 0, 0))


def _qside(g: _Geo, q, k, v, kh, beta, bias, seeds, seg, heads, extra, kernel, outs, interpret, platform,
           out_specs=None, semantics=("parallel", "parallel")):
    """Run a kernel on grid (BH, nq) with the query block, its local key blocks, the whole chunk summaries,
    the bias tiles, the row's dropout seed, a packed row's operands ``seg`` (:func:`eva_attend`; or None) and
    ``extra`` per-query-block inputs ``[(array, cols)]``; outputs per query block unless ``out_specs`` says
    otherwise."""
    BH, Lp, d = q.shape
    dv, W = v.shape[-1], g.W
    nq = Lp // W
    specs = [pl.BlockSpec((None, W, d), lambda bh, i: (bh, i, 0))]
    args = [q]
    for o in g.offsets:
        blk = lambda bh, i, o=o: (bh, jnp.clip(i + o, 0, nq - 1), 0)  # noqa: E731
        specs += [pl.BlockSpec((None, W, d), blk), pl.BlockSpec((None, W, dv), blk)]
        args += [k, v]
    specs += [_row_block(kh.shape), _row_block(beta.shape)]
    args += [kh, beta]
    if bias is not None:
        specs.append(_bias_spec(bias, heads))
        args.append(bias)
    specs += _seed_spec(seeds)
    args += [] if seeds is None else [seeds]
    if seg is not None:
        q_rel, q_doc, k_rel, k_doc, c_rel, c_doc = seg
        specs += [_seg_query_spec(W, heads)] * 2
        args += [q_rel, q_doc]
        for o in g.offsets:
            specs += [_seg_key_spec(W, heads, o, nq)] * 2
            args += [k_rel, k_doc]
        specs += [_seg_row_spec(c_rel.shape, heads)] * 2
        args += [c_rel, c_doc]
    for arr in extra:
        specs.append(pl.BlockSpec((None, W, arr.shape[-1]), lambda bh, i: (bh, i, 0)))
        args.append(arr)
    if out_specs is None:
        out_specs = [pl.BlockSpec((None, W, s.shape[-1]), lambda bh, i: (bh, i, 0)) for s in outs]
    return _call(functools.partial(kernel, g=g), (BH, nq), specs, out_specs, outs, interpret, platform,
                 semantics)(*args)


def _forward(g, q, k, v, kh, beta, bias, seeds, seg, heads, interpret, platform):
    BH, Lp, _ = q.shape
    outs = [jax.ShapeDtypeStruct((BH, Lp, v.shape[-1]), v.dtype), jax.ShapeDtypeStruct((BH, Lp, 1), f32)]
    return _qside(g, q, k, v, kh, beta, bias, seeds, seg, heads, [], _fwd_kernel, outs, interpret, platform)


def _dq(g, q, k, v, kh, beta, bias, seeds, seg, heads, do, lse, delta, interpret, platform, chunk_grads: bool):
    """The query-side pass: dq, and with ``chunk_grads`` (TPU form) dk̂, dβ in fp32."""
    W = g.W
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((None, W, q.shape[-1]), lambda bh, i: (bh, i, 0))]
    if chunk_grads:
        outs += [jax.ShapeDtypeStruct(kh.shape, f32), jax.ShapeDtypeStruct(beta.shape, f32)]
        out_specs += [_row_block(kh.shape), _row_block(beta.shape)]
    return _qside(g, q, k, v, kh, beta, bias, seeds, seg, heads, [do, lse, delta],
                  functools.partial(_dq_kernel, chunk_grads=chunk_grads), outs, interpret, platform, out_specs,
                  ("parallel", "arbitrary") if chunk_grads else ("parallel", "parallel"))


def _dkey_tpu(g, q, k, v, bias, seeds, seg, heads, do, lse, delta, interpret, platform):
    """The TPU key-side pass: (dk, dv, bias gradient per row ``[BH, n_lt, W, W]`` fp32 or None)."""
    BH, Lp, d = q.shape
    dv, W = v.shape[-1], g.W
    nq = Lp // W
    own = lambda bh, j: (bh, j, 0)  # noqa: E731
    specs = [pl.BlockSpec((None, W, d), own), pl.BlockSpec((None, W, dv), own)]
    args = [k, v]
    for o in g.offsets:
        blk = lambda bh, j, o=o: (bh, jnp.clip(j - o, 0, nq - 1), 0)  # noqa: E731
        specs += [pl.BlockSpec((None, W, d), blk), pl.BlockSpec((None, W, dv), blk),
                  pl.BlockSpec((None, W, 1), blk), pl.BlockSpec((None, W, 1), blk)]
        args += [q, do, lse, delta]
        if seg is not None:  # the query blocks' own positions and documents
            specs += [_seg_query_spec(W, heads, o, nq)] * 2
            args += [seg[0], seg[1]]
    outs = [jax.ShapeDtypeStruct((BH, Lp, d), k.dtype), jax.ShapeDtypeStruct((BH, Lp, dv), v.dtype)]
    out_specs = [pl.BlockSpec((None, W, d), own), pl.BlockSpec((None, W, dv), own)]
    if bias is not None:
        specs.append(_bias_spec(bias, heads))
        args.append(bias)
        outs.append(jax.ShapeDtypeStruct((BH,) + bias.shape[1:], f32))
        out_specs.append(_row_block(outs[-1].shape))
    specs += _seed_spec(seeds)
    args += [] if seeds is None else [seeds]
    if seg is not None:  # the key block's own
        specs += [_seg_key_spec(W, heads, 0, nq)] * 2
        args += [seg[2], seg[3]]
    res = _call(functools.partial(_dkey_kernel_tpu, g=g), (BH, nq), specs, out_specs, outs, interpret, platform,
                ("parallel", "arbitrary" if bias is not None else "parallel"))(*args)
    return res[0], res[1], (res[2] if bias is not None else None)


def _dkey_gpu(g, q, k, v, kh, beta, bias, seeds, seg, heads, do, lse, delta, interpret, platform):
    """The GPU key-side pass: (dk, dv, dk̂, dβ, bias gradient per row ``[BH, n_lt, W, W]`` fp32 or None)."""
    BH, Lp, d = q.shape
    dv, Cp = v.shape[-1], kh.shape[1]
    nq, nct = Lp // g.W, Cp // g.Tc
    args = [q, k, v, do, lse, delta, kh, beta]
    specs = [_row_block(x.shape) for x in args]
    outs = [jax.ShapeDtypeStruct((BH, Lp, d), k.dtype), jax.ShapeDtypeStruct((BH, Lp, dv), v.dtype),
            jax.ShapeDtypeStruct(kh.shape, f32), jax.ShapeDtypeStruct(beta.shape, f32)]
    aliases = {}
    if bias is not None:
        db0 = jnp.zeros((BH,) + bias.shape[1:], f32)  # the atomic sums start from zero
        specs += [_bias_spec(bias, heads), _row_block(db0.shape)]
        args += [bias, db0]
        aliases = {len(args) - 1: len(outs)}
        outs.append(jax.ShapeDtypeStruct(db0.shape, f32))
    specs += _seed_spec(seeds)
    args += [] if seeds is None else [seeds]
    if seg is not None:  # whole rows: the queries' [Lp, 1], the keys' as one row [1, Lp], the chunks' [1, Cp]
        rows = (seg[0], seg[1]) + tuple(x.reshape(x.shape[0], 1, Lp) for x in seg[2:4]) + tuple(seg[4:])
        specs += [_seg_row_spec(x.shape, heads) for x in rows]
        args += list(rows)
    out_specs = [_row_block(s.shape) for s in outs]
    res = _call(functools.partial(_dkey_kernel_gpu, g=g, nq=nq), (BH, nq + nct), specs, out_specs, outs, interpret,
                platform, ("parallel", "parallel"), aliases)(*args)
    return tuple(res) + ((None,) if bias is None else ())


# ----------------------------------------------------------------------------- differentiable entry
@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _attend(q, k, v, kh, beta, bias, seeds, seg, g, heads, interpret, platform, form):
    o, lse = _forward(g, q, k, v, kh, beta, bias, seeds, seg, heads, interpret, platform)
    return o, lse


def _attend_fwd(q, k, v, kh, beta, bias, seeds, seg, g, heads, interpret, platform, form):
    o, lse = _forward(g, q, k, v, kh, beta, bias, seeds, seg, heads, interpret, platform)
    return (o, lse), (q, k, v, kh, beta, bias, seeds, seg, o, lse)


def _attend_bwd(g, heads, interpret, platform, form, res, cts):
    q, k, v, kh, beta, bias, seeds, seg, o, lse = res
    do = cts[0].astype(v.dtype)  # dO in the compute dtype (a product operand of every backward kernel)
    # dS = P ⊙ (D ⊙ dP − Δ) + P ⊙ dlse with Δ = rowsum(dO ⊙ O) (O already holds the dropout D): a cotangent on the
    # log-sum-exp enters as a shift of Δ; Δ in fp32 (a statistic)
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1, keepdims=True) - cts[1].astype(f32)
    # two passes (module docstring): query side, then key side
    if form == "tpu":
        dq, dkh, dbeta = _dq(g, q, k, v, kh, beta, bias, seeds, seg, heads, do, lse, delta, interpret, platform,
                             True)
        dk, dv, db = _dkey_tpu(g, q, k, v, bias, seeds, seg, heads, do, lse, delta, interpret, platform)
    else:
        (dq,) = _dq(g, q, k, v, kh, beta, bias, seeds, seg, heads, do, lse, delta, interpret, platform, False)
        dk, dv, dkh, dbeta, db = _dkey_gpu(g, q, k, v, kh, beta, bias, seeds, seg, heads, do, lse, delta,
                                           interpret, platform)
    dbias = None
    if bias is not None:  # per row [BH, n_lt, W, W] -> per head, or one table shared by the heads
        BH = q.shape[0]
        db = db.reshape((BH // heads, heads) + db.shape[1:]).sum(axis=0)
        dbias = (db if bias.shape[0] > 1 else db.sum(axis=0, keepdims=True)).astype(bias.dtype)
    cast = lambda x, ref: x.astype(ref.dtype)  # noqa: E731
    return cast(dq, q), cast(dk, k), cast(dv, v), cast(dkh, kh), cast(dbeta, beta), dbias, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def eva_attend(q, k, v, k_hat, beta, bias, *, W: int, e_l: int, e_r: int, P: int, L: int, causal: bool,
               disjoint: bool, heads: int, dropout_rate: float = 0.0, seeds=None, interpret: bool = False,
               platform: str | None = None, key_tile: int | None = None, query_tile: int | None = None,
               chunk_tile: int | None = None, num_warps: int | None = None, segments=None, chunk_base: int = 0):
    """Phase B by the kernels; same contract as :func:`eva_attend_reference` (kernel operands, ``q`` pre-scaled):
    returns ``(o [BH, Lp, dv], lse [BH, Lp])``, ``o`` in the compute dtype (that of q, k, v, to which k̂, β and the
    bias are cast: module docstring) and ``lse`` in fp32, both differentiable in q, k, v, k̂, β and the bias.

    ``dropout_rate`` > 0 with ``seeds`` (int32 ``[BH]``, :func:`pallas_kernels.hash_dropout.row_seeds`): attention
    dropout on the normalised weights by the hash mask of the module docstring, the same in the backward.
    ``platform`` ('tpu' | 'cuda'; default: the default backend) picks the compiler parameters, the form of
    the backward passes and the tiles (GPU: :func:`gpu_plan`); in interpret mode it picks only those
    (default the TPU form). ``key_tile`` / ``query_tile`` / ``chunk_tile`` / ``num_warps`` (None or <= 0: the plan's)
    override the local key sub-tile, the query sub-tile (both must divide W), the chunk tile (a power of two >= 16)
    and the GPU warps: execution settings for sweeps; an override is not checked against the register or VMEM
    estimates (the compiler has the last word).

    ``segments`` (a packed row laid out again on the window grid, as EVA's ``packed.py`` lays it out; None: one
    sequence): int32 ``(rel [B, Lp], q_doc [B, Lp], k_doc [B, Lp], c_rel [B, C], c_doc [B, C])`` with ``B = BH /
    heads``: each position's own index in its document, its document as a query and as a key, each chunk's own
    index in its document and its document (negative: none; the reference's ``segments``). A key or chunk counts for a query only
    where their documents are equal; causal chunk visibility, the disjoint partition and the dropout counters take
    the documents' own indices; the window and causal masks of local keys stay the layout's (a document keeps its
    window there). Then ``L`` must be ``Lp`` (the documents mark what is real), all ``C = k_hat.shape[1]`` chunks
    are given, and ``chunk_base`` of them come first out of the layout's order (a carried state's chunks): the
    causal loops take them for every query block; layout chunk ``c`` is ``chunk_base + c``. Without ``segments``
    the kernels take no extra operand (unchanged programs)."""
    BH, Lp, d = q.shape
    dv = v.shape[-1]
    C = -(-L // P) if segments is None else k_hat.shape[1]
    if segments is not None and L != Lp:
        raise ValueError(f"eva_attend: a packed row takes L = Lp (got L={L}, Lp={Lp})")
    if Lp % W or Lp < L:
        raise ValueError(f"eva_attend: padded length {Lp} must be a multiple of W={W} and >= L={L}")
    if not 0.0 <= dropout_rate < 1.0 or (dropout_rate > 0) != (seeds is not None):
        raise ValueError(f"eva_attend: dropout_rate={dropout_rate} needs seeds (and seeds a rate in (0, 1))")
    plat = platform or {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    dtype = compute_dtype(q, k, v)
    reasons = unsupported_reasons("interpret" if interpret else plat, W=W, d=d, dv=dv, C=C, e_l=e_l, e_r=e_r,
                                  dtype=dtype, dropout=dropout_rate > 0)
    if not interpret and plat == "cpu":
        reasons = ["Pallas runs on CPU only with interpret=True"] + reasons
    if reasons:
        raise ValueError("eva_attend cannot run: " + "; ".join(reasons))
    gpu = plat in ("cuda", "gpu")
    if gpu:
        plan = gpu_plan(W=W, d=d, dv=dv, C=C, itemsize=jnp.dtype(dtype).itemsize, dropout=dropout_rate > 0)
    else:  # TPU: one [W, W] score tile per local block, chunk tiles of up to 128
        plan = GpuPlan(W, W, _chunk_tile_rule(C, 128), 4, 0.0)
    if chunk_tile is not None and chunk_tile > 0:
        if chunk_tile < 16 or chunk_tile & (chunk_tile - 1):
            raise ValueError(f"eva_attend: chunk_tile={chunk_tile} must be a power of two >= 16")
        plan = dataclasses.replace(plan, Tc=chunk_tile)
    if num_warps is not None and num_warps > 0:
        plan = dataclasses.replace(plan, num_warps=num_warps)
    Tc = plan.Tc
    Cp = -(-C // Tc) * Tc
    # every operand of the kernels' products in the compute dtype (module docstring); the identity under fp32
    q, k, v, k_hat, beta = (x.astype(dtype) for x in (q, k, v, k_hat, beta))
    bias = None if bias is None else bias.astype(dtype)
    kh = jnp.pad(k_hat[:, :C], ((0, 0), (0, Cp - C), (0, 0)))
    bt = jnp.pad(beta[:, :C], ((0, 0), (0, Cp - C), (0, 0)))
    offsets = local_offsets(e_l, e_r)
    if bias is not None and bias.shape[1] != len(offsets):
        raise ValueError(f"eva_attend: bias has {bias.shape[1]} tiles for {len(offsets)} key-block offsets")
    if bias is not None and len(offsets) & (len(offsets) - 1):  # Triton blocks: a power-of-two tile count
        bias = jnp.pad(bias, ((0, 0), (0, (1 << (len(offsets) - 1).bit_length()) - len(offsets)), (0, 0), (0, 0)))
    Tk = key_tile if key_tile is not None and key_tile > 0 else plan.Tk
    Tq = query_tile if query_tile is not None and query_tile > 0 else plan.Tq
    if W % Tk or W % Tq:
        raise ValueError(f"eva_attend: key_tile={Tk} and query_tile={Tq} must divide W={W}")
    seg = None
    if segments is not None:  # the kernels' layouts: query columns, key-block rows, chunk rows (padding: no doc)
        rel, q_doc, k_doc, c_rel, c_doc = (jnp.asarray(x, jnp.int32) for x in segments)
        B, nq = rel.shape[0], Lp // W
        # a negative document is none: distinct for queries, keys and chunks, so that none of them ever meet
        q_doc, k_doc, c_doc = (jnp.where(x < 0, none, x) for x, none in ((q_doc, -2), (k_doc, -1), (c_doc, -3)))
        pad_c = lambda x: jnp.pad(x[:, :C], ((0, 0), (0, Cp - C)), constant_values=-3)[:, None]  # noqa: E731
        seg = (rel[..., None], q_doc[..., None], rel.reshape(B, nq, 1, W), k_doc.reshape(B, nq, 1, W),
               pad_c(c_rel), pad_c(c_doc))
    g = _Geo(W, P, L, C, Tc, Tk, Tq, plan.num_warps, offsets, causal, disjoint, e_l, e_r, bias is not None,
             float(dropout_rate), segments is not None, int(chunk_base) if segments is not None else 0)
    sd = None if seeds is None else jnp.asarray(seeds, jnp.int32).reshape(BH, 1, 1)
    form = "loop" if gpu else "tpu"
    o, lse = _attend(q, k, v, kh, bt, bias, sd, seg, g, heads, interpret, None if interpret else plat, form)
    return o, lse[..., 0]


__all__ = ["DTYPES", "PLAN", "PLATFORMS", "VMEM_LIMIT_BYTES", "GpuPlan", "chunk_tile", "eva_attend", "eva_attend_reference",
           "gpu_plan", "unsupported_reasons", "vmem_bytes"]

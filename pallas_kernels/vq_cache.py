"""Transformer-VQ "compressive VQ cache attention" as Pallas kernels (docs/methods/transformer_vq.md §9): the TPU (Mosaic)
kernels here, and the entry point for both forms.

Which form runs where (:func:`vq_cache_attention`): ``platform='tpu'`` (or None / the default backend on TPU) runs
the TPU kernels of this module; ``platform='cuda'`` (or ``'gpu'``) runs the two-phase Pallas-Triton form of
:mod:`pallas_kernels.vq_cache_gpu` (per-code cache prefix in XLA, then parallel-grid forward and backward kernels).
``interpret=True`` runs the same form in Pallas interpret mode: the GPU form with ``platform='cuda'``, the TPU form
otherwise (platform None, 'tpu' or 'cpu'). :func:`unsupported_reasons` answers for both ('tpu' here, 'cuda' from
``vq_cache_gpu.unsupported_reasons``).

The reference both must match is :func:`pallas_kernels.vq_cache_ref.vq_cache_attention_reference`
(``causal_parallel`` with ``reduction='serial'``: lag-2 per-code cache, exact previous block, causal present
block, one shared softmax). This module imports only JAX, NumPy, that reference and the GPU form.

Layout. Stage 0 stays in XLA (and is differentiated by JAX): the blocked queries, the extended key/value/code
arrays (the carried band is prepended as extended block 0, so extended block ``e`` is block ``e-1``) and the
band bias ``[B·H, R, L, 2L]`` (its previous-block and present-block halves, read as one (L, 2L) block). Because
the bias and the band validity are precomputed, any ``1 <= M <= L`` works. The kernels:

* **forward** -- grid ``(B·H, R, Dv/tv)``, semantics ``("parallel", "arbitrary", "arbitrary")``. At ``j = 0``
  of query block ``r`` the probabilities of the three groups (cache ``q_u·Cᵀ + log N``, previous block,
  causal present block; one softmax) are computed once into VMEM scratch; every Dv tile ``j`` then reads them
  (no logit recomputation per tile), writes ``o[:, tile j]`` and folds block ``r-1`` into its slice of the
  per-code running mean ``μ`` (VMEM scratch ``[Dv/tv, S, tv]`` f32) through a one-hot ``[S, L]`` matmul
  (after the output: lag 2). The counts ``N`` advance at the last tile. ``μ`` and ``N`` start from the carried
  state at ``r = 0``; the final ``μ, N`` are written at the last step.
* **backward** (flash-style, recomputing the probabilities; no ``[R, S, Dv]`` tensor is ever stored):
  pass 1, same grid and order as the forward (it needs ``μ_r``), accumulates ``dP = dO·Vᵀ`` over the Dv
  tiles, writes the local ``dv = Pᵀ·dO`` per tile and, at the last tile, ``dS = P ⊙ (dP − rowsum(P ⊙ dP))``,
  ``dq, dk̂`` (previous / present halves), ``dBP, dBR`` and the row log-sum-exp; pass 2 runs the query
  blocks in reverse (grid ``(B·H, Dv/tv, R)``) and carries ``h_r = ∂/∂μ_r / max(N_r, 1)`` to give the fold's
  ``dv`` (``onehotᵀ·h_{r+1}``) and ``∂/∂μ_0``: ``h_r = (P_cᵀ·dO_r + N_r h_{r+1}) / max(N_r, 1)``, with the
  counts stepped back exactly. No gradient reaches the codebook or the counts (§9).

Dtypes: inputs fp32 or bf16 (q, k̂, v stored in bf16 when they and the carried band are all bf16; never round a
wider input). With bf16 storage every product takes bf16 MXU operands with fp32 accumulation: ``q·k̂ᵀ``, the
one-hot folds, ``P·V`` and ``P·μ`` (the probabilities and the fp32 running means cast down first), ``dO·Vᵀ``,
``dS·k̂``, ``dSᵀ·q``, ``Pᵀ·dO``; dO, the carried means and their cotangent enter in bf16 (the running means stay
fp32 in VMEM). The cache scores ``q·Cᵀ`` and ``dS·C`` take the codebook as given: bf16 when it is bf16 (the layer
casts it to its compute dtype), else fp32 (never rounded). Softmax statistics, the bias, ``μ`` and ``N`` are fp32;
the count products with the one-hot are declared statistics (``precision.statistic``). The output and state are in
``promote(dtype, float32)`` like the reference.

Packed rows (segment ids, ``packed``; docs/methods/transformer_vq.md §2.8): both forms serve them on the row's own
block grid, every score masked to the query's document, each row block reading one cache: that of the document
holding its first token, over its keys before the previous row block (lag 2 on the row's grid), the carried
document's cache and band merged first where the row opens with it (the split of
``longctx.attention.transformer_vq.xla.kernel_packed``; forward it equals every document's own grid, and the keys
take ``dk̂`` only from the queries whose own window holds them). The GPU form takes those caches from XLA
(:mod:`pallas_kernels.vq_cache_gpu`). The TPU kernels here keep folding the cache inside the kernel and restart it
at documents instead, from the small int32 document arrays of ``xla.kernel_documents`` (per query block ``[L, 3]``:
document start, reads-the-cache flag, own window's start; per extended key block ``[3, L]``: document start or -1,
taken-by-the-fold flag, continue-or-restart flag): a fold that restarts starts from zero means and counts, and only
the queries of the block's first document read the running cache, where that document began before the previous row
block. Why this and not the GPU form's caches: those are ``[B, H, R, S, Dv]`` in HBM (a mean per row block, built by
an XLA scan), which this form never stores, forward or backward; the fold here stays in VMEM, and what a packed row
adds is O(T) int32 and, per step of pass 1, the counts ``[S]`` its blocks read (pass 2 cannot step the counts back
across a restart, so it reads them: ``[B·H, R, S]`` f32, less than the band bias ``[B·H, R, L, 2L]`` this form
already takes; no ``[.., L, L]`` array is added). Pass 1 also visits the row block before the previous one (its
queries' own windows reach it, while the row's grid holds those keys in the cache): ``dk̂`` only, recomputing
``P = exp(q·k̂ − lse)`` (no band bias at a distance over L; their ``dv`` is the cache's, pass 2), one more
``(L, Dk)`` key block, ``(L, tv)`` value tile and ``(L, L)`` f32 scratch, counted in the VMEM estimate. The new
state of a packed row is formed by the caller (``state.packed_final_state``); the kernel returns ``(o, None)``.

Final state: when ``T % L == 0``, ``M == L`` and the storage is fp32 the kernel's last fold *is* the new carried
aggregate;
otherwise the aggregate is computed in XLA by the reference's ``final_state``.

Support (:func:`unsupported_reasons`): on TPU (Mosaic), ``L % 8 == 0`` and a VMEM estimate computed from
the kernels' block shapes (double-buffered) plus scratch and the main in-body temporaries, against
``VMEM_LIMIT_BYTES``; ``tv`` is the largest of 512/256/128 dividing Dv that fits (Dv itself when it is not a
multiple of 128). On CUDA, the GPU form's reasons (Triton tile shapes, shared-memory / register estimate; see
:mod:`pallas_kernels.vq_cache_gpu`). No ROCm lowering. CPU runs only in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import vq_cache_gpu
from pallas_kernels.precision import statistic
from pallas_kernels.vq_cache_ref import (
    KERNEL_DTYPES,
    NEG,
    final_state,
    float_dtype,
    input_reasons,
    pad_left,
    pad_to,
    skew_bias,
    vq_cache_attention_reference,
)

LANES = 128
SUB = 8
VMEM_LIMIT_BYTES = 48 * 2**20  # passed to Mosaic as vmem_limit_bytes; the estimate must stay below it
TV_CANDIDATES = (512, 256, 128)
PLATFORMS = ("tpu", "cuda")  # 'tpu': the kernels of this module; 'cuda': pallas_kernels.vq_cache_gpu
DTYPES = KERNEL_DTYPES
f32 = jnp.float32
# the per-code counts folded and unfolded inside the kernels (products with a one-hot, exact integers): statistics
COUNTS = "per-code counts of the compressive cache (state)"
# a packed row's document arrays (longctx.attention.transformer_vq.xla.kernel_documents): per query (columns) its
# document's start, whether it reads its block's cache, its window's start; per extended key (rows) its document's
# start, whether its block's fold takes it, whether that fold continues the running cache (every lane)
QCOLS, KROWS = 3, 3


# ----------------------------------------------------------------------------- block plans (VMEM budget)
def _padded_bytes(shape, dtype) -> int:
    """Bytes of one VMEM buffer of this block: the last two dims rounded up to the (8, 128) tile."""
    shape = tuple(shape)
    if len(shape) == 1:
        shape = (1,) + shape
    lead = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    rows = -(-shape[-2] // SUB) * SUB
    cols = -(-shape[-1] // LANES) * LANES
    return lead * rows * cols * jnp.dtype(dtype).itemsize


def _plan(kind: str, *, L, S, Dk, Dv, tv, in_dtype, packed: bool = False):
    """(input blocks, output blocks, scratch, temporaries) as lists of (name, shape, dtype) for one kernel.
    The pallas_calls below build their BlockSpecs and scratch from these same shapes. ``packed``: a packed row's
    kernels (the document arrays; the backward's visit of the row block before the previous one and its per-step
    counts)."""
    n_tv = Dv // tv
    idt = jnp.dtype(in_dtype)
    i32 = jnp.int32
    docs = [("qdocs", (L, QCOLS), i32), ("kdocs_prev", (KROWS, L), i32), ("kdocs_pres", (KROWS, L), i32)]
    docs = docs if packed else []
    common_in = [("q", (L, Dk), idt), ("k_prev", (L, Dk), idt), ("k_pres", (L, Dk), idt),
                 ("v_prev", (L, tv), idt), ("v_pres", (L, tv), idt), ("z_prev", (1, L), jnp.int32),
                 ("valid_prev", (1, L), jnp.int32), ("valid_pres", (1, L), jnp.int32), ("C", (S, Dk), f32),
                 ("bias", (L, 2 * L), f32), ("mu0", (S, tv), idt),
                 ("n0_row", (SUB, S), f32), ("n0_col", (S, LANES), f32)]
    state_scratch = [("mu", (n_tv, S, tv), f32), ("n_row", (SUB, S), f32), ("n_col", (S, LANES), f32)]
    probs = [("p_cache", (L, S), f32), ("p_prev", (L, L), f32), ("p_pres", (L, L), f32)]
    logits_tmp = [("logits", (L, S + 2 * L), f32), ("exp", (L, S + 2 * L), f32), ("onehot", (S, L), f32)]
    if kind == "fwd":
        outs = [("o", (L, tv), f32), ("mu_fin", (S, tv), f32), ("n_fin", (SUB, S), f32)]
        return common_in + docs, outs, state_scratch + probs, logits_tmp + [("acc", (L, tv), f32)]
    if kind == "bwd1":
        ins = common_in + [("do", (L, tv), idt)]
        outs = [("lse", (L, LANES), f32), ("dq", (L, Dk), f32), ("dk_prev", (L, Dk), f32),
                ("dk_pres", (L, Dk), f32), ("dbias", (L, 2 * L), f32),
                ("dv_prev", (L, tv), f32), ("dv_pres", (L, tv), f32)]
        dprobs = [("dp_cache", (L, S), f32), ("dp_prev", (L, L), f32), ("dp_pres", (L, L), f32)]
        if packed:
            ins += docs + [("k_two", (L, Dk), idt), ("v_two", (L, tv), idt), ("kdocs_two", (KROWS, L), i32)]
            outs += [("dk_two", (L, Dk), f32), ("n_step_row", (1, S), f32), ("n_step_col", (S, 1), f32)]
            dprobs += [("dp_two", (L, L), f32)]
        return ins, outs, state_scratch + probs + dprobs, logits_tmp + [("ds", (L, S + 2 * L), f32)]
    if kind == "bwd2":
        ins = [("q", (L, Dk), idt), ("C", (S, Dk), f32), ("z_prev", (1, L), jnp.int32),
               ("valid_prev", (1, L), jnp.int32),
               ("lse", (L, LANES), f32), ("do", (L, tv), idt), ("gmu_fin", (S, tv), idt),
               ("n_fin_row", (SUB, S), f32), ("n_fin_col", (S, LANES), f32)]
        ins += docs[:2] + [("n_step_row", (1, S), f32), ("n_step_col", (S, 1), f32)] if packed else []
        outs = [("dv_fold", (L, tv), f32), ("dmu0", (S, tv), f32)]
        scratch = [("h", (S, tv), f32), ("n_row", (SUB, S), f32), ("n_col", (S, LANES), f32)]
        return ins, outs, scratch, [("p_cache", (L, S), f32), ("onehot", (S, L), f32), ("dmu", (S, tv), f32)]
    raise ValueError(kind)


def vmem_bytes(kind: str, *, L, S, Dk, Dv, tv, in_dtype=f32, packed: bool = False) -> int:
    """VMEM estimate of one kernel: 2 × (input + output blocks) for double buffering, plus scratch, plus the
    main in-body temporaries (logits, exponentials, one-hot), each padded to the (8, 128) tile."""
    ins, outs, scratch, tmp = _plan(kind, L=L, S=S, Dk=Dk, Dv=Dv, tv=tv, in_dtype=in_dtype, packed=packed)
    blocks = sum(_padded_bytes(s, d) for _, s, d in ins + outs)
    return 2 * blocks + sum(_padded_bytes(s, d) for _, s, d in scratch + tmp)


def _tv_options(Dv: int):
    opts = [t for t in TV_CANDIDATES if Dv % t == 0]
    return opts or [Dv]


def choose_block_v(*, L, S, Dk, Dv, in_dtype=f32, with_grad=True, limit=VMEM_LIMIT_BYTES, packed: bool = False):
    """(tv, bytes): the largest Dv tile whose kernels fit ``limit`` (bytes of the worst kernel), or (None, bytes
    of the smallest tile) when none fits. ``packed``: a packed row's kernels."""
    kinds = ("fwd", "bwd1", "bwd2") if with_grad else ("fwd",)
    best = None
    for tv in _tv_options(Dv):
        need = max(vmem_bytes(k, L=L, S=S, Dk=Dk, Dv=Dv, tv=tv, in_dtype=in_dtype, packed=packed) for k in kinds)
        best = (tv, need)
        if need <= limit:
            return tv, need
    return None, best[1]


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def unsupported_reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype=f32,
                        with_grad: bool = True, packed: bool = False) -> list[str]:
    """Why the kernel cannot serve these shapes on ``platform`` ('tpu' | 'cuda' | 'rocm' | 'interpret');
    empty when it can. 'interpret' (CPU, Pallas interpret mode) checks only what the kernel computes; 'cuda'
    returns the GPU form's reasons (:func:`pallas_kernels.vq_cache_gpu.unsupported_reasons`, whose budget a packed
    row does not change). ``packed``: a packed row (the TPU kernels' budget with their document arrays)."""
    if platform == "cuda":
        return vq_cache_gpu.unsupported_reasons("cuda", L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dtype, with_grad=with_grad)
    reasons = input_reasons(L=L, M=M, dtype=dtype)
    if platform == "interpret":
        return reasons
    if platform not in PLATFORMS:
        reasons.append(f"no {platform} lowering (kernel platforms: {', '.join(PLATFORMS)})")
        return reasons
    if L % SUB:
        reasons.append(f"TPU blocks need block_len % 8 == 0 (got L={L})")
    in_dtype = jnp.bfloat16 if _dtype_name(dtype) == "bfloat16" else f32
    tv, need = choose_block_v(L=L, S=S, Dk=Dk, Dv=Dv, in_dtype=in_dtype, with_grad=with_grad, packed=packed)
    if tv is None:
        reasons.append(f"VMEM estimate {need / 2**20:.1f} MiB at the smallest Dv tile exceeds the "
                       f"{VMEM_LIMIT_BYTES / 2**20:.0f} MiB limit (L={L}, S={S}, Dk={Dk}, Dv={Dv}, {_dtype_name(dtype)})")
    return reasons


# ----------------------------------------------------------------------------- kernel bodies
def _nt(a, b):
    """a @ b.T (contract the last dims), f32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=f32)


def _nn(a, b):
    return jnp.dot(a, b, preferred_element_type=f32)


def _tn(a, b):
    """a.T @ b, f32 accumulation."""
    return jnp.dot(a.T, b, preferred_element_type=f32)


def _code_operands(q, c):
    """The operands of ``q·Cᵀ``: the codebook as passed (the compute dtype when the caller gives it so) with the
    query in its dtype when they match, else both float32 (a float32 codebook is never rounded)."""
    return (q, c) if q.dtype == c.dtype else (q.astype(f32), c.astype(f32))


def _cache_logits(q, c, n_row, reads=None):
    """The cache logits ``q·Cᵀ + log N`` and which are read: the codes with a count (and, for a packed row, only by
    the queries that read the block's cache: ``reads`` (L, 1))."""
    has = n_row > 0.0  # (1, S)
    has = has if reads is None else has & reads
    s_c = _nt(*_code_operands(q, c)) + jnp.where(has, jnp.log(jnp.maximum(n_row, 1.0)), NEG)
    return jnp.where(has, s_c, NEG), has


def _probs(q, kp, kr, c, bp, br, n_row, valid_p, valid_r, L, reads=None):
    """Normalized probabilities of the three groups (same op order as the reference's softmax_mix). ``valid_p``,
    ``valid_r``: the keys' validity (1, L), or for a packed row the query-key document masks (L, L)."""
    s_c, has = _cache_logits(q, c, n_row, reads)
    s_p = _nt(q, kp) + bp
    s_r = _nt(q, kr) + br
    row = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
    mask_r = (col <= row) & valid_r
    s_p = jnp.where(valid_p, s_p, NEG)
    s_r = jnp.where(mask_r, s_r, NEG)
    m = jnp.maximum(jnp.maximum(jnp.max(s_c, axis=1, keepdims=True), jnp.max(s_p, axis=1, keepdims=True)),
                    jnp.max(s_r, axis=1, keepdims=True))
    a_c = jnp.where(has, jnp.exp(s_c - m), 0.0)
    a_p = jnp.where(valid_p, jnp.exp(s_p - m), 0.0)
    a_r = jnp.where(mask_r, jnp.exp(s_r - m), 0.0)
    den = jnp.maximum(jnp.sum(a_c, axis=1, keepdims=True) + jnp.sum(a_p, axis=1, keepdims=True)
                      + jnp.sum(a_r, axis=1, keepdims=True), 1e-30)
    inv = 1.0 / den
    return a_c * inv, a_p * inv, a_r * inv, m + jnp.log(den)


def _onehot(z_row, valid_row, S, L):
    codes = jax.lax.broadcasted_iota(jnp.int32, (S, L), 0)
    return (codes == z_row) & valid_row  # [S, L] bool


def _documents(packed: bool, n: int, rest):
    """A kernel's trailing refs: (its ``n`` document refs, or Nones, and the rest: outputs and scratch)."""
    return (tuple(rest[:n]), rest[n:]) if packed else ((None,) * n, rest)


def _masks(validp_ref, validr_ref, qd_ref, kdp_ref, kdr_ref):
    """(previous-block mask, the present-block mask's reader (called where the probabilities are formed), the
    queries that read the cache, the previous block's keys the fold takes, whether the fold continues the running
    cache). Unpacked: the keys' validity (1, L), every query reads the cache, the fold takes the valid keys and
    continues. Packed: the query-key document masks (L, L) (a padding key or an uncontinued band slot has document
    -1), and the document arrays' flags."""
    if qd_ref is None:
        valid_p = validp_ref[...] > 0
        return valid_p, lambda: validr_ref[...] > 0, None, valid_p, None
    qdoc, kdp = qd_ref[:, 0:1], kdp_ref[...]
    return (kdp[0:1, :] == qdoc, lambda: kdr_ref[0:1, :] == qd_ref[:, 0:1], qd_ref[:, 1:2] > 0, kdp[1:2, :] > 0,
            kdp[2:3, 0:1] > 0)


def _kept(x, keep):
    """The running counts a fold starts from: all of them, or none where a packed row's fold restarts."""
    return x if keep is None else jnp.where(keep, x, 0.0)


def _own_window(ds, e, qd_ref, L):
    """dS for k̂'s gradient: all of it, or for a packed row only where extended block ``e``'s key lies in the
    query's own window (from ``qwin`` on; the keys before it are in the query's cache in its document's grid)."""
    if qd_ref is None:
        return ds
    key_at = e * L + jax.lax.broadcasted_iota(jnp.int32, ds.shape, 1)
    return jnp.where(key_at >= qd_ref[:, 2:3], ds, 0.0)


def _fold(mu_s, j, onehot, vp, ncol_old):
    """μ[j] ← μ[j]·N/max(N',1) + onehot·v / max(N',1) for block r-1; returns the per-code count column."""
    blk = _nn(onehot.astype(vp.dtype), vp)  # [S, tv], exact one-hot sums, f32 accumulation
    with statistic(COUNTS):
        cnt_col = _nn(onehot.astype(f32), jnp.ones((onehot.shape[1], LANES), f32))  # [S, 128]
    n_new = ncol_old[:, 0:1] + cnt_col[:, 0:1]
    inv = 1.0 / jnp.maximum(n_new, 1.0)
    mu_s[j] = mu_s[j] * (ncol_old[:, 0:1] * inv) + blk * inv
    return cnt_col


def _init_state(r, j, mu_s, nrow_s, ncol_s, mu0_ref, n0row_ref, n0col_ref):
    @pl.when(r == 0)
    def _():
        mu_s[j] = mu0_ref[...].astype(f32)

    @pl.when((r == 0) & (j == 0))
    def _():
        nrow_s[...] = n0row_ref[...]
        ncol_s[...] = n0col_ref[...]


def _fwd_kernel(q_ref, kp_ref, kr_ref, vp_ref, vr_ref, zp_ref, validp_ref, validr_ref, c_ref, b_ref,
                mu0_ref, n0row_ref, n0col_ref, *rest, L: int, S: int, packed: bool = False):
    (qd_ref, kdp_ref, kdr_ref), rest = _documents(packed, 3, rest)
    o_ref, mufin_ref, nfin_ref, mu_s, nrow_s, ncol_s, pc_s, pp_s, pr_s = rest
    r, j = pl.program_id(1), pl.program_id(2)
    last_r, last_j = pl.num_programs(1) - 1, pl.num_programs(2) - 1
    _init_state(r, j, mu_s, nrow_s, ncol_s, mu0_ref, n0row_ref, n0col_ref)
    valid_p, valid_r, reads, fold_p, keep = _masks(validp_ref, validr_ref, qd_ref, kdp_ref, kdr_ref)

    @pl.when(j == 0)
    def _():
        pc, pp, pr, _ = _probs(q_ref[...], kp_ref[...], kr_ref[...], c_ref[...], b_ref[:, :L], b_ref[:, L:],
                               nrow_s[0:1, :], valid_p, valid_r(), L, reads)
        pc_s[...], pp_s[...], pr_s[...] = pc, pp, pr

    vp, vr = vp_ref[...], vr_ref[...]
    cd = vp.dtype  # the products' operands: the probabilities and cache means cast to the values' dtype
    out = (_nn(pc_s[...].astype(cd), mu_s[j].astype(cd)) + _nn(pp_s[...].astype(cd), vp)
           + _nn(pr_s[...].astype(cd), vr))
    o_ref[...] = out.astype(o_ref.dtype)
    onehot = _onehot(zp_ref[...], fold_p, S, L)
    ncol_old = _kept(ncol_s[...], keep)
    cnt_col = _fold(mu_s, j, onehot, vp, ncol_old)  # lag 2: after the output

    @pl.when(r == last_r)
    def _():
        mufin_ref[...] = mu_s[j]

    @pl.when(j == last_j)
    def _():
        ncol_s[...] = _kept(ncol_s[...], keep) + cnt_col
        with statistic(COUNTS):
            nrow_s[...] = _kept(nrow_s[...], keep) + _nt(jnp.ones((SUB, L), f32), onehot.astype(f32))

        @pl.when(r == last_r)
        def _():
            nfin_ref[...] = nrow_s[...]


def _bwd1_kernel(q_ref, kp_ref, kr_ref, vp_ref, vr_ref, zp_ref, validp_ref, validr_ref, c_ref, b_ref,
                 mu0_ref, n0row_ref, n0col_ref, do_ref, *rest, L: int, S: int, packed: bool = False):
    (qd_ref, kdp_ref, kdr_ref, k2_ref, v2_ref, kd2_ref), rest = _documents(packed, 6, rest)
    lse_ref, dq_ref, dkp_ref, dkr_ref, db_ref, dvp_ref, dvr_ref = rest[:7]
    dk2_ref, nsr_ref, nsc_ref = rest[7:10] if packed else (None,) * 3
    mu_s, nrow_s, ncol_s, pc_s, pp_s, pr_s, dpc_s, dpp_s, dpr_s = rest[10:19] if packed else rest[7:16]
    dp2_s = rest[19] if packed else None
    r, j = pl.program_id(1), pl.program_id(2)
    last_j = pl.num_programs(2) - 1
    _init_state(r, j, mu_s, nrow_s, ncol_s, mu0_ref, n0row_ref, n0col_ref)
    valid_p, valid_r, reads, fold_p, keep = _masks(validp_ref, validr_ref, qd_ref, kdp_ref, kdr_ref)

    @pl.when(j == 0)
    def _():
        pc, pp, pr, lse = _probs(q_ref[...], kp_ref[...], kr_ref[...], c_ref[...], b_ref[:, :L], b_ref[:, L:],
                                 nrow_s[0:1, :], valid_p, valid_r(), L, reads)
        pc_s[...], pp_s[...], pr_s[...] = pc, pp, pr
        lse_ref[...] = jnp.broadcast_to(lse, (L, LANES))
        dpc_s[...] = jnp.zeros_like(pc)
        dpp_s[...] = jnp.zeros_like(pp)
        dpr_s[...] = jnp.zeros_like(pr)
        if packed:  # the counts this block read (pass 2 cannot step them back across a restart)
            nsr_ref[...] = nrow_s[0:1, :]
            nsc_ref[...] = ncol_s[:, 0:1]
            dp2_s[...] = jnp.zeros_like(pp)

    do = do_ref[...]
    vp, vr = vp_ref[...], vr_ref[...]
    cd = do.dtype  # the products' operands (dO in the compute dtype; P, μ, v cast to it)
    dpc_s[...] += _nt(do, mu_s[j].astype(cd))
    dpp_s[...] += _nt(do, vp.astype(cd))
    dpr_s[...] += _nt(do, vr.astype(cd))
    if packed:
        dp2_s[...] += _nt(do, v2_ref[...].astype(cd))
    dvp_ref[...] = _tn(pp_s[...].astype(cd), do)
    dvr_ref[...] = _tn(pr_s[...].astype(cd), do)
    onehot = _onehot(zp_ref[...], fold_p, S, L)
    ncol_old = _kept(ncol_s[...], keep)
    cnt_col = _fold(mu_s, j, onehot, vp, ncol_old)

    @pl.when(j == last_j)
    def _():
        pc, pp, pr = pc_s[...], pp_s[...], pr_s[...]
        dpc, dpp, dpr = dpc_s[...], dpp_s[...], dpr_s[...]
        delta = (jnp.sum(pc * dpc, axis=1, keepdims=True) + jnp.sum(pp * dpp, axis=1, keepdims=True)
                 + jnp.sum(pr * dpr, axis=1, keepdims=True))  # = rowsum(dO ⊙ O)
        dsc, dsp, dsr = pc * (dpc - delta), pp * (dpp - delta), pr * (dpr - delta)
        q, kp, kr = q_ref[...], kp_ref[...], kr_ref[...]  # the compute dtype: dS cast to it
        _, c = _code_operands(q, c_ref[...])
        kd = kp.dtype
        dq_ref[...] = _nn(dsc.astype(c.dtype), c) + _nn(dsp.astype(kd), kp) + _nn(dsr.astype(kd), kr)
        dkp_ref[...] = _tn(_own_window(dsp, r, qd_ref, L).astype(q.dtype), q)
        dkr_ref[...] = _tn(_own_window(dsr, r + 1, qd_ref, L).astype(q.dtype), q)
        db_ref[:, :L] = dsp
        db_ref[:, L:] = dsr
        if packed:
            # row block r-2 (extended block r-1; block 0's copy for r = 0, which no window reaches): the keys of
            # the query's own window there are in this block's cache on the row's grid; they take dk̂ only (no
            # band bias at a distance over L; their dv is the cache's, pass 2)
            same = (kd2_ref[0:1, :] == qd_ref[:, 0:1]) & (r > 0)
            p2 = jnp.where(same, jnp.exp(_nt(q, k2_ref[...]) - lse_ref[:, 0:1]), 0.0)
            ds2 = _own_window(p2 * (dp2_s[...] - delta), r - 1, qd_ref, L)
            dk2_ref[...] = _tn(ds2.astype(q.dtype), q)
        ncol_s[...] = _kept(ncol_s[...], keep) + cnt_col
        with statistic(COUNTS):
            nrow_s[...] = _kept(nrow_s[...], keep) + _nt(jnp.ones((SUB, L), f32), onehot.astype(f32))


def _bwd2_kernel(q_ref, c_ref, zp_ref, validp_ref, lse_ref, do_ref, gmu_ref, nrow_fin_ref, ncol_fin_ref, *rest,
                 L: int, S: int, packed: bool = False):
    (qd_ref, kdp_ref, nsr_ref, nsc_ref), (dvf_ref, dmu0_ref, h_s, nrow_s, ncol_s) = _documents(packed, 4, rest)
    rr = pl.program_id(2)  # query block r = R - 1 - rr

    @pl.when(rr == 0)
    def _():
        nrow_s[...] = nrow_fin_ref[...]
        ncol_s[...] = ncol_fin_ref[...]
        h_s[...] = gmu_ref[...].astype(f32) / jnp.maximum(ncol_fin_ref[:, 0:1], 1.0)

    fold = (lambda: validp_ref[...] > 0) if kdp_ref is None else (lambda: kdp_ref[1:2, :] > 0)
    onehot = _onehot(zp_ref[...], fold(), S, L).astype(f32)  # block r-1, folded at step r
    h_next = h_s[...]  # h_{r+1}
    do = do_ref[...]
    cd = do.dtype  # the products' operands (the one-hot is exact in it; h cast to it)
    dvf_ref[...] = _tn(onehot.astype(cd), h_next.astype(cd))
    if packed:  # the counts block r read (pass 1's), and whether the fold at step r continued μ_r
        ncol, keep, reads = nsc_ref[...], kdp_ref[2:3, 0:1] > 0, qd_ref[:, 1:2] > 0
    else:
        with statistic(COUNTS):
            nrow_s[...] = nrow_s[...] - _nt(jnp.ones((SUB, L), f32), onehot)  # counts are integers: exact
            ncol = ncol_s[...] - _nn(onehot, jnp.ones((L, LANES), f32))
        ncol_s[...] = ncol
        keep, reads = None, None
    s_c, has = _cache_logits(q_ref[...], c_ref[...], nsr_ref[...] if packed else nrow_s[0:1, :], reads)
    pc = jnp.where(has, jnp.exp(s_c - lse_ref[:, 0:1]), 0.0)
    n_r = ncol[:, 0:1]
    h = (_tn(pc.astype(cd), do) + _kept(n_r, keep) * h_next) / jnp.maximum(n_r, 1.0)
    h_s[...] = h

    @pl.when(rr == pl.num_programs(2) - 1)
    def _():
        dmu0_ref[...] = h * jnp.maximum(n_r, 1.0)


# ----------------------------------------------------------------------------- pallas_calls
def _compiler_params(platform, semantics):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT_BYTES)
    return None


def _scratch(shapes):
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM(s, d) for _, s, d in shapes]


def _in_specs(H, L, S, Dk, R, tv, n_tv):
    blk = lambda off: pl.BlockSpec((None, L, Dk), lambda b, r, j: (b, r + off, 0))  # noqa: E731
    vblk = lambda off: pl.BlockSpec((None, L, tv), lambda b, r, j: (b, r + off, j))  # noqa: E731
    per_bh = lambda shape: pl.BlockSpec((None,) + shape, lambda b, r, j: (b, 0, 0))  # noqa: E731
    return [
        blk(0),  # q_u, block r
        blk(0), blk(1),  # k̂: extended blocks r (previous) and r+1 (present)
        vblk(0), vblk(1),  # v tiles
        pl.BlockSpec((None, None, 1, L), lambda b, r, j: (b, r, 0, 0)),  # z of the previous block, lane-dense
        pl.BlockSpec((None, 1, L), lambda b, r, j: (r, 0, 0)),  # validity, previous
        pl.BlockSpec((None, 1, L), lambda b, r, j: (r + 1, 0, 0)),  # validity, present
        pl.BlockSpec((None, S, Dk), lambda b, r, j: (jax.lax.rem(b, H), 0, 0)),  # codebook of head b % H
        pl.BlockSpec((None, None, L, 2 * L), lambda b, r, j: (b, r, 0, 0)),  # band bias: previous, present half
        # initial μ tile j: only read at r = 0; afterwards the index stays put (no DMA)
        pl.BlockSpec((None, S, tv), lambda b, r, j: (b, 0, jnp.where(r == 0, j, n_tv - 1))),
        per_bh((SUB, S)), per_bh((S, LANES)),  # initial counts (row and column layouts)
    ]


def _doc_specs(H, L, blk):
    """BlockSpecs of a packed row's document arrays (``qdocs`` [B, R·L, 3], ``kdocs`` [B, R+1, 3, L]; grid axis 0
    runs over B·H) for the query block ``blk`` of the grid point: its queries' columns and its previous and present
    extended key blocks' rows."""
    row = lambda *g: jax.lax.div(g[0], H)  # noqa: E731 -- the batch row of B·H program b
    return [pl.BlockSpec((None, L, QCOLS), lambda *g: (row(*g), blk(*g), 0)),
            pl.BlockSpec((None, None, KROWS, L), lambda *g: (row(*g), blk(*g), 0, 0)),
            pl.BlockSpec((None, None, KROWS, L), lambda *g: (row(*g), blk(*g) + 1, 0, 0))]


def _check_plan(kind, specs, *, L, S, Dk, Dv, tv, in_dtype, packed=False):
    """The BlockSpecs passed to pallas_call are exactly the block shapes the VMEM estimate counts."""
    ins, outs, _, _ = _plan(kind, L=L, S=S, Dk=Dk, Dv=Dv, tv=tv, in_dtype=in_dtype, packed=packed)
    want = [tuple(s) for _, s, _ in ins + outs]
    got = [tuple(d for d in sp.block_shape if d is not None) for sp in specs]
    if want != got:
        raise AssertionError(f"vq_cache {kind}: BlockSpecs {got} differ from the VMEM plan {want}")


def _fwd_call(qb, kx, vx, zx, validx, C, bias, mu0, n0row, n0col, docs=(), *, H, L, tv, interpret, platform):
    """qb [BH, R·L, Dk]; kx [BH, (R+1)L, Dk]; vx [BH, (R+1)L, Dv]; zx [BH, R+1, 1, L] int32; validx [R+1, 1, L]
    int32; C [H, S, Dk]; bias [BH, R, L, 2L] (previous-block half, present-block half); mu0 [BH, S, Dv];
    n0row [BH, 8, S]; n0col [BH, S, 128]; ``docs``: () or a packed row's (qdocs, kdocs)."""
    BH, RL, Dk = qb.shape
    R, S, Dv = RL // L, C.shape[1], vx.shape[-1]
    n_tv = Dv // tv
    packed = bool(docs)
    in_specs = _in_specs(H, L, S, Dk, R, tv, n_tv) + (_doc_specs(H, L, lambda b, r, j: r) if packed else [])
    out_specs = [pl.BlockSpec((None, L, tv), lambda b, r, j: (b, r, j)),
                 pl.BlockSpec((None, S, tv), lambda b, r, j: (b, 0, jnp.where(r == R - 1, j, 0))),
                 pl.BlockSpec((None, SUB, S), lambda b, r, j: (b, 0, 0))]
    plan = dict(L=L, S=S, Dk=Dk, Dv=Dv, tv=tv, in_dtype=qb.dtype, packed=packed)
    _check_plan("fwd", in_specs + out_specs, **plan)
    _, _, scratch, _ = _plan("fwd", **plan)
    doc_args = (docs[0], docs[1], docs[1]) if packed else ()
    return pl.pallas_call(
        functools.partial(_fwd_kernel, L=L, S=S, packed=packed),
        out_shape=(jax.ShapeDtypeStruct((BH, RL, Dv), f32), jax.ShapeDtypeStruct((BH, S, Dv), f32),
                   jax.ShapeDtypeStruct((BH, SUB, S), f32)),
        grid=(BH, R, n_tv),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=_scratch(scratch),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform, ("parallel", "arbitrary", "arbitrary")),
        name="vq_cache_fwd",
    )(qb, kx, kx, vx, vx, zx, validx, validx, C, bias, mu0, n0row, n0col, *doc_args)


def _bwd1_call(qb, kx, vx, zx, validx, C, bias, mu0, n0row, n0col, do, docs=(), *, H, L, tv, interpret, platform):
    BH, RL, Dk = qb.shape
    R, S, Dv = RL // L, C.shape[1], vx.shape[-1]
    n_tv = Dv // tv
    packed = bool(docs)
    in_specs = _in_specs(H, L, S, Dk, R, tv, n_tv) + [pl.BlockSpec((None, L, tv), lambda b, r, j: (b, r, j))]
    row = lambda w: pl.BlockSpec((None, L, w), lambda b, r, j: (b, r, 0))  # noqa: E731
    sq = pl.BlockSpec((None, None, L, 2 * L), lambda b, r, j: (b, r, 0, 0))
    tile = pl.BlockSpec((None, L, tv), lambda b, r, j: (b, r, j))
    out_specs = [row(LANES), row(Dk), row(Dk), row(Dk), sq, tile, tile]
    shp = lambda *s: jax.ShapeDtypeStruct(s, f32)  # noqa: E731
    out_shape = [shp(BH, RL, LANES), shp(BH, RL, Dk), shp(BH, RL, Dk), shp(BH, RL, Dk), shp(BH, R, L, 2 * L),
                 shp(BH, RL, Dv), shp(BH, RL, Dv)]
    doc_args = ()
    if packed:  # the documents, extended block r-1 (row block r-2: clamped to 0 at r = 0) and the per-step counts
        two = lambda b, r, j: jnp.maximum(r - 1, 0)  # noqa: E731
        in_specs += _doc_specs(H, L, lambda b, r, j: r) + [
            pl.BlockSpec((None, L, Dk), lambda b, r, j: (b, two(b, r, j), 0)),
            pl.BlockSpec((None, L, tv), lambda b, r, j: (b, two(b, r, j), j)),
            _doc_specs(H, L, two)[1]]
        out_specs += [row(Dk), pl.BlockSpec((None, None, 1, S), lambda b, r, j: (b, r, 0, 0)),
                      pl.BlockSpec((None, None, S, 1), lambda b, r, j: (b, r, 0, 0))]
        out_shape += [shp(BH, RL, Dk), shp(BH, R, 1, S), shp(BH, R, S, 1)]
        doc_args = (docs[0], docs[1], docs[1], kx, vx, docs[1])
    plan = dict(L=L, S=S, Dk=Dk, Dv=Dv, tv=tv, in_dtype=qb.dtype, packed=packed)
    _check_plan("bwd1", in_specs + out_specs, **plan)
    _, _, scratch, _ = _plan("bwd1", **plan)
    return pl.pallas_call(
        functools.partial(_bwd1_kernel, L=L, S=S, packed=packed),
        out_shape=tuple(out_shape),
        grid=(BH, R, n_tv),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=_scratch(scratch),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform, ("parallel", "arbitrary", "arbitrary")),
        name="vq_cache_bwd_logits",
    )(qb, kx, kx, vx, vx, zx, validx, validx, C, bias, mu0, n0row, n0col, do, *doc_args)


def _bwd2_call(qb, zx, validx, C, lse, do, gmu, nfin_row, nfin_col, docs=(), steps=(), *, H, L, tv, interpret,
               platform):
    """``docs``, ``steps``: () or a packed row's (qdocs, kdocs) and pass 1's per-step counts (row, column)."""
    BH, RL, Dk = qb.shape
    R, S, Dv = RL // L, C.shape[1], do.shape[-1]
    n_tv = Dv // tv
    rev = lambda rr: R - 1 - rr  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, L, Dk), lambda b, j, rr: (b, rev(rr), 0)),
        pl.BlockSpec((None, S, Dk), lambda b, j, rr: (jax.lax.rem(b, H), 0, 0)),
        pl.BlockSpec((None, None, 1, L), lambda b, j, rr: (b, rev(rr), 0, 0)),
        pl.BlockSpec((None, 1, L), lambda b, j, rr: (rev(rr), 0, 0)),
        pl.BlockSpec((None, L, LANES), lambda b, j, rr: (b, rev(rr), 0)),
        pl.BlockSpec((None, L, tv), lambda b, j, rr: (b, rev(rr), j)),
        pl.BlockSpec((None, S, tv), lambda b, j, rr: (b, 0, j)),
        pl.BlockSpec((None, SUB, S), lambda b, j, rr: (b, 0, 0)),
        pl.BlockSpec((None, S, LANES), lambda b, j, rr: (b, 0, 0)),
    ]
    packed = bool(docs)
    if packed:
        in_specs += _doc_specs(H, L, lambda b, j, rr: rev(rr))[:2] + [
            pl.BlockSpec((None, None, 1, S), lambda b, j, rr: (b, rev(rr), 0, 0)),
            pl.BlockSpec((None, None, S, 1), lambda b, j, rr: (b, rev(rr), 0, 0))]
    out_specs = [pl.BlockSpec((None, L, tv), lambda b, j, rr: (b, rev(rr), j)),
                 pl.BlockSpec((None, S, tv), lambda b, j, rr: (b, 0, j))]
    plan = dict(L=L, S=S, Dk=Dk, Dv=Dv, tv=tv, in_dtype=qb.dtype, packed=packed)
    _check_plan("bwd2", in_specs + out_specs, **plan)
    _, _, scratch, _ = _plan("bwd2", **plan)
    return pl.pallas_call(
        functools.partial(_bwd2_kernel, L=L, S=S, packed=packed),
        out_shape=(jax.ShapeDtypeStruct((BH, RL, Dv), f32), jax.ShapeDtypeStruct((BH, S, Dv), f32)),
        grid=(BH, n_tv, R),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=_scratch(scratch),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(platform, ("parallel", "parallel", "arbitrary")),
        name="vq_cache_bwd_fold",
    )(qb, C, zx, validx, lse, do, gmu, nfin_row, nfin_col, *docs, *steps)


# ----------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _attend(qb, kx, vx, bias, mu0, zx, validx, C, n0row, n0col, docs, cfg):
    H, L, tv, interpret, platform = cfg
    return _fwd_call(qb, kx, vx, zx, validx, C, bias, mu0, n0row, n0col, docs, H=H, L=L, tv=tv,
                     interpret=interpret, platform=platform)


def _attend_fwd(qb, kx, vx, bias, mu0, zx, validx, C, n0row, n0col, docs, cfg):
    out = _attend(qb, kx, vx, bias, mu0, zx, validx, C, n0row, n0col, docs, cfg)
    return out, (qb, kx, vx, bias, mu0, zx, validx, C, n0row, n0col, docs, out[2])


def _attend_bwd(cfg, res, g):
    H, L, tv, interpret, platform = cfg
    qb, kx, vx, bias, mu0, zx, validx, C, n0row, n0col, docs, nfin = res
    do, gmu, _ = g
    kw = dict(H=H, L=L, tv=tv, interpret=interpret, platform=platform)
    sdt = qb.dtype  # dO and the final means' cotangent enter in the storage dtype (the products' operands)
    do = do.astype(sdt)
    lse, dq, dkp, dkr, dbias, dvp, dvr, *extra = _bwd1_call(qb, kx, vx, zx, validx, C, bias, mu0, n0row, n0col,
                                                            do, docs, **kw)
    BH, S = nfin.shape[0], nfin.shape[2]
    nfin_col = jnp.broadcast_to(nfin[:, 0, :, None], (BH, S, LANES))
    dvf, dmu0 = _bwd2_call(qb, zx, validx, C, lse, do, gmu.astype(sdt), nfin, nfin_col, docs, tuple(extra[1:]),
                           **kw)
    zeros = jnp.zeros((BH, L) + dkp.shape[2:], f32)
    dkx = jnp.concatenate([dkp, zeros], axis=1) + jnp.concatenate([zeros, dkr], axis=1)
    if docs:  # query block r's dk̂ for extended block r-1 (none from block 0)
        dkx = dkx + jnp.concatenate([extra[0][:, L:], zeros, zeros], axis=1)
    zv = jnp.zeros((BH, L, vx.shape[-1]), f32)
    dvx = jnp.concatenate([dvp + dvf, zv], axis=1) + jnp.concatenate([zv, dvr], axis=1)
    return (dq.astype(qb.dtype), dkx.astype(kx.dtype), dvx.astype(vx.dtype), dbias, dmu0.astype(mu0.dtype),
            None, None, None, None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _storage_dtype(*xs):
    return jnp.bfloat16 if all(x.dtype == jnp.bfloat16 for x in xs) else f32


def gpu_form(platform: str | None) -> bool:
    """Whether :func:`vq_cache_attention` runs the GPU form for ``platform`` (None: the default backend)."""
    platform = platform or jax.default_backend()
    return {"gpu": "cuda"}.get(platform, platform) == "cuda"


def vq_cache_attention(q_u, bd, k_hat, z, v, C, state, *, L: int, M: int, interpret: bool = False,
                       platform: str | None = None, block_v: int | None = None, packed: dict | None = None):
    """Same contract as ``vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, state, L=L, M=M)``:
    q_u, k_hat [B,H,T,Dk]; bd [B,H,T,M+1]; z int32 [B,H,T]; v [B,H,T,Dv]; C [H,S,Dk]; state with a band of M
    tokens. Requires 1 <= M <= L. Returns (o [B,H,T,Dv], new_state).

    ``platform`` ('tpu' | 'cuda'; default: the default backend) picks the form: 'cuda' (or 'gpu') runs the
    Pallas-Triton form of :mod:`pallas_kernels.vq_cache_gpu` (in interpret mode when ``interpret=True``), anything
    else the TPU kernels of this module (Mosaic compiler parameters; interpret mode when ``interpret=True``).
    ``block_v`` (Dv tile) defaults to :func:`choose_block_v` (TPU) or ``vq_cache_gpu.choose_tiles`` (GPU).
    Forward and backward are Pallas kernels (see the module docstring).

    ``packed``: a packed row (segment ids): for the GPU form the caches and document arrays of
    ``longctx.attention.transformer_vq.xla.kernel_packed`` (see ``vq_cache_gpu.vq_cache_attention``), for the TPU
    form the document arrays of ``xla.kernel_documents`` (module docstring, "Packed rows"); either returns
    (o, None): the caller forms the packed row's new state. The band's validity is then the documents' (the
    state's ``pos`` is not read)."""
    if gpu_form(platform):
        return vq_cache_gpu.vq_cache_attention(q_u, bd, k_hat, z, v, C, state, L=L, M=M, interpret=interpret,
                                               block_v=block_v, packed=packed)
    platform = platform or jax.default_backend()
    B, H, T, Dk = q_u.shape
    Dv, S = v.shape[-1], C.shape[1]
    dt = float_dtype(q_u, v)
    reasons = unsupported_reasons("interpret" if interpret else platform, L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dt,
                                  packed=packed is not None)
    if not interpret and platform == "cpu":
        reasons = ["Pallas runs on CPU only with interpret=True"] + reasons
    if reasons:
        raise ValueError("vq_cache_attention cannot run: " + "; ".join(reasons))
    sdt = _storage_dtype(q_u, k_hat, v, state["band_k"], state["band_v"])  # never round a wider input
    if block_v is None:
        block_v = (choose_block_v(L=L, S=S, Dk=Dk, Dv=Dv, in_dtype=sdt, packed=packed is not None)[0]
                   or _tv_options(Dv)[-1])
    if Dv % block_v:
        raise ValueError(f"vq_cache_attention: block_v={block_v} must divide Dv={Dv}")
    R = -(-T // L)
    Tp = R * L
    BH = B * H
    pos = state["pos"]
    band_k, band_v = state["band_k"].astype(dt), state["band_v"].astype(dt)
    agg_mu, agg_n = state["agg_mu"].astype(dt), state["agg_n"].astype(dt)

    def flat(x):
        return x.reshape((BH,) + x.shape[2:])

    qb = flat(pad_to(q_u.astype(sdt), 2, Tp))
    kx = flat(jnp.concatenate([pad_left(band_k.astype(sdt), 2, L), pad_to(k_hat.astype(sdt), 2, Tp)], axis=2))
    vx = flat(jnp.concatenate([pad_left(band_v.astype(sdt), 2, L), pad_to(v.astype(sdt), 2, Tp)], axis=2))
    zx = jnp.concatenate([pad_left(state["band_z"], 2, L), pad_to(z, 2, Tp)], axis=2).astype(jnp.int32)
    zx = flat(zx).reshape(BH, R + 1, 1, L)
    band_pos = pos - L + jnp.arange(L)
    band_valid = (band_pos >= 0) & (jnp.arange(L) >= L - M)
    validx = jnp.concatenate([band_valid, jnp.arange(Tp) < T]).astype(jnp.int32).reshape(R + 1, 1, L)
    bdb = pad_to(bd.astype(f32), 2, Tp).reshape(B, H, R, L, bd.shape[-1])
    bias = flat(skew_bias(bdb, L, 2 * L))  # [BH, R, L, 2L]
    docs = ()
    if packed is not None:  # the kernel starts from the carried cache only where the row opens with its document
        first = packed["first"][:, None, None]
        agg_mu, agg_n = jnp.where(first[..., None], agg_mu, 0.0), jnp.where(first, agg_n, 0.0)
        docs = (packed["qdocs"], packed["kdocs"])
    n0 = jax.lax.stop_gradient(flat(agg_n.astype(f32)))
    n0row = jnp.broadcast_to(n0[:, None, :], (BH, SUB, S))
    n0col = jnp.broadcast_to(n0[:, :, None], (BH, S, LANES))
    cfg = (H, L, int(block_v), bool(interpret), platform)
    # the carried means enter in the storage dtype (float32, or bfloat16 when q, k̂, v and the band are: the
    # kernel's running means stay float32 in VMEM, and the new state's are then computed in XLA, exactly); a
    # bfloat16 codebook with bfloat16 storage is used as given, any other is float32 (never rounded)
    cdt = C.dtype if C.dtype == sdt else f32
    o, mu_fin, n_fin = _attend(qb, kx, vx, bias, flat(agg_mu.astype(f32)).astype(sdt), zx, validx,
                               jax.lax.stop_gradient(C).astype(cdt), n0row, n0col, docs, cfg)
    o = o.reshape(B, H, Tp, Dv)[:, :, :T].astype(dt)
    if packed is not None:
        return o, None
    ek = jnp.concatenate([band_k, k_hat.astype(dt)], axis=2)
    ev = jnp.concatenate([band_v, v.astype(dt)], axis=2)
    ez = jnp.concatenate([state["band_z"], z], axis=2)
    if T % L == 0 and M == L and sdt == f32:  # the kernel's last fold is exactly the new carried aggregate
        new_mu = mu_fin.reshape(B, H, S, Dv).astype(dt)
        new_n = jax.lax.stop_gradient(n_fin[:, 0]).reshape(B, H, S).astype(dt)
    else:
        st = {"pos": pos, "band_k": band_k, "band_v": band_v, "band_z": state["band_z"], "agg_mu": agg_mu,
              "agg_n": agg_n}
        st = final_state(st, k_hat.astype(dt), z, v.astype(dt), T, M, S)
        new_mu, new_n = st["agg_mu"], st["agg_n"]
    new_state = {"pos": pos + T, "band_k": ek[:, :, T:], "band_v": ev[:, :, T:], "band_z": ez[:, :, T:],
                 "agg_mu": new_mu, "agg_n": new_n}
    return o, new_state


__all__ = ["DTYPES", "PLATFORMS", "VMEM_LIMIT_BYTES", "choose_block_v", "gpu_form", "unsupported_reasons",
           "vmem_bytes", "vq_cache_attention", "vq_cache_attention_reference"]

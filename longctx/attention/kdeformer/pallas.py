"""The implementation ``pallas`` (causal): the tiled estimator of ``xla.py`` with the 'band' route's heavy part
(:func:`xla.heavy_band`) computed by the Pallas kernel ``pallas_kernels/kde_band.py`` (docs/methods/kdeformer.md
§4.2): one program per (batch·head, query tile) loops over its tile's key blocks with an online softmax, so no
``[pairs, tile, block]`` logits array is materialised and no pair is a serial ``lax.map`` step. Backward:
FlashAttention-2 style from the saved log-sum-exp (its cotangent included), dq per query tile, dk/dv per key block
through the inverse pair map (deterministic, no atomics).

Here, in XLA: the queries sorted by their band ends and the pair tables (:func:`band_plan`, O(N) gathers and small
int arrays), the un-sort of the outputs. Everything else of the estimator (local window, samples, the merge) is
``xla.py``'s, unchanged.

Routes: a full pass takes 'band' whatever the cache length (the kernel is what this implementation adds); a call
with a state gathers (xla.py's rule: with a cache the bands span the whole cache per query). ``auto`` takes it on
cuda, before ``xla``, for the full passes whose route there is 'band' (cache longer than ``heavy_scores_max_len``,
:func:`_prefers_band`), except on Hopper (``dispatch.hopper``), where ``mosaic_gpu`` (the Mosaic GPU kernels) takes
its place. Packed rows (§4.6) are served: each query's band ``[lo, hi)`` already starts at its document's first
key, and the kernel reads nothing else of the document.

Under a train step's mesh the kernel runs per shard of the rows and heads (:func:`heavy_band_kernel`).

Execution knobs (fields of :class:`Pallas`): ``heavy_band_block`` (sorted queries per tile = keys per block, the
kernel's tile; :data:`DEFAULTS`), and ``tile_budget`` / ``heavy_scores_max_len`` for the XLA parts, as ``xla``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from longctx.attention import dispatch, row_split
from longctx.attention.dispatch import Implementation
from longctx.attention.kdeformer import xla
from longctx.attention.kdeformer.common import inverse_permutation
from pallas_kernels import kde_band


def band_plan(lo, hi, block: int, bh: int, M: int):
    """The kernel's tables for one (batch, head) (lo, hi [N]: each query's heavy slots): (qord [N] the queries by
    band end, lo_s, hi_s [Np], b0, cnt [n_t] every tile's first key block and block count (:func:`xla.band_pairs`),
    ptile [n_pairs] the tiles of the pairs in key-block order, pstart, pend [Mb] each key block's pairs)."""
    n_t, Np, Mb, n_pairs = xla.band_sizes(lo.shape[0], M, block, bh)
    qord, lo_s, hi_s = xla.band_order(lo, hi, Np)
    b0, cnt, ends = xla.band_pairs(lo_s, hi_s, block, block, M)
    tile, blk, valid = xla.pair_list(b0, cnt, ends, n_pairs)
    blk = jnp.where(valid, blk, Mb)  # the pairs past those needed: after every block
    by_block = jnp.argsort(blk, stable=True)
    blk_s = blk[by_block]
    j = jnp.arange(Mb, dtype=jnp.int32)
    pstart = jnp.searchsorted(blk_s, j, side="left").astype(jnp.int32)
    pend = jnp.searchsorted(blk_s, j, side="right").astype(jnp.int32)
    return qord, lo_s, hi_s, b0, cnt, tile[by_block], pstart, pend


def heavy_band_kernel(q, Ks, Vs, lo, hi, scale: float, bh: int, block: int, budget=None, row_scale=None, *,
                      interpret: bool, platform: str | None, band_kernel=kde_band.kde_band):
    """:func:`xla.heavy_band` (same arguments and results: (out [B,H,N,dv], lse [B,H,N])) by the kernel; ``budget``
    and ``row_scale`` are the XLA form's and unused (the kernel holds one [block, block] tile at a time). ``out``
    is in the compute dtype (the kernel writes it rounded once), ``lse`` float32.

    Under a train step's mesh (``row_split.active_mesh``) the kernel is a call XLA's partitioner cannot split: it
    runs in a ``shard_map``, the rows over the batch axes and the heads over ``tensor`` (every operand is
    ``[B, H, ...]`` and the band of a (batch, head) is its own). ``band_kernel``: the kernel entry
    (``kde_band.kde_band``'s signature; ``kde_band_mgpu.kde_band_mgpu`` for the implementation ``mosaic_gpu``)."""
    args = (q, Ks, Vs, lo, hi)
    fn = functools.partial(_heavy_band_kernel, scale=scale, bh=bh, block=block, interpret=interpret,
                           platform=platform, band_kernel=band_kernel)
    mesh = row_split.active_mesh(q, Ks, Vs)
    bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *q.shape[:2])
    if bspec is None and hspec is None:
        return fn(*args)
    spec = PartitionSpec(bspec, hspec)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec), check_vma=False)(*args)


def _heavy_band_kernel(q, Ks, Vs, lo, hi, *, scale: float, bh: int, block: int, interpret: bool, platform,
                       band_kernel=kde_band.kde_band):
    B, H, N, d = q.shape
    M, dv = Ks.shape[2], Vs.shape[-1]
    n_t, Np, Mb, _ = xla.band_sizes(N, M, block, bh)
    plan = jax.vmap(jax.vmap(lambda a, b: band_plan(a, b, block, bh, M)))(
        jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi))
    qord, lo_s, hi_s, b0, cnt, ptile, pstart, pend = plan
    flat = lambda x: x.reshape((B * H,) + x.shape[2:])  # noqa: E731
    col = lambda x: flat(x)[..., None]  # noqa: E731
    q_s = jnp.pad(xla._take(q, qord), ((0, 0), (0, 0), (0, Np - N), (0, 0)))
    kp = ((0, 0), (0, 0), (0, Mb * block - M), (0, 0))
    out_s, lse_s = band_kernel(flat(q_s), flat(jnp.pad(Ks, kp)), flat(jnp.pad(Vs, kp)), col(lo_s), col(hi_s),
                               col(b0), col(cnt), flat(ptile), col(pstart), col(pend), scale=scale, block=block,
                               interpret=interpret, platform=platform)
    back = inverse_permutation(qord)  # the sorted row of every query
    out = xla._take(out_s.reshape(B, H, Np, dv), back)
    lse = jnp.take_along_axis(lse_s.reshape(B, H, Np), back, axis=-1)
    return out, lse


@dataclasses.dataclass(frozen=True)
class Pallas(dispatch.Runner):
    """``pallas``, causal: a full pass's heavy part by the kernel (route 'band'), a call with a state gathers
    (module docstring); the knobs of the XLA parts as ``xla``'s, ``heavy_band_block`` the kernel's tile."""

    tile_budget: int
    heavy_scores_max_len: int
    heavy_band_block: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        opts = dataclasses.replace(xla.with_knobs(core.causal_opts, self), heavy_impl="band")
        platform = None if call.interpret else call.platform

        def band_fn(*args):
            return heavy_band_kernel(*args, interpret=call.interpret, platform=platform)

        return xla.run_causal(call, opts, band_fn=band_fn)


def _reasons(platform, *, head_dim: int = 0, value_dim: int = 0, heavy_band_block: int = 0, **_) -> list[str]:
    """The kernel's limits (:func:`kde_band.unsupported_reasons`) for the core's head widths and the tile
    ``heavy_band_block`` as it runs on ``platform`` (the layer's selection shapes give them)."""
    block = _DECLARED.setting("heavy_band_block", heavy_band_block, platform)
    return kde_band.unsupported_reasons(platform, block=block, d=head_dim, dv=value_dim)


def _prefers_band(platform, *, cache_len: int, full_pass: bool, heavy_scores_max_len: int, **_) -> bool:
    """'auto' tries the kernel only for the full passes whose route is 'band' there (xla.py's 'auto' rule with
    ``heavy_scores_max_len`` as this implementation runs it on ``platform``)."""
    max_len = _DECLARED.setting("heavy_scores_max_len", heavy_scores_max_len, platform)
    return xla.route_for("auto", max_len, cache_len, full_pass) == "band"


# Per-platform defaults: the XLA parts' knobs as xla.DEFAULTS; heavy_band_block the kernel's tile on cuda, 64
# (a [64, 64] float32 logits tile and one [64, d] key block per loop step, 4 warps: a reasoned value, not yet
# measured on a GPU); interpret mode ('cpu') as xla.DEFAULTS' CPU value.
DEFAULTS = {key: dict(xla.DEFAULTS[key]) for key in ("tile_budget", "heavy_scores_max_len", "heavy_band_block")}
_DECLARED = Implementation(
    "pallas", platforms=("cuda",), kernel=True, reasons=_reasons, config={"impl": "pallas"}, auto={"cuda": -1},
    prefer=dispatch.not_on_hopper(_prefers_band), code=Pallas, directions=("causal",),
    test_config={"heavy_band_block": 8},
    defaults=DEFAULTS)
IMPLEMENTATIONS = (_DECLARED,)

__all__ = ["DEFAULTS", "IMPLEMENTATIONS", "Pallas", "band_plan", "heavy_band_kernel"]

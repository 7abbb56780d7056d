"""The implementation ``mosaic_gpu`` (causal): ``pallas`` (:mod:`longctx.attention.kdeformer.pallas`: the tiled
estimator of ``xla.py`` with the 'band' route's heavy part by a kernel) with the heavy band computed by the Pallas
Mosaic GPU kernels ``pallas_kernels/kde_band_mgpu.py`` (Hopper: wgmma, TMA, ``emit_pipeline`` over a traced number
of key blocks; forward, dq and dk/dv kernels, FlashAttention-2 style, no atomics) instead of the Triton kernel;
interpret mode (Mosaic GPU's, ``InterpretGPUParams``) on a CPU.

Everything else is ``pallas``'s: the sort of the queries by band end, the pair tables (``pallas.band_plan``), the
un-sort, the per-shard ``shard_map`` under a train step's mesh (``pallas.heavy_band_kernel``, given the Mosaic GPU
entry), the routes (a full pass takes 'band', a call with a state gathers), the knobs and their per-platform
defaults (``pallas.DEFAULTS``), and ``auto``'s preference (the full passes whose route is 'band' there,
``pallas._prefers_band``). ``auto`` on cuda tries it first (rank -2, before ``pallas`` at -1); its reasons refuse
anything but compute capability 9.0 where the device is known, float32 operands (wgmma would round them to tf32),
blocks other than 64 rows and head widths that are not multiples of 64 (:func:`kde_band_mgpu.unsupported_reasons`),
so such calls go on to the next implementation. Nothing of it has compiled or run on a GPU yet."""

from __future__ import annotations

import dataclasses

from longctx.attention import dispatch
from longctx.attention.dispatch import Implementation
from longctx.attention.kdeformer import xla
from longctx.attention.kdeformer.pallas import DEFAULTS, Pallas, _prefers_band, heavy_band_kernel
from pallas_kernels import kde_band_mgpu


@dataclasses.dataclass(frozen=True)
class MosaicGpu(Pallas):
    """``mosaic_gpu``, causal: ``pallas`` (its knobs, routes and wrapper) with the Mosaic GPU band kernels."""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        opts = dataclasses.replace(xla.with_knobs(core.causal_opts, self), heavy_impl="band")
        platform = None if call.interpret else call.platform

        def band_fn(*args):
            return heavy_band_kernel(*args, interpret=call.interpret, platform=platform,
                                     band_kernel=kde_band_mgpu.kde_band_mgpu)

        return xla.run_causal(call, opts, band_fn=band_fn)


def _reasons(platform, *, head_dim: int = 0, value_dim: int = 0, heavy_band_block: int = 0, dtype=None,
             compute_capability=None, **_) -> list[str]:
    """The kernels' limits (:func:`kde_band_mgpu.unsupported_reasons`) for the core's head widths, the compute
    dtype and the tile ``heavy_band_block`` as it runs on ``platform``; on cuda the local device's compute
    capability where the call does not give one (None where there is no device: served)."""
    block = _DECLARED.setting("heavy_band_block", heavy_band_block, platform)
    if platform == "cuda" and compute_capability is None:
        compute_capability = dispatch.cuda_compute_capability()
    return kde_band_mgpu.unsupported_reasons(platform, block=block, d=head_dim, dv=value_dim, dtype=dtype,
                                             compute_capability=compute_capability)


# the knobs and their per-platform defaults are pallas's (heavy_band_block 64 on cuda: the kernels' one served tile)
_DECLARED = Implementation(
    "mosaic_gpu", platforms=("cuda",), kernel=True, reasons=_reasons, config={"impl": "mosaic_gpu"},
    auto={"cuda": -2}, prefer=_prefers_band, code=MosaicGpu, directions=("causal",),
    test_config={"heavy_band_block": 8}, defaults=DEFAULTS, slow_in_interpret=True)
IMPLEMENTATIONS = (_DECLARED,)

__all__ = ["IMPLEMENTATIONS", "MosaicGpu"]

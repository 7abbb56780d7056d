"""EVA's implementation ``mosaic_gpu``: Phase B of a full pass and of a packed row by the Pallas Mosaic GPU kernels
for Hopper (``pallas_kernels/eva_attend_mgpu.py``: forward and backward; wgmma, TMA, ``emit_pipeline``), Phase A
(the chunk summaries) by the Pallas Mosaic GPU kernels of ``pallas_kernels/eva_chunks_mgpu.py`` (forward and
token-level backward); the passes are ``pallas``'s (``pallas.eva_forward``,
``pallas.eva_packed``: the same padding, casts, sharding and packed layout) with these kernels as Phase B's
``kernel`` and these Phase A kernels as its ``stats``; a stream after a carried state runs as ``pallas``'s does
(Phase A by the Mosaic GPU kernels, Phase B in the XLA tiles). A packed row (segment ids) runs on ``packed.py``'s
layout (the documents laid out again on the window grid, from a carried state too), the kernels masking by each
position's and chunk's document and own index. Mosaic GPU's interpret mode (``InterpretGPUParams``) on a CPU when named.

``impl='auto'`` tries it first on cuda: it serves Hopper in bf16 / fp16 (its reasons), where ``pallas`` (Triton)
steps aside (``dispatch.hopper``; a cuda export from a CPU host counts as Hopper). It has not yet compiled on a
GPU: ``scripts/gpu_check.sh``'s tests step compiles it first; ``impl='pallas'`` (Triton) or ``'xla'`` where it fails.
Refused, one line each (:func:`reasons`): the kernels' shapes and dtypes, a compute capability other than 9.0;
float32 operands on cuda are refused by the kernel when called (wgmma would round them to tf32; the selection is not
told the dtype)."""

from __future__ import annotations

import dataclasses
import functools

from longctx.attention import dispatch
from longctx.attention.eva import pallas, xla
from longctx.attention.eva.common import run_pass
from pallas_kernels import eva_attend_mgpu, eva_chunks_mgpu


def reasons(platform: str, *, P: int, d: int, dv: int, W: int, C: int, e_l: int, e_r: int, chunk_logit: str,
            full: bool, segments: bool = False, dtype=None, **_) -> list[str]:
    """Phase A's limits (the Mosaic GPU chunk kernels), then for a full pass or a packed row Phase B's."""
    cc = dispatch.cuda_compute_capability() if platform == "cuda" else None
    out = [f"eva_chunks_mgpu: {r}" for r in eva_chunks_mgpu.unsupported_reasons(
        platform, P=P, d=d, dv=dv, dtype=dtype, compute_capability=cc)]
    if full or segments:
        out += [f"eva_attend_mgpu: {r}" for r in eva_attend_mgpu.unsupported_reasons(
            platform, W=W, d=d, dv=dv, e_l=e_l, e_r=e_r, chunk_logit=chunk_logit, dtype=dtype,
            compute_capability=cc)]
    return out


def _phase_b(*args, **kwargs):
    """Phase B by :func:`pallas_kernels.eva_attend_mgpu.eva_attend_mgpu` (looked up when called; it reads neither
    the platform nor the Triton kernel's tiles that ``pallas._attend_fn`` binds)."""
    return eva_attend_mgpu.eva_attend_mgpu(*args, **kwargs)


def _phase_a(interpret, platform):
    """Phase A's ``stats_fn`` by :func:`pallas_kernels.eva_chunks_mgpu.make_stats_fn` (``pallas._stats_fn``'s
    ``make``; the kernels read no platform)."""
    return eva_chunks_mgpu.make_stats_fn(interpret=interpret)


# Full pass: (out [B,H,L,dv], extras), ``pallas.eva_forward`` with Phase A and Phase B by the Mosaic GPU kernels
# (attention dropout included: the hash mask of ``common.dropout_seeds``, the same as ``pallas``'s)
eva_forward = functools.partial(pallas.eva_forward, kernel=_phase_b, stats=_phase_a)
# A packed row (from a carried state too): ``pallas.eva_packed`` with both phases by the Mosaic GPU kernels
eva_packed = functools.partial(pallas.eva_packed, kernel=_phase_b, stats=_phase_a)
# Tokens after a carried state: ``pallas.eva_stream`` with Phase A by the Mosaic GPU kernels
eva_stream = functools.partial(pallas.eva_stream, stats=_phase_a)


@dataclasses.dataclass(frozen=True)
class MosaicGpu(dispatch.Runner):
    """``mosaic_gpu``: :func:`eva_forward` from a row's start, :func:`eva_packed` for a packed row,
    ``pallas.eva_stream`` after a carried state (the XLA tiles' logit budget), on the call's platform (interpret mode
    on a CPU)."""

    logit_budget: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        kernel = dict(interpret=call.interpret, platform=call.platform)
        return run_pass(self, core, call, eva_forward, eva_stream, functools.partial(eva_packed, **kernel),
                        **kernel)


# 'auto' tries it first on cuda; it serves Hopper only (its reasons), where the Triton kernels step aside
# (``dispatch.hopper``). Not yet compiled or run on a GPU (gpu_check.sh's tests step compiles it first).
IMPLEMENTATIONS = (
    dispatch.Implementation("mosaic_gpu", platforms=("cuda",), kernel=True, reasons=reasons,
                            config={"impl": "mosaic_gpu"}, auto={"cuda": -1}, code=MosaicGpu,
                            defaults={"logit_budget": xla.LOGIT_BUDGET}, slow_in_interpret=True),
)

__all__ = ["IMPLEMENTATIONS", "MosaicGpu", "eva_forward", "eva_packed", "eva_stream", "reasons"]

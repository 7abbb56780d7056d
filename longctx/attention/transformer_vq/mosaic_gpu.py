"""The implementation ``mosaic_gpu`` of Transformer-VQ: the §9 compressive VQ-cache attention as Pallas Mosaic GPU
kernels for Hopper (``pallas_kernels/vq_cache_mgpu.py``: forward and backward; wgmma, TMA, ``emit_pipeline``) for
the causal block-parallel form with the serial reduction; Mosaic GPU's interpret mode (``InterpretGPUParams``) on a
CPU when named. It runs as ``pallas`` does (the key quantization and band scores in XLA, per shard under a train
step's mesh), with this kernel.

``impl='auto'`` tries it first on cuda, for the calls ``pallas.prefer`` gives the kernel: it serves Hopper in bf16
(its reasons), where ``pallas`` (Triton) steps aside (``dispatch.hopper``; a cuda export from a CPU host counts as
Hopper). It has not yet compiled on a GPU: ``scripts/gpu_check.sh``'s tests step compiles it first;
``impl='pallas'`` (Triton) or an XLA form where it fails.
A packed row (segment ids) runs as ``pallas``' GPU form does: ``xla.kernel_packed``'s per-row-block caches and
document arrays (formed per shard), the kernels masking by query / key documents, the new state in XLA."""

from __future__ import annotations

import dataclasses
import functools

from longctx.attention import dispatch
from longctx.attention.dispatch import Implementation
from longctx.attention.transformer_vq import xla
from longctx.attention.transformer_vq.pallas import Pallas, prefer
from pallas_kernels import vq_cache_mgpu


def reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype="float32", reduction: str = "serial",
            segments: bool = False, **_) -> list[str]:
    """Refusals: the kernels' limits (cuda, compute capability 9.0, 64-row tiles, head widths multiples of 64 with
    Dk <= 256, bfloat16, shared memory per kernel) and any reduction but the serial one (the one it computes; a
    packed row's cache is serial whatever the setting)."""
    extra = [] if reduction == "serial" or segments else [
        f"reduction={reduction!r} (the kernel computes the serial reduction)"]
    cc = dispatch.cuda_compute_capability() if platform == "cuda" else None
    return extra + vq_cache_mgpu.unsupported_reasons(platform, L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dtype,
                                                     compute_capability=cc, block=_tile(platform, L))


def _tile(platform: str, L: int) -> int | None:
    """The kernels' row tile: wgmma's 64 rows on a GPU; in interpret mode (tests' small blocks) at most a block."""
    return min(vq_cache_mgpu.TILE, L) if platform == "interpret" else None


@dataclasses.dataclass(frozen=True)
class MosaicGpu(Pallas):
    """``mosaic_gpu``: ``pallas``'s runner with the Mosaic GPU kernels (``call.interpret``: interpret mode)."""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        # the kernels are a GPU form whatever platform traces them (interpret mode on a CPU): a packed row takes
        # ``xla.kernel_packed``'s per-row-block caches and document arrays, as ``pallas``' form for 'cuda' does
        return super().__call__(core, dataclasses.replace(call, platform="cuda"))

    def kernel(self, core, call: dispatch.Call):
        return functools.partial(vq_cache_mgpu.vq_cache_attention, L=core.L, M=core.M, interpret=call.interpret,
                                 block=_tile("interpret" if call.interpret else call.platform, core.L))


IMPLEMENTATIONS = (
    Implementation("mosaic_gpu", platforms=("cuda",), kernel=True, reasons=reasons,
                   config={"impl": "mosaic_gpu", "reduction": "serial"}, auto={"cuda": -1}, prefer=prefer,
                   code=MosaicGpu, directions=("causal",),
                   defaults={"search_chunk": xla.SEARCH_CHUNK}, slow_in_interpret=True),
)

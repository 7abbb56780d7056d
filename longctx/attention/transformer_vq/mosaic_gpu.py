"""The implementation ``mosaic_gpu`` of Transformer-VQ: the §9 compressive VQ-cache attention as Pallas Mosaic GPU
kernels for Hopper (``pallas_kernels/vq_cache_mgpu.py``: forward and backward; wgmma, TMA, ``emit_pipeline``) for
the causal block-parallel form with the serial reduction; Mosaic GPU's interpret mode (``InterpretGPUParams``) on a
CPU when named. It runs as ``pallas`` does (the key quantization and band scores in XLA, per shard under a train
step's mesh), with this kernel.

Not in ``impl='auto'``: nothing of it has compiled or run on a GPU; it runs where named (``impl='mosaic_gpu'``).
Packed rows (segment ids) are refused in one line: the kernels take no document arrays yet."""

from __future__ import annotations

import dataclasses
import functools

from longctx.attention import dispatch
from longctx.attention.dispatch import Implementation
from longctx.attention.transformer_vq import xla
from longctx.attention.transformer_vq.pallas import Pallas
from pallas_kernels import vq_cache_mgpu

SEGMENTS_REASON = ("packed rows (segment ids): the Mosaic GPU kernels take no document arrays yet; impl='pallas' "
                   "on cuda, 'reference', 'parallel', 'blocks', 'stream' and the XLA:CPU one serve them")


def reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype="float32", reduction: str = "serial",
            segments: bool = False, **_) -> list[str]:
    """Refusals: the kernels' limits (cuda, compute capability 9.0, 64-row tiles, head widths multiples of 64 with
    Dk <= 256, bfloat16, shared memory per kernel), any reduction but the serial one, a packed row."""
    extra = [] if reduction == "serial" else [f"reduction={reduction!r} (the kernel computes the serial reduction)"]
    extra += [SEGMENTS_REASON] if segments else []
    cc = dispatch.cuda_compute_capability() if platform == "cuda" else None
    return extra + vq_cache_mgpu.unsupported_reasons(platform, L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dtype,
                                                     compute_capability=cc, block=_tile(platform, L))


def _tile(platform: str, L: int) -> int | None:
    """The kernels' row tile: wgmma's 64 rows on a GPU; in interpret mode (tests' small blocks) at most a block."""
    return min(vq_cache_mgpu.TILE, L) if platform == "interpret" else None


@dataclasses.dataclass(frozen=True)
class MosaicGpu(Pallas):
    """``mosaic_gpu``: ``pallas``'s runner with the Mosaic GPU kernels (``call.interpret``: interpret mode)."""

    def kernel(self, core, call: dispatch.Call):
        return functools.partial(vq_cache_mgpu.vq_cache_attention, L=core.L, M=core.M, interpret=call.interpret,
                                 block=_tile("interpret" if call.interpret else call.platform, core.L))


IMPLEMENTATIONS = (
    Implementation("mosaic_gpu", platforms=("cuda",), kernel=True, reasons=reasons,
                   config={"impl": "mosaic_gpu", "reduction": "serial"}, code=MosaicGpu, directions=("causal",),
                   defaults={"search_chunk": xla.SEARCH_CHUNK}, slow_in_interpret=True),
)

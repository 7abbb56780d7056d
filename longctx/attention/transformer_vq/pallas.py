"""The ``pallas`` implementation of Transformer-VQ: the §9 compressive VQ-cache kernel
(``pallas_kernels/vq_cache.py``: TPU; ``vq_cache_gpu.py``: GPU; interpret mode on a CPU when named) for the causal
block-parallel form with the serial reduction, forward and backward (docs/methods/transformer_vq.md §9).

'auto' tries it first on a GPU / TPU (never on a CPU), for the calls the size rule gives the block-parallel or tiled
form (:func:`prefer`: ``xla.preferred_form``); :func:`reasons` then says whether it serves the call. Named, it runs
every causal call it serves (decoding steps shorter than a block too).

Under a train step's mesh (``longctx.attention.row_split.active_mesh``) the kernel is a call XLA's partitioner
cannot split, so it runs per shard: a ``shard_map`` with the rows over the batch axes and the heads over
``tensor`` (the sequence axis whole; the codebook split by heads, the carried state as its rows and heads)."""

from __future__ import annotations

import functools
import sys

import jax
from jax.sharding import PartitionSpec as P

from longctx.attention import row_split
from longctx.attention.dispatch import Implementation
from longctx.attention.transformer_vq import xla
from pallas_kernels import vq_cache


def reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype="float32", reduction: str = "serial",
            segments: bool = False, **_) -> list[str]:
    """What the kernel refuses: its own limits (platforms, shapes, VMEM / shared-memory budget), any reduction
    but the serial one (the one it computes) and a packed row (``segments``)."""
    extra = [] if reduction == "serial" else [f"reduction={reduction!r} (the kernel computes the serial reduction)"]
    extra += xla.segments_reasons(platform, segments=segments)
    return extra + list(vq_cache.unsupported_reasons(platform, L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dtype))


def run(core, choice, pre, v, C, state):
    """One causal call through the kernel (``choice``: interpret mode and the platform it lowers for).

    The kernel takes the band scores ``bd = (q + v')·r'ᵀ`` [B, H, T, M+1] (float32) and forms each tile's band bias
    itself. Its matmul operands arrive in the compute dtype (the values' dtype): k̂ (``stvq`` keeps it), the
    codebook (cast here; the EMA statistics it comes from stay float32) and the carried band's keys and values
    (cast here: a band a bfloat16 call wrote holds bfloat16 values, so the cast is exact); the carried cache
    means and counts stay float32 state."""
    settings = IMPLEMENTATIONS[0].settings(core.cfg, choice.platform)
    k_hat, z, err2, c_z = xla.stvq(pre["k"], C, chunk=settings["search_chunk"])
    cd = v.dtype
    band = {"band_k": state["band_k"].astype(cd), "band_v": state["band_v"].astype(cd)}
    args = (pre["q_u"], xla.band_scores(pre["q_v"], pre["r"]), k_hat, z, v, jax.lax.stop_gradient(C).astype(cd),
            {**state, **band})
    call = functools.partial(vq_cache.vq_cache_attention, L=core.L, M=core.M, interpret=choice.interpret,
                             platform=choice.platform)
    mesh = row_split.active_mesh(*args[:5])
    bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *v.shape[:2])
    if bspec is None and hspec is None:
        o, new = call(*args)
    else:
        bh = P(bspec, hspec)
        state_specs = {name: P() if x.ndim == 0 else bh for name, x in state.items()}  # pos; [B,H,..] the rest
        o, new = jax.shard_map(call, mesh=mesh, in_specs=(bh,) * 5 + (P(hspec), state_specs),
                               out_specs=(bh, state_specs), check_vma=False)(*args)
    return o, new, (z, err2, c_z)


code_sums = xla.code_sums


def prefer(platform, **shapes) -> bool:
    """'auto' tries the kernel for the calls the size rule gives the block-parallel form (one-shot or tiled), not
    the streaming ones (shorter than a block, or a band longer than one)."""
    return xla.preferred_form(platform, **shapes) in ("parallel", "blocks")


IMPLEMENTATIONS = (
    Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=reasons,
                   config={"impl": "pallas", "reduction": "serial"}, auto={"cuda": 0, "rocm": 0, "tpu": 0},
                   prefer=prefer, code=sys.modules[__name__], directions=("causal",),
                   defaults={"search_chunk": xla.SEARCH_CHUNK}),  # the key quantization before the kernel
)

__all__ = ["IMPLEMENTATIONS", "code_sums", "prefer", "reasons", "run"]

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

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from longctx.attention import dispatch, row_split
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


@dataclasses.dataclass(frozen=True)
class Pallas(dispatch.Runner):
    """``pallas``: one causal call through the kernel (``call.interpret``: interpret mode; ``call.platform``: the
    platform it lowers for); ``search_chunk``: the key quantization before it (:func:`xla.stvq`).

    The kernel takes the band scores ``bd = (q + v')·r'ᵀ`` [B, H, T, M+1] (float32) and forms each tile's band bias
    itself. Its matmul operands arrive in the compute dtype (the values' dtype): k̂ (``stvq`` keeps it), the
    codebook (cast here; the EMA statistics it comes from stay float32) and the carried band's keys and values
    (cast here: a band a bfloat16 call wrote holds bfloat16 values, so the cast is exact); the carried cache
    means and counts stay float32 state."""

    search_chunk: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x, state = call.inputs, call.state
        v, C = x["v"], x["C"]
        k_hat, z, err2, c_z = xla.stvq(x["k"], C, chunk=self.search_chunk)
        cd = v.dtype
        band = {"band_k": state["band_k"].astype(cd), "band_v": state["band_v"].astype(cd)}
        args = (x["q_u"], xla.band_scores(x["q_v"], x["r"]), k_hat, z, v, jax.lax.stop_gradient(C).astype(cd),
                {**state, **band})
        kernel = functools.partial(vq_cache.vq_cache_attention, L=core.L, M=core.M, interpret=call.interpret,
                                   platform=call.platform)
        mesh = row_split.active_mesh(*args[:5])
        bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *v.shape[:2])
        if bspec is None and hspec is None:
            o, new = kernel(*args)
        else:
            bh = P(bspec, hspec)
            state_specs = {name: P() if a.ndim == 0 else bh for name, a in state.items()}  # pos; [B,H,..] the rest
            o, new = jax.shard_map(kernel, mesh=mesh, in_specs=(bh,) * 5 + (P(hspec), state_specs),
                                   out_specs=(bh, state_specs), check_vma=False)(*args)
        return xla.result(o, new, (z, err2, c_z), code_sums=xla.code_sums)


def prefer(platform, **shapes) -> bool:
    """'auto' tries the kernel for the calls the size rule gives the block-parallel form (one-shot or tiled), not
    the streaming ones (shorter than a block, or a band longer than one)."""
    return xla.preferred_form(platform, **shapes) in ("parallel", "blocks")


IMPLEMENTATIONS = (
    Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=reasons,
                   config={"impl": "pallas", "reduction": "serial"}, auto={"cuda": 0, "rocm": 0, "tpu": 0},
                   prefer=prefer, code=Pallas, directions=("causal",),
                   defaults={"search_chunk": xla.SEARCH_CHUNK}),  # the key quantization before the kernel
)

__all__ = ["IMPLEMENTATIONS", "Pallas", "prefer", "reasons"]

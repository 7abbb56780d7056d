"""The ``pallas`` implementation of Transformer-VQ: the §9 compressive VQ-cache kernel
(``pallas_kernels/vq_cache.py``: TPU; ``vq_cache_gpu.py``: GPU; interpret mode on a CPU when named) for the causal
block-parallel form with the serial reduction, forward and backward (docs/methods/transformer_vq.md §9).

A packed row (segment ids, §2.8) runs both forms, with the new state of ``state.packed_final_state``: the GPU form
(``platform='cuda'``) takes the per-block caches and document arrays of ``xla.kernel_packed``, the TPU form (which a
CPU runs in interpret mode) the document arrays of ``xla.kernel_documents``, restarting the cache it folds inside
the kernel at documents.

'auto' tries it first on a GPU / TPU (never on a CPU; on Hopper ``mosaic_gpu`` instead, ``dispatch.hopper``), for
the calls the size rule gives the block-parallel or tiled form (:func:`prefer`: ``xla.preferred_form``);
:func:`reasons` then says whether it serves the call. Named, it runs every causal call it serves (decoding steps
shorter than a block too).

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
from longctx.attention.transformer_vq.state import packed_final_state
from pallas_kernels import vq_cache
from pallas_kernels.vq_cache_ref import cast_state, float_dtype


def reasons(platform: str, *, L: int, M: int, S: int, Dk: int, Dv: int, dtype="float32", reduction: str = "serial",
            segments: bool = False, **_) -> list[str]:
    """What the kernel refuses: its own limits (platforms, shapes, VMEM / shared-memory budget, a packed row's
    included) and any reduction but the serial one (the one it computes; a packed row's cache is serial whatever
    the setting)."""
    extra = [] if reduction == "serial" or segments else [
        f"reduction={reduction!r} (the kernel computes the serial reduction)"]
    return extra + list(vq_cache.unsupported_reasons(platform, L=L, M=M, S=S, Dk=Dk, Dv=Dv, dtype=dtype,
                                                     packed=segments))


@dataclasses.dataclass(frozen=True)
class Pallas(dispatch.Runner):
    """``pallas``: one causal call through the kernel (``call.interpret``: interpret mode; ``call.platform``: the
    platform it lowers for); ``search_chunk``: the key quantization before it (:func:`xla.stvq`).

    The kernel takes the band scores ``bd = (q + v')·r'ᵀ`` [B, H, T, M+1] (float32) and forms each tile's band bias
    itself. Its matmul operands arrive in the compute dtype (the values' dtype): k̂ (``stvq`` keeps it), the
    codebook (cast here; the EMA statistics it comes from stay float32) and the carried band's keys and values
    (cast here: a band a bfloat16 call wrote holds bfloat16 values, so the cast is exact); the carried cache
    means and counts stay float32 state.

    A packed row (``segment_ids``): the GPU form takes ``xla.kernel_packed``'s caches and document arrays, the TPU
    form ``xla.kernel_documents``' document arrays, formed per shard from the shard's rows (and heads), and the new
    state is the call's last document's (``state.packed_final_state``, in XLA, as the packed XLA forms')."""

    search_chunk: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x, state = call.inputs, call.state
        v, C = x["v"], x["C"]
        k_hat, z, err2, c_z = xla.stvq(x["k"], C, chunk=self.search_chunk)
        cd = v.dtype
        band = {"band_k": state["band_k"].astype(cd), "band_v": state["band_v"].astype(cd)}
        args = (x["q_u"], xla.band_scores(x["q_v"], x["r"]), k_hat, z, v, jax.lax.stop_gradient(C).astype(cd),
                {**state, **band})
        kernel = self.kernel(core, call)
        seg = x["segment_ids"]
        docs = () if seg is None else (x["seen"], x["continues"], seg)
        if seg is not None:
            kernel = functools.partial(_packed_kernel, kernel, L=core.L, M=core.M,
                                       gpu=vq_cache.gpu_form(call.platform))
        mesh = row_split.active_mesh(*args[:5])
        bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *v.shape[:2])
        if bspec is None and hspec is None:
            o, new = kernel(*args, *docs) if seg is None else (kernel(*args, *docs), None)
        else:
            bh = P(bspec, hspec)
            state_specs = {name: P() if a.ndim == 0 else bh for name, a in state.items()}  # pos; [B,H,..] the rest
            doc_specs = (P(bspec), P(bspec), P(bspec)) if docs else ()
            out = jax.shard_map(kernel, mesh=mesh, in_specs=(bh,) * 5 + (P(hspec), state_specs) + doc_specs,
                                out_specs=(bh, state_specs) if seg is None else bh, check_vma=False)(*args, *docs)
            o, new = out if seg is None else (out, None)
        if seg is not None:
            dt = float_dtype(x["q_u"], v)
            new = packed_final_state(cast_state(state, dt), x["seen"], x["continues"], k_hat.astype(dt), z,
                                     v.astype(dt), seg, M=core.M, S=C.shape[1])
        return xla.result(o, new, (z, err2, c_z), code_sums=xla.code_sums)


    def kernel(self, core, call: dispatch.Call):
        """The kernel's entry point for this call (the Pallas one: TPU form, or GPU form on cuda)."""
        return functools.partial(vq_cache.vq_cache_attention, L=core.L, M=core.M, interpret=call.interpret,
                                 platform=call.platform)


def _packed_kernel(kernel, q_u, bd, k_hat, z, v, C, state, seen, continues, segment_ids, *, L: int, M: int,
                   gpu: bool):
    """``kernel`` (the entry point with its platform) on a packed row: ``xla.kernel_packed``'s inputs (GPU form,
    ``gpu``) or ``xla.kernel_documents``' (TPU form) from the rows (and heads) it is given. Returns o (the caller
    forms the new state)."""
    if gpu:
        packed = xla.kernel_packed(z, v, state, seen, continues, L=L, M=M, S=C.shape[1], segment_ids=segment_ids)
    else:
        packed = xla.kernel_documents(seen, continues, L=L, M=M, segment_ids=segment_ids)
    return kernel(q_u, bd, k_hat, z, v, C, state, packed=packed)[0]


def prefer(platform, **shapes) -> bool:
    """'auto' tries the kernel for the calls the size rule gives the block-parallel form (one-shot or tiled), not
    the streaming ones (shorter than a block, or a band longer than one); a packed row where 'auto' tries the
    packed one-shot or tiled form (a block or more)."""
    if shapes.get("segments"):
        return xla.prefer_parallel(platform, **shapes) or xla.prefer_blocks(platform, **shapes)
    return xla.preferred_form(platform, **shapes) in ("parallel", "blocks")


IMPLEMENTATIONS = (
    Implementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=reasons,
                   config={"impl": "pallas", "reduction": "serial"}, auto={"cuda": 0, "rocm": 0, "tpu": 0},
                   prefer=dispatch.not_on_hopper(prefer), code=Pallas, directions=("causal",),
                   atomics=("cuda",),  # the code means' gradient dμ̄ (vq_cache_gpu's backward)
                   defaults={"search_chunk": xla.SEARCH_CHUNK}),  # the key quantization before the kernel
)

__all__ = ["IMPLEMENTATIONS", "Pallas", "prefer", "reasons"]

"""The implementation ``mosaic_gpu``: the blocked path (:func:`longctx.attention.fma.xla.fma_forward`) with the
Pallas Mosaic GPU kernels ``pallas_kernels/fma_blocks_mgpu.py`` (forward and backward, Hopper: wgmma, TMA,
``emit_pipeline``) as its block function; interpret mode (Mosaic GPU's, ``InterpretGPUParams``) on a CPU. The
kernels serve full passes of FMA (packed coarse slots, no dropout); streaming steps run the kernels' reference.

FMA's only (the kernels compute FMA's packed slots, not FMA-linear's statistics). ``impl='auto'`` tries it first on
cuda: it serves Hopper in bf16 / fp16 (its reasons), where ``pallas`` (Triton) steps aside (``dispatch.hopper``; a
cuda export from a CPU host counts as Hopper). It has not yet compiled on a GPU: ``scripts/gpu_check.sh``'s tests
step compiles it first; ``impl='pallas'`` (Triton) or ``'xla'`` where it fails. Under a train step's mesh
each kernel call runs per shard of the batch and heads (a ``shard_map``), as ``pallas`` does."""

from __future__ import annotations

import dataclasses
import functools

from longctx.attention import dispatch, row_split
from longctx.attention.fma import xla
from longctx.attention.fma.pallas import MethodImplementation, per_shard
from longctx.attention.fma.state import Blocked
from pallas_kernels import fma_blocks_mgpu
from pallas_kernels.fma_blocks import kernel_docs
from pallas_kernels.fma_blocks_ref import attend_blocks


def _blocks(qb, kp, vp, coarse, *, n_valid, causal, interpret, docs=None):
    """The kernels on one full pass's block operands (``attend_blocks``' layout: ``kp, vp`` with one block in
    front; ``docs`` its documents of a packed row) -> ``[B, H, nb, m, dv]`` in the compute dtype."""
    B, H, nb, m, d = qb.shape
    dv = vp.shape[-1]

    def rows(x, w):  # [B, H, ..., w] -> [BH, -1, w]
        return x.reshape(B * H, -1, w)

    tables = (None,) * 4 if coarse is None else (rows(coarse[1], d), rows(coarse[2], dv), coarse[3], coarse[4])
    if docs is not None:  # per (row, head), the slots' unpadded (the kernels pad them with their slot tiles)
        docs = kernel_docs(docs, H, m, nb, None if coarse is None else coarse[3].shape[1])
    out = fma_blocks_mgpu.fma_blocks_mgpu(rows(qb, d), rows(kp[:, :, m:m + nb * m], d),
                                          rows(vp[:, :, m:m + nb * m], dv), *tables, m=m, causal=causal,
                                          n_valid=n_valid, interpret=interpret, docs=docs)
    return out.reshape(B, H, nb, m, dv)


def attend(interpret: bool):
    """The block function running the kernels (interpret mode on a CPU where ``interpret``); the kernels read no
    settings."""

    def run(qb, kp, vp, coarse, *, q_block0, n_valid, causal, drop_key=None, attn_dropout=0.0, docs=None, **kw):
        kind = None if coarse is None else coarse[0]
        if (kind not in (None, "packed") or not isinstance(q_block0, int) or q_block0 != 0
                or not isinstance(n_valid, int) or (drop_key is not None and attn_dropout > 0)):
            return attend_blocks(qb, kp, vp, coarse, q_block0=q_block0, n_valid=n_valid, causal=causal,
                                 drop_key=drop_key, attn_dropout=attn_dropout, docs=docs, **kw)
        call = functools.partial(_blocks, n_valid=n_valid, causal=causal, interpret=interpret)
        mesh = row_split.active_mesh(qb, kp, vp)
        bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *qb.shape[:2])
        return per_shard(call, mesh, bspec, hspec, qb, kp, vp, coarse, docs)

    return run


@dataclasses.dataclass(frozen=True)
class MosaicGpu(Blocked):
    """The implementation ``mosaic_gpu``: the blocked path with the kernels as its block function, for full passes
    and streamed steps alike (the kernels' reference where they do not serve a call: a streamed step, dropout);
    interpret mode where ``call.interpret``. Its one knob, ``logit_budget``, is read by the reference."""

    def attend(self, call):
        return attend(call.interpret)

    def forward(self, call):
        return functools.partial(xla.fma_forward, attend=self.attend(call))


def _reasons(platform, *, release_zero_slots=False, segments=False, **shapes):
    if platform == "cuda" and shapes.get("compute_capability") is None:
        shapes["compute_capability"] = dispatch.cuda_compute_capability()  # "needs compute capability 9.0 (Hopper)" if not
    out = list(fma_blocks_mgpu.unsupported_reasons(platform, **shapes))
    if release_zero_slots:
        out.append("release_zero_slots (the release's unmasked zero slots) is served by the reference and the XLA "
                   "paths; the kernels are not tested with the extra slot")
    return out  # packed rows (``segments``): served, the documents reaching the kernels (``fma_blocks_mgpu``' docs)


# logit_budget: read by the streamed steps only (the kernels' reference, xla.py's table); the kernels hold one
# block's scores at a time. 'auto' tries it first on cuda; it serves Hopper only (its reasons), where ``pallas``
# steps aside. Not yet compiled on a GPU (gpu_check.sh's tests step compiles it first).
IMPLEMENTATIONS = (
    MethodImplementation("mosaic_gpu", platforms=("cuda",), kernel=True, reasons=_reasons,
                         config={"impl": "mosaic_gpu"}, auto={"cuda": -1}, code=MosaicGpu, methods=("fma",),
                         defaults={"logit_budget": xla.LOGIT_BUDGET}, slow_in_interpret=True),
)

__all__ = ["IMPLEMENTATIONS", "MosaicGpu", "attend"]

"""The implementation ``pallas``: the blocked path (:func:`longctx.attention.fma.xla.fma_forward`) with the
Pallas block kernel ``pallas_kernels/fma_blocks.py`` (docs/methods/fma.md §8) as its block function. The kernel
serves full passes of FMA (packed coarse slots, no dropout); streaming steps run the kernel's reference.

FMA's only: the kernel computes FMA's packed coarse slots, not FMA-linear's statistics, so the declaration names
the one method it serves (``methods``); ``impl='auto'`` tries it first on GPU and TPU, before ``xla``, except on
Hopper, where ``mosaic_gpu`` takes its place (JAX deprecated the Triton backend; ``dispatch.hopper``).

Under a train step's mesh (``longctx.attention.row_split.active_mesh``) the kernel is a call XLA's partitioner
cannot split, so each kernel call runs per shard: a ``shard_map`` with the rows over the batch axes and the heads
over ``tensor`` (the sequence axis whole), the coarse slots' block tables replicated."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from longctx.attention import row_split
from longctx.attention.dispatch import Implementation, not_on_hopper
from longctx.attention.fma import xla
from longctx.attention.fma.state import Blocked
from pallas_kernels import fma_blocks

unsupported_reasons = fma_blocks.unsupported_reasons


def attend(platform: str, interpret: bool, tiles):
    """The block function running the kernel for ``platform`` (``'interpret'``: interpret mode on a CPU, with
    ``interpret``) with ``tiles(m)`` (the kernel's GPU tiles for fine blocks of ``m`` rows, :meth:`Pallas.tiles`);
    the kernel's calls run per shard of the batch and heads under a mesh (module docstring)."""

    def run(qb, kp, vp, coarse, *, q_block0, n_valid, causal, drop_key=None, attn_dropout=0.0, docs=None, **kw):
        inner = fma_blocks.make_attend(interpret=interpret, platform=platform, **tiles(qb.shape[3]))
        kind = None if coarse is None else coarse[0]
        kernel = (kind in (None, "packed") and isinstance(q_block0, int) and q_block0 == 0
                  and isinstance(n_valid, int) and not (drop_key is not None and attn_dropout > 0))
        mesh = row_split.active_mesh(qb, kp, vp) if kernel else None
        bspec, hspec = (None, None) if mesh is None else row_split.batch_heads_specs(mesh, *qb.shape[:2])
        call = functools.partial(inner, q_block0=q_block0, n_valid=n_valid, causal=causal, drop_key=drop_key,
                                 attn_dropout=attn_dropout, **kw)
        return per_shard(call, mesh, bspec, hspec, qb, kp, vp, coarse, docs)

    return run


def per_shard(call, mesh, bspec, hspec, qb, kp, vp, coarse, docs):
    """``call(qb, kp, vp, coarse, docs=docs)`` (a kernel's block function), under a mesh per shard of the batch
    (``bspec``) and heads (``hspec``): a ``shard_map`` with the coarse slots' block tables replicated and the
    documents of a packed row (``[B, ...]``) split with the batch; directly where neither is split."""
    if bspec is None and hspec is None:
        return call(qb, kp, vp, coarse, docs=docs)
    bh = P(bspec, hspec)
    kind = None if coarse is None else coarse[0]
    tables = () if coarse is None else tuple(coarse[1:])
    table_specs = () if coarse is None else (bh, bh, P(), P())  # kall, vall [B,H,..]; idx, bias per block
    doc_args = () if docs is None else tuple(x for x in docs if x is not None)
    n_t = len(tables)

    def local(qb, kp, vp, *rest):
        t, d = rest[:n_t], rest[n_t:]
        local_docs = None if docs is None else (d[0], d[1], d[2] if len(d) > 2 else None)
        return call(qb, kp, vp, None if kind is None else (kind, *t), docs=local_docs)

    return jax.shard_map(local, mesh=mesh, in_specs=(bh, bh, bh, *table_specs, *(P(bspec),) * len(doc_args)),
                         out_specs=bh, check_vma=False)(qb, kp, vp, *tables, *doc_args)


@dataclasses.dataclass(frozen=True)
class Pallas(Blocked):
    """The implementation ``pallas``: the blocked path with the kernel as its block function, for full passes and
    streamed steps alike (the kernel falls back to its reference where it does not serve a call: a streamed step,
    dropout), built for ``call.platform`` (interpret mode where ``call.interpret``). Its knobs beyond
    ``logit_budget``: the GPU lowering's warps per 64 query rows and pipeline stages, and the fine blocks one
    program loops over (each 0: the kernel's rule)."""

    kernel_warps_per_64_rows: int = 0
    kernel_stages: int = 0
    blocks_per_program: int = 0

    def tiles(self, m: int) -> dict:
        """The kernel's ``num_warps`` / ``num_stages`` / ``blocks_per_program`` for fine blocks of ``m`` rows (0: the
        kernel's rule, :func:`pallas_kernels.fma_blocks.gpu_tiles`; one block per program). The warps are
        configured per 64 query rows (a program works on one block of ``m`` rows at a time), so one setting serves
        every ``m``: 4 gives the rule's 4 warps up to ``m = 64`` and 8 at 128."""
        warps, stages = self.kernel_warps_per_64_rows, self.kernel_stages
        return {"num_warps": warps * max(1, m // 64) if warps else None, "num_stages": stages or None,
                "blocks_per_program": self.blocks_per_program or None}

    def attend(self, call):
        return attend("interpret" if call.interpret else call.platform, call.interpret, self.tiles)

    def forward(self, call):
        return functools.partial(xla.fma_forward, attend=self.attend(call))


def _reasons(platform, *, release_zero_slots=False, segments=False, **shapes):
    # packed rows (docs/methods/fma.md §2.7, ``segments``): served. The blocked path lays the documents out again
    # and hands the kernel the document of every query, fine key and coarse slot (``fma_blocks``' ``docs``).
    out = list(unsupported_reasons(platform, **shapes))
    if release_zero_slots:
        out.append("release_zero_slots (the release's unmasked zero slots) is served by the reference "
                   "and the XLA paths; the kernel is not tested with the extra slot")
    return out


@dataclasses.dataclass(frozen=True)
class MethodImplementation(Implementation):
    """An implementation of this folder that serves only some of its methods: ``methods`` names them (the
    layer lists a declaration for a method only where its ``methods`` include the method's name; empty: all)."""

    methods: tuple[str, ...] = ()


# logit_budget: read by the streamed steps only (they run the kernel's reference, xla.py's table); the kernel holds
# one block's scores at a time. The GPU lowering's tiles: cuda the kernel's rule (4 warps per 64 query rows, 2
# stages), not yet measured against other values on a GPU; the Mosaic (TPU) lowering and interpret mode read neither
# ('default'). blocks_per_program (fine blocks one program loops over, a power of two; fewer where the block count
# has no such divisor): a program of G blocks reads G + 1 (causal; bidirectional G + 2) fine key blocks instead of
# 2 G (3 G). cuda 2, tpu 4 (a core runs its programs one after another: fewer, larger steps); interpret mode
# ('cpu') 2, so the loop runs at test lengths. Reasoned values, not yet measured on a GPU or TPU.
TILES = {"kernel_warps_per_64_rows": {"cuda": 4, "default": 4}, "kernel_stages": {"cuda": 2, "default": 2},
         "blocks_per_program": {"cuda": 2, "tpu": 4, "cpu": 2, "default": 1}}
IMPLEMENTATIONS = (
    MethodImplementation("pallas", platforms=("tpu", "cuda"), kernel=True, reasons=_reasons,
                         config={"impl": "pallas"}, auto={"cuda": 0, "rocm": 0, "tpu": 0}, prefer=not_on_hopper(),
                         code=Pallas, atomics=("cuda",),  # the coarse slots' gradient (fma_blocks' gather form)
                         methods=("fma",), defaults={"logit_budget": xla.LOGIT_BUDGET, **TILES}),
)

__all__ = ["IMPLEMENTATIONS", "MethodImplementation", "Pallas", "attend", "per_shard", "unsupported_reasons"]

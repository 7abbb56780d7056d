"""EVA's implementation ``mosaic_gpu``: Phase B of a full pass by the Pallas Mosaic GPU kernels for Hopper
(``pallas_kernels/eva_attend_mgpu.py``: forward and backward; wgmma, TMA, ``emit_pipeline``), Phase A (the chunk
summaries) by ``pallas``'s kernel; a stream after a carried state runs as ``pallas``'s does (Phase A by the kernel,
Phase B in the XLA tiles). Mosaic GPU's interpret mode (``InterpretGPUParams``) on a CPU when named.

Not in ``impl='auto'``: nothing of it has compiled or run on a GPU; it runs where named (``impl='mosaic_gpu'``).
Refused, one line each (:func:`reasons`): packed rows (segment ids), the kernels' shapes and dtypes, a compute capability other than 9.0; float32 operands on cuda are refused by the
kernel when called (wgmma would round them to tf32; the selection is not told the dtype)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from longctx.attention import dispatch
from longctx.attention.eva import pallas, xla
from longctx.attention.eva.common import chunk_noise, dropout_seeds, geometry, local_bias_tiles, run_pass
from pallas_kernels import eva_attend_mgpu
from pallas_kernels.precision import compute_dtype


def reasons(platform: str, *, P: int, d: int, dv: int, W: int, C: int, e_l: int, e_r: int, chunk_logit: str,
            full: bool, segments: bool = False, **_) -> list[str]:
    """Phase A's limits (``pallas``'s kernel), then for a full pass or a packed row the Mosaic GPU kernels'."""
    out = pallas.unsupported_reasons(platform, P=P, d=d, dv=dv, W=W, C=C,
                                     e_l=e_l, e_r=e_r, chunk_logit=chunk_logit, full=False)
    if full or segments:
        cc = dispatch.cuda_compute_capability() if platform == "cuda" else None
        out += [f"eva_attend_mgpu: {r}" for r in eva_attend_mgpu.unsupported_reasons(
            platform, W=W, d=d, dv=dv, e_l=e_l, e_r=e_r, chunk_logit=chunk_logit, segments=segments,
            compute_capability=cc)]
    return out


def eva_forward(q, k, v, params, rpe_table, noise_key, drop_key, opts, *, chunk_size: int, num_chunks: int,
                interpret: bool, platform: str):
    """Full pass: (out [B,H,L,dv], extras), as ``pallas.eva_forward`` with Phase B by the Mosaic GPU kernels
    (attention dropout included: the hash mask of ``common.dropout_seeds``, the same as ``pallas``'s)."""
    B, H, L, d = q.shape
    dv = v.shape[-1]
    scale = d**-0.5
    L_pad, P, C, _ = geometry(opts, L, chunk_size, num_chunks)
    cd = compute_dtype(q, k, v)
    qf, kf, vf = (jnp.pad(x.astype(cd), ((0, 0), (0, 0), (0, L_pad - L), (0, 0))) for x in (q, k, v))
    valid = jnp.asarray((np.arange(L_pad) < L).reshape(C, P))
    noise = None if noise_key is None else chunk_noise(noise_key, jnp.arange(C), B, H, d)
    bias = local_bias_tiles(rpe_table, opts, scale) if opts.use_rpe and rpe_table is not None else None
    bias = None if bias is None else bias.astype(cd)
    stats_fn = pallas._stats_fn(interpret, platform)
    seeds = dropout_seeds(drop_key, opts, B, H)  # [B, H]: row b·H + h of the whole batch, sharded like the rows

    def kernels(qf, kf, vf, params, noise, bias, seeds):
        b, h = qf.shape[:2]
        k_hat, beta = stats_fn(*(x.reshape(b, h, C, P, x.shape[-1]) for x in (qf, kf, vf)), valid, params, noise,
                               opts, scale)
        flat = lambda x: x.reshape((b * h,) + x.shape[2:])  # noqa: E731
        o, _ = eva_attend_mgpu.eva_attend_mgpu(
            flat(qf * scale), flat(kf), flat(vf), flat(k_hat.astype(cd)), flat(beta.astype(cd)), bias, W=opts.W,
            e_l=opts.e_l, e_r=opts.e_r, P=P, L=L, causal=opts.causal, disjoint=opts.partition == "disjoint",
            heads=h, interpret=interpret, dropout_rate=0.0 if seeds is None else opts.attn_dropout,
            seeds=None if seeds is None else seeds.reshape(b * h))
        return o.reshape(b, h, L_pad, dv), k_hat, beta

    specs = lambda bh, bspec, hspec: (bh, bh, bh, jax.tree.map(lambda _: PartitionSpec(), params),  # noqa: E731
                                      None if noise is None else bh, pallas._bias_spec(bias, H, hspec),
                                      None if seeds is None else bh)
    o, k_hat, beta = pallas._per_shard(kernels, (qf, kf, vf, params, noise, bias, seeds), specs,
                                       lambda bh: (bh, bh, bh), B, H)
    extras = {"k_hat": k_hat, "beta": beta, "L_pad": L_pad, "P": P, "C": C, "padded": (qf, kf, vf)}
    return o[:, :, :L], extras


def _packed(*_, **__):
    raise dispatch.KernelUnsupportedError("eva mosaic_gpu: packed rows (segment ids) are not served (reasons)")


@dataclasses.dataclass(frozen=True)
class MosaicGpu(dispatch.Runner):
    """``mosaic_gpu``: :func:`eva_forward` from a row's start, ``pallas.eva_stream`` after a carried state (the XLA
    tiles' logit budget), on the call's platform (interpret mode on a CPU)."""

    logit_budget: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        kernel = dict(interpret=call.interpret, platform=call.platform)
        return run_pass(self, core, call, eva_forward, pallas.eva_stream, _packed, **kernel)


# No auto entry: not yet compiled or run on a GPU.
IMPLEMENTATIONS = (
    dispatch.Implementation("mosaic_gpu", platforms=("cuda",), kernel=True, reasons=reasons,
                            config={"impl": "mosaic_gpu"}, code=MosaicGpu,
                            defaults={"logit_budget": xla.LOGIT_BUDGET}, slow_in_interpret=True),
)

__all__ = ["IMPLEMENTATIONS", "MosaicGpu", "eva_forward", "reasons"]

"""The blocked FMA path tuned for XLA:CPU (jax 0.10.2), the implementation ``xla_cpu`` (``impl='auto'`` on a CPU).

The algorithm is :func:`longctx.attention.fma.xla.fma_forward` (the portable ``xla`` path); this file hands it
the CPU forms of its products and of the level summaries:

* the block function's scores and weighted sums are ``longctx.xla_cpu.scores`` / ``mix`` (their key-side
  gradients as plain dots), and ``num / den`` is ``scale_rows`` (its gradient's row sum a dot, not a
  multiply-and-reduce that XLA:CPU runs on a slow path when a dimension has size 1, batch 1);
* the summaries of all levels are one fused multiply-and-reduce per level with a written-out backward
  (:func:`all_level_summaries`, :func:`_depthwise_groups`).

Narrow inputs (bfloat16, float16): the products take compute-dtype operands with float32 accumulation
(:func:`pallas_kernels.precision.acc_einsum`; ``longctx.xla_cpu``'s ``scores`` / ``mix`` return their operands'
dtype, so they serve float32 and float64 only) and the summaries' multiply-and-reduce runs in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from longctx.attention.dispatch import Implementation
from longctx.attention.fma import xla
from longctx.attention.fma.options import FMAOptions, acc_type, pad_to
from longctx.attention.fma.reference import bias_rows
from longctx.attention.fma.state import Blocked
from longctx.xla_cpu import mix, scale_rows, scores
from pallas_kernels.fma_blocks_ref import BlockOps, attend_blocks
from pallas_kernels.precision import acc_einsum


def _wide(a, b) -> bool:
    """Operands of one float32-or-wider dtype: the CPU forms, as they are; narrower ones accumulate in float32."""
    return a.dtype == b.dtype == acc_type(a)


def _qk(q, k):
    return scores(q, k) if _wide(q, k) else acc_einsum("...id,...jd->...ij", q, k)


def _pv(p, v):
    return mix(p, v) if _wide(p, v) else acc_einsum("...ij,...jd->...id", p, v)


OPS = BlockOps(qk_dot=_qk, pv_dot=_pv, row_scale=scale_rows)
attend = functools.partial(attend_blocks, ops=OPS)  # the block function; also the streaming steps'


def all_level_summaries(x, prms, Lu: int, opts: FMAOptions):
    """``[level_summaries(x, prms[l-1], m_l, opts) for l = 1..Lu]`` (:mod:`longctx.attention.fma.xla`), faster.

    For the paper's operator (depthwise, weights shared across heads) each level is one fused
    multiply-and-reduce over the group's tokens, ``sum_t x[g, t, f] W[t, f, r]``, reading the
    sequence in its stored order (features minor). Two earlier forms were slower on XLA:CPU: the
    per-level einsum transposed the whole sequence for every level, and so did a batched matmul over
    the features after one explicit transpose (XLA made the transpose a layout change and redid it in
    every level's dot), each about twice the time of this form over all levels of a long sequence.
    Other operators keep the per-level path."""
    if Lu == 0:
        return []
    if opts.downsample != "depthwise_conv" or not opts.shared:
        return xla.all_level_summaries(x, prms, Lu, opts)
    B, H, n, f = x.shape
    # zero-padded once to the top level's group size (a per-level pad copied the sequence at every level, so that
    # an unpadded length ran slower than the next power of two); the extra all-zero groups of a level are cut
    xp = pad_to(x, opts.m_l(Lu))
    out = []
    for l in range(1, Lu + 1):
        ml, prm = opts.m_l(l), prms[l - 1]
        # one leading axis for (batch, head, group): the same product with separate [BH, N_l, 1, ...] axes is
        # miscompiled by XLA:CPU (jax 0.10.2) when B*H = 1 (wrong sums under jit, right eagerly; see
        # tests/attention/test_fma.py::test_level_summaries_under_jit_equal_the_einsum_form)
        W = jnp.moveaxis(prm["kernel"], -1, 0).astype(x.dtype)  # [p, ml, f]
        y = _depthwise_groups(xp.reshape(-1, ml, f), W)  # [BH N_l', p, f]
        y = y.reshape(B, H, -1, opts.p, f)[:, :, : -(-n // ml)]
        out.append(y + bias_rows(prm, opts))
    return out


@jax.custom_vjp
def _depthwise_groups(xg, W):
    """y[g, r, f] = sum_t xg[g, t, f] W[r, t, f]: xg [G, m, f], W [p, m, f] -> [G, p, f] (one leading axis for
    batch, head and group; see :func:`all_level_summaries`).

    The backward is written out. Autodiff of the multiply-and-reduce materialised [G, p, m, f] broadcasts of x,
    of the cotangent and of W for every level (134 MB each at 32k) and reduced them over the groups: at 32k
    causal the summaries' backward took an order of magnitude longer than the whole forward.

    Narrow x and W (bfloat16): multiplied and summed in float32 (an element-wise reduce, not a product the
    compute dtype should take), the result float32; the backward's matmul ``dW`` takes compute-dtype operands."""
    acc = acc_type(xg)
    return jnp.sum(xg[:, None].astype(acc) * W[None].astype(acc), axis=2)


def _depthwise_groups_fwd(xg, W):
    return _depthwise_groups(xg, W), (xg, W)


def _depthwise_groups_bwd(res, ct):
    xg, W = res
    # dx[g, t, f] = sum_r ct[g, r, f] W[r, t, f]: p element-wise terms, no broadcast written out
    dx = ct[:, 0, None, :] * W[0][None]
    for r in range(1, W.shape[0]):
        dx = dx + ct[:, r, None, :] * W[r][None]
    # a matmul over the groups, batched over features: compute-dtype operands, accumulated in at least float32
    dW = jnp.einsum("gtf,grf->rtf", xg, ct.astype(xg.dtype), preferred_element_type=acc_type(xg))
    return dx.astype(xg.dtype), dW.astype(W.dtype)


_depthwise_groups.defvjp(_depthwise_groups_fwd, _depthwise_groups_bwd)


def forward(q, k, v, ds, opts: FMAOptions, drop_key=None, **packed):
    """The implementation ``xla_cpu``: the blocked path with the CPU products and fused summaries (``packed``: its
    ``docs`` and ``levels``, for a packed row laid out again)."""
    return xla.fma_forward(q, k, v, ds, opts, drop_key, attend=attend, summaries=all_level_summaries, **packed)


@dataclasses.dataclass(frozen=True)
class XlaCpu(Blocked):
    """The implementation ``xla_cpu``: :func:`forward` for a full pass, the streamed steps with its block function
    (:data:`attend`; its one knob, ``logit_budget``, reaches both through the options)."""

    def forward(self, call):
        return forward

    def attend(self, call):
        return attend


# the name ``xla_cpu`` (users and saved configs use it); 'auto' on a CPU tries it first, before ``xla``
# its logit_budget: the XLA:CPU value (it runs on XLA:CPU only; 'default' answers the platforms it never runs on)
IMPLEMENTATIONS = (
    Implementation("xla_cpu", platforms=("cpu",), config={"impl": "xla_cpu"}, auto={"cpu": 0}, code=XlaCpu,
                   defaults={"logit_budget": {"cpu": 1 << 24, "default": 1 << 24}}),
)

__all__ = ["IMPLEMENTATIONS", "OPS", "XlaCpu", "all_level_summaries", "attend", "forward"]

"""The XLA:CPU implementation of Transformer-VQ (``xla_cpu``; ``impl='auto'`` on a CPU): the portable forms of
``xla.py`` (block-parallel, tiled, streaming, encoder) run with products laid out for XLA:CPU (the helpers of
``longctx.xla_cpu``, docs/DESIGN.md "Where the time goes"). Which causal form a call takes is this implementation's
own rule over its own settings (:func:`xla.form_for` with its ``tiled_min_scores``: the tiled form for calls of at
least that many scores, the one-shot form with its ``reduction`` below it, the streaming form for calls shorter
than a block); the forms by name are the portable implementations. The products:

* the score and value products ``q kᵀ`` and ``p v`` with key-side gradients as plain dots (``scores``, ``mix``);
* the softmax normalizer applied as an einsum (its gradient's row sum a dot, not a multiply-and-reduce over a
  size-1 batch or head), exact in float32;
* the tiled backward's key-side gradients accumulated transposed (``transposed``, ``rows_dot``, ``rowdot``);
* per-code sums as a scatter-add (a [.., S, L] one-hot costs an order of magnitude more here);
* the nearest-code search heads-major, with the argmax as two plain reductions.

Same results as the portable forms (tests/attention/test_implementations.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from longctx.attention import dispatch
from longctx.attention.dispatch import Implementation
from longctx.attention.transformer_vq import xla
from longctx.xla_cpu import mix, rowdot, rows_dot, scores, transposed
from pallas_kernels.precision import statistic
from pallas_kernels.vq_cache_ref import Ops, acc_einsum, causal_parallel, float_dtype


def score_dot(q, k):
    """``q kᵀ`` (same batch axes): ``scores`` (its dk a plain dot) for float32 or wider operands, else compute-dtype
    operands with a float32 result."""
    if q.dtype == k.dtype == float_dtype(q, k):
        return scores(q, k)
    return acc_einsum("...id,...jd->...ij", q, k)


def mix_dot(p, v):
    """``p v`` (same batch axes): ``mix`` (its dv a plain dot) for float32 or wider values, else p cast to the
    values' (compute) dtype and a float32 result."""
    if v.dtype == float_dtype(v):
        return mix(p, v)
    return acc_einsum("...ij,...jd->...id", p.astype(v.dtype), v)


def normalize(num, den):
    """``num / den`` as a scaling by 1 / den written as an einsum: the gradient's sum over the row is then a dot;
    p / den made it a multiply-and-reduce, which XLA:CPU runs on a slow path when a dimension has size 1 (one head,
    batch 1; longctx/xla_cpu.py). HIGHEST keeps 1/den exact."""
    return jnp.einsum("...qd,...q->...qd", num, 1.0 / den, precision=jax.lax.Precision.HIGHEST)


def code_sums_scatter(z, v, w, S: int):
    """Per-code (sum, count) of v [..., L, D] with codes z [..., L] and weights w [..., L], as a scatter-add."""
    lead, L, D = z.shape[:-1], z.shape[-1], v.shape[-1]
    G = math.prod(lead)
    idx = (jnp.arange(G, dtype=jnp.int32)[:, None] * S + z.reshape(G, L).astype(jnp.int32)).reshape(-1)
    tot = jax.ops.segment_sum((v * w[..., None]).reshape(G * L, D), idx, num_segments=G * S)
    cnt = jax.ops.segment_sum(w.reshape(-1), idx, num_segments=G * S)
    return tot.reshape(lead + (S, D)), cnt.reshape(lead + (S,))


def code_sums(z, v, valid, S: int):
    """``vq_cache_ref.code_sums`` (per-code sums and counts of valid entries) as a scatter-add."""
    return code_sums_scatter(z, v, jnp.broadcast_to(valid, z.shape).astype(v.dtype), S)


def first_argmax(g):
    """argmax over the last axis, ties to the lowest index, as two plain reductions (a max, then a min over
    the indices that reach it). Same result as ``lax.argmax`` for finite g; XLA:CPU vectorizes these where
    it runs the (value, index) pair reduction of ``lax.argmax`` element by element (over twice as slow).
    A row with a NaN matches nowhere; it gets the last index, so a code stays in range (the
    per-code scatter-add of ``code_sums`` must never see an index past S - 1)."""
    m = jnp.max(g, axis=-1, keepdims=True)
    n = g.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(g == m, jnp.arange(n, dtype=jnp.int32), n), axis=-1), n - 1)


def nearest(k, C, half_c2):
    """``xla.nearest`` heads-major: [H, B, chunk, S], the order of the head-batched matmul's output (in [B, H, ..]
    order XLA:CPU copied every distance tile into place, twice), the argmax by :func:`first_argmax`."""
    with statistic(xla.SEARCH):
        g = jnp.einsum("bhtd,hsd->hbts", k, C) - half_c2[:, None, None, :]
    z, g_max = (jnp.swapaxes(x, 0, 1) for x in (first_argmax(g), jnp.max(g, -1)))
    return z, jnp.sum(k * k, -1) - 2.0 * g_max


OPS = Ops(qk_dot=score_dot, pv_dot=mix_dot, normalize=normalize, code_sums=code_sums)
TILES = xla.TileOps(rowsum_product=rowdot, swap_last=transposed, matmul_tn=rows_dot)

# the forms with these products (the names tests and benchmarks call)
stvq = functools.partial(xla.stvq, nearest=nearest)
causal_parallel = functools.partial(causal_parallel, ops=OPS)
causal_blocks = functools.partial(xla.causal_blocks, ops=OPS, tiles=TILES)
causal_stream = functools.partial(xla.causal_stream, ops=OPS)
encoder_parallel = functools.partial(xla.encoder_parallel, ops=OPS)


@dataclasses.dataclass(frozen=True)
class XlaCpu(dispatch.Runner):
    """``xla_cpu``: the encoder, or the causal form :func:`xla.form_for` gives the call's size under this
    implementation's settings (its fields, as they run on the call's platform: :data:`DEFAULTS`); a causal packed
    row (§2.8) by :func:`xla.attend_packed` with the form the same rule gives it (the tiled packed form
    :func:`xla.causal_packed_blocks` from ``tiled_min_scores`` scores on, else the one-shot packed form; the short one
    below a block; :func:`reasons`); a bidirectional one by :func:`xla.encoder_packed`."""

    search_chunk: int
    keep_budget: int
    tiled_min_scores: int
    reduction: str

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        v = x["v"]
        if not core.causal:
            form = "encoder"
        else:
            B, H, T, _ = v.shape
            packed = x["segment_ids"] is not None  # a packed row's cache scan is serial whatever the reduction
            form = xla.form_for(B=B, H=H, T=T, S=core.S, L=core.L, M=core.M,
                                reduction="serial" if packed else self.reduction, min_scores=self.tiled_min_scores)
        o, new, codes = xla.attend(form, core, x, v, x["C"], call.state, settings=dataclasses.asdict(self), ops=OPS,
                                   tiles=TILES, quantize=stvq, segment_ids=x["segment_ids"])
        return xla.result(o, new, codes, code_sums=code_sums)


# The settings this implementation reads, with the XLA:CPU values of the numeric knobs (xla.DEFAULTS' cpu column,
# which they were tuned as), and the one-shot form's reduction (xla.REDUCTION). It runs on a CPU only; 'default'
# answers a lookup for another platform with the same values.
DEFAULTS = {**{key: {"cpu": table["cpu"], "default": table["cpu"]} for key, table in xla.DEFAULTS.items()},
            "reduction": xla.REDUCTION}


def reasons(platform, *, segments: bool = False, causal: bool = True, T: int = 0, L: int = 1, M: int = 1,
            **_) -> list[str]:
    """What it refuses: a causal packed row of a block or more with a band longer than a block (the one-shot packed
    form's limit)."""
    return xla.band_reasons(platform, L=L, M=M) if segments and causal and T >= L else []


IMPLEMENTATIONS = (
    # what impl='auto' runs on a CPU (rank 0 there, every call: it picks its form by its own settings). Test
    # settings: the tiled form (every call of a block or more) with a recomputing backward (its one-shot form, below
    # tiled_min_scores, runs in the contract cases and tests/attention/test_transformer_vq.py)
    Implementation("xla_cpu", platforms=("cpu",), reasons=reasons, config={"impl": "xla_cpu"},
                   test_config={"tiled_min_scores": 1, "keep_budget": -1}, auto={"cpu": 0}, code=XlaCpu,
                   defaults=DEFAULTS),
)

__all__ = ["DEFAULTS", "IMPLEMENTATIONS", "OPS", "TILES", "XlaCpu", "causal_blocks", "causal_parallel", "causal_stream", "code_sums",
           "code_sums_scatter", "encoder_parallel", "first_argmax", "mix_dot", "nearest", "normalize", "reasons", "score_dot", "stvq"]

"""The ``chunked`` implementation: the reference's biased softmax over query chunks (portable JAX, plain einsums).

Queries run in chunks of ``query_chunk`` rows under ``lax.map``, each chunk rematerialized in the backward pass,
so the [R, R] logits are never held whole: peak memory O(query_chunk * R) per head instead of O(R^2); rows that
fit one chunk run as one call. Products take the inputs' dtype (bfloat16 stays bfloat16) and accumulate in at least
float32; the logits, the key bias and the softmax are float32 and the probabilities are cast to the values' dtype
before their product (float32 inputs: the reference's operations exactly).

Declares ``chunked`` (:data:`IMPLEMENTATIONS`, the encoder's direction), what ``impl='auto'`` takes on every
platform; ``query_chunk`` (0: the platform's default, :data:`QUERY_CHUNK`) is its knob.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longctx.attention.dispatch import ALL_PLATFORMS, Implementation, Result, Runner
from pallas_kernels.precision import acc_einsum

# query rows per chunk by platform (0 in the config): the XLA:CPU value measured with the chunked form; the
# accelerators' (a chunk of [4096, R] float32 logits per head) not yet measured on a GPU or TPU
QUERY_CHUNK = {"cpu": 1024, "cuda": 4096, "rocm": 4096, "tpu": 4096}


def _biased(q, k, v, bias):
    """softmax(q k^T / sqrt(d_h) + bias) v: compute-dtype products accumulated in float32 (``acc_einsum``: its
    backward's products take the compute dtype too), float32 logits and softmax (``bias``: [B, R] float32)."""
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qs = (q.astype(acc) * q.shape[-1] ** -0.5).astype(q.dtype)
    s = acc_einsum("bhqd,bhkd->bhqk", qs, k)
    p = jax.nn.softmax(s + bias[:, None, None, :], axis=-1)
    return acc_einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v)


def chunked_attention(q, k, v, key_bias, *, query_chunk: int):
    """:func:`longctx.attention.vcc.reference.biased_attention` of q, k: [B, H, R, D], v: [B, H, R, Dv],
    key_bias: [B, R] in query chunks of ``query_chunk`` (> 0) rows; rows that fit one chunk run as one call."""
    B, H, R, D = q.shape
    bias = key_bias.astype(jnp.promote_types(q.dtype, jnp.float32))
    if R <= query_chunk:
        return _biased(q, k, v, bias).astype(v.dtype)

    def one(qc):
        return _biased(qc, k, v, bias)

    pad = (-R) % query_chunk
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    n = qp.shape[2] // query_chunk
    qb = qp.reshape(B, H, n, query_chunk, D).transpose(2, 0, 1, 3, 4)
    out = jax.lax.map(jax.checkpoint(one), qb)  # [n, B, H, c, Dv]
    out = out.transpose(1, 2, 0, 3, 4).reshape(B, H, n * query_chunk, -1)[:, :, :R]
    return out.astype(v.dtype)


@dataclasses.dataclass(frozen=True)
class Chunked(Runner):
    """``chunked`` with its knob (``query_chunk``, as it runs on the call's platform)."""

    query_chunk: int

    def __call__(self, core, call):
        x = call.inputs
        return Result(chunked_attention(x["q"], x["k"], x["v"], x["key_bias"], query_chunk=self.query_chunk))


IMPLEMENTATIONS = (
    Implementation("chunked", config={"impl": "chunked"}, test_config={"query_chunk": 16},
                   auto={p: 0 for p in ALL_PLATFORMS}, code=Chunked, directions=("bidirectional",),
                   defaults={"query_chunk": QUERY_CHUNK}),
)


__all__ = ["IMPLEMENTATIONS", "QUERY_CHUNK", "Chunked", "chunked_attention"]

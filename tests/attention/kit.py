"""What the per-method attention tests share: random inputs, exact softmax attention to compare with (jitted, and
in float64 NumPy), a core built by name, a jitted core call, the largest absolute difference.

A per-method test file imports these rather than keeping its own copy; what it adds is its method's own
properties (the spec's §6/§7 checks)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longctx import attention
from longctx.attention.dense import naive_attention

# cheap XLA:CPU compiles for functions a test jits itself (the suite is compile-bound on a CPU)
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def qkv(T, *, batch=2, heads=2, head_dim=8, value_dim=None, seed=0, scale=1.0, value_scale=None,
        dtype=jnp.float32):
    """Standard-normal q, k, v of shape [batch, heads, T, head_dim] (v: value_dim), q and k times ``scale``, v
    times ``value_scale`` (default: ``scale``)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    vs = scale if value_scale is None else value_scale
    return (scale * jax.random.normal(ks[0], (batch, heads, T, head_dim), dtype),
            scale * jax.random.normal(ks[1], (batch, heads, T, head_dim), dtype),
            vs * jax.random.normal(ks[2], (batch, heads, T, value_dim or head_dim), dtype))


@functools.partial(jax.jit, static_argnums=3)  # an eager call dispatches op by op
def softmax_attention(q, k, v, causal):
    """Exact softmax attention over the whole row (every key valid)."""
    T = q.shape[2]
    pos = jnp.arange(T)
    return naive_attention(q, k, v, pos, pos, jnp.ones((T,), bool), causal=causal)


def np_softmax_attention(q, k, v, causal):
    """Exact softmax attention in float64 NumPy: the oracle that shares no code with the library."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


def build(name, is_causal=True, *, heads=2, head_dim=8, value_dim=None, platform=None, **settings):
    """The method's core: its defaults updated with ``settings`` (``is_causal``: a method may have a setting
    named ``causal``), built for ``platform`` (default: the running one)."""
    return attention.build(name, settings, num_heads=heads, head_dim=head_dim, value_dim=value_dim, causal=is_causal,
                           rngs=nnx.Rngs(0), platform=platform)


@functools.partial(nnx.jit, static_argnames=("deterministic",))
def run(core, q, k, v, state=None, deterministic=True, key=None):
    """``core(q, k, v, state, ...)`` jitted (an eager first call compiles op by op)."""
    return core(q, k, v, state, deterministic=deterministic, key=key)


def out(core, q, k, v, state=None):
    """The output of a jitted deterministic call."""
    return run(core, q, k, v, state)[0]


def maxdiff(a, b):
    """The largest absolute difference, in float64."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def sub_jaxprs(params):
    """The jaxprs an equation's ``params`` hold (scan / cond / custom-rule bodies), to walk a traced program."""
    from jax.extend import core as jex_core

    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jex_core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex_core.Jaxpr):
                yield x

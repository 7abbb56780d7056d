"""Building attention cores from the registry and the pure functions the benchmarks jit.

Every core goes through ``attention.build``; the module is split once (``nnx.split``)
into its graph and its state so the jitted functions take parameters as arguments
(no parameters baked into the program as constants).

Randomness convention (BENCHMARKS.md, "How to read this"):
* forward timing: ``deterministic=True`` (the inference path);
* forward+backward timing: ``deterministic=False`` with a PRNG key and an ``Aux``
  collector whose losses are added to the loss -- the training path of
  ``longctx.train.step`` (for deterministic methods the flag changes nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx import attention
from longctx.attention import Aux, dispatch


def variants(name: str) -> list[tuple[str, dict]]:
    """(label, config overrides) of each variant a method asks to be benchmarked in on the running platform
    (``AttentionCore.bench_variants``; default: its default config, labelled by its name)."""
    platform = dispatch.current_platform()
    return [(f"{name}:{suffix}" if suffix else name, dict(over))
            for suffix, over in attention.get_class(name).bench_variants(platform).items()]


def is_exact(name: str) -> bool:
    """The method computes exact softmax attention (the reference the benchmarks compare with)."""
    return bool(attention.get_class(name).exact)


def method_config(name: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    cfg = attention.default_config(name)
    if overrides:
        cfg.update(overrides)
    return cfg


def build_core(name: str, overrides: dict | None, *, heads: int, head_dim: int, causal: bool, seed: int = 0,
               value_dim: int | None = None, cache_dtype=None):
    """attention.validate first (raises ConfigError when the method lacks this direction), then build
    (``cache_dtype``: the dtype its state keeps keys and values in, as a model's blocks set it; None: float32)."""
    cfg = method_config(name, overrides)
    attention.validate(name, cfg, causal=causal)
    return attention.build(name, cfg, num_heads=heads, head_dim=head_dim, causal=causal, rngs=nnx.Rngs(seed),
                           value_dim=value_dim, cache_dtype=cache_dtype)


def has_params(core) -> bool:
    return len(jax.tree.leaves(nnx.state(core, nnx.Param))) > 0


class CoreFns:
    """Pure functions of (params, rest, ...) around one core."""

    def __init__(self, core):
        self.graphdef, self.params, self.rest = nnx.split(core, nnx.Param, ...)

    def merge(self, params, rest):
        return nnx.merge(self.graphdef, params, rest)

    def forward(self):
        """(params, rest, q, k, v) -> out, deterministic (inference path)."""

        def f(params, rest, q, k, v):
            core = self.merge(params, rest)
            out, _ = core(q, k, v, deterministic=True, aux=Aux())
            return out

        return f

    def forward_random(self):
        """(params, rest, q, k, v, key) -> out with deterministic=False (the training-time estimator)."""

        def f(params, rest, q, k, v, key):
            core = self.merge(params, rest)
            out, _ = core(q, k, v, deterministic=False, key=key, aux=Aux())
            return out

        return f

    def grads(self):
        """(params, rest, q, k, v, w, key) -> grads wrt (params, q, k, v) of sum(out * w) + aux losses;
        deterministic=False with a key (the training path)."""

        def loss(params, q, k, v, rest, w, key):
            core = self.merge(params, rest)
            aux = Aux()
            out, _ = core(q, k, v, deterministic=False, key=key, aux=aux)
            total = jnp.sum(out.astype(jnp.float32) * w)
            for val in aux.losses.values():
                total = total + val
            return total

        g = jax.grad(loss, argnums=(0, 1, 2, 3))

        def f(params, rest, q, k, v, w, key):
            return g(params, q, k, v, rest, w, key)

        return f

    def step(self):
        """(params, rest, q, k, v, state) -> (out, new_state), deterministic (decoding)."""

        def f(params, rest, q, k, v, state):
            core = self.merge(params, rest)
            return core(q, k, v, state, deterministic=True, aux=Aux())

        return f

"""The mixed-precision policy: which dtype the parameters are kept in and which the model computes in.

One object, read from the ``model`` config section (``model.dtype``, ``model.param_dtype``) and applied where the
backbone and the blocks build their layers (flax's ``dtype`` / ``param_dtype`` arguments), in the manner of
Levanter's ``jmp`` policy: parameters in ``param`` (float32: the master weights, and with them the optimizer
state, which optax keeps in the parameters' dtype), activations and matmul inputs in ``compute``, and the outputs
that need range in float32. No layer casts on its own account.

    policy = precision.policy(model_cfg)          # 'auto' resolved for the default backend
    nnx.Linear(..., **policy.layer_kw)            # dtype=compute, param_dtype=param

What stays float32 whatever ``compute`` is:

* softmax statistics (running max, sum, log-sum-exp) inside the attention cores: each core computes its scores
  from compute-dtype q and k with ``preferred_element_type=float32`` (or casts them up), and its
  normalisers in float32;
* norms' statistics (``RMSNorm`` computes in float32; flax's ``LayerNorm`` promotes its mean and variance to at
  least float32);
* the loss: the vocabulary head's product accumulates into float32 logits (``preferred_element_type``) before
  ``log_softmax``; :func:`longctx.models.adaptive_softmax.chunked_logsumexp` runs in float32;
* the codebook EMA statistics of Transformer-VQ (non-gradient state, float32 variables updated in float32);
* sampling probabilities (``longctx.sample`` draws from float32 logits).

Matmuls take compute-dtype operands. Where this code writes the product itself it asks for float32 accumulation
(``preferred_element_type=jnp.float32``); flax's ``Linear`` returns its product in the compute dtype, and on GPU
and TPU XLA accumulates a bfloat16 dot in float32 before rounding the result (cuBLAS / MXU accumulators), so the
projections round once per output element, not per partial sum.

``'auto'`` is float32 on CPU (the CPU runs compute exactly what they computed before the policy existed) and
bfloat16 on GPU and TPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longctx.layout import flattens_rows
from pallas_kernels.precision import acc_einsum

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
PARAM_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(name: str, backend: str | None = None):
    """The jnp dtype ``name`` stands for; ``'auto'``: float32 on CPU, bfloat16 on GPU and TPU."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"dtype {name!r}: allowed: {', '.join(COMPUTE_DTYPES)}")
    if name == "auto":
        return jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16
    return jnp.dtype(name).type


@dataclasses.dataclass(frozen=True)
class Policy:
    compute: type = jnp.float32
    param: type = jnp.float32
    # where the model runs: row-wise layers flatten their rows on a CPU host (longctx.layout.rows_apply)
    platform: str = "cpu"

    @property
    def flat_rows(self) -> bool:
        return flattens_rows(self.platform)

    @property
    def rows_kw(self) -> dict:
        """longctx's row-wise layers' argument (Linear, LayerNorm, RMSNorm): whether they flatten their rows."""
        return {"flat_rows": self.flat_rows}

    @property
    def full(self) -> bool:
        """Whether the model computes in float32 (the layers then run exactly as without a policy)."""
        return jnp.dtype(self.compute) == jnp.float32

    @property
    def layer_kw(self) -> dict:
        """flax layer arguments: compute-dtype inputs and outputs, parameters stored in ``param``."""
        return {"dtype": self.compute, "param_dtype": self.param}

    @property
    def cache(self):
        """The dtype decoding states keep keys and values in (``AttentionCore.cache_dtype``): the compute dtype,
        except float32 on a CPU, where XLA converts a bfloat16 or float16 cache to float32 whole for the step's
        one-slot write (a copy of the cache every token: the main config's model with dense attention and an 8k
        cache, unrolled, had 32 MB of temporaries for its 34 MB bfloat16 state, 1.2 MB for the 67 MB float32 one)."""
        return jnp.float32 if self.platform == "cpu" else self.compute

    def cast(self, x):
        """``x`` in the compute dtype (floating arrays only)."""
        return x.astype(self.compute) if jnp.issubdtype(x.dtype, jnp.floating) else x


def policy(cfg, backend: str | None = None) -> Policy:
    """The policy of a ``model`` config section (``dtype``, ``param_dtype``) for the platform ``backend`` (None:
    the default backend at build time, as an attention core's platform)."""
    backend = backend or jax.default_backend()
    param = str(cfg.param_dtype)
    if param not in PARAM_DTYPES:
        raise ValueError(f"param_dtype {param!r}: allowed: {', '.join(PARAM_DTYPES)}")
    return Policy(compute=resolve_dtype(str(cfg.dtype), backend), param=jnp.dtype(param).type, platform=backend)




def einsum_f32(spec: str, a, b):
    """``jnp.einsum(spec, a, b)`` with float32 accumulation and a float32 result for compute-dtype (bfloat16 /
    float16) operands, whose backward takes the cotangent back to the operands' dtype first (so the backward's
    products take compute-dtype operands too). Float32 (or wider) operands: the plain einsum, exactly."""
    return acc_einsum(spec, a, b)


__all__ = ["COMPUTE_DTYPES", "PARAM_DTYPES", "Policy", "einsum_f32", "policy", "resolve_dtype"]

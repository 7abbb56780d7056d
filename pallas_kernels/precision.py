"""Mixed-precision helpers shared by the kernels' references and the model (which imports them from here:
a kernel module never imports ``longctx``): the statistics and matmul-operand dtypes of given inputs, and an
einsum that accumulates narrow (bfloat16 / float16) operands into a float32 result."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def float_dtype(*xs):
    """The statistics dtype: the inputs' dtype promoted to at least float32."""
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def compute_dtype(*xs):
    """The matmul-operand dtype: the inputs' floating dtype (bfloat16 stays bfloat16; float32 / float64 as given)."""
    dt = jnp.result_type(*xs)
    return dt if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(jnp.float32)


def acc_einsum(spec: str, a, b):
    """``jnp.einsum(spec, a, b)`` accumulated and returned in float32 for narrower operands (bfloat16), whose backward
    casts the cotangent back to the operands' dtype first, so its products take narrow operands too. Operands of
    float32 or wider: the plain einsum, exactly."""
    if a.dtype == b.dtype == float_dtype(a, b):
        return jnp.einsum(spec, a, b)
    return _acc_einsum(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _acc_einsum(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _acc_einsum_fwd(spec, a, b):
    return _acc_einsum(spec, a, b), (a, b)


def _acc_einsum_bwd(spec, res, g):
    a, b = res
    _, vjp = jax.vjp(functools.partial(jnp.einsum, spec), a, b)
    return vjp(g.astype(jnp.result_type(a, b)))


_acc_einsum.defvjp(_acc_einsum_fwd, _acc_einsum_bwd)


__all__ = ["STATISTIC", "acc_einsum", "compute_dtype", "float_dtype", "statistic"]


# two-dimensional tile products with float32 accumulation and the operands as they are (inside kernel bodies)
def dot_nn(a, b):
    """a @ b."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """a @ b.T."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a.T @ b."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# the name scope that declares a float32 product a statistic (tests/attention/test_compute_dtype.py reads it)
STATISTIC = "f32_statistic"


def statistic(why: str):
    """``with statistic("codebook counts"):`` the products traced inside are float32 statistics by design (row
    sums of probabilities written as dots, codebook counts and sums), not matmul work the compute dtype should
    reach; ``why`` names them in the trace."""
    return jax.named_scope(f"{STATISTIC}:{why}")

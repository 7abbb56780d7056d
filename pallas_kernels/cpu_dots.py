"""Attention's two einsums with a backward that stays on XLA:CPU's fast dots (jax 0.10.2).

Autodiff of ``s = q kᵀ`` and ``o = p v`` writes the key-side gradients ``dk = dsᵀ q`` and ``dv = pᵀ do`` as dots
that contract the row axis of both operands; XLA:CPU does not hand that form to YNNPACK and runs it as a generic dot
at roughly half the rate of the plain ``[d, rows] x [rows, keys]`` product (see docs/DESIGN.md, "Where the time
goes"). :func:`scores` and :func:`mix` compute the same forward; their backward transposes the small
``[rows, d]`` operand first (an optimization barrier keeps XLA from folding the transpose back into the dot) and
transposes the small ``[d, keys]`` result. On other backends, and when the operands' batch axes differ (a
broadcast operand), they are the plain einsums. Shared by the kernels' pure-JAX references and ``longctx``
(``longctx.xla_cpu`` re-exports them); nothing here imports ``longctx``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _plain(a, b) -> bool:
    return jax.default_backend() != "cpu" or a.shape[:-2] != b.shape[:-2]


def _barrier(x):
    return jax.lax.optimization_barrier(x)


def _rows_dot_t(a, b, precision):
    """``Σ_i a[..., i, d] b[..., i, j]`` as ``[..., j, d]``: a transposed first, the ``[d, j]`` product transposed
    after (both small beside b)."""
    a_t = _barrier(jnp.swapaxes(a, -1, -2))
    return jnp.swapaxes(_barrier(jnp.einsum("...di,...ij->...dj", a_t, b, precision=precision)), -1, -2)


def _einsum_with_grads(spec: str, grads):
    """``einsum(spec, a, b)`` whose backward is ``grads(a, b, g, precision) -> (da, db)``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def f(a, b, precision):
        return jnp.einsum(spec, a, b, precision=precision)

    def f_fwd(a, b, precision):
        return f(a, b, precision), (a, b)

    def f_bwd(precision, res, g):
        a, b = res
        da, db = grads(a, b, g, precision)
        return da.astype(a.dtype), db.astype(b.dtype)

    f.defvjp(f_fwd, f_bwd)
    return f


# s = q kᵀ: dq = ds k, dk = dsᵀ q;  o = p v: dp = do vᵀ, dv = pᵀ do
_scores = _einsum_with_grads("...id,...jd->...ij", lambda q, k, g, pr: (
    jnp.einsum("...ij,...jd->...id", g, k, precision=pr), _rows_dot_t(q, g, pr)))
_mix = _einsum_with_grads("...ij,...jd->...id", lambda p, v, g, pr: (
    jnp.einsum("...id,...jd->...ij", g, v, precision=pr), _rows_dot_t(g, p, pr)))


def scores(q, k, precision=None):
    """``einsum('...id,...jd->...ij', q, k)`` (q, k with the same batch axes), its ``dk`` a plain dot on CPU."""
    if _plain(q, k):
        return jnp.einsum("...id,...jd->...ij", q, k, precision=precision)
    return _scores(q, k, precision)


def mix(p, v, precision=None):
    """``einsum('...ij,...jd->...id', p, v)`` (p, v with the same batch axes), its ``dv`` a plain dot on CPU."""
    if _plain(p, v):
        return jnp.einsum("...ij,...jd->...id", p, v, precision=precision)
    return _mix(p, v, precision)


__all__ = ["mix", "scores"]

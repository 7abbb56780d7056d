"""The XLA:CPU helpers: shapes and ops that keep XLA:CPU off its slow paths (jax 0.10.2). Only the CPU
implementations (files named ``xla_cpu.py``) import this module (tests/test_rooms.py). The arithmetic is unchanged; only the shapes and ops
XLA sees are. docs/DESIGN.md, "Where the time goes", says where each is used; ``longctx-bench profile`` shows the
fusions each one avoids."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def rowdot(a, b):
    """``Σ_d a[..., d] * b[..., d]`` (shape ``[...]``) as a dot, not as a multiply feeding a reduce. XLA:CPU fuses
    both into a YNNPACK multiply-and-reduce, but the reduce of ``jnp.sum`` keeps the size-1 dimensions of its
    result (batch 1, one head), and YNNPACK runs that an order of magnitude slower, where the dot's reduce folds
    them away; without the size-1 dimension both forms are equally fast (``longctx-bench profile`` lists such
    fusions). Full fp32 on every backend (an fp32 dot may otherwise use TF32
    on a GPU)."""
    return jnp.einsum("...d,...d->...", a, b, precision=jax.lax.Precision.HIGHEST)


def scale_rows(x, s):
    """``x [..., d] * s[..., None]`` written as an einsum: the gradient with respect to ``s`` is then a dot (see
    :func:`rowdot`) where the broadcasting multiply's is a multiply-and-reduce. A softmax's ``num / den`` as
    ``scale_rows(num, 1 / den)``: its gradient over batch-1 rows is then a fast dot instead of a slow
    multiply-and-reduce."""
    return jnp.einsum("...d,...->...d", x, s, precision=jax.lax.Precision.HIGHEST)


def materialized(x):
    """``x`` as a buffer of its own on CPU: a product with the identity (exact in fp32 for finite x, where every term
    but one is ``0 * x``), which XLA:CPU does not fuse into the ops that read it. Left as an expression, a cheap-
    looking elementwise producer is recomputed inside each consumer fusion, once per element the consumer
    writes: eva's chunk noise (an erf_inv polynomial per element) was fused into the chunk keys' gradient, where
    it is broadcast over the P keys of a chunk, and recomputed P times.
    An optimization barrier does not help here (XLA:CPU removes barriers before fusion). Other backends get
    ``x``."""
    if jax.default_backend() != "cpu":
        return x
    return jnp.einsum("...d,de->...e", x, jnp.eye(x.shape[-1], dtype=x.dtype), precision=jax.lax.Precision.HIGHEST)


def transposed(*xs):
    """Each x with its last two axes swapped, materialised on CPU: the optimization barrier keeps XLA from folding
    the transposes back into the dots that read them (see :func:`rows_dot`). Other backends get the plain swap,
    which XLA folds into the dot (the form autodiff writes, fast there)."""
    out = tuple(jnp.swapaxes(x, -1, -2) for x in xs)
    if jax.default_backend() == "cpu":
        out = jax.lax.optimization_barrier(out)
    return out if len(xs) > 1 else out[0]


def rows_dot(a_t, b, precision=None, preferred_element_type=None):
    """``Σ_q a[..., q, i] * b[..., q, j]`` as ``[..., i, j]``, from ``a_t`` = :func:`transposed` ``(a)``
    ``[..., i, q]``: the key-side gradients of attention (``dk = dsᵀ q``, ``dv = pᵀ do``, here transposed, as
    ``[..., d, keys]``). Written as that contraction of the row axis of both operands, XLA:CPU falls back to a
    generic dot at roughly half the rate YNNPACK reaches on the plain ``[i, q] x [q, j]`` product (the key-side
    gradients of dense and eva got measurably faster). Transposing ``a`` (``[q, d]``, small beside ``b``'s ``[q, keys]``) costs
    one pass over it; transpose it once per block row, not per pair. ``precision`` as the caller's other dots.
    For autodiff, :func:`scores` and :func:`mix` (below) are the einsums ``q kᵀ`` and
    ``p v`` with this backward built in."""
    return jnp.einsum("...iq,...qj->...ij", a_t, b, precision=precision, preferred_element_type=preferred_element_type)



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


__all__ = ["materialized", "mix", "rowdot", "rows_dot", "scale_rows", "scores", "transposed"]

"""longctx/xla_cpu.py (the XLA:CPU helpers): scores / mix / transposed / rows_dot / materialized give the same values and
gradients as the plain einsums, the compiled backward free of dots that contract the row axis of both operands, and
a sampler kept out of the fusions that read it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.xla_cpu import materialized, mix, rows_dot, scores, transposed

HI = jax.lax.Precision.HIGHEST


def _operands(shape_a, shape_b, dtype=jnp.float32):
    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    return jax.random.normal(ka, shape_a, dtype), jax.random.normal(kb, shape_b, dtype), kg


@pytest.mark.parametrize("fn,spec,shape_a,shape_b", [
    (scores, "...id,...jd->...ij", (2, 3, 16, 8), (2, 3, 24, 8)),
    (mix, "...ij,...jd->...id", (2, 3, 16, 24), (2, 3, 24, 8)),
    (scores, "...id,...jd->...ij", (2, 3, 16, 8), (3, 24, 8)),  # broadcast batch: the plain einsum
])
def test_values_and_gradients_match_the_einsum(fn, spec, shape_a, shape_b):
    a, b, kg = _operands(shape_a, shape_b)
    w = jax.random.normal(kg, jnp.einsum(spec, a, b).shape)
    ours = jax.value_and_grad(lambda a, b: jnp.sum(fn(a, b, HI) * w), argnums=(0, 1))
    ref = jax.value_and_grad(lambda a, b: jnp.sum(jnp.einsum(spec, a, b, precision=HI) * w), argnums=(0, 1))
    (v, (da, db)), (v_ref, (da_ref, db_ref)) = jax.jit(ours)(a, b), jax.jit(ref)(a, b)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(da, da_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, db_ref, rtol=1e-4, atol=1e-4)


def test_gradients_keep_the_operand_dtype():
    a, b, _ = _operands((2, 16, 8), (2, 24, 8), jnp.bfloat16)
    da, db = jax.grad(lambda a, b: jnp.sum(scores(a, b).astype(jnp.float32)), argnums=(0, 1))(a, b)
    assert da.dtype == db.dtype == jnp.bfloat16


def _row_contracting_dots(text: str) -> list[str]:
    """Top-level dots whose lhs contracts its second-to-last axis (the rows of a [.., rows, d] operand)."""
    out = []
    for line in text.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\S* dot\(.*lhs_contracting_dims=\{(\d+)\}", line)
        if m and "param" not in line.split("dot(")[1].split(")")[0]:
            ndim = len(m[1].split(","))
            if int(m[2]) == ndim - 2:
                out.append(line.strip())
    return out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the custom backward is XLA:CPU's; elsewhere the einsum")
@pytest.mark.parametrize("fn", [scores, mix])
def test_the_compiled_backward_has_no_row_contracting_dot(fn):
    """The form XLA:CPU runs as a generic dot at about half the rate: present in autodiff of the plain einsum,
    absent from ours."""
    a, b, _ = _operands((1, 4, 256, 64) if fn is scores else (1, 4, 256, 256), (1, 4, 256, 64))
    spec = "...id,...jd->...ij" if fn is scores else "...ij,...jd->...id"
    compiled = lambda f: jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1))).lower(  # noqa: E731
        a, b).compile().as_text()
    assert _row_contracting_dots(compiled(lambda a, b: jnp.einsum(spec, a, b)))
    assert not _row_contracting_dots(compiled(fn))


def test_rows_dot_is_the_row_contraction():
    a, b, _ = _operands((2, 32, 8), (2, 32, 24))
    np.testing.assert_allclose(rows_dot(transposed(a), b, HI), jnp.einsum("...qi,...qj->...ij", a, b, precision=HI),
                               rtol=1e-5, atol=1e-5)
    x, y = transposed(a, b)
    assert x.shape == (2, 8, 32) and y.shape == (2, 24, 32)


def test_materialized_is_the_identity_with_its_gradient():
    x, w, _ = _operands((3, 5, 16), (3, 5, 16))
    np.testing.assert_array_equal(materialized(x), x)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(materialized(x) * w))(x), w)


def _sampler_in_broadcast_consumer(fn) -> bool:
    """Whether XLA fused a normal sampler (its erf_inv) into a fusion writing the [C, P, d] broadcast of the
    sample: one sampler evaluation per output element, P per sample."""
    def loss(x, key):
        eps = fn(jax.random.normal(key, (64, 16)))
        return jnp.sum(jnp.einsum("cpd,cd->cp", x, eps) ** 2)

    x = jnp.ones((64, 8, 16), jnp.float32)
    hlo = jax.jit(jax.grad(loss)).lower(x, jax.random.key(0)).compile().as_text()
    comps = re.split(r"\n(?=%\S+ \()", hlo)
    return any("erf_inv" in c and re.search(r"-> f32\[64,8,16\]", c.split("\n")[0]) for c in comps)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the fusion decision is XLA:CPU's; elsewhere x as it is")
def test_materialized_keeps_a_sampler_out_of_its_consumers():
    assert _sampler_in_broadcast_consumer(lambda e: e)  # the duplication this guards against
    assert not _sampler_in_broadcast_consumer(materialized)

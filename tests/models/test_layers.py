"""The flattened Linear layer computes nnx.Linear's function, values and gradients, for any leading shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx.layout import rows_apply
from longctx.models.layers import Linear, linear


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 7, 5), (2, 0, 5), (2, 3, 4, 5)])
def test_linear_matches_nnx_linear(shape):
    ours = linear(5, 6, ("embed", "mlp"), rngs=nnx.Rngs(0), flat_rows=True)  # the CPU host's layout
    assert isinstance(ours, Linear)
    ref = nnx.Linear(5, 6, rngs=nnx.Rngs(1))
    ref.kernel[...], ref.bias[...] = ours.kernel[...], jax.random.normal(jax.random.key(2), (6,))
    ours.bias[...] = ref.bias[...]
    x = jax.random.normal(jax.random.key(3), shape)
    y = ours(x)
    assert y.shape == shape[:-1] + (6,)
    np.testing.assert_allclose(y, ref(x), rtol=1e-6, atol=1e-6)

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x)))

    (g_ours, gx_ours), (g_ref, gx_ref) = (nnx.grad(loss, argnums=(0, 1))(m, x) for m in (ours, ref))
    np.testing.assert_allclose(gx_ours, gx_ref, rtol=1e-5, atol=1e-6)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(getattr(g_ours, name)[...], getattr(g_ref, name)[...], rtol=1e-5, atol=1e-6)


def test_rows_apply_passes_flattened_rows_and_restores_the_shape():
    seen = []

    def fn(z):
        seen.append(z.shape)
        return jnp.stack([z.sum(-1), z.max(-1)], axis=-1)

    x = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)
    y = rows_apply(fn, x, flat=True)
    assert seen == [(6, 4)] and y.shape == (2, 3, 2)
    assert rows_apply(fn, x, flat=False).shape == (2, 3, 2) and seen[-1] == (2, 3, 4)
    np.testing.assert_array_equal(y[..., 0], x.sum(-1))


def test_dropout_in_training_needs_a_key():
    """A training call (deterministic=False) with a dropout rate and no key is refused, as every method's own
    randomness is, instead of silently training without dropout; a rate of 0 or an evaluation needs none."""
    from longctx.models.layers import dropout

    x = jnp.ones((2, 3))
    assert dropout(x, 0.5, True, None) is x and dropout(x, 0.0, False, None) is x
    with pytest.raises(ValueError, match="dropout rate 0.5 with deterministic=False needs a PRNG key"):
        dropout(x, 0.5, False, None)
    y = dropout(x, 0.5, False, jax.random.key(0))
    assert set(np.unique(np.asarray(y)).tolist()) <= {0.0, 2.0}

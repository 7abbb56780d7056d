"""KDEformer's packed rows on the 'scores' route (``longctx/attention/kdeformer/xla.py: causal_apply``).

In a packed row every query draws its own document's samples, so a tile of ``c`` queries has ``c * m`` sampled keys.
On the 'scores' route (caches of at most ``heavy_scores_max_len`` keys, the CPU's route for every training row up
to 1,024 tokens) the tile already scores all ``M`` keys, so the samples' logits are read from those ``[c, M]``
logits and their weights spread over the ``M`` keys for one product with the values: no ``[c * m, d]`` rows of
keys or values are gathered per tile (nor scattered back in the gradient). Checked on the traced gradient's gathers,
and on the values and gradients against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.attention import kit

SMALL = {"chunk_size": 8, "local_chunks": 2, "heavy_capacity": 4, "num_projs": 3, "num_samples": 16}
T, H, D = 64, 2, 8


def gather_shapes(jaxpr):
    """Output shapes of every float ``gather`` in ``jaxpr`` and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
            out.append(tuple(eqn.outvars[0].aval.shape))
        for sub in kit.sub_jaxprs(eqn.params):
            out += gather_shapes(sub)
    return out


def packed_inputs():
    q, k, v = kit.qkv(T, batch=2, heads=H, seed=0)
    rows = ((5, 40, 19), (30, 3, 31))  # three documents a row, one shorter than a chunk
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 4), r) for r in rows]), jnp.int32)
    return q, k, v, seg


def grad_fn(core, seg):
    def loss(q, k, v):
        out = core(q, k, v, None, deterministic=False, key=jax.random.PRNGKey(1), segment_ids=seg)[0]
        return jnp.sum(out * out), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def test_packed_scores_route_gathers_no_per_query_key_rows():
    core = kit.build("kdeformer", True, impl="scores", causal=SMALL)
    q, k, v, seg = packed_inputs()
    c, m = SMALL["chunk_size"], SMALL["num_samples"]
    shapes = gather_shapes(jax.make_jaxpr(grad_fn(core, seg))(q, k, v).jaxpr)
    assert shapes  # the unpacked tiles' shared samples and the local windows still gather
    assert not [s for s in shapes if len(s) >= 2 and s[-1] == D and s[-2] == c * m], shapes


def test_packed_scores_route_equals_the_reference():
    q, k, v, seg = packed_inputs()
    got = jax.jit(grad_fn(kit.build("kdeformer", True, impl="scores", causal=SMALL), seg))(q, k, v)
    want = jax.jit(grad_fn(kit.build("kdeformer", True, impl="reference", causal=SMALL), seg))(q, k, v)
    np.testing.assert_allclose(np.asarray(got[0][1]), np.asarray(want[0][1]), atol=2e-5, rtol=2e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)

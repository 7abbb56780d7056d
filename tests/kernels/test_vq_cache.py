"""Transformer-VQ compressive VQ-cache Pallas kernel (spec transformer-vq.md §9): interpret mode == the jnp
§2.6 serial reference (values, new state and gradients; ragged T, carried state, M < L), and TPU lowering
through jax.export."""

from __future__ import annotations

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # compile-bound suite (see test_eva)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from longctx.attention import transformer_vq as tvq  # noqa: E402
from pallas_kernels import vq_cache  # noqa: E402

B, H, L, S, DK, DV = 2, 2, 8, 6, 8, 8


def setup(T, M=L, warm=0, seed=0):
    """Random q_u, bd, quantized keys, values, codebook and a carried state after ``warm`` tokens."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q_u = jax.random.normal(ks[0], (B, H, T, DK))
    k = jax.random.normal(ks[1], (B, H, T, DK))
    v = jax.random.normal(ks[2], (B, H, T, DV))
    C = jax.random.normal(ks[3], (H, S, DK))
    bd = jax.random.normal(ks[4], (B, H, T, M + 1))
    k_hat, z, _, _ = tvq.stvq(k, C)
    state = tvq.empty_state(B, H, M, S, DK, DV)
    if warm:
        kw, zw, _, _ = tvq.stvq(jax.random.normal(ks[5], (B, H, warm, DK)), C)
        _, state = tvq.causal_parallel(jax.random.normal(ks[7], (B, H, warm, DK)), jnp.zeros((B, H, warm, M + 1)),
                                       kw, zw, jax.random.normal(ks[6], (B, H, warm, DV)), C, state, L=L, M=M)
    return q_u, bd, k_hat, z, v, C, state


def _max_err(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("T,M,warm", [(20, L, 0), (16, L, 11), (21, 5, 13)])
def test_forward_matches_reference(T, M, warm):
    args = setup(T, M, warm)
    ref = jax.jit(lambda *a: vq_cache.vq_cache_attention_reference(*a, L=L, M=M))(*args)
    out = jax.jit(lambda *a: vq_cache.vq_cache_attention(*a, L=L, M=M, interpret=True))(*args)
    assert out[0].shape == ref[0].shape == (B, H, T, DV)
    assert _max_err(ref, out) <= 1e-5
    assert float(jnp.max(jnp.abs(ref[0]))) > 0.1
    if warm:  # the cache group is really used (non-empty aggregate before the call)
        assert float(jnp.sum(args[-1]["agg_n"])) > 0


def test_gradient_matches_reference():
    T, M = 21, L
    q_u, bd, k_hat, z, v, C, state = setup(T, M, warm=13, seed=1)
    w = jnp.cos(jnp.arange(B * H * T * DV, dtype=jnp.float32)).reshape(B, H, T, DV)

    def loss(fn, q_u, bd, k_hat, v, band_k, band_v, agg_mu):
        st = dict(state, band_k=band_k, band_v=band_v, agg_mu=agg_mu)
        o, new = fn(q_u, bd, k_hat, z, v, C, st)
        return jnp.sum(o * w) + jnp.sum(jnp.sin(new["agg_mu"])) + jnp.sum(new["band_v"] ** 2)

    ref_fn = lambda *a: vq_cache.vq_cache_attention_reference(*a, L=L, M=M)  # noqa: E731
    ker_fn = lambda *a: vq_cache.vq_cache_attention(*a, L=L, M=M, interpret=True)  # noqa: E731
    args = (q_u, bd, k_hat, v, state["band_k"], state["band_v"], state["agg_mu"])
    g_ref = jax.jit(jax.grad(lambda *a: loss(ref_fn, *a), argnums=tuple(range(7))))(*args)
    g_ker = jax.jit(jax.grad(lambda *a: loss(ker_fn, *a), argnums=tuple(range(7))))(*args)
    for a, b in zip(g_ref, g_ker):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(a))))
    assert float(jnp.max(jnp.abs(g_ref[5]))) > 0.0  # the carried band receives gradient


@pytest.mark.parametrize("T,M,St", [(256, 128, 128), (200, 64, 256)])
def test_export_tpu_lowering(T, M, St):
    Bt, Ht, Lt, Dk, Dv = 1, 2, 128, 128, 128
    q_u = jnp.zeros((Bt, Ht, T, Dk))
    bd = jnp.zeros((Bt, Ht, T, M + 1))
    z = jnp.zeros((Bt, Ht, T), jnp.int32)
    v = jnp.zeros((Bt, Ht, T, Dv))
    C = jnp.zeros((Ht, St, Dk))
    state = tvq.empty_state(Bt, Ht, M, St, Dk, Dv)

    def f(q_u, bd, k_hat, z, v, C, state):
        return vq_cache.vq_cache_attention(q_u, bd, k_hat, z, v, C, state, L=Lt, M=M, platform="tpu")

    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(q_u, bd, q_u, z, v, C, state)
    assert "tpu_custom_call" in exp.mlir_module()


def test_unsupported_raise_clear_errors():
    args = setup(8)
    with pytest.raises(ValueError, match="interpret"):
        vq_cache.vq_cache_attention(*args, L=L, M=L, platform="cpu")
    with pytest.raises(ValueError, match="M <= L"):
        vq_cache.vq_cache_attention(*args, L=4, M=L, interpret=True)


def test_core_impl_pallas_equals_xla_with_a_warning():
    """transformer_vq with impl='pallas' runs this kernel (interpret mode on CPU, with a warning)
    and gives the XLA block-parallel output, carried state included."""
    import warnings

    import numpy as np
    from flax import nnx

    from longctx import attention

    def build(impl):
        cfg = attention.default_config("transformer_vq")
        cfg.update({"impl": impl, "codebook_size": 16, "block_len": 8})
        return attention.build("transformer_vq", cfg, num_heads=2, head_dim=16, causal=True, rngs=nnx.Rngs(0))

    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, 2, 20, 16)) for kk in ks)
    ref, ref_state = build("xla")(q, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, state = build("pallas")(q, k, v)
    assert any("interpret" in str(w.message) for w in caught)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-5)

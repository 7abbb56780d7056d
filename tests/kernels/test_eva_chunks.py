"""EVA chunk-statistics Pallas kernel (spec eva.md §8.2, §6.9): interpret mode == jnp reference
(values and gradients, ragged lengths), and TPU / CUDA lowering through jax.export."""

from __future__ import annotations

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # compile-bound suite (see test_eva)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from longctx import attention  # noqa: E402
from longctx.attention import eva  # noqa: E402
from pallas_kernels import eva_chunks  # noqa: E402

B, H, D = 2, 2, 16


def setup(C=5, P=4, L=18, dv=D, seed=0, **opts_over):
    core = attention.build("eva", dict(window_size=16, chunk_size=P), num_heads=H, head_dim=D, causal=True,
                           rngs=nnx.Rngs(seed))
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q, k = (jax.random.normal(kk, (B, H, C, P, D)) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, H, C, P, dv))
    valid = (jnp.arange(C * P) < L).reshape(C, P)
    q, k, v = (jnp.where(valid[..., None], x, 0.0) for x in (q, k, v))  # padded rows are zero (spec §2.1)
    noise = jax.random.normal(ks[3], (B, H, C, D))
    params = core.chunk_params()
    # non-trivial LN affine / biases so every parameter path is exercised
    params = {n: p + 0.1 * jax.random.normal(jax.random.fold_in(ks[4], i), p.shape) for i, (n, p) in
              enumerate(sorted(params.items()))}
    opts = dataclasses.replace(core.opts, **opts_over)
    return q, k, v, valid, params, noise, opts


VARIANTS = [
    dict(),
    dict(adaptive_proj="no-ln", mu_mode="half", rf_scale="principled"),
    dict(chunk_rep="identity"),
    dict(adaptive_proj="none"),
]


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("C,P,L,with_noise", [(5, 4, 18, True), (16, 8, 128, False), (3, 8, 5, True)])
def test_forward_matches_reference(variant, C, P, L, with_noise):
    q, k, v, valid, params, noise, opts = setup(C, P, L, **VARIANTS[variant])
    noise = noise if with_noise else None
    ref = jax.jit(lambda *a: eva.chunk_summaries(*a, noise, opts, D**-0.5))(q, k, v, valid, params)
    out = jax.jit(lambda *a: eva_chunks.eva_chunk_stats(*a, noise, opts, D**-0.5, interpret=True))(
        q, k, v, valid, params)
    for a, b in zip(ref, out):
        assert float(jnp.max(jnp.abs(a - b))) <= 2e-5
    assert float(jnp.max(jnp.abs(ref[1]))) > 0.1  # not a trivially zero comparison


def test_gradients_match_reference():
    q, k, v, valid, params, noise, opts = setup(5, 4, 18, dv=8)

    def loss(fn):
        def f(q, k, v, params, noise):
            k_hat, beta = fn(q, k, v, valid, params, noise, opts, D**-0.5)
            return jnp.sum(jnp.sin(beta)) + jnp.sum(jnp.cos(k_hat) * k_hat)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

    g_ref = loss(eva.chunk_summaries)(q, k, v, params, noise)
    g_ker = loss(lambda *a: eva_chunks.eva_chunk_stats(*a, interpret=True))(q, k, v, params, noise)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_ker)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-4
    assert float(jnp.max(jnp.abs(g_ref[3]["q_w"]))) > 0


def test_core_impl_pallas_on_cpu_warns_and_matches_xla():
    cfg = dict(window_size=8, chunk_size=4)
    mk = lambda impl: attention.build("eva", dict(cfg, impl=impl), num_heads=H, head_dim=D, causal=True,  # noqa: E731
                                      rngs=nnx.Rngs(0))
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(kk, (B, H, 21, D)) for kk in ks)
    key = jax.random.PRNGKey(2)
    ref = mk("xla")(q, k, v, deterministic=False, key=key)[0]
    core = mk("pallas")
    with pytest.warns(UserWarning, match="interpret"):
        out, state = core(q[:, :, :13], k[:, :, :13], v[:, :, :13], core.init_state(B, 21), deterministic=False,
                          key=key)
    with pytest.warns(UserWarning, match="interpret"):
        out2, _ = core(q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], state, deterministic=False, key=key)
    assert float(jnp.max(jnp.abs(jnp.concatenate([out, out2], 2) - ref))) < 1e-5


def _export(platform, disabled=()):
    q, k, v, valid, params, noise, opts = setup(16, 8, 120, seed=3)
    f = lambda q, k, v, p, n: eva_chunks.eva_chunk_stats(q, k, v, valid, p, n, opts, D**-0.5,  # noqa: E731
                                                         platform=platform)
    return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=list(disabled))(
        q, k, v, params, noise)


def test_export_tpu_lowering():
    exp = _export("tpu")
    assert "tpu_custom_call" in exp.mlir_module()


def test_export_cuda_lowering():
    # Triton custom calls carry no serialization-compatibility guarantee; lowering is what we check.
    exp = _export("cuda", [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    assert "triton" in exp.mlir_module()


def test_unsupported_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match="power-of-two"):
        eva_chunks.check_supported(6, 16, 16, "cuda")
    eva_chunks.check_supported(6, 16, 16, "tpu")  # Mosaic takes full-dim blocks
    q, k, v, valid, params, noise, opts = setup()
    with pytest.raises(ValueError, match="interpret"):
        eva_chunks.eva_chunk_stats(q, k, v, valid, params, noise, opts, D**-0.5, platform="cpu")

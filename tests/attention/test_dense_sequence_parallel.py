"""dense's fused kernels with the row split over the mesh's ``sequence`` axis (longctx/attention/dense/platform.py,
``sequence_parallel_attention``): a ``shard_map`` over 8 simulated CPU devices, K and V gathered along the row, each
device's query rows at their causal offset. Runs in a subprocess so XLA_FLAGS takes effect.

* the math: cuDNN's call on jax's XLA implementation (cuDNN cannot run here) and splash in Pallas interpret mode,
  values and gradients against dense's reference, rows over data, heads over tensor where they divide;
* the layer: ``dense.attend`` under ``platform.sequence_mesh`` runs the kernel in the shard_map;
* ``jax.export`` of the split call for 'cuda' (cuDNN's bias-masked form) and 'tpu' (splash with its mask tables
  sharded along the query blocks): K/V all-gathered forward, gradients reduce-scattered backward, the kernel's
  per-device shapes; the FLOP counter's analytic count of the split call equals the unsplit one.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import xla_flags

SCRIPT = textwrap.dedent(
    """
    import re, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax._src.cudnn import fused_attention_stablehlo as fas
    from longctx.attention import dense
    from longctx.attention.dense import naive_attention
    from longctx.attention.dense import platform as dp
    from longctx.bench import common as C
    from longctx.bench.attention_bench import analytic_dense_flops
    assert jax.device_count() == 8, jax.devices()
    warnings.simplefilter("ignore")
    AXES = ("data", "fsdp", "tensor", "sequence")

    def qkv(B, H, T, D, dtype=jnp.float32):
        r = np.random.default_rng(0)
        return [jnp.asarray(r.standard_normal((B, H, T, D)), dtype) for _ in range(3)]

    def check(f, ref, args, tol):
        np.testing.assert_allclose(jax.jit(f)(*args), ref(*args), rtol=tol, atol=tol)
        w = jnp.asarray(np.random.default_rng(1).standard_normal(args[0].shape), jnp.float32)
        loss = lambda g: lambda *a: jnp.sum(g(*a) * w)
        for a, b in zip(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args), jax.grad(loss(ref), argnums=(0, 1, 2))(*args)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)

    cases = [((1, 1, 1, 8), 1024, "cudnn", True), ((1, 1, 1, 8), 1024, "splash", True)]
    cases += [((2, 1, 2, 2), 256, kern, causal) for kern in ("cudnn", "splash") for causal in (True, False)]
    for shape, T, kern, causal in cases:
        mesh = Mesh(np.array(jax.devices()).reshape(shape), AXES)
        args = qkv(2, 4, T, 16)
        pos = jnp.arange(T)
        ref = lambda q, k, v: naive_attention(q, k, v, pos, pos, jnp.ones(T, bool), causal=causal)
        f = lambda q, k, v: dp.sequence_parallel_attention(kern, q, k, v, mesh=mesh, causal=causal, interpret=True,
                                                           cudnn_implementation="xla")
        check(f, ref, args, 2e-5)
        print("math", shape, kern, causal, flush=True)

    # the layer: a full pass traced under the sequence mesh runs splash (interpret) in the shard_map
    mesh = Mesh(np.array(jax.devices()).reshape(2, 1, 2, 2), AXES)
    T = 256
    pos = jnp.arange(T)
    args = qkv(2, 4, T, 16)
    def layer(q, k, v):
        with dp.sequence_mesh(mesh):
            return dense.attend(q, k, v, pos, pos, jnp.ones(T, bool), causal=True, impl="splash", block_q=64,
                                block_k=64, auto_threshold=1, full_pass=True, platform="cpu")
    assert "shard_map" in str(jax.make_jaxpr(layer)(*args))
    check(layer, lambda q, k, v: naive_attention(q, k, v, pos, pos, jnp.ones(T, bool), causal=True), args, 2e-5)
    print("layer", flush=True)

    # export for cuda and tpu with the row split over 4 devices, rows over 2
    fas.check_cudnn_version = lambda: 90800  # a CPU-only jaxlib has no cuDNN to ask (test_dense_platform.py)
    B, H, T, D = 2, 4, 1024, 128
    mesh = Mesh(np.array(jax.devices()).reshape(2, 1, 1, 4), AXES)
    sh = NamedSharding(mesh, P(("data", "fsdp"), None, "sequence", None))
    pos = jnp.arange(T)
    avals = [jax.ShapeDtypeStruct((B, H, T, D), jnp.bfloat16, sharding=sh)] * 3
    checks = [jax.export.DisabledSafetyCheck.custom_call(f"__cudnn$fmha{n}") for n in
              ("Softmax", "SoftmaxBackward", "ScaleBiasSoftmax", "ScaleBiasSoftmaxBackward")]
    for impl, plat in (("cudnn", "cuda"), ("splash", "tpu")):
        def fwd(q, k, v):
            with dp.sequence_mesh(mesh):
                return dense.attend(q, k, v, pos, pos, jnp.ones(T, bool), causal=True, impl=impl, block_q=64,
                                    block_k=64, auto_threshold=1, full_pass=True, platform=plat)
        grad = jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2))
        mods = [jax.export.export(jax.jit(g, in_shardings=(sh,) * 3), platforms=[plat], disabled_checks=checks)(*avals)
                for g in (fwd, grad)]
        assert all(m.nr_devices == 8 for m in mods)
        f_mod, b_mod = (m.mlir_module() for m in mods)
        assert "all_gather" in f_mod and "reduce_scatter" in b_mod, impl
        if plat == "cuda":
            assert "@__cudnn$fmhaScaleBiasSoftmax(" in f_mod and "@__cudnn$fmhaScaleBiasSoftmaxBackward(" in b_mod
            assert "tensor<1x256x4x128xbf16>" in f_mod and "tensor<1x1x256x1024xbf16>" in f_mod  # rows, mask
        else:
            assert f_mod.count("tpu_custom_call") >= 1 and b_mod.count("tpu_custom_call") > f_mod.count("tpu_custom_call")
        res = C.jaxpr_matmul_flops(fwd, *[jnp.zeros((B, H, T, D), jnp.bfloat16)] * 3)
        assert res["fused_calls"] == 1 and res["opaque"] == [], res
        assert res["flops"] == analytic_dense_flops(B, H, T, D, True), (impl, res)
        print("export", impl, plat, flush=True)
    print("OK")
    """
)


@pytest.mark.slow  # a subprocess with 8 devices; the default suite keeps the exports of test_dense_platform.py
def test_fused_kernels_split_over_8_devices_match_the_reference_and_lower():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(8)
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]

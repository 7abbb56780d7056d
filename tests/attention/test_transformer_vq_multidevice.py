"""Check 10 of docs/methods/transformer_vq.md §7, multi-device part: codebook statistics of a batch sharded over a Mesh of 8
simulated CPU devices equal the single-device statistics on the concatenated batch (a global sum,
not a per-device mean). Runs in a subprocess so XLA_FLAGS takes effect."""

import os
import subprocess
import sys
import textwrap

from tests.conftest import xla_flags

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flax import nnx
    from longctx import attention
    from longctx.attention import Aux
    assert jax.device_count() == 8, jax.devices()
    cfg = attention.default_config("transformer_vq")
    cfg.update({"codebook_size": 8, "block_len": 4})
    core = attention.build("transformer_vq", cfg, num_heads=2, head_dim=8, causal=True, rngs=nnx.Rngs(0))
    core.c_sum[...] = 1.4 * jax.random.normal(jax.random.PRNGKey(1), core.c_sum[...].shape) * 8 ** -0.25
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    q, k, v = (jax.random.normal(kk, (16, 2, 8, 8)) for kk in ks)
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (16, 8))
    graphdef, variables = nnx.split(core)

    def stats(variables, q, k, v, mask):
        aux = Aux()
        nnx.merge(graphdef, variables)(q, k, v, aux=aux, mask=mask)
        return aux.stats["codebook"]

    single = jax.jit(stats)(variables, q, k, v, mask)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
    sharded = jax.jit(stats)(variables, shard(q), shard(k), shard(v), shard(mask))
    # explicit per-device stats + psum over the data axis (what a shard_map train step does)
    per_dev = jax.shard_map(lambda q, k, v, m: jax.tree.map(lambda x: jax.lax.psum(x, "data"),
                                                          stats(variables, q, k, v, m)),
                            mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P(), check_vma=False)
    psummed = jax.jit(per_dev)(q, k, v, mask)
    for name in ("count", "sum"):
        np.testing.assert_allclose(sharded[name], single[name], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(psummed[name], single[name], rtol=1e-5, atol=1e-5)
    assert float(single["count"].sum()) == 2 * float(mask.sum())
    print("OK")
    """
)


def test_codebook_stats_psum_over_8_devices_equals_single_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(8)
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]

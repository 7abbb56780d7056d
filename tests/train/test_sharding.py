"""A data-parallel train step on 8 simulated CPU devices equals the single-device step."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, ml_collections
    from longctx.config import base_config, validate
    from longctx.models.decoder import build_model
    from longctx.train import sharding
    from longctx.train.optim import make_optimizer
    from longctx.train.step import make_train_step, split_model

    assert jax.device_count() == 8, jax.devices()
    c = base_config()
    c.model.vocab_size = 64
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 2, 2, 16, 64
    c.train.seq_len, c.train.window, c.train.batch_size, c.train.steps, c.train.warmup_steps = 32, 16, 8, 10, 1
    c.model.dropout = 0.1
    cfg = validate(c)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 33)).astype(np.int32)
    results = []
    for devices in (jax.devices()[:1], jax.devices()):
        mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}), devices)
        graphdef, params, nongrad, rest = split_model(build_model(cfg.model, seed=0))
        tx = make_optimizer(cfg.train)
        opt = tx.init(params)
        params, nongrad, rest, opt = sharding.replicate(mesh, (params, nongrad, rest, opt))
        step = jax.jit(make_train_step(graphdef, tx, seq_len=32, window=16, skip_nonfinite=False))
        batch = sharding.shard_batch(mesh, tokens)
        assert len(batch.sharding.device_set) == len(devices)
        p, n, o, m = step(params, nongrad, rest, opt, batch, jax.random.key(0))
        results.append((jax.device_get(p), jax.device_get(m["loss"])))
    (p1, l1), (p8, l8) = results
    np.testing.assert_allclose(l1, l8, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    print("OK", l1)
    """
)


def test_sharded_step_equals_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]

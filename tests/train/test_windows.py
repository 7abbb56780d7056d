"""Windowed training carries the model state between windows (stop-gradient),
one optimizer update per window."""

import jax
import jax.numpy as jnp
import numpy as np

from longctx.config import base_config, validate
from longctx.models.decoder import build_model
from longctx.train.optim import make_optimizer
from longctx.train.step import make_train_step, split_model, token_nll


def test_second_window_sees_the_first_as_context():
    c = base_config()
    c.model.vocab_size = 40
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 2, 2, 16, 64
    c.train.seq_len, c.train.window, c.train.batch_size, c.train.steps, c.train.warmup_steps = 24, 8, 2, 30, 5
    cfg = validate(c)
    model = build_model(cfg.model, seed=0)
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(cfg.train)  # warm-up starts at lr 0: the first update leaves params unchanged
    step = jax.jit(make_train_step(graphdef, tx, seq_len=24, window=8, skip_nonfinite=False))
    tokens = jax.random.randint(jax.random.key(1), (2, 25), 0, 40)
    new_params, _, opt, metrics = step(params, nongrad, rest, tx.init(params), tokens, jax.random.key(0))
    assert metrics["ce"].shape == (3,)
    logits, _, _ = model(tokens[:, :-1])
    nll = np.asarray(token_nll(logits, tokens[:, 1:]))
    np.testing.assert_allclose(metrics["ce"][0], nll[:, :8].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ce"][1], nll[:, 8:16].mean(), rtol=1e-5)  # context = window 1
    assert not np.isclose(metrics["ce"][2], nll[:, 16:].mean(), rtol=1e-6)  # params moved after update 2
    assert int(opt[1][0].count) == 3  # three optimizer updates
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), new_params, params)
    assert max(jax.tree.leaves(moved)) > 0

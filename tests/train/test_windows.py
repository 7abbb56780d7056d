"""Windowed training carries the model state between windows (stop-gradient),
one optimizer update per window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_transformer_vq_windows_apply_one_codebook_update_per_window():
    """GAU + transformer_vq through the real train step: the EMA codebook state moves once per
    window, from the statistics of that window only, and is left out of the optimizer."""
    from flax import nnx

    from longctx.attention.transformer_vq import ema_update

    c = base_config()
    c.model.vocab_size = 40
    c.model.block, c.model.positions, c.model.norm = "gau", "none", "rmsnorm"
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim = 32, 2, 1, 16
    c.model.attention.name = "transformer_vq"
    c.model.attention.transformer_vq.codebook_size = 8
    c.model.attention.transformer_vq.block_len = 4
    c.train.seq_len, c.train.window, c.train.batch_size, c.train.steps, c.train.warmup_steps = 16, 8, 2, 20, 5
    cfg = validate(c)
    model = build_model(cfg.model, seed=0)
    graphdef, params, nongrad, rest = split_model(model)
    assert len(jax.tree.leaves(nongrad)) == 2 * cfg.model.num_layers  # c_sum, c_count per layer
    tx = make_optimizer(cfg.train)
    step = jax.jit(make_train_step(graphdef, tx, seq_len=16, window=8, skip_nonfinite=False))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 40)
    _, new_nongrad, _, metrics = step(params, nongrad, rest, tx.init(params), tokens, jax.random.key(0))
    assert np.all(np.asarray(metrics["aux/commit"]) > 0)

    # replay: window 1 from the empty state, update, window 2 from the carried state, update
    @jax.jit  # the replay's forward (an eager call dispatches op by op: most of this test's time)
    def forward(nongrad, toks, state):
        return nnx.merge(graphdef, params, nongrad, rest)(toks, state)[1:]

    m = nnx.merge(graphdef, params, nongrad, rest)
    core = m.blocks[0].core
    state = m.init_state(2, 16)
    c_sum, c_count = core.c_sum[...], core.c_count[...]
    for w in range(2):
        state, aux = forward(split_model(m)[2], tokens[:, w * 8 : (w + 1) * 8], state)
        c_sum, c_count = ema_update(c_sum, c_count, aux["stats"][0]["codebook"], cfg.model.attention.transformer_vq.gamma)
        m.apply_stats(aux["stats"])
    got = nnx.merge(graphdef, params, new_nongrad, rest).blocks[0].core
    # warm-up starts at lr 0, so window 2 sees unchanged params and the replay is exact
    np.testing.assert_allclose(np.asarray(got.c_count[...]), np.asarray(c_count), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.c_sum[...]), np.asarray(c_sum), rtol=1e-4, atol=1e-6)
    assert not np.allclose(np.asarray(got.c_count[...]), 1.0)  # moved away from the initial counts


def staged(tiny_corpus, tmp_path, **over):
    from tests.conftest import tiny_config

    c = tiny_config(tiny_corpus, tmp_path / "cache", seq_len=32, window=8, short_steps=6, short_seq_len=16, steps=14,
                    ckpt_every=2, eval_every=14)
    c.train.update(over)
    return c


def test_staged_training_in_windows_cuts_both_phases_into_the_same_windows(tiny_corpus, tmp_path):
    """train.short_steps with train.window < train.seq_len: the short rows (short_seq_len) and the long rows
    (seq_len) are both trained in windows of train.window, one update each; each step's batch index is a pure
    function of the update it starts at; misaligned phases are refused in one line."""
    from longctx import config as config_lib
    from longctx.errors import ConfigError

    cfg = validate(staged(tiny_corpus, tmp_path))
    assert [config_lib.windows_at(cfg, s) for s in (0, 2, 4, 6, 10)] == [2, 2, 2, 4, 4]
    assert [config_lib.batch_index(cfg, s) for s in (0, 2, 4, 6, 10)] == [0, 1, 2, 3, 4]
    assert [config_lib.update_tokens(cfg, s) for s in (0, 6)] == [8, 8]
    full = validate(staged(tiny_corpus, tmp_path, window=32, steps=14))  # rows trained whole: one update a row
    assert [config_lib.windows_at(full, s) for s in (0, 5, 6)] == [1, 1, 1]
    assert [config_lib.update_tokens(full, s) for s in (0, 6)] == [16, 32]
    for over, msg in (({"short_seq_len": 12}, "must be a multiple of train.window=8"),
                      ({"short_steps": 5}, "short_seq_len/window=2"),
                      ({"steps": 16}, "must be a multiple of seq_len/window=4")):
        with pytest.raises(ConfigError, match=msg):
            validate(staged(tiny_corpus, tmp_path, **over))


@pytest.mark.slow
def test_staged_training_in_windows_resumes_to_the_same_losses(tiny_corpus, tmp_path):
    """A windowed staged run logs one record per row (2 windows, then 4) and, stopped inside the short phase,
    resumes to the losses of an uninterrupted run."""
    import json

    from longctx.train.loop import train

    def losses(wd):
        recs = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}

    whole, parted = tmp_path / "whole", tmp_path / "parted"
    train(validate(staged(tiny_corpus, tmp_path)), whole, progress=False)
    assert sorted(losses(whole)) == [2, 4, 6, 10, 14]
    train(validate(staged(tiny_corpus, tmp_path)), parted, progress=False, max_steps=4)
    train(validate(staged(tiny_corpus, tmp_path)), parted, progress=False)
    assert losses(parted) == losses(whole)

"""Gradient accumulation (``train.microbatches``): one update from k micro-batches equals one update
from the whole batch -- with windows and the carried state, for dense attention and for
Transformer-VQ (whose codebook EMA statistics are summed over the micro-batches)."""

import jax
import numpy as np
import optax
import pytest

from longctx.config import base_config, validate
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.train.step import make_train_step, split_model


def _cfg(method: str, **train):
    c = base_config()
    c.model.vocab_size = 40
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 2, 2, 16, 64
    if method == "transformer_vq":
        c.model.block, c.model.positions, c.model.norm, c.model.num_heads = "gau", "none", "rmsnorm", 1
        c.model.attention.name = "transformer_vq"
        c.model.attention.transformer_vq.codebook_size = 8
        c.model.attention.transformer_vq.block_len = 4
    c.train.seq_len, c.train.window, c.train.batch_size, c.train.steps, c.train.warmup_steps = 16, 8, 4, 20, 0
    for k, v in train.items():
        c.train[k] = v
    return validate(c)


def _run(cfg, microbatches: int, tokens, weights=None):
    model = build_model(cfg.model, seed=0)
    graphdef, params, nongrad, rest = split_model(model)
    # plain SGD: the update is the gradient, scaled (Adam's first update is about lr * sign(g), which
    # turns the rounding of a gradient element near 0 into a full step either way)
    tx = optax.sgd(0.5)
    t = cfg.train
    step = jax.jit(make_train_step(graphdef, tx, seq_len=t.seq_len, window=t.window, skip_nonfinite=True,
                                   weighted=weights is not None, microbatches=microbatches))
    batch = tokens if weights is None else {"tokens": tokens, "weights": weights}
    opt = tx.init(params)
    for i in range(2):  # two steps: the second starts from the first's parameters and codebooks
        params, nongrad, opt, metrics = step(params, nongrad, rest, opt, batch, jax.random.key(i))
    return jax.device_get((params, nongrad, opt, metrics))


def _assert_same(got, want):
    leaves_g, leaves_w = jax.tree.leaves(got[:3]), jax.tree.leaves(want[:3])
    assert len(leaves_g) == len(leaves_w) > 0
    for g, w in zip(leaves_g, leaves_w, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    for key in ("loss", "ce", "grad_norm"):
        np.testing.assert_allclose(got[3][key], want[3][key], rtol=1e-6)


@pytest.mark.parametrize("method", ["dense", "transformer_vq"])
@pytest.mark.parametrize("microbatches", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_accumulated_update_equals_the_whole_batch_update(method, microbatches):
    cfg = _cfg(method)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 40)
    want = _run(cfg, 1, tokens)
    got = _run(cfg, microbatches, tokens)
    assert got[3]["ce"].shape == (2,)  # two windows: two updates, the state carried between them
    _assert_same(got, want)
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(want[1]), jax.tree.leaves(
        split_model(build_model(cfg.model, seed=0))[2]))]
    if method == "transformer_vq":
        assert max(moved) > 0  # the codebooks moved (from the summed statistics)
        assert np.all(np.asarray(got[3]["aux/commit"]) > 0)


def test_accumulation_with_one_window_per_row():
    """No state carried (the window is the whole row): the micro-batches' states are not stitched together."""
    cfg = _cfg("dense", window=16)
    tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, 40)
    got = _run(cfg, 2, tokens)
    assert got[3]["ce"].shape == (1,)
    _assert_same(got, _run(cfg, 1, tokens))


def test_accumulated_weighted_loss_equals_the_whole_batch():
    """A generated source's loss (weighted mean over the scored targets): each micro-batch's share is
    its share of the weight, so rows with more scored targets count for more, as in the batch."""
    cfg = _cfg("dense")
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 40)
    weights = np.zeros((4, 16), np.float32)
    weights[0, 3:9] = 1
    weights[1, 12] = 1
    weights[3, 5:16] = 1  # row 2 has no scored target
    _assert_same(_run(cfg, 2, tokens, weights), _run(cfg, 1, tokens, weights))


def test_microbatches_must_divide_the_batch():
    with pytest.raises(ConfigError, match=r"train.microbatches=3 must divide train.batch_size=4"):
        _cfg("dense", microbatches=3)
    with pytest.raises(ConfigError, match=r"train.microbatches=0 must be a positive integer"):
        _cfg("dense", microbatches=0)

"""Packed rows at model level (``data.packing='segments'``): the loss of a packed batch is the token-weighted loss of
its documents run alone, with positions restarting at each document and the windows of a row carrying the state
across document boundaries; the combinations that cannot take packed rows are refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from longctx.config import base_config, validate
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.train.step import make_packed_loss_fn, make_train_step, split_model, target_weights
from tests.models.test_decoder import small_model_cfg

ROWS = ((5, 11, 17), (17, 5, 11))  # document lengths per row: T + 1 = 33 tokens, boundaries at different places
T = 32
WINDOW = 8  # windows of the row; documents cross their edges


def _batch():
    seg = np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in ROWS]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in ROWS]).astype(np.int32)
    tokens = np.asarray(jax.random.randint(jax.random.key(0), seg.shape, 0, 50), np.int32)
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}


def _alone_nll(model, batch):
    """Per target [B, T] nll of each document run alone (0 at the targets that open the next document)."""
    tokens = np.asarray(batch["tokens"])
    call = nnx.jit(lambda m, t: m(t)[0])
    out = np.zeros((len(ROWS), T), np.float64)
    for b, row in enumerate(ROWS):
        start = 0
        for n in row:
            doc = jnp.asarray(tokens[b:b + 1, start:start + n])
            logp = jax.nn.log_softmax(call(model, doc)[0, :-1].astype(jnp.float32), axis=-1)
            out[b, start:start + n - 1] = -np.take_along_axis(np.asarray(logp), np.asarray(doc[0, 1:, None]), -1)[:, 0]
            start += n
    return out


def _windowed_nll(model, batch, window):
    """Per target [B, T] nll of the packed rows run in windows of ``window`` tokens, the state carried."""
    tokens, seg, pos = (batch[k][:, :-1] for k in ("tokens", "segment_ids", "positions"))
    targets = batch["tokens"][:, 1:]

    @nnx.jit
    def run(m, t, y, p, s, state):
        h, state, _ = m.run(t, state, positions=p, segment_ids=s)
        return m.nll(h, y), state

    state, outs = model.init_state(len(ROWS), T), []
    for a in range(0, T, window):
        sl = slice(a, a + window)
        nll, state = run(model, tokens[:, sl], targets[:, sl], pos[:, sl], seg[:, sl], state)
        outs.append(nll)
    return np.asarray(jnp.concatenate(outs, axis=1), np.float64)


@pytest.mark.parametrize("positions", ["rotary", "learned", "sinusoidal"])
def test_packed_rows_score_each_document_as_if_alone(positions):
    """Windows of 8 carrying the dense KV cache: every in-document target's nll equals its document's alone."""
    model = build_model(small_model_cfg(positions), seed=1)
    batch = _batch()
    w = np.asarray(target_weights(batch["segment_ids"]))
    assert w.sum() == sum(n - 1 for r in ROWS for n in r)  # one target lost per document (its successor's first)
    want = _alone_nll(model, batch)
    got = _windowed_nll(model, batch, WINDOW)
    np.testing.assert_allclose(got * w, want, atol=2e-5, rtol=2e-5)
    # without segment ids the same rows see across documents: the law above is not met by accident
    plain = nnx.jit(lambda m, t, y: m.nll(m.run(t)[0], y))(model, batch["tokens"][:, :-1], batch["tokens"][:, 1:])
    assert np.max(np.abs(np.asarray(plain) * w - want)) > 1e-3


@pytest.mark.slow
def test_packed_loss_and_gradient_are_the_documents_token_weighted():
    """The packed loss (one window) equals sum over documents of (targets * mean nll) / all targets, and so does its
    gradient (each document's own loss, run alone, weighted by its share of the targets)."""
    model = build_model(small_model_cfg("rotary"), seed=2)
    graphdef, params, nongrad, rest = split_model(model)
    batch = _batch()
    seg, pos, tok = batch["segment_ids"], batch["positions"], batch["tokens"]
    packed = make_packed_loss_fn(graphdef)

    def packed_loss(p):
        return packed(p, nongrad, rest, tok[:, :-1], tok[:, 1:], pos[:, :-1], seg[:, :-1], target_weights(seg), None,
                      None)[0]

    def alone_loss(p):
        m = nnx.merge(graphdef, p, nongrad, rest)
        total, count = 0.0, 0
        for b, row in enumerate(ROWS):
            start = 0
            for n in row:
                doc = tok[b:b + 1, start:start + n]
                total = total + jnp.sum(m.nll(m.run(doc[:, :-1])[0], doc[:, 1:]))
                count += n - 1
                start += n
        return total / count

    lp, gp = jax.jit(jax.value_and_grad(packed_loss))(params)
    la, ga = jax.jit(jax.value_and_grad(alone_loss))(params)
    np.testing.assert_allclose(float(lp), float(la), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(ga)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_windowed_train_step_reports_each_windows_document_loss(microbatches):
    """The train step (packed=True, windows of 8 carrying the state, lr 0; the rows in one batch or in two
    micro-batches): each window's reported loss is the mean of its in-document targets' nll of the documents
    alone."""
    model = build_model(small_model_cfg("rotary"), seed=1)
    graphdef, params, nongrad, rest = split_model(model)
    tx = optax.sgd(0.0)
    step = jax.jit(make_train_step(graphdef, tx, seq_len=T, window=WINDOW, skip_nonfinite=True, packed=True,
                                   microbatches=microbatches))
    batch = _batch()
    *_, metrics = step(params, nongrad, rest, tx.init(params), batch, jax.random.key(0))
    want, w = _alone_nll(model, batch), np.asarray(target_weights(batch["segment_ids"]))
    per_window = [(want[:, a:a + WINDOW] * w[:, a:a + WINDOW]).sum() / w[:, a:a + WINDOW].sum()
                  for a in range(0, T, WINDOW)]
    np.testing.assert_allclose(np.asarray(metrics["ce"]), per_window, rtol=2e-5)


def _segments_cfg(**model):
    c = base_config()
    c.data.packing = "segments"
    for k, v in model.items():
        c.model[k] = v
    return c


def test_config_refuses_what_cannot_take_packed_rows():
    validate(_segments_cfg())  # a dense decoder takes them
    with pytest.raises(ConfigError, match="^data.packing='segments' with model.kind='encoder' is not supported yet"):
        validate(_segments_cfg(kind="encoder", causal=False))
    c = _segments_cfg()
    c.mesh.sequence = 2
    with pytest.raises(ConfigError, match=r"^data.packing='segments' with mesh.sequence=2 is not supported yet"):
        validate(c)
    c = _segments_cfg()
    c.data.source = "mqar"
    c.data.tokenizer = "bytes"
    with pytest.raises(ConfigError, match="^data.packing='segments' applies to prepared corpora"):
        validate(c)


def test_a_block_whose_method_takes_no_segment_ids_refuses_them():
    """A pattern whose other layers' method takes no segment ids: config validation and the model call refuse."""
    cfg = small_model_cfg("rotary", num_layers=2)
    cfg.attention.pattern = ("kdeformer", "dense")
    model = build_model(cfg, seed=0)
    batch = _batch()
    with pytest.raises(ConfigError, match=r"^kdeformer: packed rows \(data.packing='segments'\) are not supported "
                                          r"yet; use data.packing='document'$"):
        model.run(batch["tokens"][:, :-1], positions=batch["positions"][:, :-1],
                  segment_ids=batch["segment_ids"][:, :-1])
    c = _segments_cfg()
    c.model.attention.pattern = ("kdeformer", "dense")
    with pytest.raises(ConfigError, match="^kdeformer: packed rows"):
        validate(c)

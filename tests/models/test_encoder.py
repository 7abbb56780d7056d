"""Encoder (masked LM): one backbone with the decoder, bidirectional blocks, the loss on masked
positions only, the masked positions reaching the blocks as ``important``, named parameters, and
the built-in MLM configs at equal parameter counts for every bidirectional method."""

import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx import config as config_lib
from longctx.config import base_config
from longctx.errors import ConfigError
from longctx.models import blocks as blocks_lib
from longctx.models.backbone import Backbone
from longctx.models.decoder import DecoderLM, build_model
from longctx.models.encoder import EncoderMLM
from longctx.train.step import make_mlm_loss_fn, split_model
from tests.models.test_logical_axes import _unnamed

ROOT = Path(__file__).resolve().parents[2]
BIDIRECTIONAL = [n for n in attention.names() if attention.get_class(n).supports_bidirectional]
# dense in the default run, every other method with -m slow (eager approximate cores are slow on CPU)
BY_METHOD = [m if m == "dense" else pytest.param(m, marks=pytest.mark.slow) for m in BIDIRECTIONAL]


def bidir_case(method):
    cases = attention.get_class(method).contract_cases().values()
    return next(c for c in cases if "bidirectional" in c.directions)


def farthest_reached(model, T: int) -> int:
    """The farthest position of a row of ``T`` the first position's output depends on: the last, or where a core
    sees a sliding window of W keys (``receptive_window``: fewer than W positions away), W - 1 per layer."""
    from longctx.train.sequence_parallel import attention_cores

    cores = attention_cores(model)
    windows = [c.receptive_window for c in cores]
    if not windows or not all(windows):
        return T - 1
    return min(T - 1, sum(w - 1 for w in windows))


def model_cfg(method="dense", kind="encoder", block="transformer"):
    c = base_config().model
    c.kind = kind
    c.vocab_size = 64
    c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 16, 2, 2, 8, 32
    c.block = block
    c.positions = "none"
    c.attention.name = method
    c.attention[method] = dict(bidir_case(method).cfg)
    return c


def test_one_backbone():
    assert issubclass(DecoderLM, Backbone) and issubclass(EncoderMLM, Backbone)
    enc = build_model(model_cfg(kind="encoder"), seed=0)
    dec = build_model(model_cfg(kind="decoder"), seed=0)
    assert isinstance(enc, EncoderMLM) and isinstance(dec, DecoderLM)
    # the same parameter tree and initial values: only the blocks' causal flag differs
    pe, pd = nnx.state(enc, nnx.Param), nnx.state(dec, nnx.Param)
    assert jax.tree.structure(pe) == jax.tree.structure(pd)
    for a, b in zip(jax.tree.leaves(pe), jax.tree.leaves(pd)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(not b.core.causal for b in enc.blocks) and all(b.core.causal for b in dec.blocks)


def test_build_model_refuses_unknown_kind():
    c = model_cfg()
    c.kind = "seq2seq"
    with pytest.raises(ConfigError, match="allowed: decoder, encoder"):
        build_model(c)


@pytest.mark.parametrize("method", BY_METHOD)
def test_encoder_sees_the_whole_row(method):
    """Perturbing the last token (a sliding window's: the farthest its layers reach) changes the first position's
    output (the decoder's does not move)."""
    T = bidir_case(method).length
    call = nnx.jit(lambda m, t: m(t)[0])  # jitted: an eager call compiles op by op
    enc = build_model(model_cfg(method), seed=0)
    p = farthest_reached(enc, T)
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, 60)
    later = tokens.at[:, p].set((tokens[:, p] + 7) % 60)
    a = call(enc, tokens)
    b = call(enc, later)
    assert a.shape == (2, T, 64)
    assert np.abs(np.asarray(a[:, 0] - b[:, 0])).max() > 1e-4, method
    if attention.get_class(method).supports_causal:
        dec = build_model(model_cfg(method, kind="decoder"), seed=0)
        # the decoder's first position sees only itself (tolerance: the approximate cores)
        np.testing.assert_allclose(np.asarray(call(dec, tokens)[:, 0]), np.asarray(call(dec, later)[:, 0]), atol=1e-5)


def test_unmasked_positions_carry_no_loss():
    enc = build_model(model_cfg(), seed=0)
    graphdef, params, nongrad, rest = split_model(enc)
    T = 24
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 60, size=(2, T)).astype(np.int32)
    mask = np.zeros((2, T), bool)
    mask[0, [1, 5, 9]] = True
    mask[1, [0, 20, 23]] = True
    inputs = np.where(mask, 63, targets).astype(np.int32)
    loss_fn = jax.jit(make_mlm_loss_fn(graphdef, num_masked=3))  # jitted: an eager call compiles op by op

    def loss(t):
        batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(t), "mask": jnp.asarray(mask)}
        return float(loss_fn(params, nongrad, rest, batch, None, jax.random.key(0))[1][0])

    base = loss(targets)
    # the reference: mean over the masked positions of the full-logits NLL
    logp = jax.nn.log_softmax(nnx.jit(lambda m, x, k: m(x, k)[0])(enc, jnp.asarray(inputs), jnp.asarray(mask)), -1)
    nll = -np.take_along_axis(np.asarray(logp), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(base, nll[mask].mean(), rtol=1e-5)
    other = np.where(mask, targets, (targets + 11) % 60)  # every unmasked target changed
    assert loss(other) == pytest.approx(base, abs=1e-7)
    one = targets.copy()
    one[0, 5] = (one[0, 5] + 11) % 60  # one masked target changed
    assert abs(loss(one) - base) > 1e-4

    def masked_nll(m, x, t, k):  # jitted below: an eager call compiles op by op
        h, _ = m.hidden(x, k)
        return m.masked_nll(h, t, k, 5)

    # gathered per-position losses are zero outside the mask
    per, valid, idx = nnx.jit(masked_nll)(enc, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask))
    assert np.asarray(valid).sum() == 6
    assert (np.asarray(per)[~np.asarray(valid)] == 0).all()
    np.testing.assert_array_equal(np.sort(np.asarray(idx)[np.asarray(valid)].reshape(2, 3)),
                                  [[1, 5, 9], [0, 20, 23]])


class _RecordingBlock(blocks_lib.TransformerBlock):
    def __call__(self, x, state, *, important=None, aux=None, **kw):
        x, state = super().__call__(x, state, aux=aux, **kw)
        aux.metrics["important"] = jnp.sum(important) if important is not None else jnp.array(-1)
        return x, state


def test_important_reaches_blocks_that_take_it(monkeypatch):
    monkeypatch.setitem(blocks_lib._BLOCKS, "recording", f"{__name__}:_RecordingBlock")
    mask = jnp.zeros((1, 10), bool).at[0, [2, 3, 7]].set(True)
    call = nnx.jit(lambda m, k: m(jnp.ones((1, 10), jnp.int32), k))  # jitted: an eager call compiles op by op
    rec = build_model(model_cfg(block="recording"), seed=0)
    _, aux = call(rec, mask)
    assert [int(aux["metrics"][f"layer{i}/important"]) for i in range(2)] == [3, 3]
    _, aux = call(rec, None)
    assert int(aux["metrics"]["layer0/important"]) == -1
    plain = build_model(model_cfg(), seed=0)  # a block without the keyword never sees it
    np.testing.assert_array_equal(np.asarray(call(plain, mask)[0]), np.asarray(call(plain, None)[0]))


@pytest.mark.parametrize("method", BY_METHOD)
def test_every_encoder_variable_has_logical_axes(method):
    try:
        model = build_model(model_cfg(method), seed=0)
    except ConfigError as e:
        pytest.skip(f"{method}: {e}")
    assert _unnamed(model) == []


def _mlm_config(method, arg=None):
    mod = runpy.run_path(str(ROOT / "configs" / "builtin" / f"mlm_{method}.py"))
    c = mod["get_config"](arg) if arg else mod["get_config"]()
    return config_lib.resolve_vocab(config_lib.validate(ml_collections.ConfigDict(c.to_dict())), 256)


def _n_params(cfg):
    model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_mlm_configs_exist_for_every_bidirectional_method_with_equal_parameters():
    counts = {}
    for method in BIDIRECTIONAL:
        path = ROOT / "configs" / "builtin" / f"mlm_{method}.py"
        assert path.exists(), f"{method} supports bidirectional attention: add configs/builtin/mlm_{method}.py"
        cfg = _mlm_config(method)
        assert cfg.model.kind == "encoder" and cfg.model.attention.name == method
        assert (cfg.train.seq_len, cfg.train.steps, cfg.train.batch_size) == (256, 200, 8)
        assert cfg.model.vocab_size == 257 and cfg.mlm.mask_id == 256
        counts[method] = _n_params(cfg)
        tiny = _mlm_config(method, "tiny")
        assert tiny.model.kind == "encoder" and _n_params(tiny) < 50_000
    ref = counts["dense"]
    assert all(abs(n - ref) / ref < 0.01 for n in counts.values()), counts

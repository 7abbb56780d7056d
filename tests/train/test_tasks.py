"""The trainer's tasks through their interface (longctx.train.tasks): each task's batches, one train
step and its evaluation, on tiny models; the loop itself is tested in test_loop.py."""

import runpy
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from longctx import config as config_lib
from longctx.models.decoder import build_model
from longctx.train import sharding, tasks
from longctx.train.optim import make_optimizer
from longctx.train.step import split_model
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def lm_config(corpus, cache):
    return tiny_config(corpus, cache, steps=4, warmup_steps=1)


def mlm_config(corpus, cache):
    c = tiny_config(corpus, cache, steps=4, warmup_steps=1)
    c.model.kind = "encoder"
    return c


def recall_config(cache):
    c = runpy.run_path(str(ROOT / "configs" / "recall" / "dense.py"))["get_config"]("tiny")
    c.data.cache_dir = str(cache)
    c.data.synthetic.eval_rows = 4
    return ml_collections.ConfigDict(c.to_dict())


def start(cfg):
    """What the loop does before its first step: the task, the model, the sharding plan, task.setup."""
    task = tasks.from_config(config_lib.validate(cfg))
    cfg = task.cfg
    model = build_model(cfg.model, seed=cfg.train.seed, execution=cfg.execution)
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(cfg.train)
    opt_state = tx.init(params)
    plan = sharding.Plan(sharding.make_mesh(cfg.mesh), params, nongrad, rest, tx, opt_state,
                         sharding.parse_rules(cfg.mesh.rules))
    task.setup(model, graphdef, tx, plan)
    return task, plan.put(params, nongrad, rest, opt_state)


def one_step(task, state):
    params, nongrad, rest, opt_state = state
    params, nongrad, opt_state, metrics = task.train_step(params, nongrad, rest, opt_state, task.batch(0),
                                                          jax.random.key(0))
    metrics = jax.device_get(metrics)
    assert {"loss", "ce", "grad_norm", "loss_finite", "grad_finite"} <= set(metrics)
    assert np.all(metrics["loss_finite"]) and np.all(metrics["grad_finite"])
    assert np.isfinite(np.mean(metrics["ce"])) and np.mean(metrics["ce"]) > 0
    return params, nongrad, rest


def test_the_task_is_picked_from_the_config(tiny_corpus, tmp_path):
    assert tasks.task_class(lm_config(tiny_corpus, tmp_path)) is tasks.LanguageModel
    assert tasks.task_class(mlm_config(tiny_corpus, tmp_path)) is tasks.MaskedLM
    assert tasks.task_class(recall_config(tmp_path)) is tasks.Recall


def test_language_model(tiny_corpus, tmp_path):
    cfg = lm_config(tiny_corpus, tmp_path / "cache")
    cfg.data.packing = "document"  # rows inside one document: token rows (packed rows: tests/data/test_segments.py)
    task, state = start(cfg)
    assert task.cfg.model.vocab_size == task.tokenizer.vocab_size  # resolved from the tokenizer
    tokens = task.batch(0)
    assert tokens.shape == (4, 33)  # seq_len + 1: inputs and next-token targets
    np.testing.assert_array_equal(np.asarray(task.batch(2)), np.asarray(task.batch(2)))  # a function of the step
    assert "packing='document'" in task.summary()
    assert task.checkpoint_extra()["data_dir"]
    res = task.evaluate(one_step(task, state))
    assert list(task.valid_record(res)) == ["loss", "bits_per_token", "bits_per_byte"]  # bytes: lossless
    assert task.valid_record(res)["loss"] == res["loss_nats_per_token"] > 0
    assert task.valid_record(res)["bits_per_byte"] == res["bits_per_token"]  # one token a byte


def test_masked_lm(tiny_corpus, tmp_path):
    task, state = start(mlm_config(tiny_corpus, tmp_path / "cache"))
    assert task.cfg.mlm.mask_id == task.tokenizer.vocab_size  # -1: one id beyond the tokenizer's
    batch = task.batch(0)
    assert isinstance(batch, dict) and all(v.shape[:2] == (4, 32) for v in batch.values())  # rows of seq_len
    again = task.batch(0)
    for k in batch:  # the masks are a function of (seed, step, row)
        np.testing.assert_array_equal(np.asarray(batch[k]), np.asarray(again[k]))
    assert any(not np.array_equal(np.asarray(batch[k]), np.asarray(task.batch(1)[k])) for k in batch)
    res = task.evaluate(one_step(task, state))
    rec = task.valid_record(res)
    assert sorted(rec) == ["accuracy", "bits_per_byte", "bits_per_token", "loss"] and 0.0 <= rec["accuracy"] <= 1.0
    assert rec["bits_per_byte"] == rec["bits_per_token"]  # one byte a token: the masked bytes' bits


def test_recall(tmp_path):
    task, state = start(recall_config(tmp_path / "cache"))
    assert task.splits is None and task.checkpoint_extra() == {"data_dir": ""}
    assert "rows generated on the fly" in task.summary() and "mqar" in task.summary()
    tc = task.cfg.train
    short, long = task.batch(0), task.batch(tc.short_steps)  # staged: short rows first
    assert set(short) == {"tokens", "weights"}
    assert short["tokens"].shape == (tc.batch_size, tc.short_seq_len + 1)
    assert long["tokens"].shape == (tc.batch_size, tc.seq_len + 1)
    assert long["weights"].shape == (tc.batch_size, tc.seq_len) and float(np.sum(long["weights"])) > 0
    params = one_step(task, state)
    res = task.evaluate(params)
    assert task.eval_set is not None  # the fixed evaluation rows, made once
    rec = task.valid_record(res)
    assert list(rec) == ["loss", "bits_per_token", "accuracy"] and 0.0 <= rec["accuracy"] <= 1.0
    assert task.valid_record(task.evaluate(params)) == rec  # the same rows again


@pytest.mark.parametrize("kind", ["lm", "mlm"])
def test_eval_budget_is_the_periodic_one(tiny_corpus, tmp_path, kind):
    """The periodic validation scores at most train.eval_tokens (eval.max_tokens 0 = that budget)."""
    cfg = (lm_config if kind == "lm" else mlm_config)(tiny_corpus, tmp_path / "cache")
    cfg.eval.max_tokens = 0
    task = tasks.from_config(config_lib.validate(cfg))
    assert task.eval_config().max_tokens == cfg.train.eval_tokens
    cfg.eval.max_tokens = 100
    assert tasks.from_config(config_lib.validate(cfg)).eval_config().max_tokens == 100


def test_the_validation_forward_donates_the_carried_state(tmp_path):
    """Each window call of a stream validation hands its state on (``step.jit_forward``; longctx-eval's and longctx-recall's
    forwards too): the state passed in is
    donated, so a call does not copy a state sized for the longest stream; the returned one goes on."""
    import warnings

    import jax.numpy as jnp

    from longctx.train.step import jit_forward, make_forward

    cfg = tiny_config(tmp_path / "no-corpus", tmp_path / "no-cache")
    cfg.model.vocab_size = 256
    cfg = config_lib.validate(cfg)
    model = build_model(cfg.model, seed=0, execution=cfg.execution)
    graphdef, params, nongrad, rest = split_model(model)
    fwd = jit_forward(make_forward(graphdef))
    state = model.init_state(2, 128)
    x = jnp.zeros((2, 32), jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a donation XLA could not use would warn
        _, state2 = fwd(params, nongrad, rest, x, x, state)
        nll, _ = fwd(params, nongrad, rest, x, x, state2)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state)) and nll.shape == (2, 32)

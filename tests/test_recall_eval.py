"""Recall tasks through the trainer and longctx-recall: the loss is on the scored answer tokens only,
resume stays exact, the evaluation reports accuracy and answer loss by distance (JSON, plot,
table), the passkey probe runs zero-shot on a text LM past its training length, a state with a
static capacity is reported as such, and exact attention given the answer in context learns a tiny
instance to 100 %."""

import json
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from longctx import cli
from longctx.config import base_config, resolve_vocab, validate
from longctx.models.decoder import build_model
from longctx.recall import recall_run, report
from longctx.train.step import make_train_step, split_model
from tests.conftest import tiny_config
from tests.train.test_resume import train_losses

ROOT = Path(__file__).resolve().parents[1]


def recall_tiny(method, cache, **train):
    c = runpy.run_path(str(ROOT / "configs" / "recall" / f"{method}.py"))["get_config"]("tiny")
    c.data.cache_dir = str(cache)
    c.train.async_checkpoints = False
    for k, v in train.items():
        c.train[k] = v
    return ml_collections.ConfigDict(c.to_dict())


def test_weighted_step_scores_only_the_weighted_targets():
    c = base_config()
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 1, 2, 16, 64
    c.train.seq_len, c.train.steps, c.train.warmup_steps = 16, 4, 1
    c = resolve_vocab(validate(c), 256)
    graphdef, params, nongrad, rest = split_model(build_model(c.model, seed=0))
    tx = optax.sgd(0.1)
    opt = tx.init(params)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    weighted = jax.jit(make_train_step(graphdef, tx, seq_len=16, window=8, skip_nonfinite=False, weighted=True))
    whole = jax.jit(make_train_step(graphdef, tx, seq_len=16, window=16, skip_nonfinite=False, weighted=True))
    key = jax.random.key(0)
    # the model's forward, jitted (op-by-op it compiles every primitive on its own)
    logits, _, _ = jax.jit(lambda p, n, r, x: nnx.merge(graphdef, p, n, r)(x))(params, nongrad, rest, tokens[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    _, _, _, m1 = whole(params, nongrad, rest, opt, {"tokens": tokens, "weights": jnp.ones((2, 16))}, key)
    np.testing.assert_allclose(m1["ce"][0], nll.mean(), rtol=1e-5)  # all weights 1: the plain LM loss

    # only targets 3 and 12 scored: the weighted loss is their mean NLL, in one window or two
    w = jnp.zeros((2, 16)).at[:, 3].set(1.0).at[:, 12].set(1.0)
    _, _, _, mw = whole(params, nongrad, rest, opt, {"tokens": tokens, "weights": w}, key)
    np.testing.assert_allclose(mw["ce"][0], (nll[:, 3].sum() + nll[:, 12].sum()) / 4, rtol=1e-5)
    _, _, _, mwin = weighted(params, nongrad, rest, opt, {"tokens": tokens, "weights": w}, key)
    np.testing.assert_allclose(mwin["ce"][0], nll[:, 3].mean(), rtol=1e-5)  # first window: target 3 only
    # an unscored target (the last) changes nothing; a scored one changes the loss
    last = tokens.at[:, 16].set((tokens[:, 16] + 1) % 256)
    p3, _, _, m3 = whole(params, nongrad, rest, opt, {"tokens": last, "weights": w}, key)
    p4, _, _, _ = whole(params, nongrad, rest, opt, {"tokens": tokens, "weights": w}, key)
    np.testing.assert_array_equal(m3["ce"], mw["ce"])
    for a, b in zip(jax.tree.leaves(p3), jax.tree.leaves(p4)):
        np.testing.assert_array_equal(a, b)
    scored = tokens.at[:, 4].set((tokens[:, 4] + 1) % 256)
    _, _, _, m5 = whole(params, nongrad, rest, opt, {"tokens": scored, "weights": w}, key)
    assert not np.allclose(m5["ce"], mw["ce"])


@pytest.mark.parametrize("window", [8, pytest.param(32, marks=pytest.mark.slow)])
def test_packed_recall_rows_score_each_examples_answers_alone(tiny_corpus, tmp_path, window):
    """Packed mqar rows (3 examples of 11 tokens a row of 33, data.packing='segments'): the weighted packed step's
    loss (the whole row in one window, or windows of 8 carrying the state across the examples' boundaries) is the mean nll of the answers of each
    example run alone; the same rows without segment ids see across examples and score otherwise."""
    from longctx.data import sources
    from longctx.data.synthetic import RowBatcher

    c = base_config()
    c.data.source, c.data.packing, c.data.path = "mqar", "segments", str(tiny_corpus)
    c.data.cache_dir = str(tmp_path / "cache")
    c.data.synthetic.update(example_len=10, num_pairs=2, num_keys=8, num_values=8)
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 1, 2, 16, 64
    c.train.seq_len, c.train.steps, c.train.warmup_steps, c.train.batch_size = 32, 4, 1, 2
    c = resolve_vocab(validate(c), 256)
    batch = RowBatcher(sources.build(c.data), row_len=32, batch_size=2, seed=0).batch(0)
    np.testing.assert_array_equal(batch["segment_ids"][0], np.repeat([1, 2, 3], 11))
    model = build_model(c.model, seed=0)
    graphdef, params, nongrad, rest = split_model(model)
    tx = optax.sgd(0.0)
    opt = tx.init(params)
    W = window

    def loss(packed):
        step = jax.jit(make_train_step(graphdef, tx, seq_len=32, window=W, skip_nonfinite=False, weighted=True,
                                       packed=packed))
        keys = ("tokens", "weights") + (("segment_ids", "positions") if packed else ())
        *_, m = step(params, nongrad, rest, opt, {k: jnp.asarray(batch[k]) for k in keys}, jax.random.key(0))
        return np.asarray(m["ce"])

    call = nnx.jit(lambda m, x: m(x)[0])
    nll = np.zeros((2, 32))
    for b in range(2):
        for e in range(3):  # each example alone, from a fresh start
            ex = batch["tokens"][b, 11 * e : 11 * e + 11]
            logp = jax.nn.log_softmax(call(model, jnp.asarray(ex[None, :-1])), -1)[0]
            nll[b, 11 * e : 11 * e + 10] = -np.take_along_axis(np.asarray(logp), ex[1:, None], -1)[:, 0]
    w = batch["weights"]
    assert w.sum() == 2 * 3 * 2  # two answers per example
    want = [(nll[:, a:a + W] * w[:, a:a + W]).sum() / max(w[:, a:a + W].sum(), 1e-9) for a in range(0, 32, W)]
    np.testing.assert_allclose(loss(True), want, rtol=2e-5)
    assert np.max(np.abs(loss(False) - want)) > 1e-3


@pytest.mark.slow
def test_training_on_packed_examples_and_scoring_them_alone(tmp_path, capsys):
    """The trainer on packed mqar rows (rows of 64 inputs holding 3 examples of at least 20): it trains and
    validates, and longctx-recall scores it by default on single examples of 20 inputs."""
    from longctx.train.loop import train

    cfg = recall_tiny("dense", tmp_path / "cache", steps=2, short_steps=0, warmup_steps=1, eval_every=2,
                      ckpt_every=2, log_every=1)
    cfg.data.packing, cfg.data.synthetic.example_len = "segments", 20
    train(cfg, tmp_path / "run", progress=False)
    assert "packed: examples of at least 20 inputs back to back, each attended alone" in capsys.readouterr().out
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["split"] == "valid"]
    assert all(np.isfinite(r["loss"]) for r in records if r["split"] == "train")
    res = recall_run(tmp_path / "run", rows=8, bins=2, progress=False, write=False)
    assert res["status"] == "ok" and res["length"] == 20 and res["train_example_len"] == 20
    assert res["answers"] == 8 * 4


def test_every_causal_method_has_a_recall_config_with_the_same_budget():
    from longctx import attention

    def params(cfg):
        cfg = resolve_vocab(validate(cfg), 256)
        model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0))
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

    causal = [n for n in attention.names() if attention.get_class(n).supports_causal]
    cfgs = {m: runpy.run_path(str(ROOT / "configs" / "recall" / f"{m}.py"))["get_config"]() for m in causal}
    ref = cfgs["dense"]
    counts = {m: params(c) for m, c in cfgs.items()}
    for m, c in cfgs.items():
        assert c.model.attention.name == m and c.data.source == "mqar" and c.train.seq_len == 1024
        assert c.data.to_dict() == ref.data.to_dict()
        for k in ("seq_len", "steps", "batch_size", "short_steps", "short_seq_len", "lr", "warmup_steps", "seed"):
            assert c.train[k] == ref.train[k], (m, k)
        assert abs(counts[m] / counts["dense"] - 1) < 0.005, counts


@pytest.mark.slow
def test_train_resume_and_recall_by_distance(tmp_path, capsys):
    """Staged training on generated rows resumes exactly (the interruption is in the short stage),
    then longctx-recall scores the run by distance and the report tabulates it."""
    from longctx.train.loop import train

    cfg = recall_tiny("dense", tmp_path / "cache", steps=6, short_steps=3, ckpt_every=2, eval_every=6, log_every=1)
    train(cfg, tmp_path / "ref", progress=False)
    train(cfg, tmp_path / "run", progress=False, max_steps=2)
    train(cfg, tmp_path / "run", progress=False)
    ref, resumed = train_losses(tmp_path / "ref"), train_losses(tmp_path / "run")
    np.testing.assert_allclose([resumed[s] for s in (3, 4, 5, 6)], [ref[s] for s in (3, 4, 5, 6)], rtol=1e-6)
    assert ref[6] != ref[5]
    valid = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in valid if r["split"] == "valid"]
    assert valid and 0.0 <= valid[-1]["accuracy"] <= 1.0

    assert cli.recall_main(["x", f"--workdir={tmp_path / 'run'}", "--noprogress", "--rows=12", "--bins=3"]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "distance" in out
    assert " (chance 0.0625: 1 of 16 values), answer loss" in out  # recall_tiny's mqar: 16 values
    stem = tmp_path / "run" / "recall" / "mqar_len64_step6"
    assert f"wrote {stem}.json and {stem}_by_distance.png" in out.splitlines()
    res = json.loads((tmp_path / "run" / "recall" / "mqar_len64_step6.json").read_text())
    assert res["status"] == "ok" and res["task"] == "mqar" and res["trained_on"] == "mqar"
    assert res["answers"] == 12 * 4 == sum(b["answers"] for b in res["by_distance"])
    assert len(res["by_distance"]) == 3 and res["by_distance"][0]["lo"] == 1 and res["by_distance"][-1]["hi"] == 64
    assert (tmp_path / "run" / "recall" / "mqar_len64_step6_by_distance.png").stat().st_size > 0

    table = report([str(tmp_path / "run"), str(tmp_path / "ref")], tmp_path / "out", task="mqar", title="t")
    assert table.count("| dense |") == 1 and "no result" in table  # ref was never scored by longctx-recall
    assert (tmp_path / "out" / "recall.png").exists() and (tmp_path / "out" / "recall.md").exists()

    with pytest.raises(SystemExit) as e:
        cli.recall_main(["x", f"--workdir={tmp_path / 'run'}", "--noprogress", "--config.model.d_model=8"])
    assert e.value.code == 2 and "longctx-recall takes" in capsys.readouterr().err


def test_passkey_probe_on_a_text_lm_beyond_its_training_length(tiny_corpus, tmp_path):
    from longctx.train.loop import train

    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1, eval_every=2, ckpt_every=2)
    train(cfg, tmp_path / "lm", progress=False)
    res = recall_run(tmp_path / "lm", length=4 * cfg.train.seq_len, rows=8, bins=4, progress=False)
    assert res["status"] == "ok" and res["task"] == "passkey" and res["trained_on"] is None
    assert res["length"] == 128 and res["protocol"]["state_carried"]
    assert res["tokens_scored"] == 8 * 5 and res["by_distance"][-1]["hi"] > 2 * cfg.train.seq_len
    assert (tmp_path / "lm" / "recall" / "passkey_len128_step2.json").exists()
    # the needle grid: row lengths x depths of the needle, as JSON, a table and a heat map
    from longctx.recall import needle_grid

    grid = needle_grid(tmp_path / "lm", [128, 64], rows=6, bins=3, progress=False)
    assert [g["length"] for g in grid["grid"]] == [64, 128] and all(len(g["cells"]) == 3 for g in grid["grid"])
    cells = grid["grid"][1]["cells"]
    assert cells[0]["depth_lo"] < cells[-1]["depth_lo"] and all(0 <= x["depth_lo"] <= x["depth_hi"] <= 1
                                                                 for x in cells)
    assert grid["chance"] == 10.0 ** -grid["options"]["passkey_len"]
    for x in cells:  # the answer loss of each cell: the run's bin, in bits
        assert x["loss_bits"] is None or 0 < x["loss_bits"] < 20
    assert "Answer loss (bits per answer token)" in (tmp_path / "lm" / "recall" / "needle_grid_passkey_step2.md").read_text()
    for ext in ("json", "md", "png"):
        assert (tmp_path / "lm" / "recall" / f"needle_grid_passkey_step2.{ext}").exists()


def test_a_state_with_static_capacity_is_reported_not_truncated(tiny_corpus, tmp_path, capsys):
    from longctx.train.loop import train

    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1, eval_every=2, ckpt_every=2)
    cfg.model.attention.name = "fma"
    cfg.model.attention.fma = ml_collections.ConfigDict({"m": 8, "p": 2, "max_len": 64})
    cfg.execution.attention.fma.impl = "xla"
    train(cfg, tmp_path / "fma", progress=False)  # rows of 32, levels built for 64 tokens
    res = recall_run(tmp_path / "fma", length=128, rows=4, bins=2, progress=False)
    assert res["status"] == "capacity" and "max_len=64" in res["message"]
    assert "not measured" in capsys.readouterr().out
    ok = recall_run(tmp_path / "fma", length=64, rows=4, bins=2, progress=False)  # 2x training, within its levels
    assert ok["status"] == "ok" and ok["answers"] == 4


@pytest.mark.slow
def test_exact_attention_given_the_answer_in_context_reaches_100_percent(tmp_path):
    """Fused-pair MQAR, rows of 64 tokens, 4 pairs: a 2-layer dense decoder (82k parameters) learns
    it in ~200 steps (about a minute on 2 CPU cores)."""
    from longctx.train.loop import train

    cfg = recall_tiny("dense", tmp_path / "cache", steps=300, batch_size=32, warmup_steps=30, lr=3e-3,
                      eval_every=300, ckpt_every=300, log_every=50)
    cfg.model.d_model, cfg.model.d_ff = 64, 128
    train(cfg, tmp_path / "run", progress=False)
    res = recall_run(tmp_path / "run", rows=64, bins=4, progress=False)
    assert res["answers"] == 256 and res["accuracy"] == 1.0
    assert all(b["accuracy"] == 1.0 for b in res["by_distance"])


def test_a_resume_may_change_the_layer_layout_not_a_hyperparameter():
    """Switching the layer layout or the recomputation is allowed on resume, a hyperparameter is not."""
    from longctx.train.loop import check_resume_config

    cfg = validate(base_config())
    saved = json.loads(cfg.to_json())
    check_resume_config(saved, cfg)
    saved["model"]["scan_layers"] = "on" if cfg.model.scan_layers == "off" else "off"
    saved["model"]["remat"] = True
    check_resume_config(saved, cfg)
    saved["model"]["d_model"] = 2 * cfg.model.d_model
    with pytest.raises(Exception, match="different model config"):
        check_resume_config(saved, cfg)

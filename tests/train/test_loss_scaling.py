"""Loss scaling for float16 compute (``train.loss_scale``): gradients that underflow to zero in float16 without
it are recovered with it; a dynamic scale halves on an overflow (the update skipped, not counted as a non-finite
step) and doubles after ``train.loss_scale_period`` finite updates; the scale lives in the optimizer state, so
a checkpoint keeps it; float32 and bfloat16 runs are left exactly as they were."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from longctx.config import base_config, validate
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.train.loop import train
from longctx.train.step import (
    LossScaleState,
    LossScaling,
    loss_scale_setting,
    loss_scaling,
    make_loss_fn,
    make_train_step,
    scaled_value_and_grad,
    split_model,
    with_loss_scale,
)
from tests.conftest import tiny_config

V = 40


def _cfg(dtype="float16", **train):
    c = base_config()
    c.model.vocab_size = V
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 2, 2, 16, 64
    c.model.dtype = dtype
    c.train.seq_len, c.train.window, c.train.batch_size, c.train.steps, c.train.warmup_steps = 16, 8, 4, 20, 0
    for k, v in train.items():
        c.train[k] = v
    return validate(c)


def _tokens(seed=1, rows=4, length=17):
    return jax.random.randint(jax.random.key(seed), (rows, length), 0, V)


def _leaves(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def test_float16_gradients_underflow_without_the_scale_and_are_recovered_with_it():
    """A loss whose gradients are small (here the mean over about 2**24 tokens' worth: the tiny model's loss
    times 2**-24, exact in binary) underflows to zero in the float16 backward; scaled by 2**24 and unscaled in
    float32 the gradients match the float32 model's (to float16 rounding)."""
    tokens = _tokens()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    tiny = 2.0 ** -24

    def grads(dtype, scale=None):
        graphdef, params, nongrad, rest = split_model(build_model(_cfg(dtype).model, seed=0))
        loss = make_loss_fn(graphdef)

        def small(*a):
            value, aux = loss(*a)
            return value * tiny, aux

        args = (params, nongrad, rest, inputs, targets, None, jax.random.key(0))
        if scale is None:
            (value, _), g = jax.jit(jax.value_and_grad(small, has_aux=True))(*args)
        else:
            (value, _), g = jax.jit(lambda *a: scaled_value_and_grad(small)(*a, scale=jnp.float32(scale)))(*args)
            g = jax.tree.map(lambda x: x.astype(jnp.float32) / scale, g)
        return float(value), _leaves(g)

    loss32, want = grads("float32")
    loss16, plain = grads("float16")
    _, scaled = grads("float16", scale=2.0 ** 24)
    assert np.isfinite(loss16) and abs(loss16 - loss32) < 1e-2 * abs(loss32)
    total = sum(x.size for x in want)
    assert sum(int(np.count_nonzero(x)) for x in want) > 0.9 * total  # float32: gradients everywhere
    assert all(not np.any(x) for x in plain), "float16 without a loss scale: every gradient underflows to 0"
    norm = lambda xs: float(np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in xs)))  # noqa: E731
    diff = [a - b for a, b in zip(scaled, want, strict=True)]
    assert norm(want) > 0 and norm(diff) < 0.05 * norm(want), (norm(diff), norm(want))


def _step(cfg, tx, microbatches=1):
    graphdef, params, nongrad, rest = split_model(build_model(cfg.model, seed=0))
    t = cfg.train
    step = jax.jit(make_train_step(graphdef, tx, seq_len=t.seq_len, window=t.window, skip_nonfinite=True,
                                   microbatches=microbatches))
    return step, params, nongrad, rest, tx.init(params)


def test_an_overflow_skips_the_update_and_halves_the_scale():
    """A scale of 2**100 overflows float16 in the backward: both windows' updates are skipped (parameters and
    moments unchanged), the loss stays finite and the scale halves once per window."""
    cfg = _cfg()
    tx = loss_scaling(optax.adam(1e-2), init=2.0 ** 100, period=2)
    step, params, nongrad, rest, opt = _step(cfg, tx)
    new_params, _, new_opt, m = jax.device_get(step(params, nongrad, rest, opt, _tokens(), jax.random.key(0)))
    assert isinstance(new_opt, LossScaleState)
    np.testing.assert_array_equal(m["loss_scale"], [2.0 ** 100, 2.0 ** 99])
    assert m["loss_scale_overflow"].tolist() == [True, True]
    assert np.all(np.isfinite(m["loss"])) and not np.any(m["grad_finite"])
    assert float(new_opt.scale) == 2.0 ** 98 and int(new_opt.good_steps) == 0
    for a, b in zip(_leaves(new_params), _leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(new_opt.inner), _leaves(opt.inner), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_scale_doubles_after_the_period_of_finite_updates():
    """period=3 over windows of 2 updates per step: finite updates 1, 2, 3 double the scale at the third."""
    cfg = _cfg()
    tx = loss_scaling(optax.adam(1e-2), init=2.0 ** 10, period=3)
    step, params, nongrad, rest, opt = _step(cfg, tx)
    scales = []
    for i in range(3):
        params, nongrad, opt, m = step(params, nongrad, rest, opt, _tokens(seed=i), jax.random.key(i))
        m = jax.device_get(m)
        assert not np.any(m["loss_scale_overflow"]) and np.all(m["grad_finite"])
        scales += m["loss_scale"].tolist()
    assert scales == [2.0 ** 10] * 3 + [2.0 ** 11] * 3
    assert float(opt.scale) == 2.0 ** 12 and int(opt.good_steps) == 0


def test_a_fixed_scale_does_not_move():
    cfg = _cfg(loss_scale="1024")
    tx = with_loss_scale(optax.adam(1e-2), cfg)
    assert isinstance(tx, LossScaling) and not tx.dynamic
    step, params, nongrad, rest, opt = _step(cfg, tx)
    _, _, opt, m = jax.device_get(step(params, nongrad, rest, opt, _tokens(), jax.random.key(0)))
    assert m["loss_scale"].tolist() == [1024.0, 1024.0] and float(opt.scale) == 1024.0
    assert not np.any(m["loss_scale_overflow"])


def test_accumulated_scaled_update_equals_the_whole_batch_update():
    cfg = _cfg("float32")
    out = []
    for k in (1, 2):
        tx = loss_scaling(optax.sgd(0.5), init=2.0 ** 15, period=1000)
        step, params, nongrad, rest, opt = _step(cfg, tx, microbatches=k)
        out.append(jax.device_get(step(params, nongrad, rest, opt, _tokens(), jax.random.key(0))))
    for a, b in zip(_leaves(out[0][0]), _leaves(out[1][0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[0][3]["loss"], out[1][3]["loss"], rtol=1e-6)


def test_the_setting_and_bf16_fp32_runs_unchanged():
    """'auto' scales float16 only: float32 and bfloat16 get the optimizer itself (the step then runs exactly
    the code it ran before loss scaling existed, with the same metrics)."""
    tx = optax.adam(1e-3)
    for dtype in ("float32", "bfloat16", "auto"):
        assert loss_scale_setting(_cfg(dtype)) == ("none", None)
        assert with_loss_scale(tx, _cfg(dtype)) is tx
    assert loss_scale_setting(_cfg()) == ("dynamic", 2.0 ** 15)
    assert loss_scale_setting(_cfg(loss_scale="none")) == ("none", None)
    assert loss_scale_setting(_cfg("bfloat16", loss_scale="dynamic", loss_scale_init=256.0)) == ("dynamic", 256.0)
    assert with_loss_scale(tx, _cfg(loss_scale_period=7)).period == 7
    cfg = _cfg("bfloat16")
    step, params, nongrad, rest, opt = _step(cfg, tx)
    _, _, _, m = step(params, nongrad, rest, opt, _tokens(), jax.random.key(0))
    assert "loss_scale" not in m and "loss_scale_overflow" not in m


@pytest.mark.parametrize("key,value,match", [
    ("loss_scale", "sometimes", r"train.loss_scale='sometimes' is not allowed"),
    ("loss_scale", "-2", r"train.loss_scale='-2' is not allowed"),
    ("loss_scale_init", 0.5, r"train.loss_scale_init=0.5 must be a finite number >= 1"),
    ("loss_scale_period", 0, r"train.loss_scale_period=0 must be a positive integer"),
])
def test_bad_settings_are_refused(key, value, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**{key: value})


def _records(workdir):
    recs = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "train"]


def _fp16_run(tiny_corpus, tmp_path, **train_kw):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", **train_kw)
    cfg.model.dtype = "float16"
    return cfg


@pytest.mark.slow
def test_a_float16_run_trains_with_a_dynamic_scale(tiny_corpus, tmp_path):
    cfg = _fp16_run(tiny_corpus, tmp_path, steps=8, warmup_steps=1, eval_every=100, ckpt_every=100)
    out = train(cfg, tmp_path / "w", progress=False)
    recs = _records(tmp_path / "w")
    assert [r["loss_scale"] for r in recs] == [2.0 ** 15] * 8
    assert all(np.isfinite(r["loss"]) for r in recs) and recs[-1]["loss"] < recs[0]["loss"]
    assert out["skipped_updates"] == 0


@pytest.mark.slow
def test_overflows_do_not_stop_the_run_and_the_scale_survives_a_resume(tiny_corpus, tmp_path, capsys):
    """Every update overflows at a scale of 2**100: with train.on_nonfinite='stop' the run goes on (an overflow
    is not a non-finite step), and the run stopped after 4 steps resumes with the halved scale, not the
    initial one."""
    cfg = _fp16_run(tiny_corpus, tmp_path, steps=8, warmup_steps=1, eval_every=100, ckpt_every=100,
                    loss_scale_init=2.0 ** 100, max_skipped_in_row=2)
    wd = tmp_path / "w"
    assert train(cfg, wd, progress=False, max_steps=4)["step"] == 4
    assert "resuming" not in capsys.readouterr().out
    out = train(cfg, wd, progress=False)
    assert f"(loss scale {2.0 ** 96:g})" in capsys.readouterr().out
    recs = _records(wd)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["loss_scale"] for r in recs] == [2.0 ** (100 - i) for i in range(8)]
    assert all(r["loss_scale_overflows"] == 1 for r in recs)
    assert out["skipped_updates"] == 0


def test_a_run_resumes_only_with_loss_scaling_as_it_was_trained():
    from longctx.train.loop import check_resume_loss_scale

    fp16, off = _cfg(), _cfg(loss_scale="none")
    check_resume_loss_scale(json.loads(fp16.to_json()), _cfg(loss_scale="1024"))
    check_resume_loss_scale(json.loads(_cfg("float32").to_json()), off)
    with pytest.raises(ConfigError, match=r"trained with loss scaling .*train.loss_scale=dynamic"):
        check_resume_loss_scale(json.loads(fp16.to_json()), off)
    with pytest.raises(ConfigError, match=r"trained without loss scaling .*train.loss_scale=none"):
        check_resume_loss_scale(json.loads(_cfg("float32").to_json()), fp16)

"""Regression tests of the training loop: config validated once, periodic actions with
windows, the model's aux metrics logged, the trainer's imports."""

import json
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from longctx import cli
from longctx import config as config_lib
from longctx.errors import NonFiniteError
from longctx.train.loop import crossed, train
from tests.conftest import tiny_config


def write_cfg(path: Path, cfg) -> Path:
    path.write_text("import ml_collections\n"
                    f"def get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n")
    return path


def records(workdir, split):
    recs = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == split]


def test_config_is_validated_once_on_the_way_into_training(tiny_corpus, tmp_path, monkeypatch):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1)
    calls = {"validate": 0, "check_against_base": 0}
    for name in calls:
        real = getattr(config_lib, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += not k.get("prefix")  # check_against_base recurses with a prefix
            return _real(*a, **k)

        monkeypatch.setattr(config_lib, name, counted)
    assert cli.train_main(["longctx-train", f"--config={write_cfg(tmp_path / 'c.py', cfg)}",
                           f"--workdir={tmp_path / 'w'}", "--noprogress"]) == 0
    assert calls == {"validate": 1, "check_against_base": 1}


def test_crossed():
    assert crossed(2, 4, 3) and crossed(4, 6, 3) and not crossed(6, 8, 3) and crossed(8, 10, 3)
    assert crossed(0, 1, 1) and not crossed(1, 1, 1)


def test_periodic_actions_fire_when_a_multiple_is_crossed(tiny_corpus, tmp_path):
    """seq_len/window = 2: the step goes 2, 4, 6, 8; "every 3" must fire at 4 (crossing 3), 6 and 8."""
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, window=16, log_every=3, eval_every=3, ckpt_every=3,
                      keep_checkpoints=10)
    wd = tmp_path / "w"
    train(cfg, wd, progress=False)
    assert [r["step"] for r in records(wd, "train")] == [4, 6, 8]
    assert [r["step"] for r in records(wd, "valid")] == [4, 6, 8]
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6, 8]


def test_model_aux_metrics_are_logged(tiny_corpus, tmp_path):
    """Metrics a core reports with Aux.add_metric (and aux losses) reach metrics.jsonl."""
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1, eval_every=100)
    cfg.model.block, cfg.model.positions, cfg.model.norm = "gau", "none", "rmsnorm"
    cfg.model.num_heads = 1
    cfg.model.attention.name = "transformer_vq"
    cfg.model.attention.transformer_vq = ml_collections.ConfigDict({"codebook_size": 8, "block_len": 8})
    wd = tmp_path / "w"
    train(cfg, wd, progress=False)
    rec = records(wd, "train")[-1]
    per_layer = [k for k in rec if k.endswith("/vq_rel_err")]
    assert sorted(per_layer) == ["layer0/vq_rel_err", "layer1/vq_rel_err"], rec
    assert "aux/commit" in rec


def test_trainer_imports_no_entry_point_or_eval_module():
    """Neither at import time nor inside a function (the periodic validation used to import them lazily)."""
    import ast

    banned = {"longctx.cli", "longctx.evaluate", "longctx.sample", "longctx.runtime", "longctx.data.prepare_cli"}
    found = []
    for path in (Path(__file__).resolve().parents[2] / "longctx" / "train").glob("*.py"):
        if path.name == "launch_local.py":  # an entry point itself (scripts/multiprocess_local.sh): runs the CLI
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.name}: {n}" for n in names if n in banned]
    assert not found
    code = ("import sys, longctx.train.loop, longctx.train.checkpoint;"
            "print(sorted(m for m in sys.modules if m in %r))" % sorted(banned))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _poison(monkeypatch, bad_calls):
    """Make the train step's calls numbered in ``bad_calls`` (1 = the first step) behave like a step
    whose every update was non-finite: the state is returned unchanged (the skipped update) and the
    metrics flag it."""
    import jax.numpy as jnp

    from longctx.train import sharding

    real = sharding.Plan.jit_step

    def jit_step(self, fn, **kw):
        f = real(self, fn, **kw)
        calls = [0]

        def step(params, nongrad, rest, opt_state, tokens, key):
            calls[0] += 1
            if calls[0] not in bad_calls:
                return f(params, nongrad, rest, opt_state, tokens, key)
            nan, no = jnp.full((1,), jnp.nan), jnp.zeros((1,), bool)
            return params, nongrad, opt_state, {"loss": nan, "ce": nan, "grad_norm": nan, "loss_finite": no,
                                                "grad_finite": no}

        return step

    monkeypatch.setattr(sharding.Plan, "jit_step", jit_step)


def _ckpt_steps(wd):
    d = Path(wd) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _params(wd):
    import jax

    from longctx.runtime import Runner

    runner = Runner.from_workdir(wd)
    return runner.step, [np.asarray(x) for x in jax.tree.leaves(runner.params[:2])]


def test_nonfinite_check_one_step_late_names_the_step_and_never_checkpoints_past_it(tiny_corpus, tmp_path,
                                                                                       monkeypatch):
    """The loop checks a step's values after dispatching the next one. A non-finite step 4 stops the run
    naming step 4; no checkpoint of a later state is written; the last finite state (step 3, left
    unchanged by the skipped update) is saved only when it is still exact: when the step dispatched
    after the bad one skipped its update too, or when the check ran before a checkpoint at step 4."""
    base = dict(steps=8, log_every=100, eval_every=100, ckpt_every=100, keep_checkpoints=10)
    ref = tmp_path / "ref"
    train(tiny_config(tiny_corpus, tmp_path / "cache", **base), ref, progress=False, max_steps=3)
    step_ref, params_ref = _params(ref)
    assert step_ref == 3

    cases = [
        ("later_finite", {4}, 100, []),  # step 5 moved the state: nothing is exact, nothing saved
        ("later_nonfinite", set(range(4, 9)), 100, [3]),  # step 5 skipped too: the state is step 3's
        ("checkpoint_at_the_bad_step", {4}, 4, [3]),  # checked before the save at step 4
    ]
    for name, bad, ckpt_every, saved in cases:
        with monkeypatch.context() as m:
            _poison(m, bad)
            wd = tmp_path / name
            cfg = tiny_config(tiny_corpus, tmp_path / "cache", **{**base, "ckpt_every": ckpt_every})
            with pytest.raises(NonFiniteError, match=r"non-finite values at step 4:"):
                train(cfg, wd, progress=False)
        assert _ckpt_steps(wd) == saved, name
        if saved:
            step, params = _params(wd)
            assert step == 3
            for a, b in zip(params, params_ref, strict=True):
                np.testing.assert_array_equal(a, b)
        assert all(r["step"] <= 3 for r in records(wd, "train")), name


def test_compilation_cache_dir(tmp_path, monkeypatch):
    """'' -> <data cache dir>/jax_compile (or the environment's folder), a path as given, 'none' -> off."""
    import jax

    from longctx.train.loop import setup_compilation_cache

    was_dir, was_on = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    try:
        tc = ml_collections.ConfigDict({"compilation_cache_dir": ""})
        data = ml_collections.ConfigDict({"cache_dir": str(tmp_path / "data")})
        jax.config.update("jax_compilation_cache_dir", None)
        assert setup_compilation_cache(tc, data) == str(tmp_path / "data" / "jax_compile")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "data" / "jax_compile")
        assert (tmp_path / "data" / "jax_compile").is_dir()
        assert setup_compilation_cache(tc, data) == str(tmp_path / "data" / "jax_compile")  # now set: kept
        tc.compilation_cache_dir = str(tmp_path / "jc")
        assert setup_compilation_cache(tc, data) == str(tmp_path / "jc")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jc")
        tc.compilation_cache_dir = "none"
        assert setup_compilation_cache(tc, data) is None
        assert jax.config.jax_enable_compilation_cache is False
    finally:
        jax.config.update("jax_compilation_cache_dir", was_dir)
        jax.config.update("jax_enable_compilation_cache", was_on)


@pytest.mark.slow
def test_a_restarted_run_loads_its_compiled_step_from_the_cache(tiny_corpus, tmp_path):
    """Two processes training the same config: the first fills train.compilation_cache_dir, the
    second's compiles are cache hits (JAX's monitoring events)."""
    import os

    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1, eval_every=100, ckpt_every=100)
    cfg.train.compilation_cache_dir = str(tmp_path / "jc")
    cfg_file = write_cfg(tmp_path / "c.py", cfg)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    code = ("import jax.monitoring as m, sys\n"
            "hits = []\n"
            "m.register_event_listener(lambda e, **k: hits.append(e) if e.endswith('/cache_hits') else None)\n"
            "from longctx.cli import train_main\n"
            "rc = train_main(['longctx-train', '--config=%s', '--workdir=' + sys.argv[1], '--noprogress'])\n"
            "print('cache hits:', len(hits))\n" % cfg_file)
    hits = []
    for run in ("a", "b"):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / run)], capture_output=True, text=True,
                             timeout=600, env=env, cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0, out.stderr[-3000:]
        hits.append(int(out.stdout.rsplit("cache hits:", 1)[1]))
        if run == "a":
            assert any((tmp_path / "jc").iterdir())
    assert hits[1] > max(hits[0], 0) + 5, hits  # the first run may hit a program it compiled twice


def test_a_metrics_line_that_is_json_but_not_a_record_is_dropped_with_a_warning(tmp_path):
    from longctx.train import metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 1.0}\n[1,2]\n"text"\n{"step": "x", "split": "train"}\n'
                    '{"step": 2, "split": "train", "loss": 0.5}\n{"step": 3, "split": "train", "loss": 0.2}\n')
    said = []
    w = metrics.MetricsWriter(tmp_path, resume_step=2, tensorboard=False, warn=said.append)
    w.close()
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2]
    assert len(said) == 1 and "dropped 3 line(s)" in said[0] and said[0].startswith("warning:")


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    """Each run segment writes a new event file opening with a session start at the resumed step + 1:
    TensorBoard drops the earlier segment's points from there (read back as TensorBoard would)."""
    from longctx.train import metrics

    w = metrics.MetricsWriter(tmp_path)
    for s in range(1, 11):
        w.write(s, "train", {"loss": 1.0 / s, "bad": float("nan")})
    w.close()
    w = metrics.MetricsWriter(tmp_path, resume_step=6)
    for s in range(7, 9):
        w.write(s, "train", {"loss": 2.0})
    w.write(8, "valid", {"loss": 3.0})
    w.close()
    tb = metrics.read_tensorboard(tmp_path / "tb")
    assert sorted(tb) == ["train/loss", "valid/loss"]
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 9))
    np.testing.assert_allclose([v for _, v in tb["train/loss"]], [1.0 / s for s in range(1, 7)] + [2.0, 2.0],
                               rtol=1e-6)
    assert tb["valid/loss"] == [(8, 3.0)]
    # a record cut short by a kill ends that file's points; the next segment reads on
    files = sorted((tmp_path / "tb").iterdir())
    files[-1].write_bytes(files[-1].read_bytes()[:-7])
    assert [s for s, _ in metrics.read_tensorboard(tmp_path / "tb")["train/loss"]] == list(range(1, 9))

"""The execution section: each method's EXECUTION_KEYS live under ``execution.attention.<method>``, apart from its
hyperparameters (``model.attention.<method>``); a config written the old way (those keys among the
hyperparameters) is moved: silently when saved in a checkpoint, with a one-time note when validated."""

from __future__ import annotations

import json

import ml_collections
import pytest
from flax import nnx

from longctx import attention
from longctx import config as config_lib
from longctx.errors import ConfigError


def test_the_base_config_splits_every_method():
    c = config_lib.base_config()
    for name in attention.names():
        keys = attention.execution_keys(name)
        assert set(c.execution.attention[name].keys()) == set(keys), name
        assert not set(keys) & set(c.model.attention[name].keys()), name
        merged = dict(c.model.attention[name].to_dict(), **c.execution.attention[name].to_dict())
        assert merged == attention.default_config(name).to_dict(), name


def test_execution_settings_reach_the_core_and_stay_out_of_the_model_section():
    from longctx.models.decoder import build_model

    c = config_lib.base_config()
    c.model.update(dict(d_model=16, num_layers=1, num_heads=2, head_dim=8, d_ff=32, vocab_size=256))
    c.model.attention.name = "eva"
    c.model.attention.eva.update(dict(window_size=8, chunk_size=4))
    c.execution.attention.eva.impl = "xla,pallas"  # an ordered list, as a comma string
    c.execution.attention.eva.keep_budget = 0
    v = config_lib.validate(c)
    assert "impl" not in v.model.attention.eva and v.execution.attention.eva.impl == "xla,pallas"
    assert list(v.execution.attention.keys()) == ["eva"]
    def cores(model):
        return [m for _, m in nnx.iter_graph(model) if isinstance(m, attention.AttentionCore)]

    built = cores(build_model(v.model, seed=0, execution=v.execution))
    assert built and all(m.cfg.impl == "xla,pallas" and m.cfg.keep_budget == 0 for m in built)
    assert all(m.cfg.impl == "xla,pallas" for m in cores(build_model(v, seed=0)))  # the whole config
    assert all(m.cfg.impl == "auto" for m in cores(build_model(v.model, seed=0)))  # the method's default


def test_an_old_layout_key_is_moved_with_one_note(capsys):
    config_lib._moved_noted.clear()
    for _ in range(2):
        c = config_lib.base_config()
        c.model.attention.dense.impl = "naive"
        v = config_lib.validate(c)
        assert v.execution.attention.dense.impl == "naive" and "impl" not in v.model.attention.dense
    err = capsys.readouterr().err
    assert err.count("model.attention.dense.impl is an execution setting") == 1
    assert "execution.attention.dense.impl" in err


def test_a_hyperparameter_under_execution_is_refused_naming_its_place():
    c = config_lib.base_config()
    c.execution.attention.dense.kv_window = True
    with pytest.raises(ConfigError, match="model.attention.dense.kv_window"):
        config_lib.validate(c)
    c = config_lib.base_config()
    c.execution.attention.dense.impl = "triton"
    with pytest.raises(ConfigError, match="impl"):
        config_lib.validate(c)


def old_layout(cfg: ml_collections.ConfigDict) -> dict:
    """``cfg`` (validated) as the code before the execution section saved it: the execution keys among the
    method's hyperparameters and no execution section."""
    d = json.loads(cfg.to_json())
    execution = d.pop("execution")
    for name, keys in execution["attention"].items():
        d["model"]["attention"][name].update(keys)
    return d


def test_a_checkpoint_saved_with_the_old_layout_evaluates_to_the_same_bits(tiny_cfg, tmp_path):
    """One trained state saved twice, with the old layout and with the new one: both restore (the old one's
    execution keys moved) and evaluate to identical bits per byte."""
    from longctx import runtime
    from longctx.data.prepare import prepare
    from longctx.evaluate import evaluate_split
    from longctx.models.decoder import build_model
    from longctx.train import checkpoint
    from longctx.train.step import split_model

    c = ml_collections.ConfigDict(tiny_cfg.to_dict())
    c.execution.attention.dense.update(dict(impl="blockwise", block_q=8, block_k=8))
    cfg = config_lib.resolve_vocab(config_lib.validate(c), 256)
    _, params, nongrad, _ = split_model(build_model(cfg.model, seed=3, execution=cfg.execution))
    old = old_layout(cfg)
    assert "impl" in old["model"]["attention"]["dense"] and "execution" not in old
    results = {}
    for label, saved in (("new", cfg), ("old", ml_collections.ConfigDict(old))):
        wd = tmp_path / label
        mngr = checkpoint.manager(wd, async_save=False)
        checkpoint.save(mngr, 4, {"params": params, "nongrad": nongrad}, config=saved)
        checkpoint.wait(mngr)
        mngr.close()
        runner = runtime.Runner.from_workdir(wd)
        assert runner.cfg.execution.attention.dense.to_dict() == dict(impl="blockwise", block_q=8, block_k=8,
                                                                      auto_threshold=4096 * 4096)
        assert "impl" not in runner.cfg.model.attention.dense
        _, data, _ = prepare(runner.cfg.data, ["valid"], progress=False)
        results[label], _ = evaluate_split(runner, data["valid"], runner.cfg.eval, progress=False)
    assert results["old"]["bits_per_byte"] == results["new"]["bits_per_byte"]
    assert results["old"]["tokens_scored"] == results["new"]["tokens_scored"] > 0

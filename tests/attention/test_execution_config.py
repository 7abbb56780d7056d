"""The execution section: each method's EXECUTION_KEYS live under ``execution.attention.<method>``, apart from its
hyperparameters (``model.attention.<method>``); a config written the old way (those keys among the
hyperparameters) is moved: silently when saved in a checkpoint, with a one-time note when validated."""

from __future__ import annotations

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
    c.execution.attention.eva.keep_budget = 12345  # a written value (0 would be the platform's default)
    v = config_lib.validate(c)
    assert "impl" not in v.model.attention.eva and v.execution.attention.eva.impl == "xla,pallas"
    assert list(v.execution.attention.keys()) == ["eva"]
    def cores(model):
        return [m for _, m in nnx.iter_graph(model) if isinstance(m, attention.AttentionCore)]

    built = cores(build_model(v.model, seed=0, execution=v.execution))
    assert built and all(m.cfg.impl == "xla,pallas" and m.cfg.keep_budget == 12345 for m in built)
    assert all(m.cfg.impl == "xla,pallas" for m in cores(build_model(v, seed=0)))  # the whole config
    assert all(m.cfg.impl == "auto" for m in cores(build_model(v.model, seed=0)))  # the method's default


def test_an_execution_key_among_the_hyperparameters_is_refused_naming_its_place():
    c = config_lib.base_config()
    c.model.attention.dense.impl = "reference"
    with pytest.raises(ConfigError, match="is an execution setting: set execution.attention.dense.impl"):
        config_lib.validate(c)


def test_a_hyperparameter_under_execution_is_refused_naming_its_place():
    c = config_lib.base_config()
    c.execution.attention.dense.kv_window = True
    with pytest.raises(ConfigError, match="model.attention.dense.kv_window"):
        config_lib.validate(c)
    c = config_lib.base_config()
    c.execution.attention.dense.impl = "triton"
    with pytest.raises(ConfigError, match="impl"):
        config_lib.validate(c)



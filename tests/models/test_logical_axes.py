"""Every parameter and non-gradient variable of every block type, with every registered
attention method, and of the model around them names its logical axes (DESIGN §5): the
sharding rules map these names to a mesh without touching method files."""

import pytest
from flax import nnx

from longctx import attention
from longctx.attention.base import LOGICAL_AXES
from longctx.config import base_config
from longctx.errors import ConfigError
from longctx.models.blocks import block_names
from longctx.models.decoder import build_model


def _model_cfg(block, method, output="tied"):
    c = base_config().model
    c.vocab_size = 64
    c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 16, 1, 2, 8, 32
    c.block = block
    c.positions = "none"
    c.output = output
    c.attention.name = method
    case = next(iter(attention.get_class(method).contract_cases().values()))
    c.attention[method] = dict(case.cfg)
    if output == "adaptive":
        c.adaptive_cutoffs = (16, 32)
    return c


def _unnamed(model):
    bad = []
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata().get("out_sharding")
            if names is None or len(names) != var[...].ndim or any(n is not None and n not in LOGICAL_AXES
                                                                    for n in names):
                bad.append(("/".join(map(str, path)), names, var[...].shape))
    return bad


@pytest.mark.parametrize("block", block_names())
@pytest.mark.parametrize("method", attention.names())
def test_every_variable_has_logical_axes(block, method):
    try:
        model = build_model(_model_cfg(block, method), seed=0)
    except ConfigError as e:
        pytest.skip(f"{block} + {method}: {e}")
    assert _unnamed(model) == []


@pytest.mark.parametrize("output", ["untied", "adaptive"])
def test_output_heads_have_logical_axes(output):
    c = _model_cfg("transformer", "dense", output)
    model = build_model(c, seed=0)
    assert _unnamed(model) == []


def test_the_check_has_teeth():
    model = build_model(_model_cfg("transformer", "dense"), seed=0)
    model.extra = nnx.Param(model.norm.scale[...])  # no names
    assert [p for p, _, _ in _unnamed(model)] == ["extra"]

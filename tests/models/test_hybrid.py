"""Hybrid stacks (``model.attention.pattern``: each layer its own attention method).

The model-level contract (streamed in uneven chunks == token-by-token == full, no future leak) for a
2-layer (method, dense) hybrid of every causal method that can be one layer (it runs on bare q, k, v, or its stack
wrapper declares ``per_layer``), reusing tests/models/test_model_contract.py's harness and laws; the pattern's
config errors; a pattern-less config builds the same parameters as before the key existed. No method name is
special-cased in the contract cases: each method brings its first fast causal contract case (core-level, or
model-level for a method whose core runs only inside its stack wrapper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.config import base_config, validate
from longctx.errors import ConfigError
from longctx.models.backbone import stack_wrapper_class
from longctx.models.blocks import takes_rotary
from longctx.models.decoder import build_model
from tests.models import test_model_contract as contract

# one worker: the cached harnesses below (built models, compiled forwards) are shared between tests
pytestmark = pytest.mark.xdist_group("hybrid")

EXACT = "dense"
POSITIONS = ("rotary", "sinusoidal", "learned", "none")  # the first one every method of the pattern allows


def _hybrid_cases():
    out = []
    for name in attention.names():
        cls = attention.get_class(name)
        wrapper = stack_wrapper_class(name, True) if cls.supports_causal else None
        if name == EXACT or not cls.supports_causal or (wrapper is not None and not getattr(wrapper, "per_layer",
                                                                                               False)):
            continue
        level = "core" if wrapper is None else "model"
        for cname, case in cls.contract_cases().items():
            if case.level == level and not case.slow and "causal" in case.directions:
                out.append(pytest.param(name, cname, id=f"{name}-{EXACT}"))
                break
    return out


HYBRID = _hybrid_cases()
# the model-contract laws in a hybrid stack: two state kinds by default (eva's chunk summaries, transformer_vq's
# compressive cache), every method with -m slow (each method's own stack is in the model contract's default run)
HYBRID_LAWS = [c if c.values[0] in ("eva", "transformer_vq") else pytest.param(*c.values, id=c.id,
                                                                                marks=pytest.mark.slow)
               for c in HYBRID]


def _positions(methods) -> str:
    if any(takes_rotary(n) for n in methods):  # rotary per layer: the others run unrotated
        return "rotary"
    for pos in POSITIONS:
        if all(attention.get_class(n).allowed_positions is None or pos in attention.get_class(n).allowed_positions
               for n in methods):
            return pos
    raise AssertionError(f"no position scheme fits {methods}")


class HybridHarness(contract.ModelHarness):
    """A 2-layer decoder whose first layer runs ``name`` (its contract case's settings) and second the exact
    method; the rest of :class:`contract.ModelHarness` as it is."""

    def __init__(self, name, cname):
        self.cls = attention.get_class(name)
        self.case = self.cls.contract_cases()[cname]
        self.causal = True
        c = base_config().model
        c.vocab_size = contract.V
        c.d_model, c.num_layers, c.d_ff = 16, 2, 32
        c.num_heads, c.head_dim = self.case.num_heads, self.case.head_dim
        c.positions = _positions((name, EXACT))
        c.max_len = 128
        c.attention.name = name
        c.attention.pattern = (name, EXACT)
        c.attention[name] = dict(self.case.cfg)
        self.model = build_model(c, seed=0)
        self.graphdef, self.params, self.rest = nnx.split(self.model, nnx.Param, ...)
        self.T = self.case.length
        self.fwd = jax.jit(self._raw, static_argnames=("deterministic",))


@functools.cache
def hybrid(name, cname) -> HybridHarness:
    return HybridHarness(name, cname)


@pytest.fixture
def as_hybrid(monkeypatch):
    """The contract suite's laws, run on the hybrid harness."""
    monkeypatch.setattr(contract, "harness", lambda name, cname, direction: hybrid(name, cname))


def test_every_causal_method_has_a_hybrid_case():
    assert len(HYBRID) >= 5


@pytest.mark.parametrize("name,cname", HYBRID)
def test_hybrid_layers_run_their_own_methods(name, cname):
    h = hybrid(name, cname)
    cores = [type(b.core) for b in h.model.blocks]
    assert cores == [attention.get_class(name), attention.get_class(EXACT)]


@pytest.mark.parametrize("name,cname", HYBRID_LAWS)
def test_hybrid_streamed_and_decoded_equal_full(as_hybrid, name, cname):
    contract.test_model_streamed_and_decoded_equal_full(name, cname, "causal")


@pytest.mark.parametrize("name,cname", HYBRID_LAWS)
def test_hybrid_no_future_leak(as_hybrid, name, cname):
    contract.test_model_no_future_leak(name, cname, "causal")


# --- config -----------------------------------------------------------------------------------------------


def _cfg(pattern, name="eva", **model):
    c = base_config()
    c.train.steps = 10
    c.model.num_layers = 4
    c.model.attention.name = name
    c.model.attention.pattern = pattern
    for k, v in model.items():
        c.model[k] = v
    return c


def test_pattern_repeats_to_the_depth_and_keeps_each_methods_settings():
    c = _cfg(("eva", "dense"))
    c.model.attention.eva.window_size = 16
    c.execution.attention.dense.block_q = 256
    v = validate(c)
    assert set(v.model.attention.keys()) == {"name", "pattern", "eva", "dense"}
    assert set(v.execution.attention.keys()) == {"eva", "dense"}
    assert v.model.attention.eva.window_size == 16 and v.execution.attention.dense.block_q == 256
    v = ml_tiny(v)
    model = build_model(v)
    assert [b.core.name for b in model.blocks] == ["eva", "dense", "eva", "dense"]
    assert model.blocks[0].core.cfg.window_size == 16
    assert model.blocks[1].core.cfg.block_q == 256  # execution settings reach the pattern's other methods too


def ml_tiny(v):
    import ml_collections

    c = ml_collections.ConfigDict(v.to_dict())
    c.model.vocab_size, c.model.d_model, c.model.d_ff, c.model.num_heads, c.model.head_dim = 64, 16, 32, 2, 8
    return c


@pytest.mark.parametrize("pattern,extra,match", [
    (("eva", "vcc"), {"kind": "encoder"}, "stack wrapper"),
    (("eva", "dense"), {"scan_layers": "on"}, "not supported yet"),
    (("eva", "nonesuch"), {}, "unknown method 'nonesuch'"),
    (("eva", "dense", "dense"), {}, "neither equals nor divides"),
    (("dense", "dense"), {}, "not in model.attention.pattern"),
    (("eva", 3), {}, "must be a tuple of method names"),
])
def test_pattern_config_errors(pattern, extra, match):
    c = _cfg(pattern, **extra)
    with pytest.raises(ConfigError, match=match) as err:
        validate(c)
    assert "\n" not in str(err.value)


ROTARY_FREE = [n for n in attention.names() if not takes_rotary(n)]  # methods with their own position signal


@pytest.mark.parametrize("name", ROTARY_FREE)
def test_rotary_applies_per_layer_and_a_model_with_no_rotated_layer_is_refused(name):
    """model.positions='rotary' with a pattern: the layers whose method takes rotary rotate q and k, the others
    run unrotated; the same method alone (or a pattern of only such methods) is refused in one line."""
    v = validate(_cfg((name, EXACT), name=name))
    assert v.model.positions == "rotary"
    model = build_model(ml_tiny(v).model)
    assert [b.rotary for b in model.blocks] == [False, True, False, True]
    x = jax.random.normal(jax.random.key(0), (1, 8, 16))
    p0, p1 = jnp.arange(8, dtype=jnp.int32), jnp.arange(8, dtype=jnp.int32) + 5
    for block, rotated in zip(model.blocks, (False, True)):  # the layer's q, k depend on positions iff rotated
        q0, k0, _ = block.project(x, p0)
        q1, k1, _ = block.project(x, p1)
        assert (not np.allclose(q0, q1)) == rotated and (not np.allclose(k0, k1)) == rotated
    for pattern in ((), (name,)):
        with pytest.raises(ConfigError, match=f"not supported with attention {name!r}") as err:
            validate(_cfg(pattern, name=name))
        assert "\n" not in str(err.value)


def test_recall_hybrids_validate_with_the_recipe_positions():
    """Every configs/recall/hybrid_<method>.py validates; its exact layer runs the dense recall run's positions
    (rotary: additive sinusoids left a 2-layer model of the recipe at chance)."""
    import importlib
    import pathlib

    dense = validate(importlib.import_module("configs.recall.dense").get_config())
    files = sorted(pathlib.Path(__file__).resolve().parents[2].glob("configs/recall/hybrid_*.py"))
    assert files
    for f in files:
        v = validate(importlib.import_module(f"configs.recall.{f.stem}").get_config())
        assert v.model.positions == dense.model.positions == "rotary", f.stem
        methods = v.model.attention.pattern
        assert methods[0] == EXACT and len(methods) == v.model.num_layers, f.stem
        assert takes_rotary(methods[0]), f.stem


def test_pattern_refuses_sequence_parallelism_for_now():
    c = _cfg(("eva", "dense"))
    c.mesh.sequence = 2
    with pytest.raises(ConfigError, match="mesh.sequence=2 with a pattern"):
        validate(c)
    c.model.attention.pattern = ("eva",)  # one method everywhere: as without a pattern
    validate(c)


def test_uniform_pattern_scans_and_wrapper_method_alone_still_validates():
    assert validate(_cfg(("eva",), scan_layers="on")).model.scan_layers == "on"
    validate(_cfg((), name="vcc"))


def test_backbone_refuses_what_validate_refuses():
    c = ml_tiny(_cfg(("eva", "dense"), scan_layers="on")).model
    with pytest.raises(ConfigError, match="not supported yet"):
        build_model(c)


def _tree(model):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


@pytest.mark.parametrize("scan", ["off", "on"])
def test_pattern_less_config_builds_the_same_parameters(scan):
    c = ml_tiny(_cfg((), scan_layers=scan)).model
    ref = _tree(build_model(c))
    for pattern in (("eva",), ("eva",) * 4):
        c.attention.pattern = pattern
        got = _tree(build_model(c))
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_hybrid_remat_and_non_gradient_state_per_layer():
    """remat per block gives the same gradients; a layer's non-gradient state (VQ codebooks) updates its own layer."""
    c = ml_tiny(_cfg(("transformer_vq", "dense"), name="transformer_vq", positions="sinusoidal")).model
    c.attention.transformer_vq = {"codebook_size": 16, "block_len": 8}
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 63)
    grads, stats = [], []
    for remat in (False, True):
        c.remat = remat
        model = build_model(c)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p, graphdef=graphdef, rest=rest):
            logits, _, aux = nnx.merge(graphdef, p, rest)(tokens, None, deterministic=False, key=jax.random.key(1))
            return jnp.mean(jax.nn.logsumexp(logits, -1)) + sum(aux["losses"].values()), aux["stats"]

        g, st = jax.jit(jax.grad(loss, has_aux=True))(params)  # the training pass's statistics come with it
        grads.append(g)
        stats.append(st)
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(stats[0]), jax.tree.leaves(stats[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    assert len(stats[1]) == 4
    before = _tree(model)
    model.apply_stats(stats[1])
    after = _tree(model)
    changed = {k.split("]")[1].lstrip("[") for k in before if not np.array_equal(before[k], after[k])}
    assert changed == {"0", "2"}, changed  # the transformer_vq layers' codebooks; the dense layers have none

"""Layers under scan (``model.scan_layers``): the stacked layout computes what the unrolled one does.

A scanned model is built from the same blocks as an unrolled one of the same seed and then stacked, so the
two start equal; every check compares them: loss, parameter gradients (training mode: dropout, per-layer
keys, aux losses), non-gradient updates, carried-state decoding, the ``layers`` logical axis, and the
conversion of trees and checkpoints between the layouts (:func:`longctx.models.backbone.relayout`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.config import base_config
from longctx.errors import ConfigError
from longctx.models.backbone import layer_layout, relayout
from longctx.models.decoder import build_model
from longctx.train import sharding

# one worker: the cached model pairs and reference gradients below are shared between tests
pytestmark = pytest.mark.xdist_group("scan_layers")

B, V = 2, 64
# (method, block): every method whose blocks the backbone runs itself; transformer_vq with the paper's GAU blocks
METHODS = [("dense", "transformer"), ("transformer_vq", "gau"), ("eva", "transformer"), ("fma", "transformer"),
           ("fma_linear", "transformer"), ("kdeformer", "transformer")]
FAST = ("dense", "transformer_vq")


def model_cfg(name, block="transformer", *, scan=False, layers=3, **kw):
    cls = attention.get_class(name)
    case = next(iter(cls.contract_cases().values()))
    c = base_config().model
    c.positions = "rotary" if cls.allowed_positions is None or "rotary" in cls.allowed_positions else "none"
    c.vocab_size = V
    c.d_model, c.num_layers, c.d_ff = 16, layers, 32
    c.num_heads, c.head_dim = case.num_heads, case.head_dim
    c.block = block
    c.attention.name = name
    c.attention[name] = dict(case.cfg)
    c.scan_layers = "on" if scan else "off"
    for k, v in kw.items():
        c[k] = v
    return c, case.length


@functools.cache
def pair(name, block, **kw):
    kw = dict(kw)
    (cu, T), (cs, _) = model_cfg(name, block, **kw), model_cfg(name, block, scan=True, **kw)
    return build_model(cu, seed=0), build_model(cs, seed=0), T


def close(a, b, tol, msg=""):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=tol, rtol=tol,
                                   err_msg=msg)


def loss_and_grads(model, tokens, key):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits, _, aux = nnx.merge(graphdef, p, rest)(tokens, deterministic=False, key=key)
        ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
        return ce + sum(aux["losses"].values(), 0.0), aux

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, grads, aux


@functools.cache
def unrolled_loss_and_grads(name, block):
    """The unrolled model's training-mode loss, gradients and aux (the reference the scanned forms are held to)."""
    unrolled, _, T = pair(name, block, dropout=0.1)
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, V - 1)
    return tokens, loss_and_grads(unrolled, tokens, jax.random.key(1))


def _params(name):
    return [pytest.param(n, b, id=n, marks=[] if n in FAST else [pytest.mark.slow]) for n, b in METHODS if n == name]


@pytest.mark.parametrize("name,block", [p for n, _ in METHODS for p in _params(n)])
def test_scanned_equals_unrolled_loss_and_gradients(name, block):
    unrolled, scanned, _ = pair(name, block, dropout=0.1)
    assert layer_layout(nnx.state(unrolled)) == "unrolled" and layer_layout(nnx.state(scanned)) == "scanned"
    close(relayout(nnx.state(unrolled), scanned=True), nnx.state(scanned), 0.0, "same seed, same initial values")
    tokens, (lu, gu, au) = unrolled_loss_and_grads(name, block)
    ls, gs, as_ = loss_and_grads(scanned, tokens, jax.random.key(1))
    np.testing.assert_allclose(float(ls), float(lu), atol=1e-6, rtol=1e-6)
    close(gs, relayout(gu, scanned=True), 1e-6, "gradients")
    assert sorted(as_["metrics"]) == sorted(au["metrics"]) and sorted(as_["losses"]) == sorted(au["losses"])
    close([as_["losses"], as_["metrics"]], [au["losses"], au["metrics"]], 1e-6, "aux")
    # per-layer statistics come stacked; applied, they update each layer as the unrolled loop does
    close(as_["stats"], jax.tree.map(lambda *s: jnp.stack(s), *au["stats"]) if au["stats"][0] else {}, 1e-6)
    mu, ms = nnx.clone(unrolled), nnx.clone(scanned)  # copies: the cached pair stays untouched
    mu.apply_stats(au["stats"])
    ms.apply_stats(as_["stats"])
    close(nnx.state(ms), relayout(nnx.state(mu), scanned=True), 1e-6, "after apply_stats")


@pytest.mark.parametrize("policy", ["cotangent_tied", pytest.param("nothing_saveable", marks=pytest.mark.slow),
                                    pytest.param("dots_saveable", marks=pytest.mark.slow)])
def test_remat_inside_the_scan(policy):
    cfg, _ = model_cfg("transformer_vq", "gau", scan=True, dropout=0.1, remat=True, remat_policy=policy)
    scanned = build_model(cfg, seed=0)
    tokens, (lu, gu, _) = unrolled_loss_and_grads("transformer_vq", "gau")
    ls, gs, _ = loss_and_grads(scanned, tokens, jax.random.key(1))
    np.testing.assert_allclose(float(ls), float(lu), atol=1e-6, rtol=1e-6)
    close(gs, relayout(gu, scanned=True), 1e-6, f"remat {policy}")


@pytest.mark.parametrize("name,block", [p for n, _ in METHODS for p in _params(n)])
def test_scanned_decoding_equals_full_forward(name, block):
    _, model, T = pair(name, block, dropout=0.1)
    call = nnx.jit(lambda m, t, s: m(t, s)[:2])
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, V - 1)
    full, _ = call(model, tokens, None)
    state = model.init_state(B, T)
    L = model.blocks.num_layers
    assert all(x.shape[0] == L for x in jax.tree.leaves(state["layers"])), "per-layer states stacked"
    outs, a = [], 0
    for n in (5, 1, 3) * T:
        if a >= T:
            break
        o, state = call(model, tokens[:, a:a + n], state)
        outs.append(o)
        a += n
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), atol=1e-4, rtol=1e-4)
    assert int(state["pos"]) == T


def test_layers_axis_is_named_and_replicated():
    _, model, _ = pair("transformer_vq", "gau", dropout=0.1)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), sharding.AXES)
    for path, var in nnx.iter_graph(model.blocks):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata()["out_sharding"]
            assert names[0] == "layers" and var[...].shape[0] == 3, (path, names)
    assert sharding.DEFAULT_RULES["layers"] == ()
    specs = sharding.state_specs(nnx.state(model), mesh)
    assert all(s.get_value()[0] is None for s in jax.tree.leaves(specs["blocks"], is_leaf=lambda x: isinstance(
        x, nnx.Variable)))


def test_relayout_round_trip_of_optimizer_state():
    import optax

    unrolled, scanned, _ = pair("transformer_vq", "gau", dropout=0.1)
    tx = optax.adamw(1e-3)
    pu, ps = nnx.state(unrolled, nnx.Param), nnx.state(scanned, nnx.Param)
    ou = tx.init(pu)
    os_ = relayout(ou, scanned=True)
    assert jax.tree.structure(os_) == jax.tree.structure(tx.init(ps))
    back = relayout(os_, scanned=False)
    assert jax.tree.structure(back) == jax.tree.structure(ou)
    close(back, ou, 0.0)
    assert relayout(ps, scanned=True) is not None and layer_layout(relayout(ps, scanned=False)) == "unrolled"


@pytest.mark.parametrize("saved_scan", [False, True])
def test_checkpoint_restores_into_the_other_layout(tmp_path, saved_scan):
    from longctx.train import checkpoint

    unrolled, scanned, _ = pair("transformer_vq", "gau", dropout=0.1)
    src, dst = (scanned, unrolled) if saved_scan else (unrolled, scanned)
    cfg = base_config()
    cfg.model = model_cfg("transformer_vq", "gau", scan=saved_scan, dropout=0.1)[0]
    tree = dict(zip(("params", "nongrad"), nnx.state(src, nnx.Param, ...)))
    mngr = checkpoint.manager(tmp_path)
    checkpoint.save(mngr, 3, tree, config=cfg)
    checkpoint.wait(mngr)
    target = dict(zip(("params", "nongrad"), nnx.state(dst, nnx.Param, ...)))
    got, meta = checkpoint.restore(mngr, lambda meta: target)
    mngr.close()
    assert meta["step"] == 3
    for name in target:
        assert jax.tree.structure(got[name]) == jax.tree.structure(target[name])
        close(got[name], relayout(tree[name], scanned=not saved_scan), 0.0, name)


def _unscannable():
    """(what, config) for each case the scan does not apply to: 'on' is refused, 'auto' resolves to 'off'."""
    vcc = base_config()
    vcc.model.attention.name = "vcc"
    mixed = base_config()
    mixed.model.attention.name, mixed.model.attention.pattern = "eva", ("eva", "dense")
    composed = base_config()
    composed.mesh.sequence, composed.mesh.sequence_mode = 2, "compose"
    composed.train.seq_len, composed.train.window = 64, 32
    transfer = base_config()
    transfer.train.task, transfer.model.attention.name = "attention_transfer", "eva"
    return [("scan_layers='on': attention 'vcc' runs the blocks inside its own stack", vcc),
            ("scan_layers='on' with a pattern of different methods", mixed),
            ("attention_transfer' takes a decoder .* not model.scan_layers='on'", transfer),
            ("scan_layers='on' with mesh.sequence=2 and windows carrying state", composed)]


def test_scan_layers_on_is_refused_where_the_scan_does_not_apply_and_auto_leaves_it_off():
    from longctx import config as config_lib

    for match, c in _unscannable():
        c.model.scan_layers = "on"
        with pytest.raises(ConfigError, match=match) as err:
            config_lib.validate(c, platform="cuda")
        assert "\n" not in str(err.value)
        c.model.scan_layers = "auto"
        assert config_lib.validate(c, platform="cuda").model.scan_layers == "off", match


def test_scan_layers_auto_resolves_per_platform_and_is_saved_resolved():
    from longctx import config as config_lib

    c = base_config()
    assert c.model.scan_layers == "auto"
    for platform in ("cuda", "rocm", "tpu"):
        assert config_lib.validate(c, platform=platform).model.scan_layers == "on"
    assert config_lib.validate(c, platform="cpu").model.scan_layers == config_lib.CPU_SCAN_LAYERS
    for given in ("on", "off"):  # an explicit choice is kept on every platform
        c.model.scan_layers = given
        assert {config_lib.validate(c, platform=p).model.scan_layers for p in ("cpu", "cuda")} == {given}
    resolved = config_lib.validate(base_config(), platform="cuda")  # a saved config validates to itself anywhere
    assert config_lib.validate(config_lib.merge_over_base(resolved.to_dict()), platform="cpu").model.scan_layers == "on"


@pytest.mark.parametrize("given", ["True", "false", True, 1])
def test_scan_layers_takes_only_its_three_names(given):
    from longctx import config as config_lib

    c = config_lib.merge_over_base({"model": {"scan_layers": given}})
    with pytest.raises(ConfigError, match=r"model.scan_layers=.* is not allowed; choose one of: auto, on, off$"):
        config_lib.validate(c, platform="cpu")


_SEQUENCE_PARALLEL = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from longctx.models.decoder import build_model
from longctx.train import sequence_parallel as sp, sharding
from tests.models.test_scan_layers import model_cfg
c, _ = model_cfg("transformer_vq", "gau", scan=True)
m = build_model(c)
mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(1, 1, 1, 2), sharding.AXES)
tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 63)
g, v = nnx.split(m)
assert sp.plan(m, 16) == ("compose", [])
ref = m.hidden(tokens)[0]
hook = sp.make_hidden(mesh, 32, fold_key=False)
for h in (sp.hidden(g, v, tokens, mesh, mode="compose"), jax.jit(lambda v, t: hook(nnx.merge(g, v), t)[0])(v, tokens)):
    np.testing.assert_allclose(np.asarray(h), np.asarray(ref), atol=1e-4, rtol=1e-4)
print("ok")
"""


@pytest.mark.slow
def test_scanned_model_runs_sequence_parallel_by_composed_states():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", _SEQUENCE_PARALLEL], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# a decoding step that writes its token into its layer's slot of the stacked states and reads the caches there
# (AttentionCore.steps_in_stack): dense by the tiles ('auto' takes them for one query), a sliding window, and
# KDEformer's §4.4 step (its contract case samples 'uniform')
IN_STACK = [("dense", {"impl": "auto", "block_k": 64}), ("swa", {"impl": "auto", "window": 96}),
            ("kdeformer", {})]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,settings", IN_STACK, ids=[n for n, _ in IN_STACK])
def test_a_scanned_stack_decodes_in_place_as_the_unrolled_one(name, settings, dtype):
    """Token by token after a prefill, the scanned model's logits are the unrolled one's, and its donated
    decoding step updates the stacked states in place: its XLA temporaries a small part of them (as scan inputs
    and outputs, XLA copied the whole stack every step: 1.4x of it in temporaries)."""
    models = []
    for scan in (False, True):
        cfg, _ = model_cfg(name, scan=scan, dtype=dtype)
        cfg.attention[name].update(settings)
        models.append(build_model(cfg, seed=0))
    M, T0, steps = 512, 37, 5
    tokens = jax.random.randint(jax.random.key(3), (B, T0 + steps), 0, V - 1)
    call = nnx.jit(lambda m, t, s: m(t, s)[:2])
    logits = []
    for model in models:
        out, state = call(model, tokens[:, :T0], model.init_state(B, M))
        outs = [out[:, -1]]
        for t in range(T0, T0 + steps):
            out, state = call(model, tokens[:, t:t + 1], state)
            outs.append(out[:, -1])
        logits.append(np.stack([np.asarray(o, np.float32) for o in outs]))
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(logits[1], logits[0], atol=tol, rtol=tol)

    scanned = models[1]
    graphdef, variables = nnx.split(scanned)
    step = jax.jit(lambda v, t, s: nnx.merge(graphdef, v)(t, s)[1], donate_argnums=2)
    state = scanned.init_state(B, M)
    size = sum(x.nbytes for x in jax.tree.leaves(state))
    temps = step.lower(variables, tokens[:, :1], state).compile().memory_analysis().temp_size_in_bytes
    assert temps < size / 4, (temps, size)


@pytest.mark.parametrize("name,settings", IN_STACK, ids=[n for n, _ in IN_STACK])
def test_a_scanned_stack_decodes_packed_documents_as_the_unrolled_one(name, settings):
    """Decoding steps with segment ids (a sampler crossing a document end): each token starts or continues its
    document, in the stack (dense, swa) or through the layer's slot sliced out and set back (KDEformer)."""
    seg = np.array([[1] * 9 + [2] * 4 + [3] * 5, [1] * 3 + [2] * 12 + [3] * 3], np.int32)
    pos = np.concatenate([np.arange(n) for n in (9, 4, 5)])[None].repeat(2, 0)
    pos[1] = np.concatenate([np.arange(n) for n in (3, 12, 3)])
    T = seg.shape[1]
    tokens = jax.random.randint(jax.random.key(4), (B, T), 0, V - 1)
    call = nnx.jit(lambda m, t, s, p, g: m(t, s, positions=p, segment_ids=g)[:2])
    logits = []
    for scan in (False, True):
        cfg, _ = model_cfg(name, scan=scan)
        cfg.attention[name].update(settings)
        model = build_model(cfg, seed=0)
        state, outs = model.init_state(B, 64), []
        for t in range(T):
            out, state = call(model, tokens[:, t:t + 1], state, jnp.asarray(pos[:, t:t + 1]),
                              jnp.asarray(seg[:, t:t + 1]))
            outs.append(np.asarray(out[:, -1]))
        logits.append(np.stack(outs))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=1e-5)

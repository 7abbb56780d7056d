"""Each attention method swapped into layer 1 of the imported tiny Llama-style model (grouped-query attention,
rotary positions; ``model.attention.pattern=('dense', method)``): the layer keeps the Hugging Face projections,
MLP and norms, its core starts from the method's own initialisation; the model runs forward, decodes what the
full forward computes, and takes a training step. A method whose stack wrapper runs one layer (``per_layer``:
VCC-LM) runs that layer on the layer's own block; the same method in every layer takes the model's grouped-query
attention too. A method whose wrapper runs only the whole stack (VCC's encoder stack) is refused in a pattern in
one line. Each method brings its settings: its first fast causal contract case (as tests/models/test_hybrid.py
does; a model-level case for a method whose core runs only inside its wrapper), so no method is special-cased
here."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx import config as config_lib
from longctx.convert import core
from longctx.convert.cli import main
from longctx.convert.safetensors import Folder, Reader
from longctx.errors import ConfigError
from longctx.models.backbone import stack_wrapper_class
from longctx.models.blocks import takes_rotary

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama_tiny"
EXACT = core.exact_method()


def _one_layer(name, causal: bool) -> bool:
    """Whether ``name`` can be one layer of a pattern: it runs on the plain loop, or its stack wrapper declares
    ``per_layer``."""
    wrapper = stack_wrapper_class(name, causal)
    return wrapper is None or bool(getattr(wrapper, "per_layer", False))


def _case(name):
    """The method's first fast causal contract case (None: it has none): core-level, or model-level for a method
    whose core runs only inside its stack wrapper."""
    level = "model" if attention.get_class(name).stack_wrapper(causal=True) else "core"
    for case in attention.get_class(name).contract_cases().values():
        if case.level == level and not case.slow and "causal" in case.directions:
            return case
    return None


SWAPPABLE = [n for n in attention.names() if _one_layer(n, causal=True)]
PER_LAYER = [n for n in SWAPPABLE if attention.get_class(n).stack_wrapper(causal=True)]  # run by their wrapper
WRAPPED = [n for n in attention.names() if not _one_layer(n, causal=True)]
ENCODER_WRAPPED = [n for n in attention.names() if attention.get_class(n).supports_bidirectional
                   and not _one_layer(n, causal=False)]


def _config(pattern=None, name=None):
    c = config_lib.base_config()
    if pattern:
        c.model.attention.pattern = pattern
        method = next(p for p in pattern if p != EXACT)
        case = _case(method)
        exec_keys = attention.execution_keys(method)
        for k, v in (case.cfg if case is not None else {}).items():
            (c.execution if k in exec_keys else c.model).attention[method][k] = v
    if name:
        c.model.attention.name = name
    return c


@functools.cache
def swapped(name):
    """(config, model) of llama_tiny imported with ``name`` in layer 1."""
    fam, cfg = core.hf_model_config(core.read_hf_config(FIXTURE), _config((EXACT, name)))
    cfg = config_lib.validate(cfg)
    return cfg, nnx.merge(*core.load_params(fam, cfg, Folder(FIXTURE)))


def test_every_method_is_covered():
    assert set(SWAPPABLE) | set(WRAPPED) == set(attention.names()) and len(SWAPPABLE) >= 6
    assert PER_LAYER and (WRAPPED or ENCODER_WRAPPED)  # the one-layer capability, and a refusal to test


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SWAPPABLE if n != EXACT])
def test_swapped_layer_forward_decode_and_train_step(name):
    cfg, model = swapped(name)
    case = _case(name)
    tol = {"rtol": 1e-4, "atol": 1e-4} if case is None else {"rtol": max(case.rtol, 1e-5), "atol": max(case.atol, 1e-5)}
    # layer 1 runs the method, with the source's tensors in its block; layer 0 is the source's exact layer
    assert [type(b.core) for b in model.blocks] == [attention.get_class(EXACT), attention.get_class(name)]
    src = Reader(FIXTURE / "model.safetensors")
    assert np.array_equal(np.asarray(model.blocks[1].out.kernel[...]),
                          np.asarray(src.get("model.layers.1.self_attn.o_proj.weight")).T)
    assert np.array_equal(np.asarray(model.blocks[1].mlp.gate.kernel[...]),
                          np.asarray(src.get("model.layers.1.mlp.gate_proj.weight")).T)

    T = case.length if case is not None else 32
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, T)), jnp.int32)
    full = nnx.jit(lambda m, x: m(x)[0])(model, ids)
    assert full.shape == (2, T, cfg.model.vocab_size) and bool(jnp.all(jnp.isfinite(full)))

    # decoding: uneven chunks, then single tokens, carrying the state, equal the full forward
    step = nnx.jit(lambda m, x, st: m(x, st)[:2])
    state, parts, cuts = model.init_state(2, T), [], [0, T // 3, T - 1, T]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        y, state = step(model, ids[:, lo:hi], state)
        parts.append(y)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, axis=1)), np.asarray(full), **tol)

    # one training step (the trainer's loss, Adam): finite loss, every parameter of the swapped block that the
    # loss reaches changes
    import optax

    from longctx.train.step import make_loss_fn, split_model

    graphdef, params, nongrad, rest = split_model(model)
    loss_fn = make_loss_fn(graphdef)
    tx = optax.adam(1e-3)

    @jax.jit
    def train_step(params, opt_state):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, nongrad, rest, ids[:, :-1], ids[:, 1:],
                                                                      None, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, jax.tree.map(lambda p, u: p + u, params, updates), grads

    loss, new, grads = train_step(params, tx.init(params))
    assert np.isfinite(float(loss))
    before, after = (nnx.to_flat_state(t) for t in (params, new))
    grads = dict(nnx.to_flat_state(grads))
    moved = {k: not np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
             for (k, a), (_, b) in zip(before, after)}
    layer1 = [k for k in moved if k[:2] == ("blocks", 1)]
    assert layer1 and all(moved[k] for k in layer1 if np.any(np.asarray(grads[k].get_value()) != 0)), \
        [k for k in layer1 if not moved[k]]
    assert moved[("blocks", 1, "qkv", "kernel")] and moved[("embed", "embedding")]


def _error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(["longctx-convert", "import", f"--hf_dir={FIXTURE}", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("name", WRAPPED)
def test_a_stack_wrapper_method_is_refused_in_one_line(name, tmp_path, capsys):
    out = f"--workdir={tmp_path / 'run'}"
    err = _error(capsys, out, "--dry_run", f"--config.model.attention.pattern={EXACT},{name}")
    assert f"{name!r} runs the whole stack of blocks inside its own stack wrapper and cannot be one layer" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ENCODER_WRAPPED)
def test_an_encoder_stack_wrapper_is_refused_in_a_pattern(name):
    c = config_lib.base_config()
    c.model.kind, c.model.num_layers, c.model.attention.pattern = "encoder", 2, (EXACT, name)
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    msg = str(e.value)
    assert f"{name!r} runs the whole stack of blocks inside its own stack wrapper and cannot be one layer" in msg
    assert "\n" not in msg
    c.model.attention.pattern = ()
    c.model.attention.name = name  # the whole stack: accepted
    assert config_lib.validate(c).model.attention.name == name


@pytest.mark.slow
@pytest.mark.parametrize("name", PER_LAYER)
def test_a_per_layer_wrapper_runs_every_layer_of_the_grouped_query_model(name):
    """The same method in every layer (no pattern: its wrapper runs the whole stack) takes llama_tiny's
    grouped-query attention: forward, then chunked decoding equal to it."""
    c = _config((EXACT, name))
    c.model.attention.pattern, c.model.attention.name = (), name
    fam, cfg = core.hf_model_config(core.read_hf_config(FIXTURE), c)
    cfg = config_lib.validate(cfg)
    assert 0 < cfg.model.num_kv_heads < cfg.model.num_heads
    model = nnx.merge(*core.load_params(fam, cfg, Folder(FIXTURE)))
    case = _case(name)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, case.length)), jnp.int32)
    full = nnx.jit(lambda m, x: m(x)[0])(model, ids)
    step = nnx.jit(lambda m, x, st: m(x, st)[:2])
    state, parts, cuts = model.init_state(2, case.length), [], [0, case.length // 3, case.length]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        y, state = step(model, ids[:, lo:hi], state)
        parts.append(y)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, axis=1)), np.asarray(full),
                               rtol=max(case.rtol, 1e-5), atol=max(case.atol, 1e-5))


UNROTATED = [n for n in attention.names() if not takes_rotary(n)]  # methods with a position signal of their own


@pytest.mark.parametrize("name", UNROTATED)
def test_a_method_without_rotary_in_every_layer_is_refused_with_a_flag_that_works(name, tmp_path, capsys):
    """llama_tiny's rotary positions come from its config.json: a method that takes none cannot run in every layer,
    and the refusal gives a pattern (exact layers keep the rotation), not --config.model.positions, which the import
    overrides (given, the same refusal). The flag it gives imports."""
    run = tmp_path / "run"
    for extra in ([], ["--config.model.positions=none"]):
        err = _error(capsys, f"--workdir={run}", "--dry_run", f"--config.model.attention.name={name}", *extra)
        assert "--config.model.positions is overridden" in err and "add --config.model.positions" not in err, err
        flag = re.search(r"--config\.model\.attention\.pattern=\S+", err).group(0)
        assert flag == f"--config.model.attention.pattern={EXACT},{name}", err
    assert not run.exists()
    assert main(["longctx-convert", "import", f"--hf_dir={FIXTURE}", f"--workdir={run}", "--nooptimizer_state",
                 f"--config.model.attention.name={name}", "--config.model.positions=none", flag]) == 0
    from longctx.runtime import Runner

    runner = Runner.from_workdir(run)
    assert runner.cfg.model.positions == "rotary"
    assert [type(b.core) for b in runner.model().blocks] == [attention.get_class(EXACT), attention.get_class(name)]


def test_swapped_run_imports_and_export_refuses_it(tmp_path, capsys):
    """The swap through the command: the run's config keeps the pattern; export writes only exact models."""
    name = next(n for n in SWAPPABLE if n != EXACT)
    run = tmp_path / "run"
    assert main(["longctx-convert", "import", f"--hf_dir={FIXTURE}", f"--workdir={run}", "--nooptimizer_state",
                 f"--config.model.attention.pattern={EXACT},{name}"]) == 0
    from longctx.runtime import Runner

    runner = Runner.from_workdir(run)
    assert tuple(runner.cfg.model.attention.pattern) == (EXACT, name)
    assert [type(b.core) for b in runner.model().blocks] == [attention.get_class(EXACT), attention.get_class(name)]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["longctx-convert", "export", f"--workdir={run}", f"--hf_dir={tmp_path / 'hf'}"])
    err = capsys.readouterr().err.strip()
    assert "only a model whose every layer runs" in err and "\n" not in err

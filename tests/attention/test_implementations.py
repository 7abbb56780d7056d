"""One law for every named implementation: it equals its method's reference.

For every method in ``attention.names()``, each direction it supports and each implementation it declares
(``AttentionCore.implementations()``, longctx/attention/dispatch.py) that can run on this machine (a Pallas
kernel runs in interpret mode on a CPU), the core built with that implementation's execution settings gives the
same outputs, the same gradients (q, k, v and every parameter) and the same final state as the core built with
the method's first implementation, its reference: fp32 at a tight tolerance, bf16 inputs at a looser one (an
implementation compiled only for a CPU, whose default compute dtype is fp32, checks bf16 with ``-m slow``). Both
cores are built from one seed at the method's first contract case (same parameters: execution settings define
none). A method contributes no test code here: declaring an implementation gives it the law.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dispatch

FP32 = dict(atol=5e-5, rtol=5e-5)
BF16 = 5e-2  # relative to each compared array's largest entry


def _case(cls, direction):
    for case in cls.contract_cases().values():
        if case.level == "core" and direction in case.directions:
            return case
    return None


def _pairs(model_level: bool = False):
    """(method, direction, implementation) past the reference: for the cores with a core-level contract case,
    or (``model_level``) for the cores that run only inside a model (no core-level case, a fast model case)."""
    out = []
    for name in attention.names():
        cls = attention.get_class(name)
        for direction in ("causal", "bidirectional"):
            causal = direction == "causal"
            if (causal and not cls.supports_causal) or (not causal and not cls.supports_bidirectional):
                continue
            core_case = _case(cls, direction) is not None
            if core_case == model_level or (model_level and _model_case(cls, direction) is None):
                continue
            for impl in cls.implementations(causal=causal)[1:]:
                suffix = "-model" if model_level else ""
                # one xdist worker per (method, direction): the reference's results are computed once for all
                group = pytest.mark.xdist_group(f"implementations-{name}-{direction}{suffix}")
                marks = [group] + ([pytest.mark.slow] if impl.slow_in_interpret else [])
                if model_level:
                    out.append(pytest.param(name, direction, impl.name, id=f"{name}-{direction}-{impl.name}{suffix}",
                                            marks=marks))
                    continue
                for dtype in ("float32", "bfloat16"):
                    # bf16 of an implementation that runs compiled only on a CPU (whose 'auto' compute dtype is
                    # float32) runs with -m slow; every other implementation's bf16 by default
                    cpu_only = dtype == "bfloat16" and not impl.kernel and tuple(impl.platforms) == ("cpu",)
                    out.append(pytest.param(name, direction, impl.name, dtype,
                                            id=f"{name}-{direction}-{impl.name}-{dtype}",
                                            marks=marks + ([pytest.mark.slow] if cpu_only else [])))
    return out


def _runnable(impl: dispatch.Implementation) -> str | None:
    """None when ``impl`` runs on this platform (compiled, or a kernel in interpret mode on a CPU); else why not.
    Reasons that depend on the call's shapes are the implementation's to raise when it is called."""
    plat = dispatch.current_platform()
    if (impl.kernel and plat == "cpu") or plat in impl.platforms:
        return None
    return f"it runs on {', '.join(impl.platforms)}, not {plat}"


@functools.lru_cache(maxsize=None)
def _reference(name, direction, dtype_name):
    """The reference's results for (method, direction, dtype), computed once for all its implementations."""
    cls = attention.get_class(name)
    case = _case(cls, direction)
    run = _runner(_build(name, direction, cls.implementations(causal=direction == "causal")[0], case))
    return run(*_inputs(case, jnp.dtype(dtype_name)))


def _inputs(case, dtype):
    T, H, Dk = case.length, case.num_heads, case.head_dim
    Dv = case.value_dim or Dk
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(ks[0], (2, H, T, Dk)).astype(dtype)
    k = jax.random.normal(ks[1], (2, H, T, Dk)).astype(dtype)
    v = jax.random.normal(ks[2], (2, H, T, Dv)).astype(dtype)
    return q, k, v, jax.random.normal(ks[3], (2, H, T, Dv))


def _build(name, direction, impl, case):
    cfg = attention.default_config(name)
    cfg.update(case.cfg)
    cfg.update({**impl.config, **impl.test_config})
    return attention.build(name, cfg, num_heads=case.num_heads, head_dim=case.head_dim, value_dim=case.value_dim,
                           causal=direction == "causal", rngs=nnx.Rngs(0))


def _runner(core):
    """A jitted ``(q, k, v, w) -> (output, final state, gradients of <out, w> w.r.t. params, q, k, v)``."""
    graphdef, params, rest = nnx.split(core, nnx.Param, ...)

    def loss(params, q, k, v, w):
        out, state = nnx.merge(graphdef, params, rest)(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w), (out, state)

    @jax.jit
    def run(q, k, v, w):
        (_, (out, state)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(params, q, k, v, w)
        return out, state, grads

    return run


def _leaves(tree):
    return [(jax.tree_util.keystr(p), np.asarray(x, np.float64))
            for p, x in jax.tree_util.tree_leaves_with_path(tree) if hasattr(x, "dtype")]


def _compare(what, got, want, *, atol=None, rtol=None, rel=None):
    got, want = _leaves(got), _leaves(want)
    assert [p for p, _ in got] == [p for p, _ in want], what
    for (path, a), (_, b) in zip(got, want):
        if rel is not None:
            scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-6)
            err = float(np.max(np.abs(a - b), initial=0.0)) / scale
            assert err <= rel, f"{what}{path}: max error {err:.3g} of the largest entry > {rel}"
        else:
            np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg=f"{what}{path}")


@pytest.mark.parametrize("name,direction,impl_name,dtype_name", _pairs())
def test_implementation_equals_reference(name, direction, impl_name, dtype_name):
    cls = attention.get_class(name)
    impls = dispatch.by_name(cls.implementations(causal=direction == "causal"))
    ref_impl = cls.implementations(causal=direction == "causal")[0]
    impl = impls[impl_name]
    why = _runnable(impl)
    if why:
        pytest.skip(f"{name} {impl_name} cannot run here: {why}")
    case = _case(cls, direction)
    run = _runner(_build(name, direction, impl, case))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        tol = dict(atol=case.atol * 4, rtol=case.rtol * 4) if dtype_name == "float32" else dict(rel=BF16)
        out, state, grads = run(*_inputs(case, jnp.dtype(dtype_name)))
        r_out, r_state, r_grads = _reference(name, direction, dtype_name)
        label = f"{name} {direction} {impl_name} vs {ref_impl.name} ({dtype_name}): "
        _compare(label + "output", out, r_out, **tol)
        _compare(label + "final state", state, r_state, **tol)
        for part, g, r in zip(("d params", "dq", "dk", "dv"), grads, r_grads):
            _compare(label + part, g, r, **tol)


def _model_case(cls, direction):
    for case in cls.contract_cases().values():
        if case.level == "model" and direction in case.directions and not case.slow:
            return case
    return None


@functools.lru_cache(maxsize=None)
def _model_run(name, direction, impl_name):
    """Logits and parameter gradients of a tiny model (3 layers) whose attention uses ``impl_name``."""
    from longctx.config import base_config
    from longctx.models.decoder import build_model

    cls = attention.get_class(name)
    causal = direction == "causal"
    case = _model_case(cls, direction)
    impl = dispatch.by_name(cls.implementations(causal=causal))[impl_name]
    c = base_config().model
    c.kind, c.causal = ("decoder" if causal else "encoder"), causal
    c.vocab_size, c.d_model, c.num_layers, c.d_ff = 64, 16, 3, 32
    c.num_heads, c.head_dim = case.num_heads, case.head_dim
    c.positions = "rotary"
    c.attention.name = name
    c.attention[name] = {**case.cfg, **impl.config, **impl.test_config}
    model = build_model(c, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    k1, k2 = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(k1, (2, case.length), 0, 63)
    important = None if causal else jax.random.bernoulli(k2, 0.15, (2, case.length))

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m(tokens, None, deterministic=True)[0] if causal else m(tokens, important, deterministic=True)[0]
        w = jnp.cos(jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)
        return jnp.sum(logits.astype(jnp.float32) * w), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


@pytest.mark.parametrize("name,direction,impl_name", _pairs(model_level=True))
def test_model_level_implementation_equals_reference(name, direction, impl_name):
    """The same law for a core that runs only inside its model (it needs the model's inputs, e.g. per-key
    biases): a tiny model built with the implementation gives the reference model's logits and gradients."""
    cls = attention.get_class(name)
    impl = dispatch.by_name(cls.implementations(causal=direction == "causal"))[impl_name]
    why = _runnable(impl)
    if why:
        pytest.skip(f"{name} {impl_name} cannot run here: {why}")
    case = _model_case(cls, direction)
    ref = cls.implementations(causal=direction == "causal")[0].name
    logits, grads = _model_run(name, direction, impl_name)
    r_logits, r_grads = _model_run(name, direction, ref)
    tol = dict(atol=max(case.atol, 1e-5) * 4, rtol=max(case.rtol, 1e-5) * 4)
    _compare(f"{name} {direction} {impl_name} vs {ref}: logits", logits, r_logits, **tol)
    _compare(f"{name} {direction} {impl_name} vs {ref}: d params", grads, r_grads, **tol)


def test_every_method_declares_its_implementations_and_execution_keys():
    """Each implementation's settings are execution keys of its method (never hyperparameters), and every
    execution key is a key of the method's defaults."""
    for name in attention.names():
        cls = attention.get_class(name)
        defaults = cls.default_config()
        assert set(cls.EXECUTION_KEYS) <= set(defaults.keys()), name
        for causal in (True, False):
            impls = cls.implementations(causal=causal)
            assert impls and len({i.name for i in impls}) == len(impls), name
            for impl in impls:
                assert set(impl.config) <= set(cls.EXECUTION_KEYS), (name, impl.name)
                assert set(impl.test_config) <= set(cls.EXECUTION_KEYS), (name, impl.name)

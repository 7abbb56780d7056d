"""Packed documents never see each other (STYLE house rule 11): the contract law of ``segment_ids``.

For every method in ``attention.names()``, each direction it supports and each implementation it declares:

* a method that declares ``takes_segments``: a packed batch (two rows, each three documents of ragged lengths, one of
  them shorter than the tiles of the method's test configuration, in a different order per row) gives the outputs
  and the q, k, v gradients of each document run alone, float32 at the contract's tolerance and bfloat16 at the
  implementation law's; a causal core that carries state also gives them when the packed row is fed in two calls
  whose cut falls inside a document (the carried state keeps the boundaries); an implementation that takes no segment
  ids (cuDNN through ``jax.nn.dot_product_attention``) refuses a packed call in one line naming them, when named;
* a method that does not: a block refuses segment ids for it in one line (``segment_kwargs``), and so does config
  validation for ``data.packing='segments'`` before any work.

The per-method configuration is the implementation law's (``tests/attention/test_implementations.py``); the
implementations past the reference repeat the law on their own structure and are marked slow where they run in
Pallas interpret mode."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx import attention
from longctx.attention import dispatch
from longctx.attention.base import segment_kwargs, segments_refusal
from longctx.config import base_config, validate
from longctx.errors import ConfigError
from tests.attention.test_implementations import BF16, _build, _case, _compare, _runnable

FP32_SCALE = 4  # the implementation law's factor on a case's fp32 tolerance


def _params():
    """(method, direction, implementation) for every implementation of every method, the reference included."""
    out = []
    for name, cls in ((n, attention.get_class(n)) for n in attention.names()):
        supported = {"causal": cls.supports_causal, "bidirectional": cls.supports_bidirectional}
        for direction in (d for d, ok in supported.items() if ok):
            impls = cls.implementations(causal=direction == "causal")
            # the reference, and the first implementation past it causally; the other repeats with -m slow
            first = impls[:2] if direction == "causal" else impls[:1]
            for impl in impls:
                slow = cls.takes_segments and (impl.kernel or impl not in first)
                out.append(pytest.param(name, direction, impl.name, id=f"{name}-{direction}-{impl.name}",
                                        marks=[pytest.mark.slow] if slow else []))
    return out


def _layouts(T: int):
    """Two rows' document lengths: three ragged documents, the first shorter than any test tile (3 tokens)."""
    a = 3
    b = (T - a) // 2 + 1
    lengths = (a, b, T - a - b)
    return lengths, lengths[1:] + lengths[:1]


def _segment_ids(rows):
    return jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]), jnp.int32)


def _inputs(case, dtype):
    T, H, Dk = case.length, case.num_heads, case.head_dim
    Dv = case.value_dim or Dk
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v = (jax.random.normal(kk, (2, H, T, d)).astype(dtype) for kk, d in zip(ks[:3], (Dk, Dk, Dv)))
    return q, k, v, jax.random.normal(ks[3], (2, H, T, Dv))


def _grad_run(core, seg):
    """A jitted ``(q, k, v, w) -> (output, (dq, dk, dv) of <out, w>)`` of ``core`` (with ``seg`` when given)."""
    kw = {} if seg is None else {"segment_ids": seg}

    def loss(q, k, v, w):
        out = core(q, k, v, **kw)[0]
        return jnp.sum(out.astype(jnp.float32) * w), out

    @jax.jit
    def run(q, k, v, w):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, w)
        return out, grads

    return run


def _alone(core, rows, q, k, v, w):
    """Each document run alone (the rows' documents of one length together), reassembled into the packed layout:
    (output, (dq, dk, dv))."""
    out, grads = jnp.zeros_like(v), [jnp.zeros_like(x) for x in (q, k, v)]
    starts = [np.concatenate([[0], np.cumsum(r)[:-1]]) for r in rows]
    for n in sorted(set(rows[0])):
        where = [int(s[list(r).index(n)]) for r, s in zip(rows, starts)]
        take = lambda x, n=n, where=where: jnp.stack([x[b, :, a:a + n] for b, a in enumerate(where)])  # noqa: E731
        o, g = _grad_run(core, None)(take(q), take(k), take(v), take(w))
        for b, a in enumerate(where):
            out = out.at[b, :, a:a + n].set(o[b])
            grads = [x.at[b, :, a:a + n].set(y[b]) for x, y in zip(grads, g)]
    return out, tuple(grads)


@pytest.mark.parametrize("name,direction,impl_name", _params())
def test_packed_rows_equal_documents_alone(name, direction, impl_name):
    cls = attention.get_class(name)
    causal = direction == "causal"
    impl = dispatch.by_name(cls.implementations(causal=causal))[impl_name]
    case = _case(cls, direction)
    if not cls.takes_segments:
        _check_refusal(name, direction, impl, case)
        return
    if case is None:  # a core that runs only inside its method's stack wrapper: the law is the wrapper's, model-level
        pytest.skip(f"{name} runs only inside its stack wrapper (no core-level case): its packed law runs at model "
                    "level (tests/models/test_model_contract.py, tests/models/test_packed_*.py)")
    why = _runnable(impl)
    if why:
        pytest.skip(f"{name} {impl_name} cannot run here: {why}")
    core = _build(name, direction, impl, case)
    try:
        _check_packed(core, case, f"{name} {direction} {impl_name}", causal)
    except dispatch.KernelUnsupportedError as e:  # an implementation that takes no segment ids refuses them by name
        assert "segment ids" in str(e) and "\n" not in str(e), str(e)
        q, k, v, w = _inputs(case, jnp.bfloat16)
        _grad_run(core, None)(q, k, v, w)  # while it serves the same call without them


def _check_packed(core, case, what, causal):
    """Packed rows equal their documents alone (outputs, q/k/v gradients; fp32 and bf16); causal: also fed in two
    calls carrying the state."""
    rows = _layouts(case.length)
    seg = _segment_ids(rows)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        for dtype, tol in ((jnp.float32, dict(atol=case.atol * FP32_SCALE, rtol=case.rtol * FP32_SCALE)),
                           (jnp.bfloat16, dict(rel=BF16))):
            q, k, v, w = _inputs(case, dtype)
            out, grads = _grad_run(core, seg)(q, k, v, w)
            want, want_grads = _alone(core, rows, q, k, v, w)
            label = f"{what} packed vs alone ({jnp.dtype(dtype).name}): "
            _compare(label + "output", out, want, **tol)
            for part, g, r in zip(("dq", "dk", "dv"), grads, want_grads):
                _compare(label + part, g, r, **tol)
        if causal:  # the packed row in two calls, cut inside its second document: the state keeps the boundaries
            q, k, v, _ = _inputs(case, jnp.float32)
            cut = rows[0][0] + rows[0][1] // 2
            stream = jax.jit(lambda q, k, v, seg: _two_calls(core, q, k, v, seg, cut, case.length))
            _compare(f"{what} packed, streamed in two calls: output", stream(q, k, v, seg),
                     _grad_run(core, seg)(q, k, v, jnp.zeros_like(v))[0],
                     atol=case.atol * FP32_SCALE, rtol=case.rtol * FP32_SCALE)


def _two_calls(core, q, k, v, seg, cut, max_len):
    """The packed row fed as tokens [:cut] from the empty state, then [cut:] from the state it left."""
    part = lambda x, sl: x[:, :, sl]  # noqa: E731
    first, state = core(part(q, slice(0, cut)), part(k, slice(0, cut)), part(v, slice(0, cut)),
                        core.init_state(q.shape[0], max_len), segment_ids=seg[:, :cut])
    second, _ = core(part(q, slice(cut, None)), part(k, slice(cut, None)), part(v, slice(cut, None)), state,
                     segment_ids=seg[:, cut:])
    return jnp.concatenate([first, second], axis=2)


def _check_refusal(name, direction, impl, case):
    """A method without ``takes_segments``: one line from the block's hand-over and from config validation."""
    line = segments_refusal(name)
    assert "\n" not in line and line.startswith(f"{name}: packed rows")
    if case is not None:  # a core-level method: the core the block would hand segment ids to
        core = _build(name, direction, impl, case)
        seg = jnp.ones((2, case.length), jnp.int32)
        with pytest.raises(ConfigError, match=f"^{line.replace('(', '[(]').replace(')', '[)]')}$"):
            segment_kwargs(core, seg)
        assert segment_kwargs(core, None) == {}
    if direction == "causal":  # config validation (an encoder is refused before its method: tests/models)
        c = base_config()
        c.data.packing = "segments"
        c.model.attention.name = name
        allowed = attention.get_class(name).allowed_positions
        if allowed is not None and c.model.positions not in allowed:
            c.model.positions = allowed[0]
        with pytest.raises(ConfigError) as err:
            validate(c)
        assert str(err.value) == line


def test_cudnn_takes_packed_calls_where_its_packed_layout_serves_them(monkeypatch):
    """cuDNN takes a packed row through its packed ("THD") layout on Hopper up to auto_threshold scores, so 'auto' on
    such a GPU takes it; past auto_threshold (its statistics are the score matrix's size) or before Hopper its
    reasons refuse in one line and 'auto' takes the next implementation."""
    from longctx.attention.dense import choose
    from longctx.attention.dense import platform as dp

    shapes = dict(dtype=jnp.bfloat16, head_dim=64, capability=(9, 0))
    assert dp.cudnn_unsupported_reasons("cuda", segments=True, **shapes) == []
    assert any("segment ids" in r for r in dp.cudnn_unsupported_reasons("cuda", segments=True,
                                                                        **{**shapes, "capability": (8, 0)}))
    monkeypatch.setattr(dp, "_cuda_capability", lambda: (9, 0))  # lowering for a Hopper GPU from here
    assert choose("auto", dtype=jnp.bfloat16, head_dim=64, platform="cuda", segments=True).name == "cudnn"
    packed = choose("auto", dtype=jnp.bfloat16, head_dim=64, platform="cuda", large=True, segments=True)
    assert packed.name not in ("cudnn", "splash")
    with pytest.raises(dispatch.KernelUnsupportedError, match="segment ids"):
        choose("cudnn", dtype=jnp.bfloat16, head_dim=64, platform="cuda", large=True, segments=True)

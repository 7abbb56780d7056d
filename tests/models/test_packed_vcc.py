"""VCC on packed rows (``segment_ids``; docs/methods/vcc.md §4.3), at model level: VCC runs as a stack wrapper over
the backbone's blocks, so the core-level packed law (tests/attention/test_packed_law.py, bare q, k, v) cannot reach
it. A small encoder and a small VCC-LM decoder, built as models, give every document of a packed row what it gives
alone: the final-norm hidden states and the gradients of ``sum(h * w)`` with respect to the embedded tokens and the
parameters (packed = the sum over the documents alone), in evaluation and in training mode (exploration off, the
straight-through gate on), with every implementation of the direction; the decoder also in windows carrying the
state across document boundaries and token by token (decoding). The documents are long enough to compress (more old
blocks than the fine budget), and without segment ids the packed row differs (the law is not met by accident).

The backbone does not hand segment ids to a stack wrapper yet, so :func:`_hidden` is ``Backbone.run``'s stack path
(embedding at the packed positions, the wrapper, the final norm) with the segment ids handed to the wrapper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx.attention import vcc as vcc_core
from longctx.attention.base import CapacityError
from longctx.models.decoder import build_model
from tests.attention.test_implementations import BF16
from tests.attention.test_vcc import lm_cfg, model_cfg

T = 32
ENC_ROWS = ((3, 17, 12), (12, 3, 17))  # document lengths per row; the 17-token document has 2 blocks past 8 slots + 1
LM_ROWS = ((3, 18, 11), (18, 11, 3))
LM_SMALL = {"window": 4, "local": 4, "block_size": 2, "num_fine_blocks": 1, "anchors": 2}  # 11 tokens compress
TOL = dict(atol=2e-5, rtol=2e-5)


def _close(got, want, what, tol=2e-5):
    """|got - want| <= tol * the largest |want| (float32 summation order; gradients reach the hundreds)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} x {scale:.3g}"


def _seg_pos(rows):
    seg = np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in rows]).astype(np.int32)
    return jnp.asarray(seg), jnp.asarray(pos)


def _pieces(rows):
    """(row, start, length) of every document."""
    out = []
    for b, r in enumerate(rows):
        starts = np.concatenate([[0], np.cumsum(r)[:-1]])
        out += [(b, int(a), int(n)) for a, n in zip(starts, r)]
    return out


def _hidden(model, tokens, state=None, *, positions, segment_ids=None, important=None, deterministic=True,
            key=None):
    """``Backbone.run``'s stack path with ``segment_ids`` handed to the stack wrapper: (h, new layer states)."""
    x = model.embed_tokens(tokens, positions)
    seg = {} if segment_ids is None else {"segment_ids": segment_ids}
    y, states = model.stack(model.blocks, x, state, positions=positions, important=important,
                            deterministic=deterministic, key=key, **seg)
    return model.norm(y), states


def _grad_fn(model, *, deterministic, key=None):
    """jitted (tokens, positions, seg, important, w) -> (h, d<h, w>/d embeddings, d<h, w>/d params); seg None:
    unpacked. The embeddings' gradient is taken at the embedding table's rows for these tokens (via an additive
    zero ``e`` on the embedded tokens)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, e, tokens, pos, seg, imp, w):
        m = nnx.merge(graphdef, params, rest)
        x = m.embed_tokens(tokens, pos) + e
        kw = {} if seg is None else {"segment_ids": seg}
        y, _ = m.stack(m.blocks, x, None, positions=pos, important=imp, deterministic=deterministic, key=key, **kw)
        h = m.norm(y)
        return jnp.sum(h.astype(jnp.float32) * w), h

    @jax.jit
    def run(tokens, pos, seg, imp, w):
        e = jnp.zeros(tokens.shape + (model.d_model,), jnp.float32)
        (_, h), (gp, ge) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, e, tokens, pos, seg, imp,
                                                                                  w)
        return h, ge, gp

    return run


def _check_packed_equals_alone(model, rows, *, important=False, deterministic=True, key=None):
    seg, pos = _seg_pos(rows)
    ks = jax.random.split(jax.random.key(7), 3)
    tokens = jax.random.randint(ks[0], seg.shape, 0, 60)
    imp = jax.random.bernoulli(ks[1], 0.3, seg.shape) if important else None
    w = jax.random.normal(ks[2], seg.shape + (model.d_model,))
    run = _grad_fn(model, deterministic=deterministic, key=key)
    h, ge, gp = run(tokens, pos, seg, imp, w)
    gp_sum = jax.tree.map(jnp.zeros_like, gp)
    for b, a, n in _pieces(rows):
        sl = (slice(b, b + 1), slice(a, a + n))
        ha, gea, gpa = run(tokens[sl], jnp.arange(n, dtype=jnp.int32)[None], None,
                           None if imp is None else imp[sl], w[sl])
        _close(h[sl], ha, f"h of doc {b}:{a}+{n}")
        _close(ge[sl], gea, f"d embeddings of doc {b}:{a}+{n}")
        gp_sum = jax.tree.map(jnp.add, gp_sum, gpa)
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp_sum)):
        _close(g, want, f"d params {jax.tree_util.keystr(path)}")
    # without the segment ids the documents see each other: the law above is not met by accident
    plain = run(tokens, pos, None, imp, w)[0]
    assert float(jnp.max(jnp.abs(plain - h))) > 1e-3


def _encoder(impl="reference", **vc):
    c = model_cfg(impl=impl, **({"query_chunk": 8} if impl == "chunked" else {}), **vc)
    return build_model(c, seed=0)


def _decoder(**vc):
    c = lm_cfg(explore_prob=0.0, **LM_SMALL)
    c.attention.vcc.update(vc)
    return build_model(c, seed=0)


@pytest.mark.parametrize("impl", [pytest.param(i.name, marks=[pytest.mark.slow] if n else [])
                                  for n, i in enumerate(vcc_core.implementations(causal=False))])
def test_encoder_packed_rows_equal_documents_alone(impl):
    """Each document its own VIP slots, blocks, fine budget and segment-local layers: outputs, gradients (eval)."""
    _check_packed_equals_alone(_encoder(impl), ENC_ROWS, important=True)


@pytest.mark.slow
def test_encoder_packed_rows_in_training_mode():
    """Training mode (exploration off, the straight-through gate on), and rows with no VIP token (slot fallback)."""
    _check_packed_equals_alone(_encoder(explore_prob=0.0), ENC_ROWS, important=False, deterministic=False,
                               key=jax.random.key(1))


@pytest.mark.slow  # 20-45 s on a 2-core CPU; the windows test below runs the decoder by default
@pytest.mark.parametrize("deterministic", [True, False])
def test_decoder_packed_rows_equal_documents_alone(deterministic):
    """VCC-LM, one call from no state: outputs and gradients of every document as alone (training: the gate)."""
    model = _decoder()
    _check_packed_equals_alone(model, LM_ROWS, deterministic=deterministic,
                               key=None if deterministic else jax.random.key(1))


@pytest.mark.slow
def test_decoder_compresses_the_long_documents():
    """The fixture exercises the compression: the 18-token document alone differs from exact attention (every old
    block fine)."""
    tokens = jax.random.randint(jax.random.key(0), (1, 18), 0, 60)
    pos = jnp.arange(18, dtype=jnp.int32)[None]
    got = _hidden(_decoder(), tokens, positions=pos)[0]
    exact = _hidden(_decoder(causal=dict(LM_SMALL, num_fine_blocks=16)), tokens, positions=pos)[0]
    assert float(jnp.max(jnp.abs(got - exact))) > 1e-4


def _alone_h(model, tokens, rows):
    out = np.zeros(tokens.shape + (model.d_model,), np.float32)
    call = nnx.jit(lambda m, t, p: _hidden(m, t, positions=p)[0])
    for b, a, n in _pieces(rows):
        out[b, a:a + n] = np.asarray(call(model, tokens[b:b + 1, a:a + n], jnp.arange(n, dtype=jnp.int32)[None]))[0]
    return out


@pytest.mark.parametrize("window", [7, pytest.param(1, marks=pytest.mark.slow)])
def test_decoder_windows_and_decoding_carry_each_document(window):
    """The packed rows fed in windows of 7 (documents cross the windows' edges) or token by token (decoding), the
    state carried: every token's hidden state is its document's alone."""
    model = _decoder()
    seg, pos = _seg_pos(LM_ROWS)
    tokens = jax.random.randint(jax.random.key(3), seg.shape, 0, 60)
    want = _alone_h(model, tokens, LM_ROWS)
    step = nnx.jit(lambda m, t, st, p, s: _hidden(m, t, st, positions=p, segment_ids=s))
    state, outs = model.stack.init_state(model.blocks, len(LM_ROWS), T), []
    for a in range(0, T, window):
        sl = slice(a, a + window)
        h, state = step(model, tokens[:, sl], state, pos[:, sl], seg[:, sl])
        outs.append(np.asarray(h))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want, **TOL)
    assert [int(s) for s in state[0]["segment"]] == [3, 3]
    assert [int(s) for s in state[0]["doc_length"]] == [r[-1] for r in LM_ROWS]


@pytest.mark.slow
def test_decoder_state_starts_afresh_at_a_new_document():
    """A call whose first token opens a new document (a new id) ignores the carried state."""
    model = _decoder()
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 60)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    _, state = _hidden(model, tokens, model.stack.init_state(model.blocks, 2, 24), positions=pos,
                       segment_ids=jnp.ones((2, 12), jnp.int32))
    fresh = _hidden(model, tokens, model.stack.init_state(model.blocks, 2, 24), positions=pos,
                    segment_ids=jnp.full((2, 12), 2, jnp.int32))[0]
    after = _hidden(model, tokens, state, positions=pos, segment_ids=jnp.full((2, 12), 2, jnp.int32))[0]
    np.testing.assert_allclose(np.asarray(after), np.asarray(fresh), **TOL)


def test_more_documents_than_the_layout_holds_are_refused():
    seg, pos = _seg_pos(((3, 17, 12), (12, 3, 17)))
    tokens = jnp.zeros(seg.shape, jnp.int32)
    for model in (_encoder(max_documents=2), _decoder(max_documents=2)):
        with pytest.raises(CapacityError, match="3 documents but the stack lays out at most 2"):
            _hidden(model, tokens, positions=pos, segment_ids=seg)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_bfloat16_packed_rows_equal_documents_alone(kind):
    """Under the bfloat16 policy (compute dtype bfloat16): the packed rows' hidden states are each document's alone."""
    c = model_cfg() if kind == "encoder" else lm_cfg(explore_prob=0.0, **LM_SMALL)
    c.dtype = "bfloat16"
    model, rows = build_model(c, seed=0), ENC_ROWS if kind == "encoder" else LM_ROWS
    seg, pos = _seg_pos(rows)
    tokens = jax.random.randint(jax.random.key(5), seg.shape, 0, 60)
    h = nnx.jit(lambda m, t, p, s: _hidden(m, t, positions=p, segment_ids=s)[0])(model, tokens, pos, seg)
    assert h.dtype == jnp.bfloat16
    # the implementation law's bfloat16 tolerance (tests/attention/test_implementations.py: BF16), relative to the
    # largest entry: other shapes fuse and round differently across the layers
    _close(h.astype(jnp.float32), _alone_h(model, tokens, rows), "bf16 h", tol=BF16)

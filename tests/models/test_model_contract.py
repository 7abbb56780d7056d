"""The attention contract's laws at the model level (DESIGN §2), for every registered method.

A method whose core runs only inside a stack wrapper (``AttentionCore.stack_wrapper``: it acts on
whole layers, e.g. VCC's compression) cannot be checked on bare q, k, v; it declares
``ContractCase(level='model')`` cases and this suite checks the laws on a tiny model built with
them (an encoder for 'bidirectional', a decoder for 'causal'). Every other method's first fast
case per direction runs here too, under ``-m slow`` (its core-level laws are the main suite,
tests/attention/test_contract.py). No method name appears here.

Laws: shapes and finite outputs, jit == eager (slow: an eager pass through the whole stack), vmap over batches == per-batch calls; bidirectional: the first
position sees the last token, a row shorter than the case's length works; causal: streamed in
uneven chunks == token-by-token == full, no future leak (perturbation and Jacobian); randomized
training passes: same key reproduces, another key differs; finite parameter gradients in fp32 and
bf16 (training mode).
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
from longctx.models.decoder import build_model
from tests.models.test_encoder import farthest_reached

# one worker: the cached harnesses below (built models, compiled forwards) are shared between tests
pytestmark = pytest.mark.xdist_group("model_contract")

B, V = 2, 64
SPLIT_SIZES = (13, 1, 7)


def _cases():
    out = []
    for name in attention.names():
        cls = attention.get_class(name)
        seen = set()
        for cname, case in cls.contract_cases().items():
            for direction in case.directions:
                if (direction == "causal" and not cls.supports_causal) or (
                        direction == "bidirectional" and not cls.supports_bidirectional):
                    continue
                if case.level == "model":
                    marks = [pytest.mark.slow] if case.slow else []
                elif case.slow or direction in seen:
                    continue
                else:  # a core-level method's first fast case: the same laws one level up, in the slow run
                    seen.add(direction)
                    marks = [pytest.mark.slow]
                out.append(pytest.param(name, cname, direction, id=f"{name}-{cname}-{direction}", marks=marks))
    return out


ALL = _cases()
CAUSAL = [p for p in ALL if p.values[2] == "causal"]
BIDIR = [p for p in ALL if p.values[2] == "bidirectional"]


class ModelHarness:
    def __init__(self, name, cname, direction):
        self.cls = attention.get_class(name)
        self.case = self.cls.contract_cases()[cname]
        self.causal = direction == "causal"
        c = base_config().model
        c.kind = "decoder" if self.causal else "encoder"
        c.causal = self.causal
        c.vocab_size = V
        c.d_model, c.num_layers, c.d_ff = 16, 3, 32
        c.num_heads, c.head_dim = self.case.num_heads, self.case.head_dim
        c.positions = "rotary"
        c.attention.name = name
        c.attention[name] = dict(self.case.cfg)
        self.model = build_model(c, seed=0)
        self.graphdef, self.params, self.rest = nnx.split(self.model, nnx.Param, ...)
        self.T = self.case.length
        self.fwd = jax.jit(self._raw, static_argnames=("deterministic",))

    def _raw(self, params, tokens, important, state, key, deterministic=True):
        model = nnx.merge(self.graphdef, params, self.rest)
        if self.causal:
            logits, state, _ = model(tokens, state, deterministic=deterministic, key=key)
            return logits, state
        return model(tokens, important, deterministic=deterministic, key=key)[0], None

    def __call__(self, tokens, important=None, state=None, key=None, params=None):
        return self.fwd(self.params if params is None else params, tokens, important, state, key,
                        deterministic=key is None)

    def inputs(self, seed=0, T=None):
        T = self.T if T is None else T
        k1, k2 = jax.random.split(jax.random.key(seed))
        tokens = jax.random.randint(k1, (B, T), 0, V - 1)
        important = jax.random.bernoulli(k2, 0.15, (B, T))
        return tokens, (None if self.causal else important)

    def stream(self, tokens, sizes):
        state = self.model.init_state(B, tokens.shape[1])
        outs, a, i = [], 0, 0
        while a < tokens.shape[1]:
            b = min(tokens.shape[1], a + sizes[i % len(sizes)])
            o, state = self(tokens[:, a:b], state=state)
            outs.append(o)
            a, i = b, i + 1
        return jnp.concatenate(outs, axis=1)

    def close(self, got, want, msg=""):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=max(self.case.atol, 1e-4), rtol=max(self.case.rtol, 1e-4), err_msg=msg)


@functools.cache
def harness(name, cname, direction) -> ModelHarness:
    return ModelHarness(name, cname, direction)


@pytest.mark.slow  # an eager pass through a whole model stack: 25-40 s per case on a 2-core CPU
@pytest.mark.parametrize("name,cname,direction", ALL)
def test_model_jit_equals_eager(name, cname, direction):
    h = harness(name, cname, direction)
    tokens, imp = h.inputs()
    out, _ = h(tokens, imp)
    eager = h.model(tokens)[0] if h.causal else h.model(tokens, imp)[0]
    h.close(eager, out, "jit != eager")


@pytest.mark.parametrize("name,cname,direction", ALL)
def test_model_shapes_and_vmap(name, cname, direction):
    h = harness(name, cname, direction)
    tokens, imp = h.inputs()
    out, _ = h(tokens, imp)
    assert out.shape == (B, h.T, V) and bool(jnp.all(jnp.isfinite(out)))
    # vmap over an extra leading axis (two whole batches) == one call per batch
    flip = (jnp.flip(tokens, 0), None if imp is None else jnp.flip(imp, 0))
    ts = jnp.stack([tokens, flip[0]])
    ims = None if imp is None else jnp.stack([imp, flip[1]])
    vm = jax.jit(jax.vmap(lambda t, i: h._raw(h.params, t, i, None, None)[0],
                          in_axes=(0, None if imp is None else 0)))(ts, ims)  # jitted: an eager vmap runs op by op
    h.close(vm[0], out, "vmap[0] != call")
    h.close(vm[1], h(*flip)[0], "vmap[1] != call")


@pytest.mark.parametrize("name,cname,direction", BIDIR)
def test_model_bidirectional_sees_later_tokens_and_short_rows(name, cname, direction):
    h = harness(name, cname, direction)
    tokens, imp = h.inputs()
    out, _ = h(tokens, imp)
    p = farthest_reached(h.model, tokens.shape[1])  # the last token, or the farthest a sliding window reaches
    later = tokens.at[:, p].set((tokens[:, p] + 7) % (V - 1))
    out2, _ = h(later, imp)
    assert float(jnp.max(jnp.abs(out2[:, 0] - out[:, 0]))) > 1e-5, f"the first position ignores token {p}"
    for T in (1, h.T - 3):
        t, i = h.inputs(seed=3, T=T)
        o, _ = h(t, i)
        assert o.shape == (B, T, V) and bool(jnp.all(jnp.isfinite(o)))


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_model_streamed_and_decoded_equal_full(name, cname, direction):
    h = harness(name, cname, direction)
    tokens, _ = h.inputs()
    full, _ = h(tokens)
    h.close(h.stream(tokens, SPLIT_SIZES), full, "streamed in uneven chunks != full")
    h.close(h.stream(tokens, (1,)), full, "token-by-token decoding != full")


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_model_no_future_leak(name, cname, direction):
    h = harness(name, cname, direction)
    tokens, _ = h.inputs()
    t0 = h.T - 6
    full, _ = h(tokens)
    pert = tokens.at[:, t0 + 1:].set((tokens[:, t0 + 1:] + 5) % (V - 1))
    out, _ = h(pert)
    np.testing.assert_array_equal(np.asarray(out[:, :t0 + 1]), np.asarray(full[:, :t0 + 1]),
                                  err_msg="perturbing future tokens changed a past logit")
    assert float(jnp.max(jnp.abs(out[:, t0 + 1:] - full[:, t0 + 1:]))) > 1e-5
    model = h.model

    def at_t0(x):  # logits at t0 as a function of the embedded inputs
        return model.logits(_hidden_from_embeddings(model, x))[:, t0]

    emb = model.embed_tokens(tokens, jnp.arange(h.T))
    g = jax.jit(lambda e, c: jax.vjp(at_t0, e)[1](c)[0])(emb, jax.random.normal(jax.random.key(1), (B, V)))
    assert float(jnp.max(jnp.abs(g[:, t0 + 1:]))) == 0.0, "d logits[t0] / d embedding[> t0] is not zero"
    assert float(jnp.max(jnp.abs(g[:, : h.T // 4]))) > 0.0, "logits at t0 do not depend on the distant past"


def _hidden_from_embeddings(model, x):
    """The backbone from embedded inputs (the model's run() after its embedding)."""
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)
    if model.stack is not None:
        x, _ = model.stack(model.blocks, x, None, positions=positions)
    else:  # each layer through its block or, where its method's stack wrapper runs it as one layer, the wrapper
        for block, wrap in zip(model.blocks, model.layer_wrappers()):
            x, _ = block(x, None, positions=positions) if wrap is None else wrap.layer(block, x, None)
    return model.norm(x)


@pytest.mark.parametrize("name,cname,direction", ALL)
def test_model_randomness_comes_from_the_key(name, cname, direction):
    h = harness(name, cname, direction)
    if not (h.cls.randomized or h.model.stack is not None):
        pytest.skip(f"{name}: no randomness of its own at the model level")
    tokens, imp = h.inputs()
    a, _ = h(tokens, imp, key=jax.random.key(1))
    a2, _ = h(tokens, imp, key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    outs = [h(tokens, imp, key=jax.random.key(s))[0] for s in range(2, 8)]
    assert max(float(jnp.max(jnp.abs(o - a))) for o in outs) > 1e-5, "other keys give the same training pass"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,cname,direction", ALL)
def test_model_finite_gradients(name, cname, direction, dtype):
    h = harness(name, cname, direction)
    tokens, imp = h.inputs(seed=1)
    dt = jnp.dtype(dtype)
    params = jax.tree.map(lambda p: p.astype(dt), h.params)

    def loss(p):
        out, _ = h._raw(p, tokens, imp, None, jax.random.key(0), deterministic=False)
        return jnp.mean(jax.nn.logsumexp(out.astype(jnp.float32), -1))

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in leaves), f"{name} {dtype}: non-finite"
    assert max(float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for g in leaves) > 0.0


def _packed_rows(T):
    """Two rows' document lengths: three ragged documents (the first of 3 tokens, shorter than any method's block or
    chunk), the second row rotated so its boundaries fall elsewhere; and their segment ids and positions [B, T]."""
    a = 3
    b = (T - a) // 2 + 1
    rows = ((a, b, T - a - b), (b, T - a - b, a))
    seg = np.stack([np.repeat(np.arange(1, 4), r) for r in rows]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in rows]).astype(np.int32)
    return rows, jnp.asarray(seg), jnp.asarray(pos)


def _alone(h, rows, tokens, important, params=None):
    """The logits of each document run alone through the model (the two rows' documents of one length together),
    laid out as in the packed rows."""
    out = None
    starts = [np.concatenate([[0], np.cumsum(r)[:-1]]) for r in rows]
    for n in sorted(set(rows[0])):
        where = [int(s[list(r).index(n)]) for r, s in zip(rows, starts)]
        take = lambda x, n=n, where=where: jnp.stack([x[b, a:a + n] for b, a in enumerate(where)])  # noqa: E731
        o, _ = h(take(tokens), None if important is None else take(important), params=params)
        out = jnp.zeros((B, h.T, o.shape[-1]), o.dtype) if out is None else out
        for b, a in enumerate(where):
            out = out.at[b, a:a + n].set(o[b])
    return out


@pytest.mark.slow  # a whole model's forward per document length, windows and two parameter gradients per case;
# exact attention's packed rows at model level run in the default suite (tests/models/test_packed.py)
@pytest.mark.parametrize("name,cname,direction", ALL)
def test_model_packed_rows_equal_documents_alone(name, cname, direction):
    """Packed rows at model level (STYLE rule 11), for every method that takes segment ids: the logits of a packed
    batch (three ragged documents per row, positions restarting at each) equal each document's run alone, and so
    does the parameter gradient of the packed loss against the documents' token-weighted loss; causal, the rows are
    also fed in windows carrying the state, the cuts falling inside documents. Without the segment ids the same
    rows differ (the law is not met by accident). A method without them refuses in one line
    (tests/attention/test_packed_law.py)."""
    h = harness(name, cname, direction)
    if not h.cls.takes_segments:
        pytest.skip(f"{name} takes no segment ids (its one-line refusal: tests/attention/test_packed_law.py)")
    rows, seg, pos = _packed_rows(h.T)
    tokens, imp = h.inputs(seed=5)
    want = _alone(h, rows, tokens, imp)

    def packed(params, tokens, important, state, positions, segment_ids):
        model = nnx.merge(h.graphdef, params, h.rest)
        if h.causal:
            logits, state, _ = model(tokens, state, positions=positions, segment_ids=segment_ids)
            return logits, state
        return model(tokens, important, positions=positions, segment_ids=segment_ids)[0], None

    run = jax.jit(packed)
    got, _ = run(h.params, tokens, imp, None, pos, seg)
    h.close(got, want, "packed rows != each document alone")
    plain, _ = h(tokens, imp)
    assert float(jnp.max(jnp.abs(plain - want))) > 1e-4, "the rows without segment ids equal the documents alone"
    if h.causal:  # windows carrying the state, cut inside documents
        state, outs, w = h.model.init_state(B, h.T), [], h.T // 3 + 1
        for a in range(0, h.T, w):
            sl = slice(a, a + w)
            o, state = run(h.params, tokens[:, sl], None, state, pos[:, sl], seg[:, sl])
            outs.append(o)
        h.close(jnp.concatenate(outs, axis=1), want, "packed rows in windows carrying the state != alone")

    # the parameter gradient of the packed loss (every position's logsumexp-centred logit of its own token)
    def loss(params, logits_of):
        logits = logits_of(params).astype(jnp.float32)
        return jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))

    def packed_logits(params):
        return packed(params, tokens, imp, None, pos, seg)[0]

    g_packed = jax.jit(jax.grad(lambda p: loss(p, packed_logits)))(h.params)
    g_alone = jax.grad(lambda p: loss(p, lambda q: _alone(h, rows, tokens, imp, q)))(h.params)
    for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone)):
        h.close(a, b, "the packed loss's parameter gradient != the documents' alone")

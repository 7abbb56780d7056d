"""The attention contract (DESIGN.md §2) as one executable suite.

Every registered method runs every law below, in each direction it supports, at each small
configuration it declares through ``AttentionCore.contract_cases()``. A method contributes that
configuration only, never test code: registering a new method gives it the whole suite.

Laws (tolerances from the case; a wrong implementation cannot meet them):
  * shapes and dtypes; jit == eager (on each method's first case); vmap == per-example calls
  * streamed in uneven chunks (1 token, borders that are multiples of no block size) == one full pass
  * token-by-token decoding == full pass, over a length that populates every part of the state
  * a layer's slot of a scanned stack's states (``base.LayerOfStack``, through ``call_core``) decodes as the
    layer's state alone, its new state lands in its slot and the other layers' slots are untouched
  * no future leak, by perturbation and by Jacobian, at a late query whose carried state is populated;
    and a query does see the distant past (its gradient reaches the first quarter of the row)
  * bidirectional: a query sees later tokens
  * finite gradients (inputs and parameters) in fp32 and bf16 with logits scaled x30
  * ragged lengths: a causal pass over a prefix equals the full pass's first outputs
  * randomized methods: same key reproduces, another key differs, deterministic mode ignores the key
  * composed slice states (sequence parallelism): slices summarized from their origins and composed
    left to right give the full pass; the composition is associative
  * capacity: a state smaller than the stream needs raises CapacityError (eager and under jit), or the
    answer is right; never a silently different one
  * every parameter and non-gradient variable names its logical axes
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention.base import LOGICAL_AXES, AttentionCore, CapacityError, LayerOfStack
from longctx.models.backbone import stack_layers
from longctx.models.sequence_shard import call_core

B = 2
SPLIT_SIZES = (13, 1, 7)  # the first chunk spans block borders; no size is a multiple of a block size but 1
CHUNK = 7  # the capacity law streams in chunks of this size (one of SPLIT_SIZES: compiled once)


def _cases():
    out = []
    for name in attention.names():
        cls = attention.get_class(name)
        for cname, case in cls.contract_cases().items():
            if case.level != "core":  # model-level cases: tests/models/test_model_contract.py
                continue
            for direction in case.directions:
                if direction == "causal" and not cls.supports_causal:
                    continue
                if direction == "bidirectional" and not cls.supports_bidirectional:
                    continue
                # one xdist worker per (method, case): the cached harness and its compilations are reused
                marks = [pytest.mark.xdist_group(f"contract-{name}-{cname}")]
                marks += [pytest.mark.slow] if case.slow else []
                out.append(pytest.param(name, cname, direction, id=f"{name}-{cname}-{direction}", marks=marks))
    return out


ALL = _cases()
CAUSAL = [p for p in ALL if p.values[2] == "causal"]
BIDIR = [p for p in ALL if p.values[2] == "bidirectional"]
# jit == eager is checked on each method's first default case: an eager call dispatches op by op and costs 5-9 s
# for the larger methods, and what it can catch (Python-side branches on concrete values) does not depend on the
# case; every other law runs jitted on every case
EAGER = {next(p.values for p in ALL if p.values[0] == n and not any(m.name == "slow" for m in p.marks))
         for n in {p.values[0] for p in ALL if not any(m.name == "slow" for m in p.marks)}}


class Harness:
    """One built core per (method, case, direction) with jitted calls reused across laws."""

    def __init__(self, name, cname, direction):
        self.cls = attention.get_class(name)
        self.case = self.cls.contract_cases()[cname]
        self.causal = direction == "causal"
        c = self.case
        self.core = attention.build(name, ml_collections.ConfigDict(dict(c.cfg)), num_heads=c.num_heads,
                                    head_dim=c.head_dim, value_dim=c.value_dim, causal=self.causal,
                                    rngs=nnx.Rngs(0))
        self.graphdef, self.variables = nnx.split(self.core)
        self.T = c.length
        self.dv = c.value_dim or c.head_dim
        self.call = jax.jit(self._raw, static_argnames=("deterministic",))

    def _raw(self, variables, q, k, v, state, key, deterministic=True):
        return nnx.merge(self.graphdef, variables)(q, k, v, state, deterministic=deterministic, key=key)

    def __call__(self, q, k, v, state=None, key=None, variables=None):
        deterministic = key is None
        return self.call(self.variables if variables is None else variables, q, k, v, state, key,
                         deterministic=deterministic)

    def qkv(self, seed=0, T=None, dtype=jnp.float32, batch=B):
        c = self.case
        T = self.T if T is None else T
        ks = jax.random.split(jax.random.key(seed), 3)
        shape = (batch, c.num_heads, T)
        return (jax.random.normal(ks[0], shape + (c.head_dim,)).astype(dtype),
                jax.random.normal(ks[1], shape + (c.head_dim,)).astype(dtype),
                jax.random.normal(ks[2], shape + (self.dv,)).astype(dtype))

    def key(self):
        return jax.random.key(7) if self.cls.randomized else None

    def stream(self, q, k, v, sizes, state=None, key=None, capacity=None):
        if state is None:
            state = self.core.init_state(q.shape[0], capacity or q.shape[2])
        outs, a, i = [], 0, 0
        T = q.shape[2]
        while a < T:
            b = min(T, a + sizes[i % len(sizes)])
            o, state = self(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state, key=key)
            outs.append(o)
            a, i = b, i + 1
        return jnp.concatenate(outs, axis=2), state

    def close(self, got, want, msg=""):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=self.case.atol, rtol=self.case.rtol, err_msg=msg)


@functools.cache
def harness(name, cname, direction) -> Harness:
    return Harness(name, cname, direction)


@functools.cache
def full_output(name, cname, direction, randomized_key: bool):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    out, _ = h(q, k, v, key=h.key() if randomized_key else None)
    return out


# ----------------------------------------------------------------------------- registry-level laws
def test_every_method_declares_contract_cases():
    for name in attention.names():
        cls = attention.get_class(name)
        cases = cls.contract_cases()
        assert cases, f"{name}: contract_cases() is empty; every registered method must declare at least one"
        for cname, case in cases.items():
            assert set(case.directions) <= {"causal", "bidirectional"}, (name, cname)
            assert case.level in ("core", "model"), (name, cname, case.level)
            assert case.level == "core" or cls.stack_wrapper(causal="causal" in case.directions), (
                f"{name}/{cname}: a model-level case is for a method whose core runs inside a stack wrapper")
            merged = cls.default_config()
            merged.update(case.cfg)
            attention.validate(name, merged, causal="causal" in case.directions)
        for direction, supported in (("causal", cls.supports_causal), ("bidirectional", cls.supports_bidirectional)):
            if supported:
                assert any(direction in c.directions and not c.slow for c in cases.values()), (
                    f"{name}: no fast contract case runs it {direction} in the default suite")


@pytest.mark.parametrize("name,cname,direction", ALL)
def test_parameters_name_their_logical_axes(name, cname, direction):
    h = harness(name, cname, direction)
    variables = jax.tree.leaves(nnx.state(h.core, nnx.Variable), is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in nnx.iter_graph(h.core):
        if not isinstance(var, nnx.Variable):
            continue
        names = var.get_metadata().get("out_sharding")
        assert names is not None, f"{name}: variable {'/'.join(map(str, path))} has no logical axis names"
        assert len(names) == var[...].ndim, f"{name}: {path} names {names} for shape {var[...].shape}"
        assert all(n is None or n in LOGICAL_AXES for n in names), f"{name}: {path} unknown axis in {names}"
    assert variables is not None


# ----------------------------------------------------------------------------- both directions
@pytest.mark.parametrize("name,cname,direction", ALL)
def test_shapes_dtypes_jit_and_vmap(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    out = full_output(name, cname, direction, False)
    assert out.shape == (B, h.case.num_heads, h.T, h.dv)
    assert out.dtype == v.dtype
    assert bool(jnp.all(jnp.isfinite(out)))
    if (name, cname, direction) in EAGER:
        eager, _ = h.core(q, k, v, None, deterministic=True)
        h.close(eager, out, "jit != eager")
    # vmap over an extra leading axis == per-example calls
    qs, ks, vs = (jnp.stack([a, jnp.flip(a, axis=0)]) for a in (q, k, v))
    # under jit, as a vmap is used (an eager vmap dispatches op by op: 8 s of the 19 s of eva's case)
    vm = jax.jit(jax.vmap(lambda a, b, c: h._raw(h.variables, a, b, c, None, None)[0]))(qs, ks, vs)
    h.close(vm[0], out, "vmap[0]")
    h.close(vm[1], h(qs[1], ks[1], vs[1])[0], "vmap[1]")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,cname,direction", ALL)
def test_finite_gradients_with_large_logits(name, cname, direction, dtype):
    h = harness(name, cname, direction)
    dtype = jnp.dtype(dtype)
    q, k, v = h.qkv(seed=1, dtype=dtype)
    q = (q.astype(jnp.float32) * 30.0).astype(dtype)
    w = jax.random.normal(jax.random.key(3), (B, h.case.num_heads, h.T, h.dv))
    key = h.key()
    gd, params, rest = nnx.split(h.core, nnx.Param, ...)

    def loss_p(params, q, k, v):
        out, _ = nnx.merge(gd, params, rest)(q, k, v, None, deterministic=key is None, key=key)
        assert out.dtype == dtype, f"{name}: output dtype {out.dtype} for {dtype} inputs"
        return jnp.sum(out.astype(jnp.float32) * w)

    grads = jax.jit(jax.grad(loss_p, argnums=(0, 1, 2, 3)))(params, q, k, v)
    for leaf in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))), f"{name} {dtype}: non-finite gradient"
    gv = grads[3]
    assert float(jnp.max(jnp.abs(gv.astype(jnp.float32)))) > 0.0, f"{name} {dtype}: zero gradient wrt v"


# ----------------------------------------------------------------------------- bidirectional
@pytest.mark.parametrize("name,cname,direction", BIDIR)
def test_bidirectional_sees_later_tokens(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    out = full_output(name, cname, direction, False)
    k2 = k.at[:, :, -3:].add(3.0)
    v2 = v.at[:, :, -3:].add(3.0)
    out2, _ = h(q, k2, v2)
    W = h.core.receptive_window  # a sliding window: the outputs the changed tokens reach, and none further
    early = slice(h.T - 3 - W + 1, h.T - 3 - W + 5) if W else slice(0, 4)
    assert float(jnp.max(jnp.abs(out2[:, :, early] - out[:, :, early]))) > 1e-4, "early outputs ignore later tokens"
    if W:
        far = slice(0, h.T - 3 - W + 1)
        np.testing.assert_array_equal(np.asarray(out2[:, :, far]), np.asarray(out[:, :, far]),
                                      err_msg="tokens beyond the window changed an output")
    with pytest.raises((ValueError, TypeError)):
        h.core(q, k, v, {"not": "a state"})


@pytest.mark.parametrize("name,cname,direction", BIDIR)
def test_bidirectional_ragged_lengths(name, cname, direction):
    h = harness(name, cname, direction)
    for T in (1, h.T - 3):
        q, k, v = h.qkv(seed=5, T=T)
        out, _ = h(q, k, v)
        assert out.shape == (B, h.case.num_heads, T, h.dv)
        assert bool(jnp.all(jnp.isfinite(out)))


# ----------------------------------------------------------------------------- causal
@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_streamed_uneven_chunks_equal_full(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    for randomized in sorted({False, h.cls.randomized}):
        key = h.key() if randomized else None
        full = full_output(name, cname, direction, randomized)
        streamed, _ = h.stream(q, k, v, SPLIT_SIZES, key=key)
        h.close(streamed, full, f"streamed != full (key={randomized})")
    # a long prefill, then a chunk through the carried state (the sampler's path) == full
    prefilled, _ = h.stream(q, k, v, (h.T - CHUNK, CHUNK))
    h.close(prefilled, full_output(name, cname, direction, False), "prefill + continuation != full pass")


def _composition_slice(h) -> int | None:
    """The longest slice length the core composes states for that cuts the case's row into at
    least three slices (else two); None when the core declares no composition."""
    if type(h.core).compose_states is AttentionCore.compose_states:
        return None
    for parts in (3, 2):
        for n in range(h.T // parts, 0, -1):
            if h.core.sequence_refusal(n) is None:
                return n
    pytest.fail(f"{h.cls.name} declares state composition but refuses every slice of its contract case: "
                f"{h.core.sequence_refusal(h.T // 2)}")


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_composed_slice_states_equal_full(name, cname, direction):
    """Sequence parallelism's law: each slice summarized from its own origin, the summaries composed
    left to right, each slice run from the composition of those before it == the full pass; and
    the composition is associative."""
    h = harness(name, cname, direction)
    n = _composition_slice(h)
    if n is None:
        pytest.skip(f"{name} declares no state composition ({h.core.sequence_refusal(h.T)})")
    q, k, v = h.qkv()
    parts = [slice(i, i + n) for i in range(0, h.T - n + 1, n)]  # a causal prefix of the row: whole slices
    deltas = [h(q[:, :, s], k[:, :, s], v[:, :, s], h.core.sequence_origin(B, h.T, jnp.asarray(s.start, jnp.int32)))[1]
              for s in parts]
    compose = jax.jit(h.core.compose_states)
    prefix, outs = h.core.init_state(B, h.T), []
    for s, delta in zip(parts, deltas):
        outs.append(h(q[:, :, s], k[:, :, s], v[:, :, s], prefix)[0])
        prefix = compose(prefix, delta)
    h.close(jnp.concatenate(outs, axis=2), full_output(name, cname, direction, False)[:, :, :parts[-1].stop],
            "slices run from composed prefix states != full pass")
    if len(deltas) >= 3:
        left = compose(compose(deltas[0], deltas[1]), deltas[2])
        right = compose(deltas[0], compose(deltas[1], deltas[2]))
        for a, b in zip(jax.tree.leaves(left), jax.tree.leaves(right)):
            h.close(a, b, "compose_states is not associative")


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_token_by_token_decoding_equals_full(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    key = h.key()
    full = full_output(name, cname, direction, key is not None)
    decoded, _ = h.stream(q, k, v, (1,), key=key)
    h.close(decoded, full, "decoded token by token != full")


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_a_layer_of_a_stack_decodes_as_the_layer_alone(name, cname, direction):
    """A scanned model's decoding: the core gets its layer's slot of the stacked states (``LayerOfStack``) and
    either steps in the stack itself (``steps_in_stack``: a decoding step writing its token there) or is handed the
    slot's state and its new state set back; tokens one at a time and a chunk of two, the layer index traced as in
    the scan."""
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    key = h.key()
    n = h.T - 5
    _, mine = h.stream(q[:, :, :n], k[:, :, :n], v[:, :, :n], SPLIT_SIZES, key=key, capacity=h.T)
    _, other = h.stream(*(x[:, :, :9] * 0.5 for x in (q, k, v)), SPLIT_SIZES, key=key, capacity=h.T)
    stack = stack_layers([other, mine, other])

    @jax.jit
    def in_stack(variables, q, k, v, stack, layer, key):
        core = nnx.merge(h.graphdef, variables)
        out, st = call_core(core, q, k, v, LayerOfStack(stack, layer), deterministic=key is None, key=key)
        return out, st.stack

    for size in (1, 2, 1, 1):
        s = slice(n, n + size)
        want, mine = h(q[:, :, s], k[:, :, s], v[:, :, s], mine, key=key)
        got, stack = in_stack(h.variables, q[:, :, s], k[:, :, s], v[:, :, s], stack, jnp.int32(1), key)
        h.close(got, want, f"a stack's layer != the layer alone at tokens {s}")
        n += size
    for i, st in ((0, other), (1, mine), (2, other)):
        for got, want in zip((a[i] for a in jax.tree.leaves(stack)), jax.tree.leaves(st), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"slot {i} of the stack")


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_no_future_leak_by_perturbation_and_jacobian(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    T, t0 = h.T, h.T - 6
    out = full_output(name, cname, direction, False)
    noise = h.qkv(seed=11)
    qp, kp, vp = (a.at[:, :, t0 + 1:].set(3.0 * n[:, :, t0 + 1:]) for a, n in zip((q, k, v), noise))
    out_p, _ = h(qp, kp, vp)
    np.testing.assert_allclose(np.asarray(out_p[:, :, :t0 + 1]), np.asarray(out[:, :, :t0 + 1]), atol=1e-6, rtol=0,
                               err_msg="perturbing the future changed a past output")
    assert float(jnp.max(jnp.abs(out_p[:, :, t0 + 1:] - out[:, :, t0 + 1:]))) > 1e-3
    # Jacobian of the output at t0 (every batch row and head) w.r.t. all inputs
    ct = jax.random.normal(jax.random.key(2), (B, h.case.num_heads, h.dv))
    at_t0 = lambda a, b, c: h._raw(h.variables, a, b, c, None, None)[0][:, :, t0]  # noqa: E731
    gq, gk, gv = jax.jit(lambda a, b, c, ct: jax.vjp(at_t0, a, b, c)[1](ct))(q, k, v, ct)  # eager vjp: op by op
    for g, nm in ((gq, "q"), (gk, "k"), (gv, "v")):
        assert float(jnp.max(jnp.abs(g[:, :, t0 + 1:]))) == 0.0, f"d out[{t0}] / d {nm}[>{t0}] is not zero"
    W = h.core.receptive_window
    if W:  # a sliding window: nothing before it reaches t0 (its values, keys or queries), its far edge does
        for g, nm in ((gq, "q"), (gk, "k"), (gv, "v")):
            assert float(jnp.max(jnp.abs(g[:, :, :t0 - W + 1]))) == 0.0, f"d out[{t0}] / d {nm} before the window"
        early = slice(t0 - W + 1, t0 - W + 2)
        qo, ko, vo = (a.at[:, :, :t0 - W + 1].set(3.0 * n[:, :, :t0 - W + 1]) for a, n in zip((q, k, v), noise))
        out_o, _ = h(qo, ko, vo)
        np.testing.assert_allclose(np.asarray(out_o[:, :, t0]), np.asarray(out[:, :, t0]), atol=1e-6, rtol=0,
                                   err_msg="perturbing the keys before the window changed the output")
    else:
        early = slice(0, T // 4)
    assert float(jnp.max(jnp.abs(gv[:, :, early]))) > 1e-6, "the output at t0 does not depend on the distant past"
    assert float(jnp.max(jnp.abs(gq[:, :, t0]))) > 1e-6


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_ragged_prefix_equals_full(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    full = full_output(name, cname, direction, False)
    for T in (1, h.T - 3):
        out, _ = h(q[:, :, :T], k[:, :, :T], v[:, :, :T])
        h.close(out, full[:, :, :T], f"pass over the first {T} tokens != full pass's first {T} outputs")


@pytest.mark.parametrize("name,cname,direction", ALL)
def test_randomness_comes_from_the_key(name, cname, direction):
    h = harness(name, cname, direction)
    if not h.cls.randomized:
        pytest.skip(f"{name} declares no randomness (randomized=False)")
    q, k, v = h.qkv()
    a, _ = h(q, k, v, key=jax.random.key(1))
    a2, _ = h(q, k, v, key=jax.random.key(1))
    b, _ = h(q, k, v, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert float(jnp.max(jnp.abs(a - b))) > 1e-4, "another key gives the same output"
    d1, _ = h.call(h.variables, q, k, v, None, jax.random.key(1), deterministic=True)
    d2, _ = h.call(h.variables, q, k, v, None, jax.random.key(2), deterministic=True)
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))


@pytest.mark.parametrize("name,cname,direction", CAUSAL)
def test_state_capacity_is_never_exceeded_silently(name, cname, direction):
    h = harness(name, cname, direction)
    q, k, v = h.qkv()
    full = full_output(name, cname, direction, False)
    small = h.T // 2
    # eager: one call that overflows the state raises on the host (or is right); the gradual overflow
    # of a chunked stream is the jitted case below (an eager chunked stream compiles every op twice)
    n = small + CHUNK
    try:
        out, _ = h.core(q[:, :, :n], k[:, :, :n], v[:, :, :n], h.core.init_state(B, small), deterministic=True)
    except CapacityError:
        pass
    else:
        h.close(out, full[:, :, :n], "an undersized state gave a different answer (eager)")
    # jitted: the compiled program raises through its host callback
    try:
        out, _ = h.stream(q, k, v, (CHUNK,), state=h.core.init_state(B, small))
        jax.block_until_ready(out)
    except Exception as e:  # JaxRuntimeError wrapping the host callback's CapacityError
        assert isinstance(e, CapacityError) or "CapacityError" in str(e), f"unexpected error: {e!r}"
    else:
        h.close(out, full, "an undersized state gave a different answer (jit)")

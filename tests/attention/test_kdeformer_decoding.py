"""KDEformer's one-token decoding step (docs/methods/kdeformer.md §4.4, ``xla.one_token``): the same output as the
tiled causal form at every position (heavy sets empty, partial and at capacity; a local window wider than the
cache; no samples; no heavy sets; bfloat16), no sort of the code cache, and the token written in place into a
donated state (the step's XLA temporaries a small fraction of the cache). The decoding law of the whole layer
(token by token against the full pass) is the contract's (tests/attention/test_contract.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from longctx.attention.kdeformer import common as kd
from longctx.attention.kdeformer import xla as kx
from longctx.bench.cores import CoreFns
from tests.attention import kit
from tests.attention.kit import maxdiff

D, B, H, M = 16, 2, 2, 48


def copts(**kw):
    return kd.CausalOptions(**(dict(chunk_size=8, local_chunks=2, heavy_capacity=4, num_projs=3, num_samples=8,
                                    sampling="uniform", residual="sampled", power_iters=20, scale=D**-0.5,
                                    tile_budget=1 << 22, heavy_scores_max_len=1024, band_block=8, heavy_impl="gather")
                               | kw))


@functools.partial(jax.jit, static_argnums=5, compiler_options=kit.FAST)
def both(q, k, v, W, key, opts, i):
    """(one_token's output, the tiled form's) for the token at position i after the cache of [0, i) (the slots
    from i on hold later keys, which neither reads: they are not keys yet)."""
    state = dict(kd.next_state(None, k, v, W, q.dtype), length=i)
    new = tuple(jax.lax.dynamic_slice_in_dim(x, i, 1, axis=2) for x in (q, k, v))
    one = kx.one_token(new[0], W, key, opts, kd.next_state(state, new[1], new[2], W, q.dtype))
    tiled = kx.causal_forward(*new, W, key, opts, (state["k"], state["v"], state["codes"]), i)[0]
    return one, tiled


@pytest.mark.parametrize("settings,dtype,tol", [
    ({}, jnp.float32, 2e-6),
    ({"num_projs": 1}, jnp.float32, 2e-6),  # two codes: Hv(i) at its capacity of 4 (the newest 4 of many)
    ({"heavy_capacity": 64}, jnp.float32, 2e-6),  # a capacity above the cache
    ({"local_chunks": 8}, jnp.float32, 2e-6),  # a local window wider than the cache
    ({"local_chunks": 1, "heavy_impl": "scores"}, jnp.float32, 2e-6),
    ({"heavy_capacity": 0}, jnp.float32, 2e-6),
    ({"num_samples": 0}, jnp.float32, 2e-6),
    ({}, jnp.bfloat16, 2e-2),
])
def test_one_token_equals_the_tiled_form_at_every_position(settings, dtype, tol):
    opts = copts(**settings)
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    q, k, v = (jax.random.normal(ks[j], (B, H, M, D)).astype(dtype) for j in range(3))
    W = jax.random.normal(ks[3], (B, H, D, opts.num_projs))
    for i in (1, 7, 8, 15, 16, 17, 24, 31, 40, 47):
        one, tiled = both(q, k, v, W, ks[4], opts, jnp.int32(i))
        assert one.shape == tiled.shape == (B, H, 1, D)
        assert maxdiff(one, tiled) <= tol, (settings, i)


def _decoding_step(dtype=jnp.float32, **settings):
    """A compiled one-token call of a causal core (uniform samples) after a cache of 4096 tokens, its state
    donated as sampling donates it; (core functions, compiled step, its arguments)."""
    core = kit.build("kdeformer", True, heads=H, head_dim=D,
                     causal={"chunk_size": 64, "heavy_capacity": 16, "num_samples": 32, **settings})
    fns = CoreFns(core)
    state = core.init_state(1, 4096)
    q, k, v = (x.astype(dtype) for x in kit.qkv(1, batch=1, heads=H, head_dim=D))
    step = jax.jit(fns.step(), donate_argnums=5)
    return fns, step, (fns.params, fns.rest, q, k, v, state)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_decoding_step_sorts_nothing_and_writes_the_donated_state_in_place(dtype):
    fns, step, args = _decoding_step(dtype)
    text = str(jax.make_jaxpr(fns.step())(*args))
    assert " sort" not in text and "argsort" not in text  # the tiled form sorts the whole code cache
    cache = sum(x.nbytes for x in jax.tree.leaves(args[-1]))
    mem = step.lower(*args).compile().memory_analysis()
    # a read of the state before the write made XLA copy the whole cache into its temporaries every token
    assert mem.temp_size_in_bytes < cache / 8, (mem.temp_size_in_bytes, cache)
    assert mem.alias_size_in_bytes >= cache - 64


def test_the_ref_sampler_keeps_the_tiled_form():
    """'ref' draws from the whole prefix's weights and Gram: its decoding step stays the tiled one (it sorts)."""
    fns, _, args = _decoding_step(sampling="ref")
    assert " sort" in str(jax.make_jaxpr(fns.step())(*args))


@pytest.mark.parametrize("settings", [{}, {"num_projs": 1}, {"heavy_capacity": 0}, {"num_samples": 0},
                                      {"local_chunks": 1}])
def test_a_packed_row_decoded_token_by_token_equals_its_full_pass(settings):
    """Segment ids through §4.4's step (a sampler past a document's end): each document's chunks, prefix end, heavy
    keys and samples counted from its first key, as the packed full pass (§4.6) has them; rows whose documents
    differ in length and order, an id that comes back later as a new document."""
    core = kit.build("kdeformer", True, heads=H, head_dim=D,
                     causal={"chunk_size": 8, "local_chunks": 2, "heavy_capacity": 4, "num_projs": 3,
                             "num_samples": 8} | settings)
    T = 56
    q, k, v = kit.qkv(T, batch=2, heads=H, head_dim=D, seed=4)
    seg = jnp.array([[1] * 21 + [2] * 3 + [3] * 25 + [1] * 7, [4] * 2 + [5] * 37 + [6] * 17], jnp.int32)
    key = jax.random.PRNGKey(9)
    full, _ = core(q, k, v, None, deterministic=False, key=key, segment_ids=seg)
    step = jax.jit(lambda q, k, v, s, st: core(q, k, v, st, deterministic=False, key=key, segment_ids=s))
    state, outs = core.init_state(2, T), []
    for t in range(T):
        o, state = step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], seg[:, t:t + 1], state)
        outs.append(o)
    assert maxdiff(jnp.concatenate(outs, axis=2), full) <= 2e-6, settings

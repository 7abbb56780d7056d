"""Dense's decoding step (longctx/attention/dense/layer.py, module docstring): the KV cache is a ring, a step of one
token writes it into its slot and attends to the written cache (``xla.one_query_attention``: key blocks read as
slices of the cache), so a donated state is updated in place (the step's XLA temporaries a small fraction of the
cache); ``kv_window`` keeps its sliding cache. The decoding law (token by token and uneven chunks against the full
pass, every implementation) is the contract's (tests/attention/test_contract.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.attention.dense import layer as dense_layer
from longctx.attention.dense import xla as dense_xla
from longctx.bench.cores import CoreFns
from tests.attention import kit
from tests.attention.kit import maxdiff


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # bf16: the float32 cache is cast block by block
@pytest.mark.parametrize("name,settings", [("dense", {}), ("swa", {"window": 4096})])
def test_a_decoding_step_writes_the_donated_cache_in_place(name, settings, dtype):
    core = kit.build(name, True, heads=4, head_dim=64, **settings)
    fns = CoreFns(core)
    state = core.init_state(1, 4096)  # 8 MiB of keys and values
    q, k, v = (x.astype(dtype) for x in kit.qkv(1, batch=1, heads=4, head_dim=64))
    args = (fns.params, fns.rest, q, k, v, state)
    cache = sum(x.nbytes for x in jax.tree.leaves(state))
    mem = jax.jit(fns.step(), donate_argnums=5).lower(*args).compile().memory_analysis()
    # a right-aligned cache shifted by concatenate + slice, or one product over the written cache, copied it
    assert mem.temp_size_in_bytes < cache / 4, (mem.temp_size_in_bytes, cache)
    assert mem.alias_size_in_bytes >= cache - 64


# every CPU implementation ('auto' takes the tiles for a decoding step), a sliding window the ring wraps under
PACKED_STEPS = [("dense", {"impl": impl, "block_k": 8}) for impl in ("reference", "blockwise", "xla_cpu", "auto")] + [
    ("swa", {"impl": "auto", "window": 9, "block_k": 8})]


@pytest.mark.parametrize("name,settings", PACKED_STEPS, ids=lambda p: p if isinstance(p, str) else p["impl"])
def test_a_packed_row_decoded_token_by_token_equals_its_full_pass(name, settings):
    """Segment ids through the decoding step: the token written into its slot, the query's document the keys after
    the newest key of another id (rows with ragged documents in different orders, an id that comes back later as
    a new document, a first document longer than a sliding window's ring); the full pass is the packed law's."""
    core = kit.build(name, True, **settings)
    T = 30
    q, k, v = kit.qkv(T, seed=3)
    seg = jnp.array([[1] * 11 + [2] * 3 + [3] * 9 + [1] * 7, [4] * 2 + [5] * 19 + [6] * 9], jnp.int32)
    full, _ = core(q, k, v, None, segment_ids=seg)
    step = jax.jit(lambda q, k, v, s, st: core(q, k, v, st, segment_ids=s))
    state, outs = core.init_state(2, T), []
    for t in range(T):
        o, state = step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], seg[:, t:t + 1], state)
        outs.append(o)
    assert maxdiff(jnp.concatenate(outs, axis=2), full) <= 1e-5


def test_a_packed_decoding_step_writes_the_donated_cache_in_place():
    core = kit.build("dense", True, heads=4, head_dim=64)
    fns = CoreFns(core)
    state = core.init_state(1, 4096)
    q, k, v = kit.qkv(1, batch=1, heads=4, head_dim=64)
    seg = jnp.full((1, 1), 3, jnp.int32)
    step = jax.jit(lambda p, r, q, k, v, st, s: fns.merge(p, r)(q, k, v, st, segment_ids=s), donate_argnums=5)
    cache = sum(x.nbytes for x in jax.tree.leaves(state))
    mem = step.lower(fns.params, fns.rest, q, k, v, state, seg).compile().memory_analysis()
    assert mem.temp_size_in_bytes < cache / 4, (mem.temp_size_in_bytes, cache)


def test_one_query_attention_equals_the_reference_over_a_ring():
    """Positions in ring order, a block size that does not divide the cache (the last block overlaps the one
    before it), empty slots, a window, and the causal mask."""
    M, D = 40, 8
    q, k, v = kit.qkv(M, batch=2, heads=2, head_dim=D, seed=5)
    q = q[:, :, :1]
    for length, window in ((13, 0), (40, 0), (57, 0), (57, 16), (90, 40)):
        k_pos = dense_layer.slot_positions(jnp.int32(length), M)
        q_pos = jnp.array([length - 1], jnp.int32)
        want = dense_layer.naive_attention(q, k, v, q_pos, k_pos, k_pos >= 0, causal=True, window=window)
        for block in (7, 16, 40, 64):
            got = dense_xla.one_query_attention(q, k, v, q_pos, k_pos, k_pos >= 0, causal=True, block_k=block,
                                                window=window)
            assert maxdiff(got, want) <= 1e-6, (length, window, block)


def test_slot_positions_and_the_orders_round_trip():
    M = 6
    assert dense_layer.slot_positions(jnp.int32(0), M).tolist() == [-6, -5, -4, -3, -2, -1]
    assert dense_layer.slot_positions(jnp.int32(4), M).tolist() == [0, 1, 2, 3, -2, -1]
    assert dense_layer.slot_positions(jnp.int32(9), M).tolist() == [6, 7, 8, 3, 4, 5]
    x = jnp.arange(M)
    for length in (0, 4, 9, 12):
        ordered = dense_layer.in_order(x, jnp.int32(length), 0)
        # slot j of the ordered cache holds position length - M + j
        assert np.array_equal(np.asarray(dense_layer.slot_positions(jnp.int32(length), M))[np.asarray(ordered)],
                              np.arange(length - M, length))
        assert np.array_equal(dense_layer.to_ring(ordered, jnp.int32(length), 0), x)


def test_kv_window_decoding_sees_the_query_and_the_capacity_before_it():
    """``kv_window=True`` past its capacity M, token by token: each query sees itself and the M keys before it (a
    sliding window of M + 1), the older keys dropped by design; the step keeps the cache-then-call form."""
    T, M = 24, 8
    core = kit.build("dense", True, kv_window=True)
    q, k, v = kit.qkv(T, seed=9)
    state, outs = core.init_state(q.shape[0], M), []
    for t in range(T):
        o, state = kit.run(core, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outs.append(o)
    pos = jnp.arange(T, dtype=jnp.int32)
    want = dense_layer.naive_attention(q, k, v, pos, pos, jnp.ones((T,), bool), causal=True, window=M + 1)
    assert maxdiff(jnp.concatenate(outs, 2), want) <= 1e-5


@pytest.mark.parametrize("T", [1, 2])
def test_a_cache_refuses_keys_or_values_of_another_width(T):
    """The one-token step writes into the cache's slot, which would take a narrower value and leave zeros."""
    core = kit.build("dense", True, heads=2, head_dim=8)
    q, k, v = kit.qkv(T, heads=2, head_dim=8)
    state = core.init_state(q.shape[0], 4)
    with pytest.raises(ValueError, match="values of width 6"):
        core(q, k, v[..., :6], state)
    with pytest.raises(ValueError):  # the base refuses keys of another width than the queries'
        core(q, k[..., :6], v, state)

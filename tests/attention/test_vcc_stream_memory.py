"""VCC-LM scores only the query rows a call holds (``longctx/attention/vcc/stack.py: lm_layer``).

A window of ``w`` queries shares one selection, but a call holds at most ``min(w, T)`` of a window's rows: a
decoding step one, a 256-token evaluation window 256 of a 512-row window. Each window scores those rows only, and
an aligned call (the parallel pass, every packed document of a training row) shorter than a window scores the band
up to its last token only. Checked on the traced layer's softmax inputs (the logits of every scored row) and on the
values: the calls still equal the parallel pass, in chunks of every size around the window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention.vcc import stack as vs
from tests.attention import kit
from tests.attention.test_vcc import D_MODEL, B, lm

W, G, K, H_FINE, A = 16, 8, 4, 2, 4  # window, local band, block size, fine blocks, anchors
LM = {"window": W, "local": G, "block_size": K, "num_fine_blocks": H_FINE, "anchors": A}
MAX_LEN = 64


def scored_rows(jaxpr, times: int = 1) -> list[tuple[tuple[int, ...], int]]:
    """(shape, how many times it runs) of every float softmax input of 4 dimensions or more (a ``reduce_max`` over
    the last axis) in ``jaxpr``, scan bodies counted ``length`` times."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_max":
            x = eqn.invars[0].aval
            if x.ndim >= 4 and jnp.issubdtype(x.dtype, jnp.floating) and tuple(eqn.params["axes"]) == (x.ndim - 1,):
                found.append((tuple(x.shape), times))
        n = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in kit.sub_jaxprs(eqn.params):
            found += scored_rows(sub, times * n)
    return found


def layer_and_state(T_before: int):
    """The first block of a 2-layer VCC-LM, its options and the state after ``T_before`` tokens."""
    model = lm(**LM)
    block, opts = model.blocks[0], model.stack.opts
    st = vs.lm_init_state(block, opts, B, MAX_LEN, D_MODEL)
    if T_before:
        x = jax.random.normal(jax.random.key(1), (B, T_before, D_MODEL))
        _, st, _ = vs.lm_layer(block, x, st, opts, deterministic=True, key=None, aligned=True)
    return block, opts, st


def attention_logits(block, opts, st, T, *, aligned=False, n_valid=None):
    """The softmax inputs of one lm_layer call of T tokens after ``st`` (selection logits excluded: their rows
    are the A anchors)."""
    x = jnp.zeros((B, T, D_MODEL))
    fn = lambda x, st: vs.lm_layer(block, x, st, opts, deterministic=True, key=None, aligned=aligned,  # noqa: E731
                                   n_valid=n_valid)[0]
    found = scored_rows(jax.make_jaxpr(fn)(x, st).jaxpr)
    return [(shape, n) for shape, n in found if shape[2] != A]


def keys(opts, nband):
    nbmax = -(-MAX_LEN // opts.block_size)
    return nbmax + opts.num_fine * opts.block_size + nband


def test_a_decoding_step_scores_one_row():
    block, opts, st = layer_and_state(21)  # position 21: row 5 of window 1
    H = block.num_heads
    assert attention_logits(block, opts, st, 1) == [((B, H, 1, keys(opts, G + W)), 1)]


def test_an_unaligned_call_scores_its_rows_in_each_window_it_touches():
    block, opts, st = layer_and_state(21)
    H = block.num_heads
    # 8 tokens at positions [21, 29): two windows, 8 rows each (not 2 x 16)
    assert attention_logits(block, opts, st, W // 2) == [((B, H, W // 2, keys(opts, G + W)), 2)]
    # 40 tokens: up to 4 windows of 16 rows
    assert attention_logits(block, opts, st, 40) == [((B, H, W, keys(opts, G + W)), 4)]


def test_an_aligned_call_shorter_than_a_window_scores_its_band_only():
    block, opts, st = layer_and_state(0)
    H = block.num_heads
    # the parallel pass (and each document of a packed training row) over 10 tokens: one window of 10 rows, the
    # band [-G, 10) (not two windows of 16 rows against [-G, 16))
    assert attention_logits(block, opts, st, 10, aligned=True) == [((B, H, 10, keys(opts, G + 10)), 1)]
    assert attention_logits(block, opts, st, 10, aligned=True, n_valid=jnp.int32(7)) == [
        ((B, H, 10, keys(opts, G + 10)), 1)]
    assert attention_logits(block, opts, st, 40, aligned=True) == [((B, H, W, keys(opts, G + W)), 3)]


def test_packed_training_rows_run_each_document_from_a_window_border():
    """The packed parallel pass (state None): one window per document slot of a row shorter than a window."""
    model = lm(**LM)
    stack, block = model.stack, model.blocks[0]
    T = 12
    seg = jnp.concatenate([jnp.ones((B, 5), jnp.int32), jnp.full((B, T - 5), 2, jnp.int32)], axis=1)
    x = jnp.zeros((B, T, D_MODEL))
    fn = lambda x: stack.layer(block, x, None, deterministic=True, segment_ids=seg)[0]  # noqa: E731
    found = [(s, n) for s, n in scored_rows(jax.make_jaxpr(fn)(x).jaxpr) if s[-2] != A]
    nbmax = -(-T // K)  # the state the pass builds holds T tokens
    assert len(found) == 1 and found[0][1] == 1, found  # one window, not a map over two
    assert found[0][0][-2:] == (T, nbmax + min(H_FINE, nbmax) * K + G + T), found


def test_calls_of_every_size_equal_the_parallel_pass():
    block, opts, st0 = layer_and_state(0)
    T = 60
    x = jax.random.normal(jax.random.key(3), (B, T, D_MODEL))
    layer = jax.jit(lambda x, st, aligned=False: vs.lm_layer(block, x, st, opts, deterministic=True, key=None,
                                                             aligned=aligned)[:2], static_argnames="aligned")
    want, want_st = layer(x, st0, aligned=True)
    for sizes in ((1, 5, 11, 3, 16, 17, 7), (7, 33, 20), (21, 1, 1, 37)):
        st, ys, t = st0, [], 0
        for n in sizes:
            y, st = layer(x[:, t:t + n], st)
            ys.append(y)
            t += n
        np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, axis=1)), np.asarray(want), atol=2e-5, rtol=2e-5,
                                   err_msg=str(sizes))
        for name in ("ck", "cv", "sel", "length"):
            np.testing.assert_allclose(np.asarray(st[name]), np.asarray(want_st[name]), atol=2e-5, rtol=2e-5,
                                       err_msg=f"{sizes} {name}")

"""Sampling: filters, and stateful decoding equals recomputing the prefix."""

import jax
import jax.numpy as jnp
import numpy as np

from longctx.sample import filter_logits, generate
from tests.test_evaluate import make_runner


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert np.isfinite(np.asarray(k2)).tolist() == [[True, True, False, False]]
    p = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.7)
    assert np.isfinite(np.asarray(p)).tolist() == [[True, True, False, False]]
    p1 = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.4)
    assert np.isfinite(np.asarray(p1)).tolist() == [[True, False, False, False]]


def test_greedy_stateful_decoding_equals_full_recompute(tiny_cfg):
    _, runner, _ = make_runner(tiny_cfg)
    prompt = np.array([100, 101, 32, 40], np.int32)
    out, times = generate(runner, prompt, 12, temperature=0.0)
    assert len(times) == 12
    # one full pass over prompt + generated tokens: causal, so the logits at position i are the
    # recomputed prefix's, and greedy decoding must have picked their argmax (one compilation)
    seq = np.concatenate([prompt, np.asarray(out)])
    logits, _, _ = runner.model()(jnp.asarray(seq[None, :-1], jnp.int32))
    want = np.asarray(jnp.argmax(logits[0], axis=-1))[len(prompt) - 1:]
    assert out.tolist() == want.tolist()


def test_sampling_is_reproducible_by_seed(tiny_cfg):
    _, runner, _ = make_runner(tiny_cfg)
    prompt = np.array([100, 101], np.int32)
    a, _ = generate(runner, prompt, 10, temperature=1.0, seed=3)
    b, _ = generate(runner, prompt, 10, temperature=1.0, seed=3)
    assert a.tolist() == b.tolist()
    _ = jax

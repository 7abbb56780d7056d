"""FMA's fidelity fixes: where the paper or the released code was silent or wrong (docs/DESIGN.md, "Where the
specs were silent or wrong"; docs/methods/fma.md §2.6, §9.3), the behaviour fixed here and its regression test.

- ``max_len``: its default 0 is the training length; a core built with it unresolved refuses (a large fixed
  default built levels that never get a gradient); ``resolve_max_len`` rounds the training length up to
  ``m 2^k`` and keeps an explicit value.
- ``release_zero_slots=True``: the release's unmasked zero-padded fine and coarse slots (masked by default), on a
  hand-computed case; the blocked paths equal the reference; causal FMA only, refused by the kernel, no decoding.
- ``allow_truncated_window``: past ``max_len`` a query sees back 1/2..1 x ``max_len`` (measured through the
  outputs' dependence on ``v``; an earlier docstring said 3/4).

The fixture comparison with the release is tests/fidelity/test_fma_release.py; the method's own properties
(docs/methods/fma.md §6) are tests/attention/test_fma.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from tests.attention.test_fma import build, qkv, randomize_params


def test_default_max_len_is_the_training_length_and_unresolved_refuses():
    """max_len 0 (default) = the training length: a core built with it unresolved refuses (levels past the
    training length would run untrained); resolve_max_len rounds the training length up to m 2^k and keeps
    an explicit max_len (so explicit configs build the same parameters)."""
    cfg = attention.default_config("fma")
    assert cfg.max_len == 0
    with pytest.raises(ValueError, match="training length"):
        attention.build("fma", cfg, num_heads=1, head_dim=8, causal=True, rngs=nnx.Rngs(0))
    cls = attention.get_class("fma")
    assert cls.resolve_max_len(cfg, seq_len=256).max_len == 256
    assert cls.resolve_max_len(cfg, seq_len=300).max_len == 512
    assert cls.resolve_max_len(ml_collections.ConfigDict({**cfg.to_dict(), "max_len": 1024}), seq_len=256).max_len == 1024
    core = attention.build("fma", cls.resolve_max_len(cfg, seq_len=256), num_heads=1, head_dim=8, causal=True,
                           rngs=nnx.Rngs(0))
    assert core.opts.L == 1  # log2(256/64) - 1


@pytest.mark.parametrize("impl", ["reference", "xla", "xla_cpu"])
def test_release_zero_slots_hand_computed(impl):
    """m=2, p=1, n=max_len=8 (one coarse level, groups of 2), avgpool, q = 0 (every score 0), v_j = j+1.
    Query i's weights: 1 per fine key, m_1/p = 2 per coarse partner; the release adds unmasked zero slots of
    weight m = 2 for i < 2 and (a+1) p m_1/p = 2 (a = 0) or 4 (a = 1) for level-1 group a < 2."""
    n = 8
    core = build("fma", True, heads=1, d=4, dv=1, m=2, p=1, max_len=n, downsample="avgpool", impl=impl,
                 release_zero_slots=True)
    q = jnp.zeros((1, 1, n, 4))
    k = jax.random.normal(jax.random.PRNGKey(0), (1, 1, n, 4))
    v = jnp.arange(1.0, n + 1)[None, None, :, None]
    out, state = core(q, k, v)
    want = [1 / 5, 3 / 6, 6 / 7, 10 / 8, 3.0, 3.5, 4.0, 4.5]
    np.testing.assert_allclose(np.asarray(out[0, 0, :, 0]), want, rtol=1e-6)
    assert state is None  # not decodable
    masked = build("fma", True, heads=1, d=4, dv=1, m=2, p=1, max_len=n, downsample="avgpool", impl=impl)
    np.testing.assert_allclose(np.asarray(masked(q, k, v)[0][0, 0, :, 0]), [1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5],
                               rtol=1e-6)


def test_release_zero_slots_blocked_equals_reference_and_is_refused_where_unserved():
    n = 56
    q, k, v = qkv(n, heads=2, d=8, dv=6)
    outs = {}
    for impl in ("reference", "xla", "xla_cpu"):
        core = randomize_params(build("fma", True, dv=6, release_zero_slots=True, impl=impl))
        outs[impl] = np.asarray(core(q, k, v)[0])
    np.testing.assert_allclose(outs["xla"], outs["reference"], atol=2e-5)
    np.testing.assert_allclose(outs["xla_cpu"], outs["reference"], atol=2e-5)
    base = np.asarray(randomize_params(build("fma", True, dv=6))(q, k, v)[0])
    assert np.abs(base - outs["reference"]).max() > 1e-2  # the zero slots change the first half
    cls = attention.get_class("fma")
    kernel = next(i for i in cls.implementations(causal=True) if i.name == "pallas")
    assert any("release_zero_slots" in r for r in kernel.reasons("cuda", m=4, d=8, dv=8, coarse_kind="packed",
                                                                  release_zero_slots=True))
    with pytest.raises(Exception, match="causal only"):
        build("fma", False, release_zero_slots=True)
    with pytest.raises(ValueError, match="release_zero_slots"):
        build("fma", True, release_zero_slots=True).init_state(1, 56)


@pytest.mark.slow
def test_truncated_window_reaches_back_half_to_one_max_len():
    """allow_truncated_window past max_len: query i depends on keys back to i - w with w in [max_len/2,
    max_len) -- 1/2..1 x max_len, measured through the outputs' dependence on v."""
    max_len, n = 32, 128
    core = build("fma", True, heads=1, d=4, dv=1, m=4, p=2, max_len=max_len, allow_truncated_window=True,
                 impl="xla")
    q, k, _ = qkv(n, heads=1, d=4)
    J = np.asarray(jax.jacfwd(lambda v: core(q, k, v)[0][0, 0, :, 0])(jnp.ones((1, 1, n, 1)))[:, 0, 0, :, 0])
    i = np.arange(max_len, n)
    first = np.array([np.flatnonzero(J[r])[0] for r in i])
    reach = i - first
    assert reach.min() == max_len // 2 and reach.max() == max_len - 1

"""FMA against the authors' released causal forward (GitHub yanmingk/FMA): the fixture
``tests/fixtures/release/fma.npz`` holds a NumPy port's inputs, per-level downsampling weights and outputs
(``scripts/release_fixtures/fma.py`` says which commit and files it follows and how to regenerate it).

longctx is set to the release's behaviour on every option that has one: ``release_zero_slots=True`` (the
release's zero-padded fine and coarse slots, left unmasked), ``downsample='depthwise_conv'`` (the release's
``groupedconv``) with weights shared across heads, ``multiplicity_weighting`` = the release's ``scale_attn``
(both values are checked), causal. The release masks with a finite score, d MASKVAL/(d+1) with
MASKVAL = -65504; longctx masks with -1e30; both give those slots weight exp(-58000) = 0 in f64, so the
comparison is exact up to rounding. Dropout is off (the release's forward then draws nothing).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from longctx import attention

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "release" / "fma.npz"


def load_fixture():
    with np.load(FIXTURE) as z:
        return {key: z[key] for key in z.files}


def build_core(fx, *, scale_attn: bool, impl: str):
    n, m, p, d, heads, _ = (int(x) for x in fx["config"])
    cfg = ml_collections.ConfigDict({"m": m, "p": p, "max_len": n, "impl": impl, "release_zero_slots": True,
                                     "multiplicity_weighting": scale_attn, "downsample": "depthwise_conv",
                                     "share_downsample_across_heads": True})
    core = attention.build("fma", cfg, num_heads=heads, head_dim=d, causal=True, rngs=nnx.Rngs(0))
    L = core.opts.L
    assert L == int(fx["config"][5])
    for name in ("k", "v"):
        for l in range(1, L + 1):
            ml = core.opts.m_l(l)
            w = fx[f"conv_{name}_{l}_weight"]  # torch Conv1d layout [p d, 1, m_l], out channel f p + r
            b = fx[f"conv_{name}_{l}_bias"]  # [p d]
            ds = getattr(core, f"ds_{name}_{l}")
            assert ds.kernel[...].shape == (ml, d, p)
            ds.kernel[...] = jnp.asarray(w[:, 0, :].reshape(d, p, ml).transpose(2, 0, 1))  # W[t, f, r]
            ds.bias[...] = jnp.asarray(b.reshape(d, p))  # c[f, r]
    return core


def run_and_compare(fx, *, scale_attn: bool, impl: str, short: bool = False):
    core = build_core(fx, scale_attn=scale_attn, impl=impl)
    want = fx[f"out_{'short_' if short else ''}scale_attn_{int(scale_attn)}"]
    q, k, v = (jnp.asarray(fx[name][:, :, : want.shape[2]], jnp.float32) for name in ("q", "k", "v"))
    got = np.asarray(jax.jit(lambda a, b, c: core(a, b, c)[0])(q, k, v), np.float64)
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale,
                               err_msg=f"fma impl={impl} scale_attn={scale_attn} vs the release's forward")


@pytest.mark.parametrize("scale_attn", [True, False])
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_fma_matches_release_forward(impl, scale_attn):
    run_and_compare(load_fixture(), scale_attn=scale_attn, impl=impl)


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_fma_matches_release_forward_on_a_shorter_input(impl):
    """n <= max_len/2: the release still runs all L levels of its block_size, and each level beyond those the
    input needs gives the queries of groups a < 2 its zero chunk ((a+1) p slots, weight m_l/p each)."""
    run_and_compare(load_fixture(), scale_attn=True, impl=impl, short=True)


def test_zero_slots_matter_at_this_configuration():
    """The fixture exercises the release's unmasked zero slots: longctx's default (masked) is far from it."""
    fx = load_fixture()
    n, m, p, d, heads, _ = (int(x) for x in fx["config"])
    cfg = ml_collections.ConfigDict({"m": m, "p": p, "max_len": n, "impl": "reference"})
    core = attention.build("fma", cfg, num_heads=heads, head_dim=d, causal=True, rngs=nnx.Rngs(0))
    nnx.update(core, nnx.state(build_core(fx, scale_attn=True, impl="reference"), nnx.Param))
    q, k, v = (jnp.asarray(fx[name], jnp.float32) for name in ("q", "k", "v"))
    got = np.asarray(jax.jit(lambda a, b, c: core(a, b, c)[0])(q, k, v), np.float64)
    want = fx["out_scale_attn_1"]
    assert np.max(np.abs(got - want)) > 1e-2 * np.max(np.abs(want))

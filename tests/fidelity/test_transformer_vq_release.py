"""Transformer-VQ against the released code: tests/fixtures/release/transformer_vq.npz holds the output of a NumPy
port of the release's causal VQ-attention forward (scripts/release_fixtures/transformer_vq.py: release commit,
files, configuration and how to regenerate). The core is built with the release's settings (qk_norm on: RMS norm
and Dk^-1/4 on q and k; rel_dim = the release's d_model, rel_base = its lambda; mem_len = its mem_len; the
compressive cache always on, as agg_cache = 1 in the paper's runs) and given the fixture's inputs and parameters.

Compared: the output, the codes of the keys and the state after the sequence (band keys, values and codes;
per-code mean and count of the cache; position). ``long`` (M > L) and ``short`` (M < L) use the release's
decoupled mem_len. ``dropsin`` feeds the release's sinusoid-dropout keep mask to the core through
``jax.random.bernoulli`` (the core draws its own otherwise): the release masks the [M+L, d_model] flipped table,
the core the rows of distances 0..M, the only ones whose bias the release keeps.

Not compared (documented departures or outside this fixture): the release's initial band codes are S (no code)
where the core's are 0 -- both mark the slots invalid by position, and after the 24 tokens every slot is real;
the cache's dtype (the core keeps fp32 counts and means; the release the activation dtype -- equal here, fp32
against the fp64 port); gradients (grad_thru_cache) and the codebook's EMA update.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention.transformer_vq import reference

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "release" / "transformer_vq.npz"
CASES = ("main", "short", "long", "dropsin")


@pytest.fixture(scope="module")
def fx():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files}


def build_core(fx, case, impl="reference"):
    B, H, Dk, Dv, S, d_model, L, T = (int(x) for x in fx["meta"])
    cfg = attention.default_config("transformer_vq")
    cfg.update({"codebook_size": S, "block_len": L, "mem_len": int(fx[f"{case}_M"]), "qk_norm": True,
                "rel_dim": d_model, "rel_base": float(fx["lam"]), "p_dropsin": float(fx[f"{case}_p_dropsin"]),
                "impl": impl})
    core = attention.build("transformer_vq", cfg, num_heads=H, head_dim=Dk, value_dim=Dv, causal=True,
                           rngs=nnx.Rngs(0))
    f32 = lambda name: jnp.asarray(fx[name], jnp.float32)  # noqa: E731
    core.c_sum[...] = f32("in_c_sum")
    core.c_count[...] = f32("in_c_count")
    core.u[...] = f32("in_u").reshape(H, Dk)
    core.v[...] = f32("in_v_bias").reshape(H, Dk)
    core.W_R[...] = f32("in_W_R")  # r_proj's kernel, [d_model, H*Dk]
    return core


def inputs(fx):
    return tuple(jnp.asarray(fx[f"in_{n}"], jnp.float32) for n in ("q", "k", "v"))


def release_keep_rows(fx, case):
    """The release's keep mask over its flipped table (row r = distance M+L-1-r), as rows of distance 0..M."""
    M = int(fx[f"{case}_M"])
    return jnp.asarray(fx["in_dropsin_keep"][::-1][: M + 1])


def run(fx, case, core, monkeypatch, state=None, q=None, k=None, v=None):
    if q is None:
        q, k, v = inputs(fx)
    if float(fx[f"{case}_p_dropsin"]) > 0:
        keep = release_keep_rows(fx, case)

        def bernoulli(key, p, shape):
            assert tuple(shape) == keep.shape, (shape, keep.shape)
            return keep

        monkeypatch.setattr(jax.random, "bernoulli", bernoulli)
        return _call(core, q, k, v, state, jax.random.key(0), deterministic=False)
    return _call(core, q, k, v, state, None, deterministic=True)


@nnx.jit
def _codes(core, q, k):
    """The code of every key: nearest codeword of the normalized key (the core's quantizer)."""
    return reference.stvq(core.project(q, k)["k"], core.codebook())[1]


@nnx.jit(static_argnames=("deterministic",))
def _call(core, q, k, v, state, key, *, deterministic):
    return core(q, k, v, state, deterministic=deterministic, key=key)


def tol(ref):
    return dict(rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(np.abs(ref)))))


def check_state(fx, case, st):
    np.testing.assert_array_equal(np.asarray(st["pos"]), fx[f"{case}_state_pos"])
    np.testing.assert_array_equal(np.asarray(st["band_z"]), fx[f"{case}_state_z"])
    for ours, theirs in (("band_k", "k_hat"), ("band_v", "v"), ("agg_mu", "mean"), ("agg_n", "count")):
        want = fx[f"{case}_state_{theirs}"]
        np.testing.assert_allclose(np.asarray(st[ours]), want, **tol(want), err_msg=f"state {ours}")


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_release(fx, case, monkeypatch):
    """One call over the 24 tokens (6 blocks) from the empty state: output, codes and final state."""
    core = build_core(fx, case)
    o, st = run(fx, case, core, monkeypatch)
    want = fx[f"{case}_o"]
    np.testing.assert_allclose(np.asarray(o), want, **tol(want))
    check_state(fx, case, st)
    q, k, _ = inputs(fx)
    np.testing.assert_array_equal(np.asarray(_codes(core, q, k)), fx[f"{case}_z"])


@pytest.mark.parametrize("case", ("main", "long"))
def test_reference_block_by_block_matches_release(fx, case, monkeypatch):
    """The release's own recurrence: one call per block of L tokens, the state carried between calls."""
    core = build_core(fx, case)
    q, k, v = inputs(fx)
    L, T = int(fx["meta"][6]), int(fx["meta"][7])
    st, outs = core.init_state(q.shape[0]), []
    for s in range(0, T, L):
        o, st = run(fx, case, core, monkeypatch, st, q[:, :, s:s + L], k[:, :, s:s + L], v[:, :, s:s + L])
        outs.append(o)
    want = fx[f"{case}_o"]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=2)), want, **tol(want))
    check_state(fx, case, st)


@pytest.mark.parametrize("case", ("main", "short", "long"))
def test_auto_matches_release(fx, case, monkeypatch):
    """impl='auto': the linear-time form this platform picks for the call."""
    core = build_core(fx, case, impl="auto")
    o, st = run(fx, case, core, monkeypatch)
    want = fx[f"{case}_o"]
    np.testing.assert_allclose(np.asarray(o), want, **tol(want))
    check_state(fx, case, st)

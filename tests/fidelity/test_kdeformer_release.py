"""KDEformer against the authors' released forward (majid-daliri/kdeformer, the commit stored in the fixture).

``tests/fixtures/release/kdeformer.npz`` is written by ``scripts/release_fixtures/kdeformer.py``, a float64 NumPy
port of the released ``KDEformer.forward`` (KDEformer.py: ``Angular_LSH``, ``CosineHammingLSH``,
``power_method``, ``calc_A_res``), with the caller's ``d^-1/4`` per side on ``q`` and ``k`` (as in
vit_models/kdeformer.py). Two bidirectional self-attention cases (``main``: r=4, b=8, m=24, N=64; ``r7``: r=7,
b=16, m=32, N=128). The release draws at random the projections ``W``, the power method's start and the sampled
columns; the fixture stores them.

longctx's core is built with the released options (``gray_order='forward'``: the release's table lookup;
``sampling='ref'``, ``residual='sampled'``, ``power_iters=20``, ``logit_scale`` = ``d^-1/2`` applied once to the
logits: the same logits as the release's ``d^-1/4`` on each side), and fed the fixture's ``q, k, v``.

The random draws: the test monkeypatches ``draw_projections`` in ``longctx.attention.kdeformer.layer`` (the
fixture's ``W`` instead of a draw from the key) and ``bidir_samples`` in ``longctx.attention.kdeformer.reference``
and ``...kdeformer.xla`` (the release's sampled columns, mapped from sorted to original key positions, with the
release's log-weights ``-log(m P)``), so the core runs the release's draws through its own hashing, sorting,
blocking, masking and combination.

What is compared:

* ``test_hash_codes_and_sort``: the hash codes (table values) and the stable sort orders of queries and keys.
* ``test_heavy_part``: with ``num_samples=0`` the core equals the release's heavy part alone (``sparse``
  numerator over its ones column): the block-diagonal set is the release's.
* ``test_matches_release``: the full output, implementations ``reference`` and ``auto``.
* ``test_sampling_law``: longctx's own sampler (``bidir_samples``, not patched). Departures, stated precisely:
  the release's ``λ = ‖G x_20‖`` from a random start, longctx's Rayleigh quotient from ``1/√e`` (both ``‖Ṽ‖²_op``:
  equal to 1e-5 here); the release's ``P_j ∝ 1/N + ‖ṽ_j‖/λ`` with float norms, longctx's the same formula with
  ``‖ṽ_j‖`` replaced by ``u_j/64 = (⌊64‖ṽ_j‖⌋ + 1)/64`` (integer weights for exact prefix sums), so its ``p`` is
  within ``2/64`` of the release's relatively; and longctx draws from a JAX key where the release calls
  ``torch.multinomial`` (hence the patched draws above).

Not covered: the release's unstable ``torch.sort`` (the port sorts stably, one of its possible orders), lengths
that are not a multiple of the bucket (the release lets blocks straddle batch rows; longctx pads), the ViT file's
projections fixed at construction (longctx's ``fixed_projections`` derives them from ``lsh_seed``), and the causal
form (longctx's own; the release has none).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from release_port import assert_fixture_is_port

from longctx import attention
from longctx.attention.kdeformer import common as kd_common
from longctx.attention.kdeformer import layer as kd_layer
from longctx.attention.kdeformer import reference as kd_reference
from longctx.attention.kdeformer import xla as kd_xla

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "release" / "kdeformer.npz"
SCRIPT = ROOT / "scripts" / "release_fixtures" / "kdeformer.py"
RELEASE_COMMIT = "427df2d56b7b97d1547464396755d3a453ea7e82"

RELEASED = dict(gray_order="forward", sampling="ref", residual="sampled", power_iters=20, logit_scale=0.0,
                fixed_projections=False)
CASES = {"main": dict(bucket_size=8, num_samples=24, num_projs=4),
         "r7": dict(bucket_size=16, num_samples=32, num_projs=7)}
TOL = 1e-5  # fp32, relative to the output's scale


def load(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as f:
        return {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith(case + "/")}


def build_core(case: str, fx: dict, impl: str, **over):
    H, d, dv = fx["q"].shape[1], fx["q"].shape[3], fx["v"].shape[3]
    return attention.build("kdeformer", {**RELEASED, **CASES[case], "impl": impl, **over}, num_heads=H, head_dim=d,
                           causal=False, rngs=nnx.Rngs(0), value_dim=dv)


def release_samples(fx: dict):
    """The release's draws in longctx's terms: (original key positions [B,H,m], ω = -log(m P) [B,H,m])."""
    index, P, sort_k = fx["index"], fx["P"], fx["sort_k"]
    m = index.shape[-1]
    idx = np.take_along_axis(sort_k, index, axis=-1)  # sorted position -> original position
    omega = -np.log(m * np.take_along_axis(P, index, axis=-1))
    return jnp.asarray(idx, jnp.int32), jnp.asarray(omega, jnp.float32)


def feed_release_draws(monkeypatch, fx: dict):
    """Make the core use the fixture's projections W and the release's sampled columns and weights."""
    W = jnp.asarray(fx["W"], jnp.float32)
    idx, omega = release_samples(fx)
    N = fx["q"].shape[2]

    def release_projections(key, batch, heads, dim, num_projs):
        assert (batch, heads, dim, num_projs) == W.shape
        return W

    def release_bidir_samples(key_s, v, n_valid, opts):
        assert n_valid == N and opts.num_samples == idx.shape[-1]
        return idx, omega

    monkeypatch.setattr(kd_layer, "draw_projections", release_projections)
    for module in (kd_reference, kd_xla):
        monkeypatch.setattr(module, "bidir_samples", release_bidir_samples)


def longctx_out(case: str, impl: str, monkeypatch, **over) -> tuple[np.ndarray, dict]:
    fx = load(case)
    core = build_core(case, fx, impl, **over)
    feed_release_draws(monkeypatch, fx)
    q, k, v = (jnp.asarray(fx[n], jnp.float32) for n in ("q", "k", "v"))

    @nnx.jit  # traced afresh on every call: a monkeypatched helper is never skipped by a cached compilation
    def run(c, q, k, v):
        return c(q, k, v, deterministic=False, key=jax.random.PRNGKey(0))[0]

    return np.asarray(run(core, q, k, v)), fx


def assert_close(out, want, what):
    assert out.shape == want.shape, what
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(out - want).max())
    assert err <= TOL * scale, f"{what}: max |longctx - release| = {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("case", list(CASES))
def test_hash_codes_and_sort(case):
    fx = load(case)
    r = CASES[case]["num_projs"]
    W = jnp.asarray(fx["W"])
    for side in ("q", "k"):
        code = kd_common.gray_rank(kd_common.lsh_codes(jnp.asarray(fx[side]), W), r, "forward")
        np.testing.assert_array_equal(np.asarray(code), fx[f"code_{side}"], err_msg=f"{case}: codes of {side}")
        order = jnp.argsort(code, axis=-1, stable=True)
        np.testing.assert_array_equal(np.asarray(order), fx[f"sort_{side}"], err_msg=f"{case}: sort of {side}")


@pytest.mark.parametrize("case", list(CASES))
def test_heavy_part(case, monkeypatch):
    out, fx = longctx_out(case, "reference", monkeypatch, num_samples=0)
    sparse = fx["sparse"]
    assert_close(out, sparse[..., :-1] / sparse[..., -1:], f"{case} heavy part")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_matches_release(case, impl, monkeypatch):
    out, fx = longctx_out(case, impl, monkeypatch)
    assert_close(out, fx["out"], f"{case} {impl}")


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_law(case):
    """longctx's own sampler against the release's P (departures in the module docstring)."""
    fx = load(case)
    v = jnp.asarray(fx["v"])
    B, H, N, _ = v.shape
    m = CASES[case]["num_samples"]
    gram = kd_common.augmented_gram(v, jnp.ones((N,), bool)[None, None])
    lam = jax.jit(kd_common.power_lambda, static_argnums=1)(gram, 20)
    np.testing.assert_allclose(np.asarray(lam), fx["lam"], rtol=1e-5, err_msg=f"{case}: λ = ‖Ṽ‖²_op")
    opts = kd_common.BidirOptions(bucket_size=CASES[case]["bucket_size"], num_samples=m,
                                  num_projs=CASES[case]["num_projs"], gray_order="forward", sampling="ref",
                                  residual="sampled", power_iters=20, scale=fx["q"].shape[-1] ** -0.5)
    idx, omega = jax.jit(kd_common.bidir_samples, static_argnums=(2, 3))(jax.random.PRNGKey(3), v, N, opts)
    idx, p = np.asarray(idx), np.exp(-np.asarray(omega, np.float64)) / m
    assert idx.shape == (B, H, m) and idx.min() >= 0 and idx.max() < N
    # the release's P in original key order
    P = np.empty_like(fx["P"])
    np.put_along_axis(P, fx["sort_k"], fx["P"], axis=-1)
    np.testing.assert_allclose(p, np.take_along_axis(P, idx, axis=-1), rtol=2 / 64, err_msg=f"{case}: p vs P")
    # exactly the release's formula with the norms quantised to u/64
    vaug = np.concatenate([fx["v"].astype(np.float64), np.ones((B, H, N, 1))], axis=-1)
    a = (np.floor(np.sqrt(np.sum(vaug.astype(np.float32) ** 2, -1, dtype=np.float32)) * 64) + 1) / 64
    Pq = (1.0 / N + a / fx["lam"][..., None])
    Pq = Pq / Pq.sum(-1, keepdims=True)
    np.testing.assert_allclose(p, np.take_along_axis(Pq, idx, axis=-1), rtol=1e-5, err_msg=f"{case}: quantised P")


def test_fixture_is_the_port():
    """The stored fixture is what the port in scripts/release_fixtures/kdeformer.py writes (no drift)."""
    assert_fixture_is_port(SCRIPT, FIXTURE, RELEASE_COMMIT)

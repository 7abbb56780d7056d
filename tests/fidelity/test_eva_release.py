"""EVA against the authors' released forward (HKUNLP/efficient-attention, the commit stored in the fixture).

``tests/fixtures/release/eva.npz`` is written by ``scripts/release_fixtures/eva.py``, a float64 NumPy port of the
released ``CausalEVAttention.forward`` (causal_eva.py) and ``EVA.forward`` (eva.py), with random values for every
parameter (chunk projections, LayerNorm scales and biases, relative-bias tables). Each case stores the per-head
projections ``q, k, v`` the released layer computes and its head outputs before the output projection, in
evaluation mode (``ω = µ``) and in training mode (``ω = µ + ε``, the stored draws ``ε`` [B, H, C, d]).

longctx's core is built with the released options (``partition='full'``, ``chunk_logit='rep'``,
``chunk_rep='learned'``, ``adaptive_proj='qk'`` (the release's ``qk`` / ``default``: Linear + LayerNorm),
``mu_mode='auto'`` (causal ``q̂ + k̂``, bidirectional ``½(q̂ + k̂)``), ``rf_scale='released'``, no attention
dropout), loaded with the fixture's parameters, and fed the fixture's ``q, k, v``. In training mode the test
monkeypatches ``chunk_noise`` where ``reference.py`` and ``xla.py`` look it up, so that the core uses the
release's draws instead of its own per-chunk ``fold_in`` draws.

What is compared, and what is not:

* causal, no overlap, T5 bias (``causal``): everything; 60 tokens, padded to 64 on both sides.
* causal with ``overlap_window`` (``causal_ovl``): relative bias off. The release indexes the bias by position
  inside the widened window (``key slot - query row``), longctx by absolute offset (``key - query``); they agree
  only without overlap (a documented departure), so this case compares the overlap geometry without bias.
* bidirectional (``bidir``): no overlap window, ``num_chunks`` 8 over 32 padded positions, per-head T5 bias.
  Not covered: the release's bidirectional overlap also widens the chunks by half a window (longctx has no such
  option) and the release leaves all-padding chunks visible (longctx masks them); the fixture has no overlap and
  no chunk made only of padding.
* The release pads the layer input before its projections and masks with ``-5e4``; longctx zero-pads ``q, k, v``
  and masks with ``-1e30``. Padded positions are masked or zeroed on both sides, so outputs agree.
* The release's incremental-decoding path is not compared (longctx's decoding follows its own full forward).
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
from longctx.attention.eva import reference as eva_reference_module
from longctx.attention.eva import xla as eva_xla_module

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "release" / "eva.npz"
SCRIPT = ROOT / "scripts" / "release_fixtures" / "eva.py"
RELEASE_COMMIT = "531ff5169b56fcec9d0a361125cffb62ab5e8781"

RELEASED = dict(partition="full", chunk_logit="rep", chunk_rep="learned", adaptive_proj="qk", mu_mode="auto",
                rf_scale="released", attn_dropout=0.0)
CASES = {
    "causal": dict(causal=True, cfg=dict(window_size=16, chunk_size=4, overlap_window=False, use_rpe=True)),
    "causal_ovl": dict(causal=True, cfg=dict(window_size=8, chunk_size=4, overlap_window=True, use_rpe=False)),
    "bidir": dict(causal=False, cfg=dict(window_size=8, num_chunks=8, overlap_window=False, use_rpe=True)),
}
TOL = 1e-5  # fp32, relative to the output's scale


def load(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as f:
        return {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith(case + "/")}


def build_core(case: str, fx: dict, impl: str):
    spec = CASES[case]
    H, d = fx["q"].shape[1], fx["q"].shape[3]
    core = attention.build("eva", {**RELEASED, **spec["cfg"], "impl": impl}, num_heads=H, head_dim=d,
                           causal=spec["causal"], rngs=nnx.Rngs(0))
    # the release's nn.Linear weights are [out, in]; longctx's are [in, out]
    for side, tag in (("q", "mq"), ("k", "mk")):
        getattr(core, f"{side}_w")[...] = jnp.asarray(fx[f"{tag}_w"].T, jnp.float32)
        getattr(core, f"{side}_b")[...] = jnp.asarray(fx[f"{tag}_b"], jnp.float32)
        getattr(core, f"{side}_ln_scale")[...] = jnp.asarray(fx[f"{tag}_g"], jnp.float32)
        getattr(core, f"{side}_ln_bias")[...] = jnp.asarray(fx[f"{tag}_s"], jnp.float32)
    if spec["cfg"]["use_rpe"]:
        table = fx["rpe"][:, 0] if spec["causal"] else fx["rpe"]  # causal: one table shared by the heads
        assert core.rpe_table[...].shape == table.shape
        core.rpe_table[...] = jnp.asarray(table, jnp.float32)
    return core


def feed_release_draws(monkeypatch, eps: np.ndarray):
    """Make the core's chunk noise the release's draws ε [B, H, C, d] (chunk ``c`` -> ``eps[:, :, c]``)."""
    table = jnp.asarray(eps, jnp.float32)

    def release_noise(noise_key, chunk_ids, batch, heads, dim):
        assert (batch, heads, dim) == (table.shape[0], table.shape[1], table.shape[3])
        return jnp.take(table, jnp.asarray(chunk_ids), axis=2)

    for module in (eva_reference_module, eva_xla_module):
        monkeypatch.setattr(module, "chunk_noise", release_noise)


def longctx_heads(case: str, impl: str, monkeypatch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{mode: (longctx's head outputs [B, H, T, d], the release's)} for one case, modes 'eval' and 'train'."""
    fx = load(case)
    core = build_core(case, fx, impl)
    q, k, v = (jnp.asarray(fx[n], jnp.float32) for n in ("q", "k", "v"))
    feed_release_draws(monkeypatch, fx["eps"])  # only the training pass draws

    # both modes in one program, traced afresh on every call (a monkeypatched helper is never skipped by a
    # cached compilation)
    @nnx.jit
    def both(c, q, k, v):
        return (c(q, k, v, deterministic=True)[0],
                c(q, k, v, deterministic=False, key=jax.random.PRNGKey(0))[0])

    ev, tr = both(core, q, k, v)
    return {"eval": (np.asarray(ev), fx["heads_eval"]), "train": (np.asarray(tr), fx["heads_train"])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_matches_release(case, impl, monkeypatch):
    for mode, (out, want) in longctx_heads(case, impl, monkeypatch).items():
        assert out.shape == want.shape
        scale = max(1.0, float(np.abs(want).max()))
        err = float(np.abs(out - want).max())
        assert err <= TOL * scale, f"{case} {impl} {mode}: max |longctx - release| = {err:.3g} (scale {scale:.3g})"


def test_fixture_is_the_port():
    """The stored fixture is what the port in scripts/release_fixtures/eva.py writes (no drift between them)."""
    assert_fixture_is_port(SCRIPT, FIXTURE, RELEASE_COMMIT)

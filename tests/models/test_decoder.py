"""Decoder LM: the stateful call obeys the streaming law at model level."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx.config import base_config
from longctx.models.decoder import build_model


def small_model_cfg(positions="rotary", **kw):
    c = base_config().model
    c.vocab_size = 50
    c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 32, 2, 2, 16, 64
    c.positions = positions
    c.max_len = 64
    for k, v in kw.items():
        c[k] = v
    return c


@pytest.mark.parametrize("positions", ["none", "learned", "sinusoidal", "rotary"])
def test_chunked_and_token_by_token_equal_full(positions):
    model = build_model(small_model_cfg(positions), seed=1)
    call = nnx.jit(lambda m, t, s: m(t, s)[:2])  # one compile per chunk length (eager dispatch was most of the time)
    tokens = jax.random.randint(jax.random.key(0), (2, 21), 0, 50)
    full, state_full = call(model, tokens, None)
    state = model.init_state(2, 21)
    outs = []
    for a, b in [(0, 7), (7, 8), (8, 21)]:
        lo, state = call(model, tokens[:, a:b], state)
        outs.append(lo)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), atol=1e-4)
    state = model.init_state(2, 21)
    steps = []
    for t in range(21):
        lo, state = call(model, tokens[:, t : t + 1], state)
        steps.append(lo)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-4)
    assert int(state["pos"]) == 21 == int(state_full["pos"])


def test_untied_head_and_rmsnorm_build_and_run():
    model = build_model(small_model_cfg(tie_embeddings=False, norm="rmsnorm"), seed=0)
    logits, _, aux = nnx.jit(lambda m: m(jnp.zeros((1, 5), jnp.int32)))(model)  # jitted: eager compiles op by op
    assert logits.shape == (1, 5, 50) and aux["losses"] == {}


def test_dropout_needs_key_and_is_reproducible():
    model = build_model(small_model_cfg(dropout=0.5), seed=0)
    tokens = jnp.ones((1, 8), jnp.int32)
    # jitted (an eager call compiles op by op); key None: the deterministic pass
    call = nnx.jit(lambda m, key: m(tokens, deterministic=key is None, key=key)[0])
    a = call(model, jax.random.key(1))
    b = call(model, jax.random.key(1))
    c = call(model, jax.random.key(2))
    d = call(model, None)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c)) and not np.allclose(np.asarray(a), np.asarray(d))


def test_chunked_output_loss_equals_full_softmax_loss():
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 50)
    for tie in (True, False):
        full = build_model(small_model_cfg(tie_embeddings=tie), seed=0)
        chunked = build_model(small_model_cfg(tie_embeddings=tie, loss_chunk=16), seed=0)

        def both(full, chunked):  # jitted: an eager call compiles op by op
            h, _, _ = full.hidden(tokens[:, :-1])
            logp = jax.nn.log_softmax(full(tokens[:, :-1])[0], -1)
            return chunked.nll(h, tokens[:, 1:]), -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]

        nll, ref = nnx.jit(both)(full, chunked)
        np.testing.assert_allclose(np.asarray(nll), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_adaptive_output_nll_matches_its_log_probs_and_decodes():
    model = build_model(small_model_cfg(output="adaptive", tie_embeddings=False, adaptive_cutoffs=(10, 30)), seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 50)

    def run(model):  # jitted: an eager call compiles op by op
        h, _, _ = model.hidden(tokens[:, :-1])
        return model.logits(h), model.nll(h, tokens[:, 1:])

    logp, nll = nnx.jit(run)(model)
    np.testing.assert_allclose(np.asarray(jnp.exp(logp).sum(-1)), 1.0, rtol=1e-5)
    ref = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(nll), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,block,policy", [
    ("dense", "transformer", "auto"), ("dense", "transformer", "nothing_saveable"),
    ("transformer_vq", "gau", "dots_saveable"),
    pytest.param("eva", "transformer", "auto", marks=pytest.mark.slow),
    pytest.param("transformer_vq", "gau", "auto", marks=pytest.mark.slow)])
def test_remat_gives_the_same_loss_gradients_and_aux(name, block, policy):
    """model.remat recomputes each block in the backward: same loss, gradients, aux losses and stats, and the
    gradient's program really holds the recomputed forward (more matmuls than without)."""
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 50)

    def loss_fn(model):
        logits, _, aux = model(tokens[:, :-1], deterministic=False, key=jax.random.key(3))
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
        return nll + sum(aux["losses"].values()), aux

    results, dots = [], []
    for remat in (False, True):
        cfg = small_model_cfg(block=block, remat=remat, max_len=64, remat_policy=policy)
        cfg.attention.name = name
        if name == "eva":
            cfg.attention.eva.update({"window_size": 8, "chunk_size": 4})
        if name == "transformer_vq":
            cfg.attention.transformer_vq.update({"block_len": 8, "codebook_size": 8})
        model = build_model(cfg, seed=0)
        grad = nnx.value_and_grad(loss_fn, has_aux=True)
        jaxpr = str(jax.make_jaxpr(grad)(model))
        dots.append(jaxpr.count("dot_general["))
        (loss, aux), grads = nnx.jit(grad)(model)
        results.append((loss, aux["losses"], aux["stats"], nnx.state(grads)))
    assert dots[1] > dots[0], dots  # the backward recomputes the blocks' forward matmuls
    (l0, a0, s0, g0), (l1, a1, s1, g1) = results
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for x, y in zip(jax.tree.leaves((a0, s0, g0)), jax.tree.leaves((a1, s1, g1))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-5, atol=1e-6)
    assert len(jax.tree.leaves(g0)) > 0 and len(jax.tree.leaves(g0)) == len(jax.tree.leaves(g1))


def test_remat_policy_auto_is_per_platform():
    from longctx.models.backbone import resolve_remat_policy

    assert resolve_remat_policy("auto", "cpu") == "cotangent_tied"
    assert resolve_remat_policy("auto", "gpu") == resolve_remat_policy("auto", "tpu") == "nothing_saveable"
    assert resolve_remat_policy("dots_saveable", "cpu") == "dots_saveable"
    with pytest.raises(ValueError, match="allowed"):
        resolve_remat_policy("everything", "cpu")

"""``model.remat`` under the training step's conditions: a window that carries the previous window's state in and
the rows split into micro-batches (``train.microbatches``). Each remat form gives the loss, gradients and new
state that the same step without remat gives. Transformer-VQ runs its tiled causal form (``tiled_min_scores=1``:
every window of a block or more, whose hand-written backward takes the cache counts derived from the carried state
as constants), the form long windows take; dense attention carries its key/value cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.config import base_config
from longctx.models.decoder import build_model
from longctx.train.step import _batch_axes, accumulate_grads, make_loss_fn, split_model

B, V, W = 4, 50, 16  # rows, vocabulary, window; two windows per row
K = 2  # micro-batches


def model_cfg(name, block, **kw):
    c = base_config().model
    c.vocab_size = V
    c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 16, 2, 2, 8, 32
    c.positions = "none" if name == "transformer_vq" else "rotary"
    c.max_len = 2 * W
    c.block = block
    c.attention.name = name
    if name == "transformer_vq":
        c.num_heads = 1
        c.attention.transformer_vq.update({"block_len": 8, "codebook_size": 8, "tiled_min_scores": 1})
    for k, v in kw.items():
        c[k] = v
    return c


def tokens():
    return jax.random.randint(jax.random.key(0), (B, 2 * W + 1), 0, V)


def first_window_state(model):
    """The state the first window leaves (the model's training pass over it): what the second window carries in."""
    graphdef, params, nongrad, rest = split_model(model)
    t = tokens()
    _, (_, state, _) = jax.jit(make_loss_fn(graphdef))(params, nongrad, rest, t[:, :W], t[:, 1:W + 1],
                                                        model.init_state(B, 2 * W), jax.random.key(1))
    return state


def second_window_step(model, microbatches: int, state):
    """The training step's gradient of the second window: ``state`` carried in (a constant), the rows in
    ``microbatches`` micro-batches (``accumulate_grads``) or all at once (``value_and_grad``)."""
    graphdef, params, nongrad, rest = split_model(model)
    t = tokens()
    loss = make_loss_fn(graphdef)
    if microbatches == 1:
        grad_fn = jax.value_and_grad(loss, has_aux=True)
    else:
        axes = _batch_axes(graphdef, params, nongrad, rest, B, microbatches, 2 * W)
        grad_fn = accumulate_grads(loss, microbatches, state_axes=axes)
    (value, (ce, new_state, aux)), grads = jax.jit(grad_fn)(
        params, nongrad, rest, t[:, W:2 * W], t[:, W + 1:], state, jax.random.key(2))
    return value, grads, new_state, aux["losses"]


def assert_close(a, b, msg):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), msg
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=2e-5, atol=1e-6,
                                   err_msg=msg)


# carried state (transformer_vq) and micro-batches (dense) each once by default; every combination with -m slow
@pytest.mark.parametrize("name,block,policy,microbatches", [
    ("transformer_vq", "gau", "cotangent_tied", 1), ("dense", "transformer", "cotangent_tied", K),
    *(pytest.param(*c, marks=pytest.mark.slow) for c in [
        ("transformer_vq", "gau", "cotangent_tied", K), ("dense", "transformer", "cotangent_tied", 1),
        ("transformer_vq", "gau", "nothing_saveable", K), ("dense", "transformer", "nothing_saveable", K)])])
def test_remat_with_carried_state_and_microbatches_equals_no_remat(name, block, policy, microbatches):
    model = build_model(model_cfg(name, block, dropout=0.1), seed=0)
    # both steps carry in the same first-window state; the remat model's own forward is held to the reference's
    # through the new state it returns
    state = first_window_state(model)
    ref = second_window_step(model, microbatches, state)
    got = second_window_step(build_model(model_cfg(name, block, dropout=0.1, remat=True, remat_policy=policy),
                                         seed=0), microbatches, state)
    assert jax.tree.leaves(ref[1]) and jax.tree.leaves(ref[2])  # gradients and a carried state to compare
    for part, x, y in zip(("loss", "gradients", "new state", "aux losses"), got, ref):
        assert_close(x, y, f"{name} remat={policy} microbatches={microbatches}: {part}")


def test_cotangent_tied_gives_no_gradient_to_unperturbed_inputs():
    """The cotangent-tied form differentiates the perturbed inputs only, as ``jax.checkpoint`` does: a carried state
    the gradient does not ask for is not linearized, and one it asks for gets the same gradient either way."""
    from longctx.models.backbone import _remat_after_cotangent

    def fn(w, x, st, positions, key, extra):
        y = jnp.tanh(x @ w + st["h"] * positions[:, None])
        return y, {"h": y * st["h"], "n": st["n"] + 1}, ({}, {}, {})

    w = jax.random.normal(jax.random.key(0), (3, 3))
    x = jax.random.normal(jax.random.key(1), (2, 3))
    st = {"h": jax.random.normal(jax.random.key(2), (2, 3)), "n": jnp.zeros((), jnp.int32)}
    pos = jnp.arange(2, dtype=jnp.float32)
    tied = _remat_after_cotangent(fn)

    def loss(f, w, x, h):
        y, new, _ = f(w, x, {"h": h, "n": st["n"]}, pos, None, {})
        return jnp.sum(y ** 2) + jnp.sum(new["h"])

    for argnums in ((0, 1), (0, 1, 2)):
        got = jax.grad(lambda *a: loss(tied, *a), argnums)(w, x, st["h"])
        want = jax.grad(lambda *a: loss(fn, *a), argnums)(w, x, st["h"])
        assert_close(got, want, f"argnums {argnums}")
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: loss(tied, w, x, st["h"])))(w))
    assert jaxpr.count("dot_general") == 3, jaxpr  # forward, recomputation, and w's cotangent only (no x's)

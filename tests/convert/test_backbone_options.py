"""The backbone options a pretrained model needs, as ordinary config options: grouped-query attention, gated
MLPs, biases, the rotary base, the norms' epsilon. Their defaults build every existing model as before (the
existing model tests pin that); here: what each option does, and the one-line refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.models.decoder import build_model


def tiny(**model):
    c = config_lib.base_config()
    m = c.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.head_dim, m.d_ff = 32, 16, 2, 4, 4, 32
    for k, v in model.items():
        m[k] = v
    return config_lib.validate(c)


IDS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 12)))
logits = nnx.jit(lambda model, ids: model(ids)[0])


def test_grouped_query_attention_is_attention_with_repeated_kv_heads():
    """A model with 2 k/v heads computes what the 4-head model computes when each k/v head's weights are
    repeated to the query heads of its group (kv head j serves query heads 2j, 2j+1)."""
    gqa = build_model(tiny(num_kv_heads=2).model, seed=1)
    mha = build_model(tiny().model, seed=1)
    H, Hkv, Dh, d = 4, 2, 4, 16
    for bg, bm in zip(gqa.blocks, mha.blocks):
        W = bg.qkv.kernel[...]
        assert W.shape == (d, (H + 2 * Hkv) * Dh)
        q, k, v = W[:, : H * Dh], W[:, H * Dh : (H + Hkv) * Dh], W[:, (H + Hkv) * Dh :]
        rep = lambda a: jnp.repeat(a.reshape(d, Hkv, Dh), H // Hkv, axis=1).reshape(d, H * Dh)  # noqa: E731
        bm.qkv.kernel[...] = jnp.concatenate([q, rep(k), rep(v)], axis=1)
        nnx.update(bm.out, nnx.state(bg.out))
        nnx.update(bm.mlp, nnx.state(bg.mlp))
    nnx.update(mha.embed, nnx.state(gqa.embed))
    a, b = logits(gqa, IDS), logits(mha, IDS)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_query_decoding_equals_the_full_forward():
    model = build_model(tiny(num_kv_heads=1, mlp="swiglu", qkv_bias=True, out_bias=True, norm="rmsnorm",
                             num_layers=1).model)
    full = logits(model, IDS)
    state = model.init_state(2, 12)
    parts = []
    step = nnx.jit(lambda m, ids, st: m(ids, st)[:2])
    for lo, hi in ((0, 5), (5, 12)):
        y, state = step(model, IDS[:, lo:hi], state)
        parts.append(y)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,act", [("swiglu", "silu"), ("geglu", "gelu")])
def test_gated_mlp(kind, act):
    mlp = build_model(tiny(mlp=kind, mlp_bias=False).model).blocks[0].mlp
    assert set(nnx.to_pure_dict(nnx.state(mlp))) == {"gate", "up", "down"} and mlp.up.bias is None
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 16)), jnp.float32)
    f = getattr(__import__("jax").nn, act)
    want = (f(x @ mlp.gate.kernel[...]) * (x @ mlp.up.kernel[...])) @ mlp.down.kernel[...]
    np.testing.assert_allclose(mlp(x, deterministic=True), want, rtol=1e-5, atol=1e-6)


def test_biases_rope_theta_and_eps_reach_the_layers():
    model = build_model(tiny(qkv_bias=True, out_bias=True, mlp_bias=False, rope_theta=500000.0, norm_eps=1e-5,
                             norm="rmsnorm").model)
    b = model.blocks[0]
    assert b.qkv.bias is not None and b.out.bias is not None and b.mlp.up.bias is None
    assert b.rope_theta == 500000.0 and b.norm1.eps == 1e-5 and model.norm.eps == 1e-5
    plain = build_model(tiny(norm="rmsnorm").model)
    assert plain.blocks[0].qkv.bias is None and plain.blocks[0].mlp.up.bias is not None
    # another rotary base changes the output; the default base is the one used before the key existed
    y1 = logits(build_model(tiny(rope_theta=500000.0).model, seed=2), IDS)
    y0 = logits(build_model(tiny().model, seed=2), IDS)
    assert not np.allclose(y0, y1)


@pytest.mark.parametrize("model,match", [
    ({"num_kv_heads": 3}, "num_kv_heads=3 must divide model.num_heads=4"),
    ({"num_kv_heads": -1}, "num_kv_heads=-1 must be an integer >= 0"),
    ({"mlp": "relu"}, "model.mlp='relu' is not allowed"),
    ({"rope_theta": 0.0}, "rope_theta=0.0 must be a finite number > 0"),
    ({"norm_eps": -1e-6}, "norm_eps=-1e-06 must be a finite number > 0"),
    ({"block": "gau", "mlp": "swiglu"}, "model.block='gau' has its own projections"),
])
def test_one_line_refusals(model, match):
    with pytest.raises(ConfigError, match=match) as e:
        tiny(**model)
    assert "\n" not in str(e.value)

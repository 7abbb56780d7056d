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
from longctx.models.layers import sinusoidal_table


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


# --- the encoder options (BERT, RoBERTa), usable from scratch in either kind ---------------------------------


def test_defaults_add_no_parameters():
    names = set(nnx.to_pure_dict(nnx.state(build_model(tiny().model), nnx.Param)))
    assert names == {"embed", "blocks", "norm"}
    assert {"embed", "pos_embed", "blocks", "norm"} == set(nnx.to_pure_dict(nnx.state(
        build_model(tiny(positions="learned", max_len=256).model), nnx.Param)))


def test_post_norm_block():
    """x = LN1(x + attn(x)); x = LN2(x + mlp(x)), with the block's own attention; a norm after the embeddings,
    none at the end of the stack."""
    model = build_model(tiny(post_norm=True).model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert "embed_norm" in params and "norm" not in params
    b = model.blocks[0]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 12, 16)), jnp.float32)
    pos = jnp.arange(12, dtype=jnp.int32)
    q, k, v = b.project(x, pos)  # post-norm: q, k, v of x itself
    from longctx.models.blocks import call_core

    o, _ = call_core(b.core, q, k, v, None, deterministic=True, key=None, aux=None)
    y = b.norm1(x + b.out(o.transpose(0, 2, 1, 3).reshape(2, 12, 16)))
    want = b.norm2(y + b.mlp(y, deterministic=True))
    np.testing.assert_allclose(b(x, None, positions=pos)[0], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.embed_tokens(IDS, pos), model.embed_norm(model.embed(IDS)), rtol=1e-6,
                               atol=1e-6)


def test_post_norm_decoder_decodes_as_the_full_forward():
    model = build_model(tiny(post_norm=True, type_vocab_size=2, head_transform=True, head_bias=True).model)
    full = logits(model, IDS)
    state, parts = model.init_state(2, 12), []
    step = nnx.jit(lambda m, ids, st: m(ids, st)[:2])
    for lo, hi in ((0, 7), (7, 8), (8, 12)):
        y, state = step(model, IDS[:, lo:hi], state)
        parts.append(y)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, rtol=1e-5, atol=1e-5)


def test_position_offset_reads_the_table_from_the_offset():
    a = build_model(tiny(positions="learned", max_len=256, position_offset=3).model, seed=3)
    b = build_model(tiny(positions="learned", max_len=256).model, seed=3)
    assert a.pos_embed.embedding[...].shape == (259, 16)
    nnx.update(b, nnx.state(a, nnx.Not(nnx.PathContains("pos_embed"))))
    b.pos_embed.embedding[...] = a.pos_embed.embedding[...][3:]
    np.testing.assert_allclose(logits(a, IDS), logits(b, IDS), rtol=1e-6, atol=1e-6)


def test_token_types_add_row_zero():
    a = build_model(tiny(type_vocab_size=2, positions="sinusoidal").model, seed=4)
    assert a.type_embed.embedding[...].shape == (2, 16)
    pos = jnp.arange(12, dtype=jnp.int32)
    want = a.embed(IDS) + sinusoidal_table(pos, 16)[None] + a.type_embed.embedding[...][0]
    np.testing.assert_allclose(a.embed_tokens(IDS, pos), want, rtol=1e-6, atol=1e-6)
    before = logits(a, IDS)
    a.type_embed.embedding[...] = a.type_embed.embedding[...].at[0].add(1.0)
    assert not np.allclose(logits(a, IDS), before)


@pytest.mark.parametrize("mlp", ["gelu", "gelu_exact"])
def test_head_transform_and_bias(mlp):
    """logits = LN(GELU(h W + b)) E^T + bias (GELU exact with model.mlp='gelu_exact'); the chunked loss takes
    the same head."""
    import jax

    model = build_model(tiny(kind="encoder", head_transform=True, head_bias=True, mlp=mlp).model)
    model.head_bias[...] = jnp.asarray(np.random.default_rng(5).standard_normal(32), jnp.float32)
    h = jnp.asarray(np.random.default_rng(6).standard_normal((2, 5, 16)), jnp.float32)
    t = model.head_transform
    g = jax.nn.gelu(h @ t.proj.kernel[...] + t.proj.bias[...], approximate=mlp == "gelu")
    want = t.norm(g) @ model.embed.embedding[...].T + model.head_bias[...]
    np.testing.assert_allclose(model.logits(h), want, rtol=1e-5, atol=1e-5)
    targets = IDS[:, :5]
    chunked = build_model(tiny(kind="encoder", head_transform=True, head_bias=True, mlp=mlp, loss_chunk=8).model)
    nnx.update(chunked, nnx.state(model))
    np.testing.assert_allclose(chunked.nll(h, targets), model.nll(h, targets), rtol=1e-5, atol=1e-5)
    want_nll = -jnp.take_along_axis(jax.nn.log_softmax(want), targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(model.nll(h, targets), want_nll, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model,match", [
    ({"post_norm": True, "block": "gau"}, "model.post_norm=True applies to model.block='transformer'"),
    ({"post_norm": True, "attention": {"name": "vcc"}}, "model.attention.name='vcc'"),
    ({"position_offset": 2}, "model.position_offset=2 applies to learned positions"),
    ({"position_offset": -1}, "position_offset=-1 must be an integer >= 0"),
    ({"type_vocab_size": -1}, "type_vocab_size=-1 must be an integer >= 0"),
    ({"head_bias": True, "output": "adaptive", "tie_embeddings": False, "adaptive_cutoffs": (8,)},
     "apply to model.output='dense'"),
    ({"mlp": "gelu_exact", "block": "gau"}, "model.block='gau' has its own projections"),
])
def test_encoder_option_refusals(model, match):
    test_one_line_refusals(model, match)


def test_encoder_options_name_their_logical_axes():
    from tests.models.test_logical_axes import _unnamed

    model = build_model(tiny(kind="encoder", post_norm=True, type_vocab_size=2, positions="learned", max_len=256,
                             position_offset=2, head_transform=True, head_bias=True, mlp="gelu_exact").model)
    assert model.head_transform is not None and model.head_bias is not None and model.type_embed is not None
    assert _unnamed(model) == []

"""``AttentionCore.exact_len``: the longest row a method computes as exact softmax attention, held to the method's
outputs: equal to softmax attention at that length, different one block past it; a method declaring 0 differs at
a short row already. The trainer's note on a run whose rows are no longer reads it (tests/train)."""

from __future__ import annotations

import pytest

from longctx import attention
from tests.attention import kit

# method -> (settings, the step past exact_len where it must differ), both directions
CASES = {
    "fma": ({"m": 16, "p": 4, "max_len": 128}, 16),
    "fma_linear": ({"m": 16, "p": 4, "max_len": 128}, 16),
    "kdeformer": ({"bucket_size": 16, "num_samples": 8, "num_projs": 3,
                   "causal": {"chunk_size": 16, "local_chunks": 2, "heavy_capacity": 4, "num_projs": 3,
                              "num_samples": 8}}, 16),
}


def _cfg(name, settings):
    cfg = attention.default_config(name)
    cfg.update(settings)
    return cfg


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", list(CASES))
def test_exact_up_to_exact_len_and_not_past_it(name, causal):
    settings, step = CASES[name]
    n = attention.get_class(name).exact_len(_cfg(name, settings), causal=causal)
    assert n and n > 0
    core = kit.build(name, causal, **settings)
    q, k, v = kit.qkv(n, seed=1)
    assert kit.maxdiff(kit.out(core, q, k, v), kit.softmax_attention(q, k, v, causal)) < 1e-5
    q, k, v = kit.qkv(n + step, seed=1)
    assert kit.maxdiff(kit.out(core, q, k, v), kit.softmax_attention(q, k, v, causal)) > 1e-2


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name,settings", [("eva", {"use_rpe": False, "window_size": 16, "chunk_size": 4}),
                                           ("transformer_vq", {"qk_norm": False, "block_len": 16,
                                                               "codebook_size": 16})])
def test_a_method_declaring_zero_approximates_short_rows(name, settings, causal):
    assert attention.get_class(name).exact_len(_cfg(name, settings), causal=causal) == 0
    core = kit.build(name, causal, **settings)
    q, k, v = kit.qkv(16, seed=1)  # one block or window
    assert kit.maxdiff(kit.out(core, q, k, v), kit.softmax_attention(q, k, v, causal)) > 1e-2


def test_exact_attention_is_exact_at_every_length():
    assert attention.get_class("dense").exact_len(_cfg("dense", {}), causal=True) is None
    assert attention.get_class("swa").exact_len(_cfg("swa", {"window": 8}), causal=True) is None
    kd = _cfg("kdeformer", {"residual": "exact", "causal": {"residual": "exact"}})
    assert attention.get_class("kdeformer").exact_len(kd, causal=True) is None
    assert attention.get_class("kdeformer").exact_len(kd, causal=False) is None


def test_vcc_lm_and_encoder_exact_up_to_exact_len():
    """VCC runs inside its model: the logits of VCC-LM and of the encoder against the same model with dense
    attention (same parameters), exact up to exact_len, different past it."""
    from tests.attention import test_vcc as tv

    cls = attention.get_class("vcc")
    n_lm = cls.exact_len(_cfg("vcc", {"causal": tv.LM}), causal=True)
    assert n_lm == 24  # windows of 8 after a band of 8; two fine blocks of 4 hold the old history up to 24
    tokens, _ = tv.inputs(n_lm + 16, seed=2)
    want, got = tv.call(tv.lm("dense"), tokens)[0], tv.call(tv.lm(), tokens)[0]
    assert kit.maxdiff(got[:, :n_lm], want[:, :n_lm]) < 1e-5 and kit.maxdiff(got[:, n_lm:], want[:, n_lm:]) > 1e-3
    enc = tv.model_cfg().attention["vcc"]
    n_enc = cls.exact_len(_cfg("vcc", {k: enc[k] for k in enc if k != "impl"}), causal=False)
    assert n_enc == 16  # 8 VIP slots and two fine blocks of 4
    model, dense = tv.build(), tv.build("dense")
    for T, exact in ((n_enc, True), (n_enc + 8, False)):
        tokens, imp = tv.inputs(T, seed=1)
        d = kit.maxdiff(model(tokens, imp)[0], dense(tokens, imp)[0])
        assert (d < 1e-5) if exact else (d > 1e-3), (T, d)


def test_every_method_declares_a_value():
    for name in attention.names():
        n = attention.get_class(name).exact_len(attention.default_config(name), causal=True)
        assert n is None or (isinstance(n, int) and n >= 0), name

"""Sliding-window exact attention (the method ``swa``, ``attention.swa.window``; dense's core with a window): every
implementation equals the reference with the window (values and gradients; the unrolled full pass and the
position-general loop), the reference equals a float64 NumPy oracle, the tiles never read the key blocks wholly outside the window, cuDNN and splash lower with
their own local masks, a fused kernel refuses what it cannot do (one line), and a FLOP count of a windowed kernel
counts the pairs the window keeps. The contract laws (streams, decoding through the window's state, composition, no
key before the window reaching an output) run on the contract cases of ``SlidingWindowAttention``; it mixes with
exact layers in a pattern."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.attention import dense, dispatch
from longctx.attention.dense import layer as dense_layer
from longctx.attention.dense import platform as dp
from longctx.attention.dense import xla

F32, BF16 = jnp.float32, jnp.bfloat16


def qkv(T, B=2, H=2, D=16, dtype=F32, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal((B, H, T, D)), dtype) for _ in range(3))


def np_window_attention(q, k, v, causal, W):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T = q.shape[2]
    d = np.arange(T)[:, None] - np.arange(T)[None, :]
    mask = (d < W) & ((d >= 0) if causal else (d > -W))
    s = np.where(mask, np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1]), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


def run(impl, q, k, v, causal, W, block=8):
    T = q.shape[2]
    pos = jnp.arange(T, dtype=jnp.int32)

    def f(q, k, v):
        return dense.attend(q, k, v, pos, pos, jnp.ones((T,), bool), causal=causal, impl=impl, block_q=block,
                            block_k=block, auto_threshold=1, full_pass=True, window=W, platform=dispatch.current_platform())

    w = jnp.cos(jnp.arange(q.size // q.shape[-1] * v.shape[-1], dtype=F32)).reshape(v.shape)
    out, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(F32) * w), argnums=(0, 1, 2)))(q, k, v)
    return jax.jit(f)(q, k, v), grads


RUNNABLE = [i.name for i in dense.implementations() if (i.kernel or "cpu" in i.platforms)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,W", [(40, 12), pytest.param(37, 5, marks=pytest.mark.slow),
                                 pytest.param(24, 40, marks=pytest.mark.slow)])
def test_every_implementation_equals_the_windowed_reference(causal, T, W):
    """T=40 in tiles of 8: the unrolled pass (blocks wholly inside, the far edge, the diagonal); T=37: the
    position-general loop; W > T: the whole row."""
    q, k, v = qkv(T)
    ref, ref_g = run("reference", q, k, v, causal, W)
    np.testing.assert_allclose(np.asarray(ref), np_window_attention(q, k, v, causal, W), atol=2e-5, rtol=2e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        for impl in RUNNABLE:
            if impl == "reference":
                continue
            out, g = run(impl, q, k, v, causal, W)
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5, err_msg=impl)
            for a, b, nm in zip(g, ref_g, "qkv"):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5,
                                           err_msg=f"{impl} d{nm}")


def test_the_tiles_never_read_blocks_outside_the_window():
    """The unrolled pass visits, per query block, the key blocks of its plan (blocks lo..hi-1 in one loop, the
    partial ones masked): 64 tokens in tiles of 8 with a window of 8 visit 15 blocks (each query block its diagonal
    and the one before), against 36 with no window."""
    visits = lambda W: sum(hi - lo + len(part) for lo, hi, part in  # noqa: E731
                           (xla._block_plan(i, 8, 8, 8, True, W) for i in range(8)))
    assert visits(8) == 15 and visits(0) == 36
    plan = [xla._block_plan(i, 8, 8, 8, True, 20) for i in range(8)]
    assert plan[7] == (6, 7, [4, 5, 7])  # 20 keys back from rows 56..63: 4 and 5 in part, 6 whole, 7 the diagonal
    assert xla._block_plan(3, 8, 8, 8, False, 8) == (3, 4, [2, 4])  # bidirectional: itself whole, neighbours in part
    for i in range(8):  # every block the plan leaves out is invisible to the whole query block, and the rest seen
        lo, hi, part = xla._block_plan(i, 8, 8, 8, True, 20)
        for j in range(8):
            m = xla._block_mask(i, j, 8, 8, True, 20)
            assert (lo <= j < hi) == bool(m.all()) and (j in part) == bool(m.any() and not m.all()), (i, j)


def test_cudnn_lowers_its_sliding_window_for_cuda():
    from jax._src.cudnn import fused_attention_stablehlo as fas

    orig = fas.check_cudnn_version
    fas.check_cudnn_version = lambda: 90800
    try:
        q, k, v = qkv(256, D=64, dtype=BF16)
        pos = jnp.arange(256, dtype=jnp.int32)
        checks = [jax.export.DisabledSafetyCheck.custom_call(n)
                  for n in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")]

        def f(q, k, v):
            return dense.attend(q, k, v, pos, pos, jnp.ones((256,), bool), causal=True, impl="cudnn", block_q=64,
                                block_k=64, auto_threshold=1, full_pass=True, platform="cuda", window=64)

        g = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums=(0, 1, 2))
        for fn in (f, g):
            mod = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(q, k, v).mlir_module()
            assert "__cudnn$fmhaSoftmax" in mod
            assert re.search(r"sliding_window_length\\22: 64", mod), "cuDNN's window of 64 keys"
    finally:
        fas.check_cudnn_version = orig


def test_fused_kernels_refuse_what_they_cannot_window():
    r = dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=64, causal=False, window=8)
    assert any("causal only" in x for x in r)
    r = dp.splash_unsupported_reasons("tpu", dtype=BF16, head_dim=128, window=8, sequence_slice=256)
    assert any("sequence parallelism" in x for x in r)
    with pytest.raises(dispatch.KernelUnsupportedError, match="causal only"):
        dense.choose("cudnn", dtype=BF16, head_dim=64, platform="cuda", causal=False, window=8)
    assert dense.choose("auto", dtype=BF16, head_dim=64, platform="cuda", causal=False, window=8,
                        large=True).name == "blockwise"


@pytest.mark.parametrize("causal", [True, False])
def test_splash_lowers_its_local_mask_for_tpu(causal):
    q, k, v = qkv(640, B=1, D=128, dtype=BF16)
    pos = jnp.arange(640, dtype=jnp.int32)

    def f(q, k, v):
        return dense.attend(q, k, v, pos, pos, jnp.ones((640,), bool), causal=causal, impl="splash", block_q=64,
                            block_k=64, auto_threshold=1, full_pass=True, platform="tpu", window=128)

    g = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums=(0, 1, 2))
    mod = jax.export.export(jax.jit(g), platforms=["tpu"])(q, k, v).mlir_module()
    assert mod.count("tpu_custom_call") >= 2


def test_a_windowed_kernel_counts_the_pairs_it_keeps():
    aval = jax.ShapeDtypeStruct((1, 1, 4, 8), F32)
    causal = dp.fused_call_flops("fused_attention_causal_window_2", [aval] * 3)
    bidir = dp.fused_call_flops("fused_attention_full_window_2", [aval] * 3)
    assert causal == 2.0 * 7 * 16 and bidir == 2.0 * 10 * 16  # 1+2+2+2 pairs; 2+3+3+2
    assert dp.fused_call_flops("fused_attention_causal", [aval] * 3) == 2.0 * 16 * 16 / 2


def test_the_window_state_is_the_window_whatever_max_len():
    from flax import nnx

    from longctx import attention

    core = attention.build("swa", {"window": 6}, num_heads=2, head_dim=16, causal=True, rngs=nnx.Rngs(0))
    state = core.init_state(2, 1000)
    assert state["k"].shape[2] == 6
    q, k, v = qkv(20)
    full, _ = core(q, k, v)
    outs = []
    for t in range(20):  # 20 tokens through a 6-key state: never refused, equal to the full pass
        o, state = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=2)), np.asarray(full), atol=2e-5, rtol=2e-5)
    assert core.receptive_window == 6


@pytest.mark.parametrize("pattern,reaches", [(("swa", "swa"), False), (("swa", "dense"), True)])
def test_local_and_global_layers_in_one_pattern(pattern, reaches):
    """A pattern mixes sliding-window and exact layers, each with its own section: two local layers of a 4-key
    window see at most 7 tokens back, so the first token cannot reach the 20th; one global layer after a local one
    carries it there."""
    from longctx.config import base_config
    from longctx.models.decoder import build_model

    c = base_config().model
    c.vocab_size, c.d_model, c.num_layers, c.d_ff, c.num_heads, c.head_dim = 32, 16, 2, 32, 2, 8
    c.attention.name = "swa"
    c.attention.pattern = pattern
    c.attention.swa.window = 4
    model = build_model(c, seed=0)
    assert [b.core.window for b in model.blocks] == [4 if p == "swa" else 0 for p in pattern]
    tokens = jnp.arange(20, dtype=jnp.int32)[None] % 32
    a, _, _ = model(tokens)
    b, _, _ = model(tokens.at[0, 0].set(7))
    assert bool(jnp.any(a[0, -1] != b[0, -1])) == reaches
    np.testing.assert_array_equal(np.asarray(a[0, 8:-1] != b[0, 8:-1]).any(), reaches)


def test_auto_takes_the_tiles_for_a_window_of_at_most_half_the_keys():
    """A short row (Tq*Tk under auto_threshold) takes the one softmax, unless a sliding window leaves at least half
    the keys out: then the tiles, which skip the key blocks outside it (the one softmax would score every key)."""
    cfg = {"auto_threshold": 4096 * 4096}
    pick = lambda T, W: dense_layer.select_for("auto", cfg, "cpu", scores=T * T, keys=T, dtype=F32,  # noqa: E731
                                         head_dim=32, window=W).name
    assert pick(1024, 0) == "reference"
    assert pick(1024, 1000) == "reference"
    assert pick(1024, 512) != "reference" and pick(1024, 128) != "reference"
    assert pick(1024, 128) in {i.name for i in dense.implementations() if i.prefer is xla.prefers_long_rows}



def test_the_tiles_blocks_fit_the_window():
    """The tiles take blocks no larger than the window rounded up to a power of two (the CPU's default 1024 x 512
    would visit every key of a 1k row for a window of 100), so a windowed full pass counts far fewer matmul FLOPs
    than the unwindowed one, and both equal the reference."""
    from longctx.bench.common import jaxpr_matmul_flops

    assert xla.window_blocks(1024, 512, 100) == (128, 128) and xla.window_blocks(64, 32, 100) == (64, 32)
    assert xla.window_blocks(1024, 512, 0) == (1024, 512)
    T = 1024
    q, k, v = qkv(T, B=1, H=1, D=16)
    pos = jnp.arange(T, dtype=jnp.int32)

    def run(W, impl="xla_cpu"):
        return lambda q, k, v: dense.attend(q, k, v, pos, pos, jnp.ones((T,), bool), causal=True, impl=impl,
                                            block_q=1024, block_k=512, auto_threshold=1, full_pass=True,
                                            platform="cpu", window=W)

    windowed, full = (jaxpr_matmul_flops(run(W), q, k, v)["flops"] for W in (100, 0))
    assert windowed < 0.35 * full
    np.testing.assert_allclose(np.asarray(run(100)(q, k, v)), np.asarray(run(100, "reference")(q, k, v)),
                               atol=2e-5, rtol=2e-5)


def test_a_window_as_long_as_the_rows_is_exact_attention():
    """The main job's model: swa with a window of the training rows' length has dense's parameters and dense's
    output on those rows (training is exact attention); on longer rows the two differ past the window."""
    from longctx.config import base_config
    from longctx.models.decoder import build_model

    c = base_config().model
    c.vocab_size, c.d_model, c.num_layers, c.d_ff, c.num_heads, c.head_dim = 32, 16, 2, 32, 2, 8
    c.attention.swa.window = 12
    models = {}
    for name in ("dense", "swa"):
        c.attention.name = name
        models[name] = build_model(c, seed=0)
    tokens = (jnp.arange(30, dtype=jnp.int32)[None] * 7) % 32
    d, _, _ = models["dense"](tokens[:, :12])
    s, _, _ = models["swa"](tokens[:, :12])
    np.testing.assert_allclose(np.asarray(s), np.asarray(d), atol=1e-6, rtol=1e-6)
    d, _, _ = models["dense"](tokens)
    s, _, _ = models["swa"](tokens)
    np.testing.assert_allclose(np.asarray(s[:, :12]), np.asarray(d[:, :12]), atol=1e-6, rtol=1e-6)
    assert float(jnp.max(jnp.abs(s[:, 12:] - d[:, 12:]))) > 1e-4

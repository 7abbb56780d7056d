"""Mixed precision (``model.dtype`` / ``model.param_dtype``, longctx/models/precision.py).

* float32 stays the CPU default (``'auto'``), and a bfloat16 model keeps float32 parameters and optimizer state;
* the bfloat16 train step of every method's built-in config, lowered (not compiled): at least 90 % of the matmul
  FLOPs of its ``dot_general``s take bfloat16 operands. The float32 dots that remain are listed below with their
  reasons (:data:`FP32_DOTS`).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config_files
from longctx.config import base_config, resolve_vocab, validate
from longctx.models import precision
from longctx.models.decoder import build_model
from longctx.train.optim import make_optimizer
from longctx.train.step import make_train_step, split_model

# every decoder method's built-in config (dense: the baseline configs/default.py)
CONFIGS = {
    "dense": "configs/default.py",
    "eva": "configs/builtin/eva.py",
    "fma": "configs/builtin/fma.py",
    "fma_linear": "configs/builtin/fma_linear.py",
    "kdeformer": "configs/builtin/kdeformer.py",
    "transformer_vq": "configs/builtin/transformer_vq.py",
    "vcc": "configs/builtin/vcc.py",
}

# one worker: the lowered dense train step is shared between two tests
pytestmark = pytest.mark.xdist_group("precision")

MIN_BF16_SHARE = 0.9

# float32 matmul FLOPs that stay by design (the share above counts them against bfloat16):
FP32_DOTS = {
    "softmax statistics": "a core's normalisers (row sums of exp-scores written as dots, log-sum-exp) are float32",
    "codebook EMA statistics": "Transformer-VQ's codebook counts and sums (non-gradient state) are float32",
    "loss": "the target-logit gather and the chunked log-sum-exp of the output layer are float32",
}

_DOT = re.compile(r"stablehlo\.dot_general\s+%[\w#]+,\s*%[\w#]+,\s*(.*?)\s*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")
_DIMS = re.compile(r"contracting_dims\s*=\s*\[([\d, ]*)\]\s*x\s*\[([\d, ]*)\]")
_BATCH = re.compile(r"batching_dims\s*=\s*\[([\d, ]*)\]\s*x\s*\[([\d, ]*)\]")


def _tensor(t: str):
    """'tensor<2x3x4xbf16>' -> ((2, 3, 4), 'bf16')."""
    body = t[len("tensor<"):-1]
    *dims, dtype = body.split("x")
    return tuple(int(d) for d in dims), dtype


def _ints(s: str):
    return [int(v) for v in s.split(",") if v.strip()]


def dot_flops(text: str):
    """[(flops, lhs dtype, rhs dtype, lhs shape, rhs shape)] of every ``dot_general`` in a StableHLO module:
    2 x (product of lhs dims) x (product of rhs dims that are neither batch nor contracting)."""
    out = []
    for m in _DOT.finditer(text):
        attrs, lhs, rhs = m.group(1), _tensor(m.group(2)), _tensor(m.group(3))
        c = _DIMS.search(attrs)
        b = _BATCH.search(attrs)
        rhs_c = _ints(c.group(2)) if c else []
        rhs_b = _ints(b.group(2)) if b else []
        free = [d for i, d in enumerate(rhs[0]) if i not in rhs_c and i not in rhs_b]
        out.append((2 * math.prod(lhs[0]) * math.prod(free), lhs[1], rhs[1], lhs[0], rhs[0]))
    return out


def small_config(method: str, dtype: str = "bfloat16"):
    cfg = config_files.load(CONFIGS[method])
    cfg.model.num_layers = 2
    cfg.model.dtype = dtype
    cfg.train.batch_size = 2
    return resolve_vocab(validate(cfg), 256)


def lowered_train_step(cfg, platform=None):
    model = build_model(cfg, seed=0, platform=platform)
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(cfg.train)
    t = cfg.train
    window = t.window or t.seq_len
    step = make_train_step(graphdef, tx, seq_len=t.seq_len, window=window, skip_nonfinite=True,
                           microbatches=t.microbatches)
    abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    opt = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((t.batch_size, t.seq_len + 1), jnp.int32)
    return jax.jit(step).lower(abstract(params), abstract(nongrad), abstract(rest), opt, tokens, jax.random.key(0))


@functools.cache
def bf16_train_step_text(method: str) -> str:
    """The lowered bfloat16 train step of ``method``'s built-in config (shared by the tests below)."""
    return lowered_train_step(small_config(method)).as_text()


def bf16_share(method: str):
    text = bf16_train_step_text(method)
    dots = dot_flops(text)
    assert len(dots) == text.count("stablehlo.dot_general") > 0  # every dot parsed
    total = sum(f for f, *_ in dots)
    bf16 = sum(f for f, a, b, *_ in dots if a == b == "bf16")
    return bf16 / total, dots


# cores that still compute their attention products in float32 (their inputs cast up): the share stays below
# MIN_BF16_SHARE until their products take compute-dtype operands as dense's do (none today)
FP32_CORES: dict[str, str] = {}


@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=FP32_CORES[m])) if m in FP32_CORES else m
    for m in CONFIGS])
def test_bf16_train_step_matmuls_take_bf16_operands(method):
    share, dots = bf16_share(method)
    fp32 = sorted((d for d in dots if not d[1] == d[2] == "bf16"), reverse=True)[:5]
    assert share >= MIN_BF16_SHARE, (f"{method}: {share:.1%} of the matmul FLOPs in bf16; largest others: {fp32}; "
                                     f"float32 by design: {FP32_DOTS}")


def test_dot_flops_counts_batch_and_free_dimensions():
    text = ("%0 = stablehlo.dot_general %a, %b, batching_dims = [0] x [0], contracting_dims = [2] x [1] : "
            "(tensor<2x3x4xbf16>, tensor<2x4x5xbf16>) -> tensor<2x3x5xf32>")
    assert dot_flops(text) == [(2 * 2 * 3 * 4 * 5, "bf16", "bf16", (2, 3, 4), (2, 4, 5))]


def test_float32_stays_the_cpu_default():
    m = base_config().model
    assert (m.dtype, m.param_dtype) == ("auto", "float32")
    assert precision.resolve_dtype("auto", "cpu") is jnp.float32
    assert precision.resolve_dtype("auto", "gpu") is jnp.bfloat16
    assert precision.resolve_dtype("auto", "tpu") is jnp.bfloat16
    assert precision.policy(m).full  # on this CPU


@pytest.mark.parametrize("method", ["dense", "kdeformer"])
def test_decoding_caches_keep_the_compute_dtype_off_a_cpu(method):
    """A KV cache holds the keys and values a layer was given: in the compute dtype on a GPU or TPU (half the bytes
    a decoding step reads under bfloat16), in float32 on a CPU (``Policy.cache``: XLA:CPU converts a bfloat16 cache
    whole for the step's write); a full pass's state and the empty one agree, so a donated step keeps its dtypes."""
    from tests.models.test_scan_layers import model_cfg

    for platform, want in (("cuda", jnp.bfloat16), ("tpu", jnp.bfloat16), ("cpu", jnp.float32)):
        cfg = model_cfg(method, dtype="bfloat16")[0]
        model = nnx.eval_shape(lambda: build_model(cfg, seed=0, platform=platform))  # noqa: B023
        state = jax.eval_shape(lambda: model.init_state(2, 64))  # noqa: B023
        caches = {name: leaf.dtype for name, leaf in state["layers"][0].items() if name in ("k", "v")}
        assert caches == {"k": want, "v": want}, (platform, caches)
    cfg = model_cfg(method, dtype="float32")[0]
    model = nnx.eval_shape(lambda: build_model(cfg, seed=0, platform="cuda"))
    assert jax.eval_shape(lambda: model.init_state(2, 64))["layers"][0]["k"].dtype == jnp.float32
    core = build_model(model_cfg(method, dtype="bfloat16")[0], seed=0).blocks[0].core  # as built for a GPU below
    core.cache_dtype = jnp.dtype(jnp.bfloat16)
    q = k = v = jax.random.normal(jax.random.key(0), (2, core.num_heads, 16, core.head_dim), jnp.bfloat16)
    new = lambda st: jax.eval_shape(lambda: core(q, k, v, st, deterministic=False, key=jax.random.key(1))[1])  # noqa: E731
    dtypes = lambda tree: jax.tree.map(lambda a: a.dtype, tree)  # noqa: E731
    empty = core.init_state(2, 64)
    assert dtypes(new(None)) == dtypes(new(empty)) == dtypes(empty)


@pytest.mark.parametrize("method", ["dense", "kdeformer"])
def test_a_bf16_cache_decodes_exactly_as_a_float32_one(method):
    """A bfloat16 model whose caches keep bfloat16 (as on a GPU; forced here on the CPU's cores) decodes exactly as
    with float32 caches: the keys and values they hold are bfloat16 values either way. A scanned stack, a prefill
    and decoding steps in the stack; the state keeps its dtypes from step to step."""
    from longctx.attention.base import AttentionCore
    from tests.models.test_scan_layers import V, model_cfg

    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, V - 1)
    call = nnx.jit(lambda m, t, s: m(t, s)[:2])
    logits = []
    for cache in (jnp.float32, jnp.bfloat16):
        model = build_model(model_cfg(method, scan=True, dtype="bfloat16")[0], seed=0)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, AttentionCore):
                node.cache_dtype = jnp.dtype(cache)
        out, state = call(model, tokens[:, :30], model.init_state(2, 64))
        dtypes = jax.tree.map(lambda a: a.dtype, state)
        assert state["layers"]["k"].dtype == cache
        outs = [out[:, -1]]
        for t in range(30, 40):
            out, state = call(model, tokens[:, t:t + 1], state)
            outs.append(out[:, -1])
        assert jax.tree.map(lambda a: a.dtype, state) == dtypes
        logits.append(np.stack([np.asarray(o, np.float32) for o in outs]))
    np.testing.assert_array_equal(logits[1], logits[0])


def test_dtype_keys_are_validated():
    from longctx.errors import ConfigError

    for key, bad in (("dtype", "bf16"), ("param_dtype", "auto")):
        c = base_config()
        c.model[key] = bad
        with pytest.raises(ConfigError, match=f"model.{key}"):
            validate(c)


def test_einsum_f32_is_the_plain_einsum_in_float32_and_accumulates_bf16_in_float32():
    a, b = (jax.random.normal(jax.random.key(i), (3, 8, 16)) for i in (0, 1))
    spec = "bqd,bkd->bqk"
    plain = jax.make_jaxpr(lambda x, y: jnp.einsum(spec, x, y))(a, b)
    assert str(jax.make_jaxpr(lambda x, y: precision.einsum_f32(spec, x, y))(a, b)) == str(plain)
    ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    out = precision.einsum_f32(spec, ab, bb)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, jnp.einsum(spec, ab.astype(jnp.float32), bb.astype(jnp.float32)), rtol=1e-5,
                               atol=1e-5)
    ga, gb = jax.grad(lambda x, y: precision.einsum_f32(spec, x, y).sum(), argnums=(0, 1))(ab, bb)
    assert ga.dtype == gb.dtype == jnp.bfloat16
    text = jax.jit(jax.grad(lambda x, y: precision.einsum_f32(spec, x, y).sum(), argnums=(0, 1))).lower(ab, bb).as_text()
    assert all(d[1] == d[2] == "bf16" for d in dot_flops(text))


@pytest.mark.parametrize("method", ["dense", "transformer_vq"])
def test_bf16_model_keeps_fp32_parameters_optimizer_state_and_statistics(method):
    cfg = small_config(method)
    cfg.model.d_model, cfg.model.d_ff = 32, 64
    model = build_model(cfg, seed=0)
    _, params, nongrad, _ = split_model(model)
    floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]  # noqa: E731
    assert floats(params) and all(x.dtype == jnp.float32 for x in floats(params))
    assert all(x.dtype == jnp.float32 for x in floats(nongrad))  # codebooks and their EMA statistics
    opt = make_optimizer(cfg.train).init(params)
    assert floats(opt) and all(x.dtype == jnp.float32 for x in floats(opt))
    tokens = jnp.zeros((2, 64), jnp.int32)

    def run(model):
        h, _, aux = model.hidden(tokens, deterministic=False, key=jax.random.key(0))
        return h, model.logits(h), model.nll(h, tokens), aux

    h, logits, nll, aux = nnx.jit(run)(model)  # jitted: an eager call compiles op by op
    assert h.dtype == jnp.bfloat16  # activations in the compute dtype
    assert logits.dtype == jnp.float32 and nll.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in floats(aux["stats"]))  # non-gradient statistics
    assert all(x.dtype == jnp.float32 for x in floats(aux["losses"]))


def test_bf16_train_step_with_the_accelerator_row_layout():
    """Built for a GPU, the row-wise layers take ``[B, T, d]`` as they are (built for a CPU host they flatten
    them to ``[N, d]``, ``layout.rows_apply``): the bf16 output layer must take either (it once assumed two
    dimensions). The model is built for 'cuda' on this CPU, its attention on the portable tiles (cuDNN cannot be
    lowered here)."""
    cfg = small_config("dense")
    cfg.execution.attention.dense.impl = "blockwise"
    flat = lowered_train_step(cfg, platform="cpu").as_text()
    as_is = lowered_train_step(cfg, platform="cuda").as_text()
    # the same matmul FLOPs either way, and in the accelerator's layout the output layer contracts [B, T, d]
    assert sum(f for f, *_ in dot_flops(as_is)) == sum(f for f, *_ in dot_flops(flat))
    B, T, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    assert any(lhs[:2] == (B, T) and rhs[-1] == V for _, _, _, lhs, rhs in dot_flops(as_is))

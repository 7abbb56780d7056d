"""The compute dtype reaches every matmul of the attention path, kernels included (DESIGN.md "Precision and scale").

For every method, direction and implementation past the reference (a Pallas kernel as it is traced for interpret
mode: tracing is what is read, nothing is compiled), the forward and backward of a training-mode call on bfloat16
q, k, v is traced to a jaxpr, and every equation is read, inside scans, conditionals, custom rules and the kernel
bodies of ``pallas_call`` (Mosaic GPU kernels: ``mpmd_map``):

* a matrix product (a ``dot_general`` with free axes on both sides; a row of inner products such as
  ``rowsum(dO * O)`` or a matrix-vector product is not tensor-core work) with a float32 operand is a defect unless
  it is a declared statistic: traced under the ``precision.STATISTIC`` name scope
  (``pallas_kernels.precision.statistic``, e.g. codebook counts and sums), whose reason is in the code beside it;
* a ``pallas_call`` operand in float32 whose last axis is the head width or the value width (q, k, v, dO, chunk
  summaries, codebooks: the operands its matmuls take) is a defect; float32 operands of other shapes are the
  statistics a kernel carries (log-sum-exps, row sums, biases added to scores).

A library's kernel (dense's splash: JAX's own TPU kernel) is read at its operands only: what it does inside is the
library's. An implementation that cannot be traced on this machine (cuDNN off an NVIDIA GPU) is skipped with the
reason; the GPU check runs it there.

A core's own parameters (chunk representatives, codebooks, downsampling weights) are float32 master weights; the
core casts them to the compute dtype before its products, as the backbone's layers do.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dispatch
from pallas_kernels.precision import STATISTIC
from tests.attention.test_implementations import _case, _model_case

B = 2
# the primitives a Pallas kernel call is traced to: Triton / TPU / interpret-mode kernels, and Mosaic GPU's
# (``plgpu.kernel``: a ``mpmd_map`` whose ``input_output_aliases`` is a mapping)
KERNEL_CALLS = ("pallas_call", "mpmd_map")

# implementations whose kernel body is a library's: (method, implementation) -> whose
LIBRARY_KERNELS = {(name, "splash"): "JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention)"
                   for name in ("dense", "swa")}  # exact attention, and over a sliding window


def _params(model_level=False):
    out = []
    for name in attention.names():
        cls = attention.get_class(name)
        for direction in ("causal", "bidirectional"):
            causal = direction == "causal"
            if (causal and not cls.supports_causal) or (not causal and not cls.supports_bidirectional):
                continue
            if (_case(cls, direction) is None) != model_level or (model_level and not _model_case(cls, direction)):
                continue
            for impl in cls.implementations(causal=causal)[1:]:
                out.append(pytest.param(name, direction, impl.name, id=f"{name}-{direction}-{impl.name}",
                                        marks=[pytest.mark.slow] if impl.slow_in_interpret else []))
    return out


def _sub_jaxprs(value):
    """Every jaxpr held by an equation parameter (scan / cond / pjit / custom rules / pallas_call bodies)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _is_matmul(eqn) -> bool:
    """A product with free axes (neither contracted nor batched) of size > 1 on both sides: a matrix product. A row
    of inner products (``rowsum(dO * O)`` written as a dot) or a matrix-vector product is O(elements) work, not
    tensor-core work, and stays in the statistics' dtype."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    free = lambda shape, used: [d for i, d in enumerate(shape) if i not in used and d > 1]  # noqa: E731
    return bool(free(lhs, set(lc) | set(lb))) and bool(free(rhs, set(rc) | set(rb)))


def defects(jaxpr, widths, in_kernel=False, library=False):
    """The float32 matmul operands of ``jaxpr`` (a list of one-line descriptions); ``library``: the kernel bodies
    are a library's (only their operands are read)."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        scope = str(eqn.source_info.name_stack)
        if name == "dot_general" and STATISTIC not in scope and _is_matmul(eqn) and not (in_kernel and library):
            dts = [v.aval.dtype for v in eqn.invars]
            if any(dt == jnp.float32 for dt in dts):
                shapes = [tuple(v.aval.shape) for v in eqn.invars]
                out.append(f"{'kernel ' if in_kernel else ''}dot_general {shapes} {[str(d) for d in dts]} at "
                           f"{scope or '(top)'}")
        if name == "wgmma_ref":  # a Mosaic GPU kernel's product: (accumulator, a, b), the accumulator float32
            dts = [v.aval.dtype for v in eqn.invars[1:3]]
            if any(dt == jnp.float32 for dt in dts):
                out.append(f"kernel wgmma {[str(d) for d in dts]} at {scope or '(top)'}")
        if name in KERNEL_CALLS:
            # an operand an output aliases is a float32 accumulator the kernel adds into (atomics), not a product's
            # operand: its reads inside the kernel are checked like every other equation there
            aliases = eqn.params.get("input_output_aliases", ())
            aliased = set(aliases) if hasattr(aliases, "keys") else {i for i, _ in aliases}
            for i, v in enumerate(eqn.invars):
                aval = v.aval
                if (getattr(aval, "dtype", None) == jnp.float32 and aval.shape and aval.shape[-1] in widths
                        and i not in aliased):
                    out.append(f"{name} operand {i} float32 {tuple(aval.shape)}")
        for p in eqn.params.values():
            for sub in _sub_jaxprs(p):
                out.extend(defects(sub, widths, in_kernel or name in KERNEL_CALLS, library))
    return out


def _trace(name, direction, impl_name):
    cls = attention.get_class(name)
    causal = direction == "causal"
    case = _case(cls, direction)
    impl = {i.name: i for i in cls.implementations(causal=causal)}[impl_name]
    cfg = attention.default_config(name)
    cfg.update(case.cfg)
    cfg.update({**impl.config, **impl.test_config})
    core = attention.build(name, cfg, num_heads=case.num_heads, head_dim=case.head_dim, value_dim=case.value_dim,
                           causal=causal, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(core, nnx.Param, ...)
    dk, dv = case.head_dim, case.value_dim or case.head_dim
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (B, case.num_heads, case.length, dk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, case.num_heads, case.length, dk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, case.num_heads, case.length, dv), jnp.bfloat16)

    def loss(params, q, k, v):
        out, _ = nnx.merge(graphdef, params, rest)(q, k, v, deterministic=False, key=ks[3])
        return jnp.sum(out.astype(jnp.float32))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
    return closed.jaxpr, {dk, dv}


def _trace_model(name, direction, impl_name):
    """The forward and backward of a tiny bfloat16 model (2 layers) whose attention is ``name`` with ``impl_name``:
    for cores that run only inside their model (VCC's stack hands its core the compressed rows)."""
    from longctx.config import base_config
    from longctx.models.decoder import build_model

    cls = attention.get_class(name)
    causal = direction == "causal"
    case = _model_case(cls, direction)
    impl = {i.name: i for i in cls.implementations(causal=causal)}[impl_name]
    c = base_config().model
    c.kind, c.causal, c.dtype = ("decoder" if causal else "encoder"), causal, "bfloat16"
    c.vocab_size, c.d_model, c.num_layers, c.d_ff = 64, 16, 2, 32
    c.num_heads, c.head_dim = case.num_heads, case.head_dim
    c.positions = "rotary"
    c.attention.name = name
    c.attention[name] = {**case.cfg, **impl.config, **impl.test_config}
    model = build_model(c, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    tokens = jax.random.randint(k1, (B, case.length), 0, 63)
    important = None if causal else jax.random.bernoulli(k2, 0.15, (B, case.length))

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m(tokens, None if causal else important, deterministic=False, key=k3)[0]
        return jnp.sum(logits.astype(jnp.float32))

    closed = jax.make_jaxpr(jax.grad(loss))(params)
    return closed.jaxpr, {case.head_dim, case.value_dim or case.head_dim}


def _check(name, direction, impl_name, trace):
    impl = {i.name: i for i in attention.get_class(name).implementations(causal=direction == "causal")}[impl_name]
    plat = dispatch.current_platform()
    if not ((impl.kernel and plat == "cpu") or plat in impl.platforms):
        pytest.skip(f"{name} {impl_name} runs on {', '.join(impl.platforms)}, not {plat}: traced by the GPU check")
    jaxpr, widths = trace(name, direction, impl_name)
    found = defects(jaxpr, widths, library=(name, impl_name) in LIBRARY_KERNELS)
    return found


@pytest.mark.parametrize("name,direction,impl_name", _params())
def test_bf16_reaches_every_matmul_of_the_attention_path(name, direction, impl_name):
    found = _check(name, direction, impl_name, _trace)
    assert not found, (f"{name} {direction} {impl_name}: {len(found)} float32 matmul operands in a bfloat16 "
                       f"step (first 8):\n  " + "\n  ".join(found[:8]))


@pytest.mark.parametrize("name,direction,impl_name", _params(model_level=True))
def test_bf16_reaches_every_matmul_of_a_model_level_core(name, direction, impl_name):
    """The same for a core that runs only inside its model, read over the whole bfloat16 model (its projections,
    norms and head included, which the backbone's policy already serves)."""
    found = _check(name, direction, impl_name, _trace_model)
    assert not found, (f"{name} {direction} {impl_name}: {len(found)} float32 matmul operands in a bfloat16 "
                       f"model (first 8):\n  " + "\n  ".join(found[:8]))


def test_the_reader_finds_float32_operands_in_kernels_and_scopes():
    """The reader has teeth: a float32 dot inside a kernel body and a float32 kernel operand are found; the same
    dot under the statistic scope is not."""
    from jax.experimental import pallas as pl

    from pallas_kernels.precision import statistic

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...].astype(jnp.float32), b_ref[...].astype(jnp.float32))

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), interpret=True)(a, b)

    a = jnp.ones((16, 16), jnp.float32)
    found = defects(jax.make_jaxpr(f)(a, a.astype(jnp.bfloat16)).jaxpr, {16})
    assert any(d.startswith("kernel dot_general") for d in found) and any("operand 0" in d for d in found), found
    assert not any("operand 1" in d for d in found), found

    def g(a, b):
        with statistic("row sums"):
            s = jnp.dot(a, b)
        return s + jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).astype(jnp.float32)

    assert defects(jax.make_jaxpr(g)(a, a).jaxpr, {16}) == []
    assert len(defects(jax.make_jaxpr(lambda a, b: jnp.dot(a, b))(a, a).jaxpr, {16})) == 1


def test_the_reader_finds_float32_operands_of_a_mosaic_gpu_kernel():
    """A Mosaic GPU kernel (``plgpu.kernel``, traced for its interpret mode) is read like a ``pallas_call``: a
    float32 operand of the head width is found, a bfloat16 one is not."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.fma_blocks_mgpu import interpret_params

    def copy(x):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,), grid_names=("g",),
                            interpret=interpret_params())(x)

    x = jnp.ones((16, 16), jnp.float32)
    found = defects(jax.make_jaxpr(copy)(x).jaxpr, {16})
    assert found and found[0].startswith("mpmd_map operand 0 float32"), found
    assert defects(jax.make_jaxpr(copy)(x.astype(jnp.bfloat16)).jaxpr, {16}) == []

"""Transformer-VQ's GPU path holds no band-bias array in memory (pallas_kernels/vq_cache_gpu.py): the forward and
backward of the layer as ``impl='auto'`` runs it on a GPU (the ``pallas`` implementation: the GPU form of the §9
kernel), bfloat16, at T = 32k with the paper configs' block length L = 512, is lowered with ``jax.export`` for
``cuda`` (lowering only, nothing is compiled), and the StableHLO text's tensor types are read outside the kernels'
custom calls (whose Triton modules are string attributes): no value of shape ``[.., L, L]`` or ``[.., L, 2L]`` (a
band bias per block, its previous / present halves, or their gradients) may appear. The kernels gather the bias
from the band scores ``[.., T, M+1]`` and scatter its gradient back to that shape.

The codebook has S = 256 codes so that the per-code sums' one-hot ``[.., S, L]`` (not a bias) cannot be mistaken
for one. The same holds for a packed row (segment ids: three documents that open mid-block), whose kernels take
per-query and per-key document arrays and per-block caches (``xla.kernel_packed``) instead.

The same GPU path, traced at a small shape, takes bfloat16 into every matmul of its kernels (the shared reader of
tests/attention/test_compute_dtype.py over the jaxpr, kernel bodies included): the CPU run of that test traces the
TPU form, which is what a kernel named on a CPU runs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention

T, L, S, H, D = 32768, 512, 256, 2, 64


def _exported_text(packed: bool = False, impl: str = "pallas") -> str:
    cfg = attention.default_config("transformer_vq")
    cfg.update({"block_len": L, "codebook_size": S})
    core = attention.build("transformer_vq", cfg, num_heads=H, head_dim=D, causal=True, rngs=nnx.Rngs(0),
                           platform="cuda")  # 'auto' as a GPU run resolves it
    assert core.implementation_for(B=1, T=T, dtype=jnp.bfloat16, segments=packed).name == impl
    graphdef, params, rest = nnx.split(core, nnx.Param, ...)

    def loss(params, q, k, v, *seg):
        out, _ = nnx.merge(graphdef, params, rest)(q, k, v, **({"segment_ids": seg[0]} if seg else {}))
        return jnp.sum(out.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((1, H, T, D), jnp.bfloat16)
    # three documents opening mid-block (at 1000 and 20000)
    seg = (jnp.asarray(np.repeat([1, 2, 3], [1000, 19000, T - 20000])[None], jnp.int32),) if packed else ()
    exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=["cuda"],
                            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        params, x, x, x, *seg)
    return exp.mlir_module()


def _bias_shaped(text: str) -> list[str]:
    """The tensor types of ``text`` (string attributes removed: the kernels' bodies) whose last two dims are
    (L, L) or (L, 2L)."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    found = set()
    for dims in re.findall(r"tensor<((?:\d+x)+)[a-z]", outside):
        shape = tuple(int(d) for d in dims.rstrip("x").split("x"))
        if len(shape) >= 2 and shape[-2:] in ((L, L), (L, 2 * L)):
            found.add(f"tensor<{dims}...>")
    return sorted(found)


@pytest.fixture
def before_hopper(monkeypatch):
    """A GPU before Hopper (compute capability 8.0), where 'auto' takes the Triton GPU form."""
    from longctx.attention import dispatch

    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "8.0")


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["row", "packed"])
def test_gpu_forward_backward_holds_no_band_bias_array(packed, before_hopper):
    text = _exported_text(packed)
    # the kernels are in the program: the forward and the two backward passes
    assert "__gpu$xla.gpu.triton" in text and "vq_cache_gpu_bwd_q" in text and "vq_cache_gpu_bwd_kv" in text
    assert "tensor<" in text
    found = _bias_shaped(text)
    assert not found, f"[.., L, L] / [.., L, 2L] values outside the kernels (L = {L}): {found}"


def test_hopper_forward_backward_holds_no_band_bias_array(monkeypatch):
    """The same on Hopper, where 'auto' takes the Mosaic GPU kernels (pallas_kernels/vq_cache_mgpu.py): the
    forward and its three backward kernels in the program, no Triton call."""
    from longctx.attention import dispatch

    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "9.0")
    text = _exported_text(impl="mosaic_gpu")
    assert "triton" not in text and text.count("@mosaic_gpu") >= 4
    assert "tensor<" in text
    found = _bias_shaped(text)
    assert not found, f"[.., L, L] / [.., L, 2L] values outside the kernels (L = {L}): {found}"


def test_gpu_path_takes_the_compute_dtype(before_hopper):
    from test_compute_dtype import defects

    Dk, Dv = 16, 32  # S = 40 codes (64 after padding), L = 16: no statistic's last axis is a head width
    cfg = attention.default_config("transformer_vq")
    cfg.update({"block_len": 16, "codebook_size": 40})
    core = attention.build("transformer_vq", cfg, num_heads=H, head_dim=Dk, value_dim=Dv, causal=True,
                           rngs=nnx.Rngs(0), platform="cuda")
    assert core.implementation_for(B=1, T=64, dtype=jnp.bfloat16).name == "pallas"
    graphdef, params, rest = nnx.split(core, nnx.Param, ...)

    def loss(params, q, k, v):
        out, _ = nnx.merge(graphdef, params, rest)(q, k, v)
        return jnp.sum(out.astype(jnp.float32))

    q = jnp.ones((1, H, 64, Dk), jnp.bfloat16)
    v = jnp.ones((1, H, 64, Dv), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, q, v).jaxpr
    assert "vq_cache_gpu_fwd" in str(jaxpr)
    # a float32 operand a kernel's output aliases is the zeros it accumulates into (the query-side backward pass
    # adds the cache means' gradient dμ̄ [.., S, Dv] there), not a matmul operand
    accumulators = _aliased_operands(jaxpr)
    assert len(accumulators) == 1 and accumulators[0].endswith(f"{Dv})"), accumulators
    found = [f for f in defects(jaxpr, {Dk, Dv}) if f not in accumulators]
    assert not found, "float32 matmul operands on the GPU path:\n  " + "\n  ".join(found[:8])


def _aliased_operands(jaxpr) -> list[str]:
    """``defects``' description of every float32 ``pallas_call`` operand that an output aliases."""
    from test_compute_dtype import _sub_jaxprs

    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            avals = [(i, eqn.invars[i].aval) for i, _ in eqn.params["input_output_aliases"]]
            out += [f"pallas_call operand {i} float32 {tuple(a.shape)}" for i, a in avals if a.dtype == jnp.float32]
        else:
            out += [f for p in eqn.params.values() for sub in _sub_jaxprs(p) for f in _aliased_operands(sub)]
    return out


def test_the_reader_sees_bias_shaped_values():
    """The reader has teeth: a [.., L, 2L] value is found, one inside a string attribute is not."""
    text = ('%0 = stablehlo.add %a, %b : tensor<1x2x64x512x1024xf32>\n'
            'stablehlo.custom_call @x() {backend_config = "tensor<4x512x512xf32>"} : () -> tensor<8xf32>')
    assert _bias_shaped(text) == ["tensor<1x2x64x512x1024x...>"]

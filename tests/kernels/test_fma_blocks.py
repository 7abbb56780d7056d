"""FMA multilevel-blocks Pallas kernel (docs/methods/fma.md §8) on the shared kernel test base: interpret-mode forward
against the pure-JAX reference (causal and bidirectional, ragged lengths, fine level only, fp32 and bf16), the backward
kernels (dq with the packed coarse slots' gradient, dk/dv) against autodiff of the reference in q, k, v and the packed
coarse operands kc, vc (fp32 tight, bf16 loose), a check that the VJP runs Pallas calls and no XLA recomputation of the
reference, TPU / CUDA lowering of forward and backward through jax.export (and a clear refusal of shapes a platform
cannot take), the outputs' dtypes (bf16 activations and gradients, fp32 log-sum-exp) and the GPU lowering's warps and
stages (the rule, or as given), and the method with impl='pallas' equal to impl='xla' in value and gradient (§6
check 7). Packed rows (docs/methods/fma.md §2.7): the same forward, gradient and export cases with the document of
every query, key and coarse slot (``docs``) against the reference given them. Export at configs/enwik8/fma.py's
shapes (n 1024, m 64 and n 2048, m 128; p 4, heads of 64: 24 packed coarse slots per block, padded to 24 on TPU and
32 on GPU as the method does)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from kernel_test_base import KernelTestBase  # noqa: I001

from longctx import attention
from pallas_kernels import fma_blocks
from pallas_kernels.fma_blocks_ref import NEG

BH = 3


class TestFMABlocks(KernelTestBase):
    # C: coarse slots per block (padded as the platform pads them), R: summary rows; G: fine blocks per program;
    # form 'tpu': the TPU lowering's coarse access (slots copied row by row, resident gradients) in interpret mode
    SHAPES = {
        "causal_ragged": dict(n=64, m=8, d=8, dv=6, C=12, R=20, causal=True, n_valid=59),
        "bidir_ragged": dict(n=64, m=8, d=8, dv=8, C=16, R=24, causal=False, n_valid=61),
        "fine_only": dict(n=32, m=8, d=8, dv=8, C=0, R=0, causal=True, n_valid=32),
        "causal_ragged_g4": dict(n=64, m=8, d=8, dv=6, C=12, R=20, causal=True, n_valid=59, G=4),
        "bidir_ragged_g2": dict(n=64, m=8, d=8, dv=8, C=16, R=24, causal=False, n_valid=61, G=2),
        "causal_ragged_tpu_form": dict(n=64, m=8, d=8, dv=6, C=16, R=20, causal=True, n_valid=59, G=2, form="tpu"),
        "bidir_ragged_tpu_form": dict(n=64, m=8, d=8, dv=8, C=16, R=24, causal=False, n_valid=61, form="tpu"),
        "export": dict(n=512, m=64, d=64, dv=64, C=32, R=56, causal=True, n_valid=509, G=2),
        "export_bidir": dict(n=512, m=64, d=64, dv=64, C=32, R=56, causal=False, n_valid=512, G=4),
        "export_odd_d": dict(n=256, m=64, d=48, dv=48, C=32, R=48, causal=True, n_valid=256),
        "enwik8_paper_tpu": dict(n=1024, m=64, d=64, dv=64, C=24, R=112, causal=True, n_valid=1024, G=4),
        "enwik8_paper_cuda": dict(n=1024, m=64, d=64, dv=64, C=32, R=112, causal=True, n_valid=1024, G=2),
        "enwik8_n2048_tpu": dict(n=2048, m=128, d=64, dv=64, C=24, R=112, causal=True, n_valid=2048, G=4),
        "enwik8_n2048_cuda": dict(n=2048, m=128, d=64, dv=64, C=32, R=112, causal=True, n_valid=2048, G=2),
        # packed rows: documents of every query, key and slot (packed_docs)
        "causal_packed": dict(n=64, m=8, d=8, dv=6, C=12, R=20, causal=True, n_valid=59, G=2, packed=True),
        "bidir_packed": dict(n=64, m=8, d=8, dv=8, C=16, R=24, causal=False, n_valid=61, packed=True),
        "fine_only_packed": dict(n=32, m=8, d=8, dv=8, C=0, R=0, causal=False, n_valid=32, packed=True),
        "causal_packed_tpu_form": dict(n=64, m=8, d=8, dv=6, C=16, R=20, causal=True, n_valid=59, G=4, form="tpu",
                                       packed=True),
        "export_packed": dict(n=512, m=64, d=64, dv=64, C=32, R=56, causal=True, n_valid=509, G=2, packed=True),
        "export_bidir_packed": dict(n=512, m=64, d=64, dv=64, C=32, R=56, causal=False, n_valid=512, G=4,
                                    packed=True),
    }
    FORWARD_CASES = (("causal_ragged", "float32"), ("bidir_ragged", "float32"), ("fine_only", "float32"),
                     ("causal_ragged", "bfloat16"), ("causal_ragged_g4", "float32"), ("bidir_ragged_g2", "bfloat16"),
                     ("causal_ragged_tpu_form", "float32"), ("bidir_ragged_tpu_form", "bfloat16"),
                     ("causal_packed", "float32"), ("bidir_packed", "bfloat16"), ("fine_only_packed", "float32"),
                     ("causal_packed_tpu_form", "float32"), ("bidir_packed", "float32"))
    GRAD_CASES = (("causal_ragged", "float32"), ("bidir_ragged", "float32"), ("fine_only", "float32"),
                  ("causal_ragged", "bfloat16"), ("bidir_ragged", "bfloat16"), ("causal_ragged_g4", "float32"),
                  ("bidir_ragged_g2", "float32"), ("causal_ragged_tpu_form", "float32"),
                  ("bidir_ragged_tpu_form", "float32"), ("causal_packed", "float32"), ("bidir_packed", "float32"),
                  ("fine_only_packed", "float32"), ("causal_packed_tpu_form", "float32"),
                  ("causal_packed", "bfloat16"))
    EXPORT_CASES = (("tpu", "export", "float32"), ("cuda", "export", "float32"), ("tpu", "export_bidir", "float32"),
                    ("cuda", "export_bidir", "float32"), ("cuda", "export_odd_d", "float32"),
                    ("tpu", "enwik8_paper_tpu", "float32"), ("tpu", "enwik8_paper_tpu", "bfloat16"),
                    ("cuda", "enwik8_paper_cuda", "float32"), ("cuda", "enwik8_paper_cuda", "bfloat16"),
                    ("tpu", "enwik8_n2048_tpu", "bfloat16"), ("cuda", "enwik8_n2048_cuda", "bfloat16"),
                    ("cuda", "causal_ragged", "float32"),  # m = 8: refused on GPU
                    ("tpu", "export_packed", "float32"), ("cuda", "export_packed", "bfloat16"),
                    ("tpu", "export_bidir_packed", "bfloat16"), ("cuda", "export_bidir_packed", "float32"))
    # bf16: the probabilities enter the P V product as bf16 (operands are never up-cast before a dot)
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (1e-2, 1e-2)}
    DIFF_ARGNUMS = (0, 1, 2, 3, 4)  # q, k, v and the level summaries kall, vall the coarse slots index

    def is_ragged(self, shape):  # valid tokens end inside a fine block
        return shape["n_valid"] % shape["m"] != 0

    def paper_shapes(self, platform):  # the coarse slots padded as the method pads them for that platform
        return (f"enwik8_paper_{platform}", f"enwik8_n2048_{platform}")

    def make_inputs(self, shape, dtype):
        n, m, d, dv, C, R = shape["n"], shape["m"], shape["d"], shape["dv"], shape["C"], shape["R"]
        nb = n // m
        ks = jax.random.split(jax.random.key(n + C), 6)
        q = (jax.random.normal(ks[0], (BH, n, d)) * d**-0.5).astype(dtype)
        k = jax.random.normal(ks[1], (BH, n, d)).astype(dtype)
        v = jax.random.normal(ks[2], (BH, n, dv)).astype(dtype)
        kall = vall = idx = cb = None
        if C:
            kall = jax.random.normal(ks[3], (BH, R, d)).astype(dtype)
            vall = jax.random.normal(ks[4], (BH, R, dv)).astype(dtype)
            rng = np.random.default_rng(C)
            # a block's valid slots read distinct summary rows (as the method's levels do), shared by other blocks;
            # masked slots read any row, repeats of the valid ones included
            rows = np.stack([rng.permutation(R)[:C] for _ in range(nb)]).astype(np.int32)
            masked = rng.random((nb, C)) < 0.3
            masked[0] = True  # a block with every coarse slot masked
            rows = np.where(masked & (rng.random((nb, C)) < 0.5), rows[:, :1], rows)
            idx = jnp.asarray(rows)
            cb = jnp.asarray(np.where(masked, NEG, np.log(4.0)).astype(np.float32))
        args = (q, k, v, kall, vall, idx, cb)
        if shape.get("packed"):
            args += (packed_docs(n, m, C, BH, seed=n + C),)
        return args, dict(m=m, causal=shape["causal"], n_valid=shape["n_valid"], G=shape.get("G", 1),
                          form=shape.get("form"))

    def kernel(self, q, k, v, kall, vall, idx, cb, docs=None, *, interpret, platform=None, m, causal, n_valid, G,
               form):
        return fma_blocks.fma_blocks(q, k, v, kall, vall, idx, cb, m, causal, n_valid, interpret, 1 << 24,
                                     form if interpret else platform, blocks_per_program=G, docs=docs)

    def reference(self, q, k, v, kall, vall, idx, cb, docs=None, *, m, causal, n_valid, G, form):
        f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
        return fma_blocks._ref_blocks(f32(q), f32(k), f32(v), f32(kall), f32(vall), idx, cb, m, causal, n_valid,
                                      1 << 24, docs=docs)

    def unsupported_reasons(self, platform, shape, dtype):
        return fma_blocks.unsupported_reasons(platform, m=shape["m"], d=shape["d"], dv=shape["dv"])

    def export_disabled_checks(self, platform):
        return [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []


def packed_docs(n: int, m: int, C: int, bh: int, seed: int = 0):
    """Documents of a packed row laid out again (``fma_blocks_forward``'s ``docs``), per row: runs of ids 1, 2, ...
    of ragged lengths (one shorter than a fine block, ends inside blocks), a gap of layout padding (document 0, as
    the method's layout leaves between documents) and the tail past the row's tokens (queries -1, keys -2); the
    coarse slots' groups of random documents among them (-1: a group of no document)."""
    rng = np.random.default_rng(seed)
    qd = np.zeros((bh, n), np.int32)
    for r in range(bh):
        cuts = np.sort(rng.choice(np.arange(1, n - 1), 5, replace=False))
        qd[r] = np.searchsorted(cuts, np.arange(n), side="right")  # runs 0 (a gap first), 1, ..., 5
        qd[r] = np.where(qd[r] == 2, 0, np.where(qd[r] > 2, qd[r] - 1, qd[r] + 1))  # the third run: padding
    kd = qd.copy()
    qd[:, -2:], kd[:, -2:] = -1, -2
    sd = None if C == 0 else jnp.asarray(rng.integers(-1, 5, (bh, n // m, C)).astype(np.int32))
    return jnp.asarray(qd), jnp.asarray(kd), sd


def test_packed_documents_change_the_result():
    """The packed cases compare something: the documents change the reference's output (so the kernel must read
    them), and the documents cover queries of several documents in one fine block."""
    t = TestFMABlocks()
    for name in ("causal_packed", "bidir_packed", "fine_only_packed"):
        args, static = t.make_inputs(t.SHAPES[name], jnp.float32)
        with_docs = t.reference(*args, **static)
        without = t.reference(*args[:7], **static)
        assert float(jnp.max(jnp.abs(with_docs - without))) > 0.1, name
        qd = np.asarray(args[7][0]).reshape(BH, -1, static["m"])
        assert np.any(qd.min(-1) != qd.max(-1)), name


def test_unsupported_reasons():
    assert fma_blocks.unsupported_reasons("cuda", m=64, d=64, dv=64) == []
    assert fma_blocks.unsupported_reasons("cuda", m=128, d=64, dv=64) == []  # configs/enwik8/fma.py "n2048"
    assert fma_blocks.unsupported_reasons("tpu", m=8, d=64, dv=64) == []
    assert any("16 rows" in r for r in fma_blocks.unsupported_reasons("cuda", m=8, d=64, dv=64))
    assert any("shared memory" in r for r in fma_blocks.unsupported_reasons("cuda", m=256, d=64, dv=64))
    assert any("powers of two" in r for r in fma_blocks.unsupported_reasons("cuda", m=64, d=512, dv=64))
    assert any("powers of two" in r for r in fma_blocks.unsupported_reasons("cuda", m=64, d=48, dv=48))
    assert any("FMA-linear" in r for r in fma_blocks.unsupported_reasons("interpret", m=8, d=8, dv=8,
                                                                          coarse_kind="stats"))
    assert any("dropout" in r for r in fma_blocks.unsupported_reasons("tpu", m=64, d=64, dv=64, dropout=0.1))


def test_gpu_tiles_rule_and_settings():
    """The GPU lowering's warps and stages: the rule (4 warps up to m = 64 rows, 8 at 128; 2 stages) unless given."""
    assert fma_blocks.gpu_tiles(64) == (4, 2) and fma_blocks.gpu_tiles(16) == (4, 2)
    assert fma_blocks.gpu_tiles(128) == (8, 2)
    assert fma_blocks.gpu_tiles(128, 4, 3) == (4, 3)
    params = fma_blocks._compiler_params("cuda", 64, (8, 3))
    assert (params.num_warps, params.num_stages) == (8, 3)
    params = fma_blocks._compiler_params("cuda", 128)
    assert (params.num_warps, params.num_stages) == (8, 2)


def test_outputs_in_the_compute_dtype():
    """bf16 operands: the kernels write ``o`` and every gradient in bf16 (activations), ``lse`` in fp32 (a
    statistic)."""
    t = TestFMABlocks()
    args, static = t.make_inputs(t.SHAPES["causal_ragged"], jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, lse = jax.eval_shape(lambda *a: fma_blocks.fma_blocks_forward(
            *a, interpret=True, m=static["m"], causal=static["causal"], n_valid=static["n_valid"]), *args)
        grads = jax.eval_shape(jax.grad(lambda *d: jnp.sum(t.kernel(*d, *args[5:], interpret=True, **static)
                                                           .astype(jnp.float32)), argnums=(0, 1, 2, 3, 4)), *args[:5])
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 5


def _eqns_outside_kernels(jaxpr, out):
    """Every equation of a jaxpr and its sub-jaxprs, a ``pallas_call``'s own body not walked, into ``out``."""
    for eqn in jaxpr.eqns:
        out.append(eqn)
        if eqn.primitive.name == "pallas_call":
            continue
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _eqns_outside_kernels(sub, out)
    return out


def _primitives(jaxpr, out):
    """Count the primitives of a jaxpr and its sub-jaxprs into ``out``: ``pallas_call`` itself, and every other
    primitive outside a kernel body (a kernel's own body is not walked)."""
    for eqn in _eqns_outside_kernels(jaxpr, []):
        out[eqn.primitive.name] = out.get(eqn.primitive.name, 0) + 1
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_vjp_is_the_backward_kernels(causal):
    """The gradient runs Pallas calls (forward, dq with the coarse slots, dk/dv) and no XLA recomputation of the
    scores: no dot or exp outside the kernels, so the gradient test above tests kernels, not the reference's VJP."""
    t = TestFMABlocks()
    args, static = t.make_inputs(t.SHAPES["causal_ragged" if causal else "bidir_ragged"], jnp.float32)

    def loss(*diff):
        return jnp.sum(t.kernel(*diff, *args[5:], interpret=True, **static) ** 2)

    grad = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args[:5])
    prims = _primitives(grad.jaxpr, {})
    assert prims.get("pallas_call") == 3, prims
    assert not {"dot_general", "exp"} & set(prims), prims


@pytest.mark.slow  # the kernel tests above check the kernel; this one runs it through the method
@pytest.mark.parametrize("causal", [True, False])
def test_method_pallas_equals_xla_forward_and_vjp(causal):
    """docs/methods/fma.md §6 check 7: the core with impl='pallas' (interpret mode here) == impl='xla', value and VJP."""
    n = 45
    cfg = {"m": 8, "p": 2, "max_len": 64}

    def mk(impl):
        return attention.build("fma", ml_collections.ConfigDict({**cfg, "impl": impl}), num_heads=2, head_dim=8,
                               value_dim=6, causal=causal, rngs=nnx.Rngs(0))

    ks = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(kk, (1, 2, n, 8)) for kk in ks[:2])
    v = jax.random.normal(ks[2], (1, 2, n, 6))
    w = jax.random.normal(ks[3], (1, 2, n, 6))
    outs, grads = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl in ("xla", "pallas"):
            core = mk(impl)
            gd, params, rest = nnx.split(core, nnx.Param, ...)

            def loss(params, q, k, v, gd=gd, rest=rest):
                return jnp.sum(nnx.merge(gd, params, rest)(q, k, v)[0] * w)

            # jitted (eager dispatch, interpret mode above all, runs op by op)
            outs.append(jax.jit(lambda params, q, k, v, gd=gd, rest=rest: nnx.merge(gd, params, rest)(q, k, v)[0])(
                params, q, k, v))
            grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_no_gathered_coarse_slots_outside_the_kernel(causal):
    """The method with impl='pallas' at a long length (n 8192, m 64, p 4: 128 fine blocks, 6 coarse levels), forward
    and backward: the kernel reads the coarse slots of each block from the level summaries by index, so no array of
    the per-block slots ([.., blocks, slots, d], or its flat [.., blocks * slots, d]) exists outside the kernels, and
    their gradient reaches the summaries without an XLA scatter-add."""
    n, m, p, d = 8192, 64, 4, 64
    nb, L = n // m, (n // m).bit_length() - 2
    C = (2 if causal else 4) * p * L
    slot_counts = {C, fma_blocks._c_pad(C, "interpret")}  # the slots as the interpret mode pads them
    slot_counts |= {nb * c for c in slot_counts}
    cfg = ml_collections.ConfigDict({"m": m, "p": p, "max_len": n, "impl": "pallas"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = attention.build("fma", cfg, num_heads=1, head_dim=d, causal=causal, rngs=nnx.Rngs(0))
        gd, params, rest = nnx.split(core, nnx.Param, ...)

        def loss(params, q, k, v):
            return jnp.sum(nnx.merge(gd, params, rest)(q, k, v)[0].astype(jnp.float32))

        x = jax.ShapeDtypeStruct((1, 1, n, d), jnp.float32)
        grad = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, x, x, x)
    eqns = _eqns_outside_kernels(grad.jaxpr, [])
    assert sum(e.primitive.name == "pallas_call" for e in eqns) == 3
    gathered = [(e.primitive.name, v.aval.shape) for e in eqns for v in e.outvars
                if len(getattr(v.aval, "shape", ())) >= 2 and v.aval.shape[-1] == d and v.aval.shape[-2] in slot_counts]
    assert not gathered, f"per-block coarse slots materialised outside the kernel: {gathered[:4]}"
    scatters = [e.primitive.name for e in eqns if e.primitive.name.startswith("scatter")]
    assert not scatters, scatters


def test_tpu_refuses_summaries_past_its_vmem_budget():
    """The TPU form holds a row's level summaries and their gradients in VMEM: 2^16 fine blocks' worth is refused
    with the reason; the paper's lengths are not."""
    assert fma_blocks.unsupported_reasons("tpu", m=64, d=64, dv=64, summary_rows=112) == []
    assert any("VMEM" in r for r in fma_blocks.unsupported_reasons("tpu", m=64, d=64, dv=64, summary_rows=1 << 18))
    assert fma_blocks.unsupported_reasons("cuda", m=64, d=64, dv=64, summary_rows=1 << 18) == []

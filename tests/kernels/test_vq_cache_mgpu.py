"""The Mosaic GPU form of the Transformer-VQ compressive VQ-cache kernel (pallas_kernels/vq_cache_mgpu.py: a
``plgpu.kernel`` forward, the Triton form's backward kernels) on the shared kernel test base, in Mosaic GPU's
interpret mode on a CPU (``InterpretGPUParams``: simulated shared memory, TMA, barriers, wgmma; the Triton backward
in Pallas interpret mode): values, final state and gradients against the §2.6 serial reference and its autodiff
(ragged T, carried state, M < L, several query tiles per block, several code chunks, one and several value-width
slices, float32 and bfloat16); packed rows (outputs and gradients against the packed XLA form, from the empty and a
carried state, float32 and bfloat16); the band-bias table the kernel reads; the refusals; ``jax.export`` for cuda
at the enwik8 config's shapes (L = M = S = 512, Dk = 128, Dv = 1536: the Mosaic GPU lowering runs on this CPU
host), unpacked and packed; bfloat16 reaching every wgmma, and every kernel operand and output in the compute dtype
but the declared float32 statistics.

Interpret mode takes 10-250 s a case here (on two shared cores): the default suite runs two of them
(:meth:`TestVQCacheMosaicGPU.default_cases`), ``-m slow`` the rest (the packed cases among them)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import weighted_sum  # noqa: I001
from test_fma_blocks_mgpu import _equations  # every equation of a jaxpr, kernel bodies included
from test_vq_cache import VQCacheKernelCases, make_vq_inputs

from pallas_kernels import vq_cache_mgpu, vq_cache_ref

# small tiles (interpret mode takes any tile dividing L): L = 32 in two query tiles of 16, S = 24 (or 20) padded to
# two code chunks of 16, Dk = 16, Dv = 32 in two value-width slices of 16 (or one of 32)
TINY = dict(L=32, S=24, Dk=16, Dv=32, block_q=16, block_v=16, state_dtype="input")
ENWIK8 = dict(T=1024, L=512, M=512, S=512, Dk=128, Dv=1536, warm=0, state_dtype="input")  # configs/enwik8
DEFAULT = {("forward", ("cuda_tiles_ragged", "bfloat16")), ("grad", ("cuda_tiles_ragged", "bfloat16"))}


class TestVQCacheMosaicGPU(VQCacheKernelCases):
    SHAPES = {
        "ragged_fresh": dict(TINY, T=80, M=32, warm=0),  # empty cache and band: fully masked code chunks
        "short_band_ragged": dict(TINY, T=75, M=21, S=20, warm=53),  # carried cache, partly valid band
        "one_slice_carried": dict(TINY, T=64, M=32, warm=45, block_v=32),  # one value-width slice
        # the cuda tiles (64 rows, Dv = 128 in two value slices of 64) in interpret mode: two query tiles a block,
        # M < L (tile pairs wholly outside the band), two code chunks, a carried cache
        "cuda_tiles_ragged": dict(T=200, L=128, M=80, S=100, Dk=64, Dv=128, block_v=64, warm=90,
                                  state_dtype="input"),
    }
    FORWARD_CASES = (("short_band_ragged", "float32"), ("ragged_fresh", "bfloat16"), ("ragged_fresh", "float32"),
                     ("short_band_ragged", "bfloat16"), ("one_slice_carried", "float32"),
                     ("one_slice_carried", "bfloat16"), ("cuda_tiles_ragged", "bfloat16"))
    GRAD_CASES = (("cuda_tiles_ragged", "bfloat16"), ("short_band_ragged", "bfloat16"),
                  ("short_band_ragged", "float32"), ("ragged_fresh", "float32"), ("one_slice_carried", "bfloat16"))
    EXPORT_PLATFORMS = ()  # cuda's lowering is tested below (a Mosaic GPU custom call, not the base's markers)
    # bf16 storage rounds μ̄, the probabilities (P·V, P·μ̄ operands), dO and the output o itself (written in the
    # compute dtype) to bf16 (each about 2^-9 relative); the reference is fp32 throughout (given the same bf16
    # codebook the layer passes). fp32 matches to fp32 rounding.
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (3e-3, 3e-3)}

    def default_cases(self, kind, cases):
        return {c for c in cases if (kind, c) in DEFAULT}

    def make_inputs(self, shape, dtype):
        """The shared inputs, the codebook in the compute dtype (the layer passes it so; the kernel's products
        take one operand dtype)."""
        args, static = make_vq_inputs(shape, dtype)
        args = args[:5] + (args[5].astype(dtype),) + args[6:]
        return args, static

    def kernel(self, q_u, bd, k_hat, z, v, C, *st, interpret, platform="cuda", L, M, block_q=None, block_v=None):
        return vq_cache_mgpu.vq_cache_attention(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M,
                                                interpret=interpret, block=block_q, block_v=block_v)

    def reference(self, q_u, bd, k_hat, z, v, C, *st, L, M, **_):
        return vq_cache_ref.vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M)


def test_band_table_holds_the_skewed_band():
    """``SK[i, E - base + b] = bd[i, base + a - b]`` (``a = i mod t``) for every tile distance ``base`` (a multiple
    of t) and in-band distance, 0 elsewhere (the spare box included): the box the kernel reads is the band bias of
    that tile pair."""
    t, M, RL = 4, 6, 12
    bd = jnp.asarray(np.random.default_rng(0).standard_normal((2, RL, M + 1)), jnp.float32)
    sk = np.asarray(vq_cache_mgpu.band_table(bd, M=M, t=t))
    E = vq_cache_mgpu.band_width(M, t)
    assert E == 8 and sk.shape == (2, RL, E + 2 * t)
    bd = np.asarray(bd)
    seen = np.zeros(sk.shape, bool)
    for i in range(RL):
        a = i % t
        for base in range(0, E + 1, t):
            for b in range(t):
                d = base + a - b
                expect = bd[:, i, d] if 0 <= d <= M else 0.0
                np.testing.assert_array_equal(sk[:, i, E - base + b], expect)
                seen[:, i, E - base + b] |= 0 <= d <= M
    assert not np.any(sk[~seen])  # nothing outside the band


def test_unsupported_reasons():
    r = vq_cache_mgpu.unsupported_reasons
    paper = dict(L=512, M=512, S=512, Dk=128)
    assert r("cuda", **paper, Dv=1536, dtype=jnp.bfloat16, compute_capability="9.0") == []
    assert r("cuda", **paper, Dv=4096, dtype=jnp.bfloat16) == []
    assert r("interpret", L=32, M=21, S=20, Dk=16, Dv=32, dtype=jnp.float32, block=16) == []
    assert any("Hopper" in x for x in r("cuda", **paper, Dv=1536, dtype=jnp.bfloat16, compute_capability=(8, 0)))
    assert any("tf32" in x for x in r("cuda", **paper, Dv=1536, dtype=jnp.float32))
    assert any("multiple of 64" in x for x in r("cuda", L=96, M=96, S=64, Dk=128, Dv=128, dtype=jnp.bfloat16))
    assert any("key dim" in x for x in r("cuda", L=64, M=64, S=64, Dk=48, Dv=128, dtype=jnp.bfloat16))
    assert any("value dim" in x for x in r("cuda", L=64, M=64, S=64, Dk=64, Dv=96, dtype=jnp.bfloat16))
    assert any("not tpu" in x for x in r("tpu", **paper, Dv=1536, dtype=jnp.bfloat16))
    assert any("mem_len" in x for x in r("interpret", L=32, M=40, S=20, Dk=16, Dv=32, block=16))
    assert any("must divide" in x for x in r("interpret", L=32, M=32, S=20, Dk=16, Dv=32, block=12))
    assert vq_cache_mgpu.value_slice(1536) == 256 and vq_cache_mgpu.value_slice(64) == 64
    assert vq_cache_mgpu.value_slice(320) == 64 and vq_cache_mgpu.value_slice(256, vq_cache_mgpu.TV_BACKWARD) == 128


def test_smem_estimate():
    """The shared-memory estimate per kernel: every kernel of the paper's shapes within an SM; the backward's dP pass
    at the forward's 256-wide slices would not be (why the backward takes slices of at most 128); the forward's
    estimate at Dk = 128, tv = 256 counts the query tile, P and the two-slot ring of the key pipeline."""
    est = vq_cache_mgpu.smem_bytes(128, 256)
    assert max(est.values()) <= vq_cache_mgpu.SMEM_LIMIT_BYTES
    docs = 6 * 64 * 4  # a packed row's document tiles, counted always
    assert est["fwd"] == docs + 64 * 128 * 2 + 64 * 64 * 2 + 2 * ((128 * 64 + 64 * 256) * 2 + 64 * 64 * 4 + 64 * 4)
    wide = vq_cache_mgpu.smem_bytes(128, 256, tv_b=256)
    assert wide["dq"] > vq_cache_mgpu.SMEM_LIMIT_BYTES and wide["dkv"] > vq_cache_mgpu.SMEM_LIMIT_BYTES
    assert any("shared memory" in x for x in vq_cache_mgpu.unsupported_reasons(
        "cuda", L=512, M=512, S=512, Dk=256, Dv=1536, dtype=jnp.bfloat16))


def test_compiled_refusal_names_reasons():
    """Compiled (not interpret): float32 operands and a block length off the 64-row tiles raise with reasons."""
    shape = dict(T=96, L=96, M=96, S=64, Dk=64, Dv=64, warm=0)
    args, _ = make_vq_inputs(shape, jnp.float32)
    st = TestVQCacheMosaicGPU._state(*args[6:])
    with pytest.raises(ValueError, match="cannot run") as info:
        vq_cache_mgpu.vq_cache_attention(*args[:6], st, L=96, M=96, interpret=False)
    assert "tf32" in str(info.value) and "multiple of 64" in str(info.value)


def _export(shape):
    """(forward, gradient) of the kernel on bf16 inputs of ``shape`` exported for cuda: their MLIR texts."""
    args, _ = make_vq_inputs(shape, jnp.bfloat16)
    args = args[:5] + (args[5].astype(jnp.bfloat16),) + args[6:]

    def forward(*a):
        return vq_cache_mgpu.vq_cache_attention(*a[:6], TestVQCacheMosaicGPU._state(*a[6:]), L=shape["L"],
                                                M=shape["M"], interpret=False)[0]

    diff = (0, 1, 2, 4, 8, 9, 10)

    def loss(*d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return weighted_sum(forward(*full))

    exp = jax.export.export(jax.jit(forward), platforms=["cuda"])(*args)
    exp_b = jax.export.export(jax.jit(jax.grad(loss, argnums=tuple(range(len(diff))))), platforms=["cuda"])(
        *(args[i] for i in diff))
    return exp.mlir_module(), exp_b.mlir_module()


def test_export_cuda_enwik8():
    """``jax.export`` for cuda at the enwik8 config's shapes (bf16): the forward is one ``mosaic_gpu`` custom call
    (the Mosaic GPU lowering runs on this CPU host and checks each kernel's shared memory against the device's
    limit; no GPU compiles or runs it), its gradient adds the three backward kernels; no ``[.., L, 2L]`` or
    ``[.., 2L, 2L]`` array in either program."""
    text, text_b = _export(ENWIK8)
    assert text.count("@mosaic_gpu") == 1 and "triton" not in text
    assert text_b.count("@mosaic_gpu") == 4 and "triton" not in text_b  # forward, dq, dk/dv, dμ̄
    assert not re.search(r"x512x1024x|x1024x1024x", text + text_b)


def _export_packed(shape):
    """(forward, gradient) of a packed row (three documents a row, one opening mid-block; the first row continues
    its carried document) through the kernel on bf16 inputs of ``shape``, exported for cuda: their MLIR texts."""
    from longctx.attention.base import continues_state
    from longctx.attention.transformer_vq import xla

    args, _ = make_vq_inputs(shape, jnp.bfloat16)
    args = args[:5] + (args[5].astype(jnp.bfloat16),) + args[6:]
    B, T, L, M, S = args[0].shape[0], shape["T"], shape["L"], shape["M"], shape["S"]
    cuts = np.array([[0, 300, 700], [0, 513, 1000]][:B])
    seg = jnp.asarray((np.arange(T)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
    cont = continues_state(jnp.array([1, 0][:B], jnp.int32), seg)
    seen = jnp.array([40, 0][:B], jnp.int32)

    def forward(q_u, bd, k_hat, v, *st):
        state = TestVQCacheMosaicGPU._state(*st)
        packed = xla.kernel_packed(args[3], v, state, seen, cont, L=L, M=M, S=S, segment_ids=seg)
        o, new = vq_cache_mgpu.vq_cache_attention(q_u, bd, k_hat, args[3], v, args[5], state, L=L, M=M,
                                                  interpret=False, packed=packed)
        return o

    diff = (args[0], args[1], args[2], args[4], *args[6:])
    exp = jax.export.export(jax.jit(forward), platforms=["cuda"])(*diff)
    grad = jax.grad(lambda *a: weighted_sum(forward(*a)), argnums=(0, 1, 2, 3))
    exp_b = jax.export.export(jax.jit(grad), platforms=["cuda"])(*diff)
    return exp.mlir_module(), exp_b.mlir_module()


def test_export_cuda_enwik8_packed():
    """A packed row at the enwik8 config's shapes lowers for cuda (the Mosaic GPU lowering checks each kernel's shared
    memory, the document tiles included): the forward one ``mosaic_gpu`` call, the gradient four; no
    ``[.., L, 2L]`` or ``[.., 2L, 2L]`` array."""
    text, text_b = _export_packed(ENWIK8)
    assert text.count("@mosaic_gpu") == 1 and text_b.count("@mosaic_gpu") == 4
    assert "triton" not in text + text_b
    assert not re.search(r"x512x1024x|x1024x1024x", text + text_b)


@pytest.mark.slow
def test_export_cuda_pg19():
    """PG-19's value width (Dv = 4096: 16 forward slices of 256, 32 backward slices of 128) lowers as well."""
    text, text_b = _export(dict(ENWIK8, Dv=4096))
    assert text.count("@mosaic_gpu") == 1 and text_b.count("@mosaic_gpu") == 4


def test_bf16_reaches_every_wgmma():
    """Forward and backward on bfloat16 inputs: every wgmma (the kernels' matmuls) takes bfloat16 operands into a
    float32 accumulator. (tests/attention/test_compute_dtype.py reads ``dot_general`` and ``pallas_call``; a Mosaic
    GPU kernel traces to ``wgmma_ref`` products, read here.)"""
    case = TestVQCacheMosaicGPU()
    args, static = case.make_inputs(case.SHAPES["short_band_ragged"], jnp.bfloat16)
    diff = (0, 1, 2, 4, 8, 9, 10)

    def loss(*d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return weighted_sum(case.kernel(*full, interpret=True, **static))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(diff)))))(*(args[i] for i in diff)).jaxpr
    products = [e for e in _equations(jaxpr) if e.primitive.name == "wgmma_ref"]
    # forward: S and P·W for the codes, the previous and the present block (6); dq: S, dP, dS·k per key group (9);
    # dk/dv: Sᵀ, dPᵀ, dSᵀ·q, then Sᵀ, Pᵀ·dO (5); dμ̄: Sᵀ, Pᵀ·dO (2)
    assert len(products) == 6 + 9 + 5 + 2
    found = {tuple(str(v.aval.dtype) for v in e.invars[:3]) for e in products}
    assert found == {("float32", "bfloat16", "bfloat16")}, found
    # every operand and output of the kernels in the compute dtype but the declared statistics
    shape, t = case.SHAPES["short_band_ragged"], static["block_q"]
    R = -(-shape["T"] // shape["L"])
    names, wide = _kernel_float32(jaxpr, _statistic_shapes(args[0].shape[0] * args[0].shape[1], R, shape["L"],
                                                           -(-shape["S"] // t) * t, shape["M"], t))
    assert len(names) == 4 and not wide, wide



def _packed_problem(M: int, carried: bool):
    """A packed row (documents of 3, 9 and 6 tokens in two orders; L = 4, so documents open mid-block) with its
    inputs, float32: from the empty state, or from a carried one that the first row's first document continues.
    Returns a dict of the arrays and sizes."""
    from test_vq_cache_gpu import _packed_layout

    from longctx.attention.base import continues_state
    from longctx.attention.transformer_vq import xla

    B, H, Dk, Dv, S, L, T = 2, 2, 8, 8, 5, 4, 18
    seg = jnp.asarray([np.repeat([1, 2, 3], lengths) for lengths in ((3, 9, 6), (9, 6, 3))], jnp.int32)
    assert all(n > 0 for n in _packed_layout(seg, L))  # keys two row blocks back in a window, and before one
    rng = np.random.default_rng(11)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    q_u, k, v, C = f(B, H, T, Dk), f(B, H, T, Dk), f(B, H, T, Dv), f(H, S, Dk)
    bd, w = 0.3 * f(B, H, T, M + 1), f(B, H, T, Dv)
    k_hat, z, _, _ = xla.stvq(k, C)
    state = {"pos": jnp.int32(7 * carried), "band_k": f(B, H, M, Dk), "band_v": f(B, H, M, Dv),
             "band_z": jnp.asarray(rng.integers(0, S, (B, H, M)), jnp.int32), "agg_mu": f(B, H, S, Dv),
             "agg_n": jnp.asarray(rng.integers(0, 3, (B, H, S)), jnp.float32)}
    if not carried:  # the empty state
        state = jax.tree.map(jnp.zeros_like, state)
    # row 0 continues its carried document (seen = 7 > M: a whole band) where carried; row 1 starts afresh
    doc, seen = jnp.array([carried, 0], jnp.int32), jnp.array([7 * carried, 0], jnp.int32)
    cont = continues_state(doc, seg)
    assert bool(cont[0, 0]) == carried and not bool(cont[1, 0])
    return dict(seg=seg, q_u=q_u, bd=bd, k_hat=k_hat, z=z, v=v, C=C, w=w, state=state, seen=seen, cont=cont, L=L,
                M=M, S=S)


def _packed_loss(pb, kernel: bool, dtype, block_v: int):
    """``loss(q_u, bd, k_hat, v) -> (Σ o·w, o)`` of the problem ``pb`` through the Mosaic GPU kernels in interpret
    mode (``kernel``; query tiles of 2, the band and codebook in ``dtype``) or the packed XLA form."""
    from longctx.attention.transformer_vq import xla

    L, M, S, z, state = pb["L"], pb["M"], pb["S"], pb["z"], pb["state"]

    def loss(q_u, bd, k_hat, v):
        if kernel:
            packed = xla.kernel_packed(z, v, state, pb["seen"], pb["cont"], L=L, M=M, S=S, segment_ids=pb["seg"])
            band = {"band_k": state["band_k"].astype(dtype), "band_v": state["band_v"].astype(dtype)}
            o, new = vq_cache_mgpu.vq_cache_attention(q_u, bd, k_hat, z, v, pb["C"].astype(dtype),
                                                      {**state, **band}, L=L, M=M, interpret=True, block=2,
                                                      block_v=block_v, packed=packed)
            assert new is None and o.dtype == dtype  # the output in the compute dtype
        else:
            o = xla.causal_packed(q_u, bd, k_hat, z, v, pb["C"], L=L, M=M, segment_ids=pb["seg"], state=state,
                                  seen=pb["seen"], continues=pb["cont"])
        return jnp.sum(o.astype(jnp.float32) * pb["w"]), o

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("M,carried,block_v,dtype", [(3, False, 4, jnp.float32), (4, True, 8, jnp.float32),
                                                     (3, True, 4, jnp.bfloat16), (4, False, 8, jnp.bfloat16)])
def test_packed_rows_equal_the_packed_xla_form(M, carried, block_v, dtype):
    """A packed row (:func:`_packed_problem`; L = 4 in query tiles of 2, so documents open mid-block and mid-tile)
    through the Mosaic GPU kernels in interpret mode (``packed``: ``xla.kernel_packed``'s caches and document
    arrays) equals the packed one-shot XLA form (``xla.causal_packed``, each document on its own grid, float32):
    the output and the gradients of q_u, the band scores, k̂ and v (two value-width slices, or one); the case has
    keys two row blocks back inside a query's own window and keys of the previous row block before it (the dk̂
    window)."""
    pb = _packed_problem(M, carried)
    args = (pb["q_u"].astype(dtype), pb["bd"], pb["k_hat"].astype(dtype), pb["v"].astype(dtype))
    grad = lambda kernel: jax.jit(jax.value_and_grad(_packed_loss(pb, kernel, dtype, block_v),  # noqa: E731
                                                     argnums=(0, 1, 2, 3), has_aux=True))
    (_, o1), g1 = grad(True)(*args)
    (_, o2), g2 = grad(False)(*(x.astype(jnp.float32) for x in args))
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    for name, a, b in zip(("o", "dq_u", "dbd", "dk_hat", "dv"), (o1,) + tuple(g1), (o2,) + tuple(g2)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        scale, err = float(jnp.abs(b).max()), float(jnp.abs(a - b).max())
        assert scale > 0 and err <= tol * max(scale, 1.0), (name, err, scale)


def _kernel_float32(jaxpr, allowed: dict) -> tuple[set, list]:
    """(the Mosaic GPU kernels' names, their float32 operands / outputs whose shape is not one of ``allowed``'s, the
    shapes of :data:`vq_cache_mgpu.STATISTICS`) of a traced program."""
    names, found = set(), []
    for e in _equations(jaxpr):
        name = str(e.params.get("name", ""))
        if e.primitive.name != "mpmd_map" or not name.startswith("vq_cache_mgpu"):
            continue
        names.add(name)
        for kind, vs in (("operand", e.invars), ("output", e.outvars)):
            for i, x in enumerate(vs):
                shape = tuple(x.aval.shape)
                if x.aval.dtype == jnp.float32 and shape not in allowed:
                    found.append(f"{name} {kind} {i} float32 {shape}")
    return names, found


def _statistic_shapes(BH: int, R: int, L: int, Sp: int, M: int, t: int) -> dict:
    """The shape of each float32 statistic the kernels take or give (:data:`vq_cache_mgpu.STATISTICS`)."""
    w = vq_cache_mgpu.band_width(M, t) + 2 * t
    out = {(BH, R * L): "lse, delta, qdoc, qcache, qwin", (BH, (R + 1) * L): "kdoc", ((R + 1) * L,): "kval",
           (BH, R, Sp): "ell", (BH, R * L, w): "band table", (BH, w, R * L): "band table (transposed)"}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_packed_kernels_take_and_give_the_compute_dtype(dtype):
    """A packed row's forward and gradient traced on bfloat16 inputs: every operand and output of the four kernels
    (q, k̂, v, the codebook, μ̄, dO; o, dq, dk̂, dv, dμ̄) is bfloat16 but the declared float32 statistics
    (:data:`vq_cache_mgpu.STATISTICS`: the document arrays among them); :func:`test_bf16_reaches_every_wgmma`
    checks an unpacked call the same way. On float32 inputs the same reader finds the float32 operands (teeth)."""
    pb = _packed_problem(3, True)
    packed = jax.make_jaxpr(jax.grad(lambda *a: _packed_loss(pb, True, dtype, 4)(*a)[0], argnums=(0, 1, 2, 3)))(
        pb["q_u"].astype(dtype), pb["bd"], pb["k_hat"].astype(dtype), pb["v"].astype(dtype)).jaxpr
    R = -(-pb["seg"].shape[1] // pb["L"])
    names, found = _kernel_float32(packed, _statistic_shapes(2 * 2, R, pb["L"], 6, pb["M"], 2))
    assert names == {f"vq_cache_mgpu_{k}" for k in ("fwd", "dq", "dkv", "dmu")}
    if dtype == jnp.bfloat16:
        assert not found, found
    else:  # q, k̂, v, μ̄, dO, o and every gradient: float32 operands the reader names
        assert len(found) >= 12, found

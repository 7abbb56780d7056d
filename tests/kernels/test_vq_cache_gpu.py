"""The GPU (Pallas-Triton) form of the Transformer-VQ compressive VQ-cache kernel (pallas_kernels/vq_cache_gpu.py,
docs/methods/transformer_vq.md §9) on the shared kernel test base: forward, final state and the Pallas backward kernels in
interpret mode against the jnp §2.6 serial reference and its autodiff (ragged T, carried state, M < L, several query
tiles per block, several code chunks, fp32 and bf16 storage; both value-width paths: one slice, the accumulator in
the loop carry, and two slices, the output block as accumulator), its 'cuda' lowering (jax.export, forward and VJP)
at the paper's shapes and at one slice, the shared-memory / register budget, the refusals, the entry point of
pallas_kernels/vq_cache.py picking the form by platform, and the kernels' structure read from the jaxpr (one forward
and two backward ``pallas_call``s, no value-width grid axis, no read of the output block at one slice)."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from test_vq_cache import VQCacheKernelCases, make_vq_inputs

from pallas_kernels import vq_cache, vq_cache_gpu, vq_cache_ref

# the smallest tiles Triton compiles (16: its dot minimum), also run in interpret mode on CPU: L = 32 in two query
# tiles of 16; S = 24 (or 20) padded to two code chunks of 16; Dk = 16; Dv = 32 in two value-width slices of 16
# (the output block is the accumulator); ONE_SLICE: Dv = 32 in one slice (the accumulator in the loop carry).
# state_dtype='input': bf16 runs store q, k̂, v and μ̄ in bf16.
TINY = dict(L=32, S=24, Dk=16, Dv=32, block_q=16, block_s=16, block_v=16, state_dtype="input")
ONE_SLICE = dict(TINY, block_v=32)


class TestVQCacheGPU(VQCacheKernelCases):
    SHAPES = {
        "ragged_fresh": dict(TINY, T=80, M=32, warm=0),
        "carried": dict(TINY, T=64, M=32, warm=45),
        "short_band_ragged": dict(TINY, T=75, M=21, S=20, warm=53),
        # bf16 inputs with an fp32 carried state: stored in fp32 (never round a wider input)
        "carried_f32_state": dict(TINY, T=64, M=32, warm=45, state_dtype=None),
        # one value-width slice (n_tv == 1): ragged, causal, a carried cache and a partly valid band
        "one_slice_short_band_ragged": dict(ONE_SLICE, T=75, M=21, S=20, warm=53),
        # the default tile choice through pallas_kernels.vq_cache.vq_cache_attention(platform='cuda')
        "entry_default_tiles": dict(T=50, L=16, M=16, S=24, Dk=16, Dv=32, warm=21, state_dtype="input"),
        # 'cuda' lowering: ragged T, M < L, three value-width slices of 64, S padded to the code chunk
        "cuda_ragged_short_band": dict(T=200, L=64, M=40, S=100, Dk=64, Dv=192, warm=0, state_dtype="input"),
        # 'cuda' lowering at one value-width slice (a benchmark head dim: Dv = 64), the accumulator in registers
        "cuda_one_slice": dict(T=200, L=64, M=40, S=100, Dk=64, Dv=64, warm=0, state_dtype="input"),
        "enwik8_paper": dict(T=1024, L=512, M=512, S=512, Dk=128, Dv=1536, warm=0, state_dtype="input"),
        "pg19_paper": dict(T=1024, L=512, M=512, S=512, Dk=128, Dv=4096, warm=0, state_dtype="input"),
        "refused_block_len": dict(T=48, L=24, M=24, S=32, Dk=32, Dv=32, warm=0),
    }
    FORWARD_CASES = (("ragged_fresh", "float32"), ("carried", "float32"), ("short_band_ragged", "float32"),
                     ("carried", "bfloat16"), ("short_band_ragged", "bfloat16"), ("carried_f32_state", "bfloat16"),
                     ("entry_default_tiles", "float32"), ("one_slice_short_band_ragged", "float32"),
                     ("one_slice_short_band_ragged", "bfloat16"))
    # ragged_fresh: empty cache and band (fully masked groups); short_band_ragged: carried cache, partly valid band
    GRAD_CASES = (("ragged_fresh", "float32"), ("short_band_ragged", "float32"), ("short_band_ragged", "bfloat16"),
                  ("one_slice_short_band_ragged", "float32"), ("one_slice_short_band_ragged", "bfloat16"))
    EXPORT_CASES = (("cuda", "cuda_ragged_short_band", "float32"), ("cuda", "cuda_one_slice", "float32"),
                    ("cuda", "cuda_one_slice", "bfloat16"), ("cuda", "enwik8_paper", "float32"),
                    ("cuda", "enwik8_paper", "bfloat16"), ("cuda", "pg19_paper", "float32"),
                    ("cuda", "pg19_paper", "bfloat16"), ("cuda", "refused_block_len", "float32"))
    EXPORT_PLATFORMS = ("cuda",)  # the Triton form; 'tpu' lowers the TPU form (test_vq_cache.py)
    # bf16 storage rounds μ̄, the probabilities (P·V, P·μ̄ operands) and dO to bf16 (about 2^-9 relative); the
    # reference is fp32 throughout. fp32 storage matches to fp32 rounding.
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-3, 2e-3)}

    def kernel(self, q_u, bd, k_hat, z, v, C, *st, interpret, platform="cuda", L, M, block_q=None, block_s=None,
               block_v=None):
        if block_q is None and block_s is None:  # the integrated entry point, which picks the form by platform
            return vq_cache.vq_cache_attention(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M,
                                               interpret=interpret, platform=platform or "cuda", block_v=block_v)
        return vq_cache_gpu.vq_cache_attention(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M,
                                               interpret=interpret, block_q=block_q, block_s=block_s,
                                               block_v=block_v)

    def reference(self, q_u, bd, k_hat, z, v, C, *st, L, M, **_):
        return vq_cache.vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M)

    def unsupported_reasons(self, platform, shape, dtype):
        return vq_cache.unsupported_reasons(platform, L=shape["L"], M=shape["M"], S=shape["S"], Dk=shape["Dk"],
                                            Dv=shape["Dv"], dtype=dtype)

    def export_disabled_checks(self, platform):
        return [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


# -- shared-memory / register budget at the paper's shapes (L = S = 512, Dk = 128; enwik8 Dv = 1536, PG-19 4096)
@pytest.mark.parametrize("Dv", [1536, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tile_budget_fits_at_paper_shapes(Dv, dtype):
    t = vq_cache_gpu.choose_tiles(L=512, S=512, Dk=128, Dv=Dv, in_dtype=dtype)
    assert t["fits"] and t["tq"] in (64, 128) and t["tv"] in (64, 128) and Dv % t["tv"] == 0
    assert t["ts"] <= 128 and t["Sp"] == 512
    assert set(t["plan"]) == set(vq_cache_gpu.KINDS)
    for p in t["plan"].values():
        assert p["smem_bytes"] <= vq_cache_gpu.SMEM_LIMIT_BYTES
        assert p["words_per_thread"] <= vq_cache_gpu.REG_WORDS_LIMIT
        assert p["num_warps"] in (4, 8)
    assert vq_cache.unsupported_reasons("cuda", L=512, M=512, S=512, Dk=128, Dv=Dv, dtype=dtype) == []
    # one Dv-wide tile would not fit: the Dv tiling is what makes the kernels fit
    assert not vq_cache_gpu.choose_tiles(L=512, S=512, Dk=128, Dv=Dv, in_dtype=dtype, block_v=Dv)["fits"]


def test_tile_budget_counts_the_tiles():
    """With several value-width slices the forward's shared memory is q (+ its f32 copy) plus num_stages × (the
    larger key step + one slice: a μ̄ / value slice and the f32 output slice it rescales in place); a wider slice
    adds num_stages × both slices' growth; bf16 halves the stored tiles. With one slice (tv == Dv) the accumulator is
    in the loop carry: the same live words, no f32 output (or dv) slice in shared memory."""
    kw = dict(tq=64, ts=64, Dk=128, Dv=256)
    a, _ = vq_cache_gpu.tile_budget("fwd", tv=64, **kw)
    b, _ = vq_cache_gpu.tile_budget("fwd", tv=128, **kw)
    assert b - a == vq_cache_gpu.NUM_STAGES * 2 * 64 * 64 * 4
    assert a == 64 * 128 * 4 + vq_cache_gpu.NUM_STAGES * (64 * 128 * 4 + 64 * 64 * 4 + 2 * 64 * 64 * 4)
    c, words = vq_cache_gpu.tile_budget("fwd", tv=64, in_dtype=jnp.bfloat16, num_warps=8, **kw)
    assert c < a and words == (64 * 64 + 2 * 64 * 64 + 3 * 64) / 256
    kw1 = dict(kw, Dv=64)  # one slice
    for kind in ("fwd", "bwd_kv"):
        (s1, w1), (s2, w2) = (vq_cache_gpu.tile_budget(kind, tv=64, **k) for k in (kw1, kw))
        assert s2 - s1 == vq_cache_gpu.NUM_STAGES * 64 * 64 * 4 and w1 == w2
    assert vq_cache_gpu.tile_budget("bwd_q", tv=64, **kw1) == vq_cache_gpu.tile_budget("bwd_q", tv=64, **kw)
    one, _ = vq_cache_gpu.tile_budget("fwd", tv=64, **kw1)
    assert one == 64 * 128 * 4 + vq_cache_gpu.NUM_STAGES * (64 * 128 * 4 + 64 * 64 * 4 + 64 * 64 * 4)
    _, words = vq_cache_gpu.tile_budget("fwd", tv=64, num_warps=8, **kw1)
    assert words == (64 * 64 + 2 * 64 * 64 + 3 * 64) / 256  # the [tq, Dv] accumulator as live words


def test_cases_cover_both_value_width_paths():
    """The tile plans of the cases named for each path give that path: one value-width slice (Dv // tv == 1: the
    accumulator in the loop carry) or several (the output block as accumulator)."""
    def n_tv(name, dtype=jnp.float32):
        sh = TestVQCacheGPU.SHAPES[name]
        t = vq_cache_gpu.choose_tiles(L=sh["L"], S=sh["S"], Dk=sh["Dk"], Dv=sh["Dv"], in_dtype=dtype,
                                      block_q=sh.get("block_q"), block_s=sh.get("block_s"), block_v=sh.get("block_v"))
        return sh["Dv"] // t["tv"]

    for name in ("one_slice_short_band_ragged", "entry_default_tiles", "cuda_one_slice"):
        assert n_tv(name) == n_tv(name, jnp.bfloat16) == 1, name
    for name in ("ragged_fresh", "carried", "short_band_ragged", "cuda_ragged_short_band", "enwik8_paper"):
        assert n_tv(name) > 1, name


def _pallas_calls(jaxpr) -> list:
    """The ``pallas_call`` equations of ``jaxpr`` and of every jaxpr its equations hold (kernel bodies excluded)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(eqn)
            continue
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    out.extend(_pallas_calls(sub))
    return out


def test_two_backward_passes_and_no_value_width_grid_axis():
    """The forward is one ``pallas_call`` whose grid is (B·H, query tiles): the value width is a loop inside each
    program (its scores and probabilities computed once), not a grid axis. The gradient adds two: the query-side
    pass (dq, the band scores' and the cache means' gradients) and the key-side pass (dk̂, dv), neither with a
    value-width axis. TINY: Dv = 32 in slices of 16, so a value-width axis would be a grid dimension of 2."""
    args, static = make_vq_inputs(dict(TINY, T=64, M=32, warm=45), jnp.float32)
    z, C, st = args[3], args[5], TestVQCacheGPU._state(*args[6:])
    L, tq, tv, Dv = TINY["L"], TINY["block_q"], TINY["block_v"], TINY["Dv"]
    assert Dv // tv == 2

    def loss(q_u, bd, k_hat, v):
        o, _ = vq_cache_gpu.vq_cache_attention(q_u, bd, k_hat, z, v, C, st, interpret=True, **static)
        return jnp.sum(o)

    diff = (args[0], args[1], args[2], args[4])
    fwd = _pallas_calls(jax.make_jaxpr(loss)(*diff).jaxpr)
    grad = _pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*diff).jaxpr)
    assert [e.params["name"] for e in fwd] == ["vq_cache_gpu_fwd"]
    grids = {e.params["name"]: tuple(e.params["grid_mapping"].grid) for e in grad}
    assert len(grad) == 3 and set(grids) == {"vq_cache_gpu_fwd", "vq_cache_gpu_bwd_q", "vq_cache_gpu_bwd_kv"}
    BH, n_q = 1 * 2, 64 // tq  # batch × heads; query tiles (T = 64 = R·L)
    assert grids["vq_cache_gpu_fwd"] == (BH, n_q)
    assert grids["vq_cache_gpu_bwd_q"] == (BH, n_q)
    assert grids["vq_cache_gpu_bwd_kv"] == (BH, n_q + L // tq)  # the extended keys: the band's block in front


def _ref_accesses(jaxpr, refs) -> list[str]:
    """The primitives applied to the refs ``refs`` (variables of ``jaxpr``) in ``jaxpr`` and, following each
    argument into the jaxprs its equations hold (loops, conditionals, calls), in every nested jaxpr."""
    ids = {id(r) for r in refs}
    out = []
    for eqn in jaxpr.eqns:
        p = eqn.params
        if eqn.primitive.name == "while":  # cond consts, body consts, carry
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            subs = [(p["cond_jaxpr"], eqn.invars[:nc] + eqn.invars[nc + nb:]), (p["body_jaxpr"], eqn.invars[nc:])]
        elif eqn.primitive.name == "cond":  # the branch index, then the operands
            subs = [(br, eqn.invars[1:]) for br in p["branches"]]
        else:
            subs = [(sub, eqn.invars) for v in p.values() for sub in (v if isinstance(v, (tuple, list)) else (v,))
                    if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))]
        if not subs and eqn.invars and id(eqn.invars[0]) in ids:  # a ref primitive: get, swap, load, ...
            out.append(eqn.primitive.name)
        for sub, args in subs:
            sub = getattr(sub, "jaxpr", sub)
            assert len(sub.invars) == len(args), f"unmapped arguments of {eqn.primitive.name}"
            inner = [v for v, a in zip(sub.invars, args) if id(a) in ids]
            if inner:
                out.extend(_ref_accesses(sub, inner))
    return out


@pytest.mark.parametrize("block_v", [32, 16])
def test_one_slice_keeps_the_accumulator_in_the_carry(block_v):
    """At one value-width slice (TINY's Dv = 32 with block_v = 32) the forward's output block and the key-side
    pass's dv block are written once and never read back inside the program (the accumulator is in the loop
    carry); at two slices (block_v = 16) they are the accumulators, read and written per slice."""
    args, static = make_vq_inputs(dict(TINY, T=64, M=32, warm=45, block_v=block_v), jnp.float32)
    z, C, st = args[3], args[5], TestVQCacheGPU._state(*args[6:])

    def loss(q_u, bd, k_hat, v):
        o, _ = vq_cache_gpu.vq_cache_attention(q_u, bd, k_hat, z, v, C, st, interpret=True, **static)
        return jnp.sum(o)

    calls = {e.params["name"]: e for e in _pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(
        args[0], args[1], args[2], args[4]).jaxpr)}
    for name, out in (("vq_cache_gpu_fwd", 0), ("vq_cache_gpu_bwd_kv", 1)):  # o; dv
        eqn = calls[name]
        body, gm = eqn.params["jaxpr"], eqn.params["grid_mapping"]
        ref = body.invars[gm.num_index_operands + gm.num_inputs + out]
        assert tuple(ref.aval.shape) == (TINY["block_q"], TINY["Dv"])
        acc = _ref_accesses(body, [ref])
        assert "swap" in acc, f"{name}: the walk does not reach the block's write"
        if block_v == 32:
            assert acc == ["swap"], f"{name}: the output block is read back / written per step at one slice: {acc}"
        else:
            assert "get" in acc, f"{name}: several slices accumulate in the output block: {acc}"


def test_refusals_name_their_reasons():
    def reasons(platform="cuda", **kw):
        shape = dict(L=64, M=64, S=64, Dk=64, Dv=64) | kw
        return vq_cache.unsupported_reasons(platform, **shape)

    assert reasons() == []
    assert any("block_len % 16" in r for r in reasons(L=24, M=24))
    assert any("power-of-two key dim" in r for r in reasons(Dk=48))
    assert any("value dim % 16" in r for r in reasons(Dv=40))
    r = reasons(Dk=1024)
    assert len(r) == 1 and "GPU tile budget exceeded" in r[0] and "KiB" in r[0]
    assert any("no rocm lowering" in r for r in reasons("rocm"))
    assert any("mem_len <= block_len" in r for r in reasons("interpret", M=65))
    assert any("float64" in r for r in reasons(dtype=jnp.float64))
    assert vq_cache_gpu.unsupported_reasons("interpret", L=8, M=8, S=6, Dk=8, Dv=8) == []
    args, static = make_vq_inputs(dict(T=16, L=8, M=8, S=6, Dk=8, Dv=8, warm=0), jnp.float32)
    with pytest.raises(ValueError, match="block_len % 16"):
        TestVQCacheGPU().kernel(*args, interpret=False, **static)
    # explicit tiles below Triton's dot minimum: refused compiled, accepted in interpret mode
    args, static = make_vq_inputs(dict(T=64, L=32, M=32, S=24, Dk=16, Dv=32, warm=0), jnp.float32)
    st = TestVQCacheGPU._state(*args[6:])
    with pytest.raises(ValueError, match=r"at least 16 \(got block_q=8\)"):
        vq_cache_gpu.vq_cache_attention(*args[:6], st, **static, block_q=8, block_s=16, block_v=16)
    jax.jit(lambda *a: vq_cache_gpu.vq_cache_attention(*a, st, **static, block_q=8, block_s=16, block_v=16,
                                                       interpret=True))(*args[:6])  # jitted: eager runs op by op


def test_entry_point_picks_the_form_by_platform():
    """vq_cache.vq_cache_attention runs the GPU kernels for platform 'cuda' (also 'gpu', and in interpret mode) and
    the TPU kernels otherwise (traced only)."""
    args, static = make_vq_inputs(dict(T=16, L=8, M=8, S=6, Dk=8, Dv=16, warm=0), jnp.float32)
    kern = TestVQCacheGPU()

    def kernels(platform, interpret=True):
        f = lambda *a: vq_cache.vq_cache_attention(*a[:6], kern._state(*a[6:]), **static, interpret=interpret,  # noqa: E731
                                                   platform=platform)
        return str(jax.make_jaxpr(f)(*args))

    for plat in ("cuda", "gpu"):
        jaxpr = kernels(plat)
        assert "vq_cache_gpu_fwd" in jaxpr and "name=vq_cache_fwd" not in jaxpr
    for plat in ("tpu",) + ((None,) if jax.default_backend() == "cpu" else ()):  # None: the default backend
        jaxpr = kernels(plat)
        assert "name=vq_cache_fwd" in jaxpr and "vq_cache_gpu" not in jaxpr
    assert vq_cache.PLATFORMS == ("tpu", "cuda")


def test_phase1_cache_is_the_reference_lag2_prefix():
    """Phase 1 (XLA) gives every query block the reference's lag-2 cache: carried agg ⊕ band ⊕ blocks 0..n-2."""
    shape = dict(T=40, L=8, M=6, S=6, Dk=8, Dv=8, warm=13)
    args, _ = make_vq_inputs(shape, jnp.float32)
    q_u, bd, k_hat, z, v, C = args[:6]
    st = TestVQCacheGPU._state(*args[6:])
    p = jax.jit(lambda *a: vq_cache_ref.block_inputs(*a, L=8, M=6))(q_u, bd, k_hat, z, v, C, st)
    captured = {}
    orig = vq_cache_gpu._attend

    def spy(q, kx, vx, bp, br, mu, ell, Cp, cfg, docs):  # Phase 2 not run: only its inputs are checked
        assert docs is None  # an unpacked row
        captured.update(mu=mu, ell=ell)
        return jnp.zeros(q.shape[:2] + vx.shape[-1:], jnp.float32)

    def phase1(*a):
        vq_cache_gpu.vq_cache_attention(*a[:6], TestVQCacheGPU._state(*a[6:]), L=8, M=6, interpret=True)
        return captured["mu"], captured["ell"]

    vq_cache_gpu._attend = spy
    try:
        mu, ell = jax.jit(phase1)(*args)
    finally:
        vq_cache_gpu._attend = orig
    R, S = p["cn"].shape[2], 6
    mu = mu.reshape(p["cmu"].shape[:3] + mu.shape[-2:])[..., :S, :]
    ell = ell.reshape(p["cn"].shape[:3] + ell.shape[-1:])
    assert jnp.allclose(mu, p["cmu"], atol=1e-6)
    assert jnp.allclose(ell[..., :S], vq_cache_ref.log_count(p["cn"]))
    assert bool(jnp.all(ell[..., S:] == vq_cache_ref.NEG))  # padded codes are masked
    assert R == 5 and float(jnp.max(p["cn"][:, :, 0])) > 0  # the carried state fills the cache of block 0


def _packed_layout(seg, L: int):
    """(pairs whose key lies two row blocks back yet in the query's own window, pairs whose key lies in the previous
    row block yet before the query's window): the packed case must have both for its dk̂ to test the window."""
    seg = jax.device_get(seg)
    two_back = before = 0
    for row in seg:
        starts = [next(j for j in range(i + 1) if all(row[j:i + 1] == row[i])) for i in range(len(row))]
        for i, s in enumerate(starts):
            win = s + ((i - s) // L - 1) * L  # the query's window start (row position)
            for j in range(s, i + 1):
                two_back += j // L == i // L - 2 and j >= win
                before += j // L == i // L - 1 and j < win
    return two_back, before


@pytest.mark.slow
@pytest.mark.parametrize("M,carried,block_v,dtype", [(3, False, 4, jnp.float32), (4, True, 8, jnp.float32),
                                                     (3, True, 4, jnp.bfloat16)])
def test_packed_rows_equal_the_packed_xla_form(M, carried, block_v, dtype):
    """A packed row (documents of 3, 9 and 6 tokens in two orders; L = 4, so documents open mid-block) through the GPU
    form in interpret mode (``packed``: ``xla.kernel_packed``'s caches and document arrays) equals the packed
    one-shot XLA form (``xla.causal_packed``, each document on its own grid): the output and the gradients of q_u,
    the band scores, k̂ and v, from the empty state and from a carried one that the first row's first document
    continues (two value-width slices, or one)."""
    import numpy as np

    from longctx.attention.base import continues_state
    from longctx.attention.transformer_vq import xla

    B, H, Dk, Dv, S, L, T = 2, 2, 8, 8, 5, 4, 18
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 4), r) for r in ([3, 9, 6], [9, 6, 3])]), jnp.int32)
    assert all(n > 0 for n in _packed_layout(seg, L))
    ks = jax.random.split(jax.random.PRNGKey(0), 12)
    n = lambda i, *s: jax.random.normal(ks[i], s)  # noqa: E731
    q_u, k, v, C, bd = n(0, B, H, T, Dk), n(1, B, H, T, Dk), n(2, B, H, T, Dv), n(3, H, S, Dk), 0.3 * n(4, B, H, T, M + 1)
    k_hat, z, _, _ = xla.stvq(k, C)
    w = n(10, B, H, T, Dv)
    if carried:  # row 0 continues its carried document (seen = 7 > M: a whole band), row 1 starts afresh
        state = {"pos": jnp.int32(7), "band_k": n(5, B, H, M, Dk), "band_v": n(6, B, H, M, Dv),
                 "band_z": jax.random.randint(ks[7], (B, H, M), 0, S), "agg_mu": n(8, B, H, S, Dv),
                 "agg_n": jax.random.randint(ks[9], (B, H, S), 0, 3).astype(jnp.float32)}
        doc, seen = jnp.array([1, 0], jnp.int32), jnp.array([7, 0], jnp.int32)
    else:
        state = vq_cache_ref.cast_state(jax.tree.map(jnp.zeros_like, {
            "pos": jnp.int32(0), "band_k": n(5, B, H, M, Dk), "band_v": n(6, B, H, M, Dv),
            "band_z": jnp.zeros((B, H, M), jnp.int32), "agg_mu": n(8, B, H, S, Dv), "agg_n": n(9, B, H, S)}), jnp.float32)
        doc, seen = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32)
    cont = continues_state(doc, seg)
    assert bool(cont[0, 0]) == carried and not bool(cont[1, 0])

    def loss(kernel, q_u, bd, k_hat, v):
        if kernel:
            packed = xla.kernel_packed(z, v, state, seen, cont, L=L, M=M, S=S, segment_ids=seg)
            band = {"band_k": state["band_k"].astype(dtype), "band_v": state["band_v"].astype(dtype)}
            o, new = vq_cache_gpu.vq_cache_attention(q_u, bd, k_hat, z, v, C.astype(dtype), {**state, **band}, L=L,
                                                     M=M, interpret=True, block_q=2, block_s=4, block_v=block_v,
                                                     packed=packed)
            assert new is None
        else:
            o = xla.causal_packed(q_u, bd, k_hat, z, v, C, L=L, M=M, segment_ids=seg, state=state, seen=seen,
                                  continues=cont)
        return jnp.sum(o.astype(jnp.float32) * w), o

    args = (q_u.astype(dtype), bd, k_hat.astype(dtype), v.astype(dtype))
    grad = lambda kernel: jax.jit(jax.value_and_grad(functools.partial(loss, kernel), argnums=(0, 1, 2, 3),  # noqa
                                                     has_aux=True))
    (_, o1), g1 = grad(True)(*args)
    (_, o2), g2 = grad(False)(*(x.astype(jnp.float32) for x in args))
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    for name, a, b in zip(("o", "dq_u", "dbd", "dk_hat", "dv"), (o1,) + tuple(g1), (o2,) + tuple(g2)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        scale = float(jnp.abs(b).max())
        assert scale > 0 and float(jnp.abs(a - b).max()) <= tol * max(scale, 1.0), name

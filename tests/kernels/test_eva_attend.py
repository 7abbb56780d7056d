"""EVA chunk + local attention Pallas kernel "eva_attend" (docs/methods/eva.md §8.3) on the shared kernel test base:
interpret-mode forward and the Pallas backward kernels against autodiff of the jnp reference (causal and
bidirectional, with and without window overlap, shared / per-head relative-position bias, the disjoint partition,
ragged lengths, both forms of the two backward passes, query sub-tiles, attention dropout by the shared hash mask,
fp32 and bf16), TPU / CUDA lowering at the WikiText-103 shapes through jax.export (heads of 128 with dropout
included), the GPU tile plan and its refusal, the VMEM budget, the dropout hash, and the method running both EVA
kernels with impl='pallas' in evaluation and training steps; the backward's pass count and the bias gradient summed
inside the kernel (jaxpr checks)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kernel_test_base import KernelTestBase, weighted_sum  # noqa: I001

from longctx import attention
from pallas_kernels import eva_attend, eva_attend_ref, hash_dropout

H = 2


class TestEVAAttend(KernelTestBase):
    # W window, P chunk size, L valid tokens (ragged unless stated), e_l/e_r window extensions, hb: bias heads
    # (0: no bias), form: the backward passes' form in interpret mode ('tpu' grid accumulation, 'cuda' loops and
    # atomic bias sums)
    SHAPES = {
        "causal_rpe": dict(L=45, W=8, P=4, d=16, dv=16, e_l=0, e_r=0, causal=True, hb=1, form="tpu"),
        "causal_overlap_loop": dict(L=45, W=8, P=4, d=16, dv=8, e_l=8, e_r=0, causal=True, hb=1, form="cuda",
                                    key_tile=4),  # local blocks in two key sub-tiles (GPU tiling)
        "causal_overlap_disjoint": dict(L=45, W=8, P=4, d=16, dv=16, e_l=8, e_r=0, causal=True, hb=0, form="tpu",
                                        disjoint=True),
        "bidir_overlap_loop": dict(L=43, W=8, P=2, d=16, dv=16, e_l=4, e_r=4, causal=False, hb=H, form="cuda",
                                   key_tile=4),
        "bidir_plain": dict(L=40, W=8, P=4, d=16, dv=16, e_l=0, e_r=0, causal=False, hb=0, form="tpu"),
        # WikiText-103 (§8.3): window 128, chunk 8, head 64, 512 tokens; and a long row
        "wt103": dict(L=512, W=128, P=8, d=64, dv=64, e_l=0, e_r=0, causal=True, hb=1, B=1),
        "wt103_bidir_overlap": dict(L=512, W=128, P=8, d=64, dv=64, e_l=64, e_r=64, causal=False, hb=H, B=1),
        "long_8k": dict(L=8192, W=128, P=8, d=64, dv=64, e_l=0, e_r=0, causal=True, hb=1, B=1),
        "odd_head": dict(L=512, W=128, P=8, d=48, dv=48, e_l=0, e_r=0, causal=True, hb=1, B=1),
        # configs/wikitext103/eva_16l.py: window 128 without overlap, chunk 8, heads of 128, shared RPE, 512 tokens,
        # and its training step (attention dropout 0.1)
        "wt103_paper": dict(L=512, W=128, P=8, d=128, dv=128, e_l=0, e_r=0, causal=True, hb=1, B=1),
        "wt103_paper_drop": dict(L=512, W=128, P=8, d=128, dv=128, e_l=0, e_r=0, causal=True, hb=1, B=1, rate=0.1),
        # attention dropout at ragged lengths: the GPU form with key and query sub-tiles (the mask's indices must
        # follow the tiles), the TPU form bidirectional with overlap and per-head bias
        "causal_drop_loop": dict(L=45, W=8, P=4, d=16, dv=16, e_l=8, e_r=0, causal=True, hb=1, form="cuda",
                                 key_tile=4, query_tile=4, rate=0.2),
        "bidir_drop": dict(L=43, W=8, P=2, d=16, dv=8, e_l=4, e_r=4, causal=False, hb=H, form="tpu", rate=0.3),
        # packed rows laid out on the window grid (_packed_segments: documents with gaps between, one shorter than a
        # chunk; causal: a carried document first, behind `base` chunks of a state): the GPU form with overlap, sub-tiles
        # and dropout, the TPU form with the disjoint partition, bidirectional with overlap, per-head bias, dropout
        "packed_causal_loop": dict(L=48, W=8, P=4, d=16, dv=16, e_l=8, e_r=0, causal=True, hb=1, form="cuda",
                                   key_tile=4, query_tile=4, rate=0.2, packed=True, base=4),
        "packed_causal_disjoint": dict(L=48, W=8, P=4, d=16, dv=8, e_l=8, e_r=0, causal=True, hb=0, form="tpu",
                                       disjoint=True, packed=True, base=4),
        "packed_bidir_drop": dict(L=48, W=8, P=2, d=16, dv=16, e_l=4, e_r=4, causal=False, hb=H, form="cuda",
                                  rate=0.3, packed=True),
        "packed_wt103": dict(L=768, W=128, P=8, d=64, dv=64, e_l=0, e_r=0, causal=True, hb=1, B=1, rate=0.1,
                             packed=True, base=16),
    }
    FORWARD_CASES = (("causal_rpe", "float32"), ("causal_overlap_loop", "float32"),
                     ("causal_overlap_disjoint", "float32"), ("bidir_overlap_loop", "float32"),
                     ("bidir_plain", "float32"), ("causal_rpe", "bfloat16"), ("bidir_overlap_loop", "bfloat16"),
                     ("causal_drop_loop", "float32"), ("bidir_drop", "float32"), ("causal_drop_loop", "bfloat16"),
                     ("bidir_drop", "bfloat16"), ("packed_causal_loop", "float32"), ("packed_causal_disjoint", "float32"),
                     ("packed_bidir_drop", "float32"), ("packed_causal_loop", "bfloat16"))
    GRAD_CASES = (("causal_rpe", "float32"), ("causal_overlap_loop", "float32"),
                  ("causal_overlap_disjoint", "float32"), ("bidir_overlap_loop", "float32"),
                  ("bidir_plain", "float32"), ("causal_rpe", "bfloat16"), ("causal_drop_loop", "float32"),
                  ("bidir_drop", "float32"), ("causal_drop_loop", "bfloat16"), ("bidir_drop", "bfloat16"),
                  ("packed_causal_loop", "float32"), ("packed_causal_disjoint", "float32"),
                  ("packed_bidir_drop", "float32"), ("packed_causal_loop", "bfloat16"))
    EXPORT_CASES = (("tpu", "wt103", "float32"), ("cuda", "wt103", "float32"), ("tpu", "wt103", "bfloat16"),
                    ("cuda", "wt103", "bfloat16"), ("tpu", "wt103_bidir_overlap", "float32"),
                    ("cuda", "wt103_bidir_overlap", "float32"), ("tpu", "long_8k", "float32"),
                    ("cuda", "odd_head", "float32"), ("tpu", "wt103_paper", "float32"),
                    ("tpu", "wt103_paper", "bfloat16"), ("cuda", "wt103_paper", "float32"),
                    ("cuda", "wt103_paper", "bfloat16"), ("tpu", "wt103_paper_drop", "bfloat16"),
                    ("cuda", "wt103_paper_drop", "float32"), ("cuda", "wt103_paper_drop", "bfloat16"),
                    ("tpu", "packed_wt103", "bfloat16"), ("cuda", "packed_wt103", "bfloat16"))
    PAPER_SHAPES = ("wt103_paper", "wt103_paper_drop")
    # bf16: the reference follows the kernel's precision (bf16 operands, fp32 accumulation, P cast to bf16 before
    # P·V), but the kernel's online softmax rounds P at running maxima, and o is a bf16 output: they agree to about one
    # bf16 ulp of the largest output (2^-8 relative; the fp32 lse much closer). Gradients with respect to bf16 inputs
    # are rounded to bf16 (reference and kernel alike)
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (1e-2, 1e-2)}
    GRAD_TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (8e-3, 8e-3)}
    DIFF_ARGNUMS = (0, 1, 2, 3, 4, 5)  # q, k, v, k̂, β, bias
    KERNEL_BACKWARD = True

    def is_ragged(self, shape):  # valid tokens end inside a window block (and so inside a chunk or not)
        return shape["L"] % shape["W"] != 0

    def make_inputs(self, shape, dtype):
        L, W, P, d, dv = (shape[k] for k in ("L", "W", "P", "d", "dv"))
        BH = shape.get("B", 2) * H
        Lp, Cp = -(-L // W) * W, -(-L // W) * W // P + shape.get("base", 0)
        ks = jax.random.split(jax.random.PRNGKey(L + 7 * W + P), 6)
        q = (0.5 * jax.random.normal(ks[0], (BH, Lp, d))).astype(dtype)
        k = jax.random.normal(ks[1], (BH, Lp, d)).astype(dtype)
        v = jax.random.normal(ks[2], (BH, Lp, dv)).astype(dtype)
        kh = jax.random.normal(ks[3], (BH, Cp, d)).astype(dtype)
        beta = jax.random.normal(ks[4], (BH, Cp, dv)).astype(dtype)
        n_lt = len(eva_attend_ref.local_offsets(shape["e_l"], shape["e_r"]))
        bias = jax.random.normal(ks[5], (shape["hb"], n_lt, W, W)) if shape["hb"] else None
        rate = shape.get("rate", 0.0)
        seeds = hash_dropout.row_seeds(L + 1, jnp.arange(BH)) if rate else None
        static = dict(W=W, e_l=shape["e_l"], e_r=shape["e_r"], P=P, L=L, causal=shape["causal"],
                      disjoint=shape.get("disjoint", False), heads=H, form=shape.get("form"),
                      key_tile=shape.get("key_tile"), query_tile=shape.get("query_tile"), dropout_rate=rate,
                      seeds=seeds)
        if shape.get("packed"):
            static.update(segments=_packed_segments(Lp, W, P, shape.get("base", 0)), chunk_base=shape.get("base", 0))
        return (q, k, v, kh, beta, bias), static

    def kernel(self, q, k, v, kh, beta, bias, *, interpret, platform=None, form=None, **static):
        return eva_attend.eva_attend(q, k, v, kh, beta, bias, **static, interpret=interpret,
                                     platform=platform or (form if interpret else None))

    def reference(self, q, k, v, kh, beta, bias, *, form=None, key_tile=None, query_tile=None, chunk_base=0,
                  **static):
        return eva_attend_ref.eva_attend_reference(q, k, v, kh, beta, bias, **static)  # chunk_base: loop order only

    def unsupported_reasons(self, platform, shape, dtype):
        C = -(-shape["L"] // shape["P"]) + shape.get("base", 0)
        return eva_attend.unsupported_reasons(platform, W=shape["W"], d=shape["d"], dv=shape["dv"], C=C,
                                              e_l=shape["e_l"], e_r=shape["e_r"], dtype=dtype,
                                              dropout=shape.get("rate", 0.0) > 0)

    def export_disabled_checks(self, platform):
        return [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []


def _packed_segments(Lp: int, W: int, P: int, base: int):
    """A packed row's kernel operands (eva_attend's ``segments``) for two rows of ``Lp = 6W`` laid-out positions:
    documents at whole windows or chunks with gaps between (one of 3 tokens, shorter than any chunk here), their
    positions and chunk indices their own; with ``base`` (causal), each row's first document continues a carried
    one of ``base·P`` tokens whose ``base`` finished chunks come first (ids 0..base-1)."""
    assert Lp == 6 * W and base * P % W == 0
    rows = ([(0, 2 * W + 4), (3 * W, 3), (4 * W, 2 * W - 3)],
            [(0, W - 2), (W, 2 * W + 6), (4 * W, 5), (5 * W, W)])
    rel, doc = np.zeros((2, Lp), np.int32), np.full((2, Lp), -1, np.int32)
    for b, docs in enumerate(rows):
        for n, (start, length) in enumerate(docs):
            doc[b, start:start + length] = n
            rel[b, start:start + length] = np.arange(length) + (base * P if n == 0 else 0)
    at = np.arange(0, Lp, P)
    opens = (doc[:, at] >= 0) & (rel[:, at] % P == 0)  # a layout chunk is one where a document's chunk opens
    c_rel = np.concatenate([np.tile(np.arange(base), (2, 1)), rel[:, at] // P], axis=1).astype(np.int32)
    c_doc = np.concatenate([np.zeros((2, base), np.int32), np.where(opens, doc[:, at], -1)], axis=1)
    return tuple(jnp.asarray(x) for x in (rel, doc, doc, c_rel, c_doc))


def test_packed_documents_never_meet_in_the_kernel():
    """A packed row in the kernel (GPU form, causal with a carried document's chunks): changing one document's keys,
    values and chunk summaries leaves every other document's outputs unchanged, and the gaps (no document) give 0."""
    t = TestEVAAttend()
    (q, k, v, kh, beta, bias), st = t.make_inputs(TestEVAAttend.SHAPES["packed_causal_loop"], jnp.float32)
    run = jax.jit(lambda *a: t.kernel(*a, interpret=True, **st)[0])
    rel, doc, _, _, c_doc = st["segments"]
    o1 = run(q, k, v, kh, beta, bias)
    row = jnp.repeat(doc, H, axis=0)  # [BH, Lp]
    crow = jnp.repeat(jnp.pad(c_doc, ((0, 0), (0, kh.shape[1] - c_doc.shape[1])), constant_values=-1), H, axis=0)
    hit, chit = (row == 1)[..., None], (crow == 1)[..., None]
    o2 = run(q, jnp.where(hit, 9.0, k), jnp.where(hit, 9.0, v), jnp.where(chit, 9.0, kh), jnp.where(chit, 9.0, beta),
             bias)
    others = (row >= 0) & (row != 1)
    np.testing.assert_allclose(np.asarray(jnp.where(others[..., None], o1, 0)),
                               np.asarray(jnp.where(others[..., None], o2, 0)), atol=1e-6)
    assert float(jnp.max(jnp.abs(jnp.where((row == 1)[..., None], o1 - o2, 0)))) > 1e-2  # document 1's own changed
    np.testing.assert_array_equal(np.asarray(jnp.where((row < 0)[..., None], o1, 0)), 0.0)


def test_reference_padding_rows_and_chunks_carry_no_weight():
    """The reference (what the kernel must match) gives padding keys and all-padding chunks zero weight:
    changing them leaves every real query's output unchanged."""
    t = TestEVAAttend()
    (q, k, v, kh, beta, bias), st = t.make_inputs(TestEVAAttend.SHAPES["bidir_overlap_loop"], jnp.float32)
    st.pop("form"), st.pop("key_tile"), st.pop("query_tile")
    L, P = st["L"], st["P"]
    ref = jax.jit(lambda *a: eva_attend_ref.eva_attend_reference(*a, **st)[0])
    o1 = ref(q, k, v, kh, beta, bias)
    pad = (jnp.arange(q.shape[1]) >= L)[None, :, None]
    cpad = (jnp.arange(kh.shape[1]) * P >= L)[None, :, None]
    o2 = ref(q, jnp.where(pad, 9.0, k), jnp.where(pad, 9.0, v), jnp.where(cpad, 9.0, kh), jnp.where(cpad, 9.0, beta),
             bias)
    np.testing.assert_allclose(np.asarray(o1[:, :L]), np.asarray(o2[:, :L]), atol=1e-6)


@pytest.mark.parametrize("L, fits", [(512, True), (32768, True), (65536, True), (1 << 20, False)])
def test_vmem_budget_bounds_the_chunk_count(L, fits):
    """TPU: the chunk summaries are whole VMEM blocks, so the estimate grows with C = L / P; WikiText-103 shapes
    (W 128, P 8, head 64) fit up to 64k tokens in fp32 and the refusal names the VMEM limit beyond."""
    reasons = eva_attend.unsupported_reasons("tpu", W=128, d=64, dv=64, C=L // 8)
    assert (reasons == []) == fits, reasons
    if not fits:
        assert any("VMEM" in r for r in reasons)
    assert eva_attend.vmem_bytes(W=128, d=64, dv=64, C=L // 8, n_lt=1) < 2 * eva_attend.vmem_bytes(
        W=128, d=64, dv=64, C=L // 4, n_lt=1)


def test_refusals_name_their_reasons(monkeypatch):
    assert any("power of two" in r for r in eva_attend.unsupported_reasons("cuda", W=128, d=48, dv=64, C=64))
    assert any("window" in r for r in eva_attend.unsupported_reasons("interpret", W=0, d=64, dv=64, C=64))
    assert any("exact_lse" in r for r in eva_attend.unsupported_reasons("tpu", W=128, d=64, dv=64, C=64,
                                                                         chunk_logit="exact_lse"))
    assert any("rocm" in r for r in eva_attend.unsupported_reasons("rocm", W=128, d=64, dv=64, C=64))
    # a register budget no query sub-tile fits is refused by name (the default budget takes every head <= 128)
    monkeypatch.setattr(eva_attend, "REG_WORDS_LIMIT", 80)
    assert any("register estimate" in r for r in eva_attend.unsupported_reasons("cuda", W=128, d=128, dv=128, C=64))
    assert eva_attend.unsupported_reasons("cuda", W=128, d=64, dv=64, C=64) == []


def test_gpu_plan_is_what_the_kernel_compiles(monkeypatch):
    """The GPU tile plan: WikiText-103's window 128 keeps whole windows at heads of 64; heads of 128 take key and
    chunk tiles of 32 and query sub-tiles of 64 (dropout adds a tile to the estimate); the estimate counts bf16
    queries at half a word. A cuda call builds its kernels' geometry (the tiles every kernel body slices) from that
    plan."""
    P = eva_attend.GpuPlan
    assert eva_attend.gpu_plan(W=128, d=64, dv=64, C=64) == P(128, 64, 64, 8, 192.0)
    assert eva_attend.gpu_plan(W=128, d=64, dv=64, C=64, dropout=True) == P(64, 64, 64, 8, 128.0)
    assert eva_attend.gpu_plan(W=128, d=128, dv=128, C=64) == P(64, 32, 32, 8, 144.0)
    assert eva_attend.gpu_plan(W=128, d=128, dv=128, C=64, itemsize=2, dropout=True) == P(64, 32, 32, 8, 136.0)
    assert eva_attend.gpu_plan(W=128, d=128, dv=128, C=64, limit=64).words > 64  # nothing fits: refused
    assert eva_attend.gpu_plan(W=32, d=16, dv=16, C=3) == P(32, 32, 16, 4, 36.0)
    seen = []
    real = eva_attend._Geo
    monkeypatch.setattr(eva_attend, "_Geo", lambda *a: seen.append(real(*a)) or seen[-1])
    t = TestEVAAttend()
    args, st = t.make_inputs(TestEVAAttend.SHAPES["wt103_paper_drop"], jnp.bfloat16)
    jax.eval_shape(lambda *a: t.kernel(*a, interpret=False, platform="cuda", **st), *args)
    (g,) = seen
    assert (g.Tq, g.Tk, g.Tc, g.num_warps, g.rate) == (64, 32, 32, 8, 0.1)


def test_dropout_hash_keeps_the_rate_and_separates_chunks():
    """The hash mask keeps about 1 − rate of the weights, independently of neighbours, and a chunk's index space is
    not a local key's: the same (row, query) gives other bits on chunk c than on key position c."""
    rs = jax.jit(hash_dropout.row_seeds)(hash_dropout.seed_from_key(jax.random.PRNGKey(0)), jnp.arange(8))
    qi, ki = jnp.arange(256)[:, None], jnp.arange(256)[None, :]
    keep = jax.jit(hash_dropout.keep, static_argnums=3)  # jitted: an eager call compiles op by op
    loc = np.asarray(keep(rs[:, None, None], qi[None], ki[None], 0.1))
    ch = np.asarray(keep(rs[:, None, None], qi[None], hash_dropout.CHUNK_KEY_BASE + ki[None], 0.1))
    for m in (loc, ch):
        assert abs(m.mean() - 0.9) < 0.005
        assert abs((m[:, :, 1:] == m[:, :, :-1]).mean() - 0.82) < 0.01  # 0.9² + 0.1²: neighbours independent
    assert abs((loc == ch).mean() - 0.82) < 0.01
    assert hash_dropout.threshold(0.0) == 0 and hash_dropout.threshold(1.0) == 2**32 - 1


def test_method_runs_both_kernels_in_training_steps_with_dropout(monkeypatch):
    """impl='pallas' routes a full pass through eva_attend (counted), equal to impl='xla'; a training step with
    attention dropout runs Phase B in the kernel too, with the same mask as the XLA tiles (same key, same result)."""
    calls = []
    real = eva_attend.eva_attend
    monkeypatch.setattr(eva_attend, "eva_attend", lambda *a, **k: calls.append(k["dropout_rate"]) or real(*a, **k))
    cfg = {"window_size": 16, "chunk_size": 4, "attn_dropout": 0.1}  # a window a GPU compiles too (>= 16)
    xla = attention.build("eva", {**cfg, "impl": "xla"}, num_heads=2, head_dim=16, causal=True, rngs=nnx.Rngs(0))
    pal = attention.build("eva", {**cfg, "impl": "pallas"}, num_heads=2, head_dim=16, causal=True, rngs=nnx.Rngs(0))
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2, 37, 16)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = jax.jit(lambda q, k, v: pal(q, k, v)[0])(q, k, v)
        assert calls == [0.0]
        np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(lambda q, k, v: xla(q, k, v)[0])(q, k, v)),
                                   atol=2e-5)
        key = jax.random.PRNGKey(5)
        drop = jax.jit(lambda core, q, k, v: core(q, k, v, deterministic=False, key=key)[0], static_argnums=0)
        a = drop(pal, q, k, v)
        assert calls == [0.0, 0.1]  # the dropout step: the kernel's Phase B
        np.testing.assert_allclose(np.asarray(a), np.asarray(drop(xla, q, k, v)), atol=2e-5)
        assert float(jnp.max(jnp.abs(a - out))) > 1e-2  # dropout changed the output


_SHARDED_DROPOUT = """
import warnings; warnings.simplefilter("ignore")
import jax, jax.numpy as jnp, ml_collections
from flax import nnx
from longctx import attention
from longctx.train import sharding
from pallas_kernels import eva_attend
rows, real = [], eva_attend.eva_attend
eva_attend.eva_attend = lambda *a, **k: rows.append(a[0].shape[0]) or real(*a, **k)
core = attention.build("eva", {"window_size": 8, "chunk_size": 4, "attn_dropout": 0.2, "impl": "pallas"},
                       num_heads=4, head_dim=16, causal=True, rngs=nnx.Rngs(0))
q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 4, 29, 16)) for i in range(3))
seg = {}
if PACKED:  # two rows of three documents: the kernels on the packed layout, per shard too
    seg = {"segment_ids": jnp.repeat(jnp.asarray([[1, 2, 3], [1, 2, 3]]), jnp.asarray([3, 15, 11]), axis=1,
                                     total_repeat_length=29)}
    seg["segment_ids"] = seg["segment_ids"].at[1].set(jnp.flip(4 - seg["segment_ids"][1]))
gd, st = nnx.split(core)
loss = lambda q, k, v: jnp.sum(nnx.merge(gd, st)(q, k, v, deterministic=False, key=jax.random.PRNGKey(9), **seg)[0]
                               * jnp.cos(q))
step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
one = step(q, k, v)
mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(zip(sharding.AXES, (2, 1, 2, 1)))), jax.devices()[:4])
put = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "tensor"))
many = step(*(jax.device_put(x, put) for x in (q, k, v)))
err = max(float(jnp.max(jnp.abs(a - b)) / (1 + jnp.max(jnp.abs(a)))) for a, b in zip(jax.tree.leaves(one),
                                                                                      jax.tree.leaves(many)))
print("ROWS", rows, "ERR", err)
"""


@pytest.mark.slow  # a subprocess on 4 simulated devices
@pytest.mark.parametrize("packed", [False, True])
def test_kernel_dropout_per_shard_equals_one_device(packed):
    """impl='pallas' with attention dropout on a data x tensor mesh: the kernel runs per shard of the rows and heads
    (2 of the 8 rows each) with the row seeds drawn for the whole batch, so the step equals one device's; so does a
    packed row's (its documents and chunk members split with the rows)."""
    import os
    import subprocess
    import sys

    from conftest import xla_flags

    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", f"PACKED = {packed}\n" + _SHARDED_DROPOUT], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("ROWS"))
    assert "[8, 2]" in line, line  # one device: 8 rows in one call; per shard: 2
    assert float(line.split("ERR")[1]) < 1e-5, line


def test_tile_and_warp_overrides_reach_the_kernel_geometry(monkeypatch):
    """chunk_tile and num_warps (execution settings of the layer's pallas implementation) override the GPU plan's
    chunk tile and warps in the geometry every kernel body reads; a chunk tile that is not a power of two >= 16 is
    refused by name."""
    seen = []
    real = eva_attend._Geo
    monkeypatch.setattr(eva_attend, "_Geo", lambda *a: seen.append(real(*a)) or seen[-1])
    t = TestEVAAttend()
    args, st = t.make_inputs(TestEVAAttend.SHAPES["wt103_paper"], jnp.bfloat16)
    jax.eval_shape(lambda *a: t.kernel(*a, interpret=False, platform="cuda", **st, chunk_tile=16, num_warps=4),
                   *args)
    assert (seen[-1].Tq, seen[-1].Tk, seen[-1].Tc, seen[-1].num_warps) == (64, 32, 16, 4)
    with pytest.raises(ValueError, match="chunk_tile"):
        t.kernel(*args, interpret=False, platform="cuda", **st, chunk_tile=24)


def _eqns(jaxpr, inside_kernels: bool = False):
    """Every equation of a jaxpr and of the jaxprs nested in it (jit, custom_vjp, loops, ...); a ``pallas_call``'s
    body only with ``inside_kernels``."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call" and not inside_kernels:
            continue
        for val in eqn.params.values():
            for sub in val if isinstance(val, (tuple, list)) else (val,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub, inside_kernels)


def _grad_jaxpr(shape_name: str, form: str):
    t = TestEVAAttend()
    args, st = t.make_inputs(TestEVAAttend.SHAPES[shape_name], jnp.float32)
    st["form"] = form
    fwd = lambda *a: t.kernel(*a, interpret=True, **st)  # noqa: E731
    loss = lambda *a: weighted_sum(fwd(*a))  # noqa: E731
    return (jax.make_jaxpr(fwd)(*args).jaxpr, jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(*args).jaxpr,
            args, st)


@pytest.mark.parametrize("form", ["tpu", "cuda"])
@pytest.mark.parametrize("shape_name", ["causal_drop_loop", "bidir_drop"])
def test_backward_is_two_kernel_passes(shape_name, form):
    """The gradient of eva_attend runs the forward kernel once and two backward kernels (a query-side and a
    key-side pass), in both forms, with the bias and dropout on."""
    fwd, grad, _, _ = _grad_jaxpr(shape_name, form)
    count = lambda j: sum(e.primitive.name == "pallas_call" for e in _eqns(j))  # noqa: E731
    assert count(fwd) == 1
    assert count(grad) - count(fwd) == 2


@pytest.mark.parametrize("form", ["tpu", "cuda"])
@pytest.mark.parametrize("shape_name", ["causal_rpe", "bidir_drop"])
def test_bias_gradient_is_summed_inside_the_kernel(shape_name, form):
    """No per-tile bias gradient reaches HBM: outside the kernels, every array of the gradient ending in a
    ``[W, W]`` tile holds at most one ``[n_lt, W, W]`` stack per row (none has a query- or key-block axis)."""
    _, grad, args, st = _grad_jaxpr(shape_name, form)
    bias, W, BH = args[5], st["W"], args[0].shape[0]
    n_lt = 1 << (bias.shape[1] - 1).bit_length()  # tiles padded to a power-of-two count
    assert args[0].shape[1] // W not in (1, BH, n_lt)  # the query-block count is told apart from the other axes
    tiles = [v.aval.shape for e in _eqns(grad) for v in e.outvars
             if hasattr(v.aval, "shape") and len(v.aval.shape) >= 3 and v.aval.shape[-2:] == (W, W)]
    assert tiles, "no bias gradient found"
    assert max(int(np.prod(s)) for s in tiles) <= BH * n_lt * W * W, tiles

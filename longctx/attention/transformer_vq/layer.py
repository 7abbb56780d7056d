"""The Transformer-VQ core (Lingle 2023, arXiv 2309.16354; method notes: docs/methods/transformer_vq.md, whose
sections the § numbers cite): parameters, configuration, the decoding state, the codebook's EMA learning, and
the call. The call is the base's (``AttentionCore.__call__``): :meth:`TransformerVQAttention.prepare` normalizes q, k
and forms the position terms (§2.1, §2.3) into the ``dispatch.Call`` every implementation takes, the base selects
one of the method's implementations for the core's platform and builds its ``dispatch.Runner`` (whose fields are
the execution settings it reads), the runner returns the output, the new state and the codes
(``dispatch.Result``), and :meth:`TransformerVQAttention.finish` adds the commit loss, the codebook statistics and
the quantization error metric:

* ``reference`` (:class:`Reference`, over ``reference.py``) -- the quadratic softmax over cache, band and present
  keys: the paper's math;
* ``parallel``, ``blocks``, ``stream``, ``encoder`` (``xla.py``) -- the portable linear-time forms, each an
  implementation of its own;
* the XLA:CPU implementation (its own file) -- those forms with products laid out for XLA:CPU, the form by its own
  size rule (``impl='auto'`` on a CPU);
* ``pallas`` (``pallas.py``) -- the §9 kernel (``impl='auto'`` on a GPU / TPU where it serves the call).

Each implementation module declares its own (``IMPLEMENTATIONS``: where 'auto' tries it, for which calls, the
settings it reads, what computes it); :meth:`TransformerVQAttention.implementations` collects them after the
reference. The carried state of a causal core (constant size, canonical: a function of the prefix only) is
``state.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx.attention import dispatch
from longctx.attention.base import (
    AttentionCore,
    ContractCase,
    DropIn,
    KernelBench,
    NonGradState,
    axes,
    check_segments,
    continues_state,
    require,
)
from longctx.attention.transformer_vq import reference, xla
from longctx.attention.transformer_vq.state import DOCUMENT, compose, empty_state, packed_final_state
from longctx.layout import flattens_rows, rows_apply
from pallas_kernels.vq_cache_ref import cast_state, code_sums, compute_dtype, float_dtype

sg = jax.lax.stop_gradient
METHOD = "transformer_vq"


# ----------------------------------------------------------------------------- helpers
def rms_normalize(x, eps: float = 1e-6, *, flat: bool = False):
    """x * rsqrt(mean(x^2) + eps), no gain/bias, computed in >= fp32, cast back (rows flattened on a CPU host:
    its gradient's row sums then meet no size-1 dimension, longctx.layout.rows_apply)."""
    return rows_apply(functools.partial(_rms_rows, eps=eps), x, flat=flat)


def _rms_rows(x, eps: float):
    xf = x.astype(float_dtype(x))
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def sinusoid(d, dim: int, base: float = 1e5, dtype=jnp.float32):
    """e(d) = [sin(d w_k) || cos(d w_k)], w_k = base^(-2k/dim), k = 0..dim/2-1 (halves concatenated)."""
    half = dim // 2
    w = base ** (-jnp.arange(half, dtype=dtype) * 2.0 / dim)
    ang = jnp.asarray(d, dtype)[..., None] * w
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def codebook_from_stats(c_sum, c_count):
    """C = c_sum / max(c_count, 0.01)."""
    return c_sum / jnp.maximum(c_count, 0.01)[..., None]


def rel_table(W_R, M: int, *, signed: bool, base: float, scale, dtype, dropout_key=None, p_drop: float = 0.0):
    """r'_d = scale * Drop(e(d)) W_R for d = 0..M (causal) or d = -M..M (signed); -> [n, H*Dk] in ``dtype`` (the
    compute dtype; the sinusoids are formed in float32 or wider)."""
    d = jnp.arange(-M if signed else 0, M + 1)
    e = sinusoid(d, W_R.shape[0], base, jnp.promote_types(dtype, jnp.float32))  # the angles in >= float32
    if dropout_key is not None and p_drop > 0.0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - p_drop, e.shape)
        e = jnp.where(keep, e / (1.0 - p_drop), 0.0)
    return scale * (e.astype(dtype) @ W_R.astype(dtype))


# ----------------------------------------------------------------------------- codebook learning (§3)
def vq_stats(k, z, S: int, mask=None, sums=code_sums):
    """EMA statistics of one call: per-code counts [H, S] and key sums [H, S, Dk] (pre-quantization keys,
    fp32 or wider, masked tokens excluded), summed over batch and time, under stop_gradient. ``sums``: the
    running implementation's per-code sums (``vq_cache_ref.code_sums``' signature)."""
    kf = sg(k).astype(float_dtype(k))
    valid = jnp.ones(z.shape, bool) if mask is None else mask[:, None, :]
    tot, cnt = sums(z, kf, valid, S)  # [B,H,S,Dk], [B,H,S]
    return {"count": jnp.sum(cnt, axis=0), "sum": jnp.sum(tot, axis=0)}


def ema_update(c_sum, c_count, stats, gamma: float):
    """c_sum <- g c_sum + (1-g) sum_k ; c_count <- g c_count + (1-g) count (stats summed globally)."""
    c_sum = gamma * c_sum + (1.0 - gamma) * stats["sum"].astype(c_sum.dtype)
    c_count = gamma * c_count + (1.0 - gamma) * stats["count"].astype(c_count.dtype)
    return c_sum, c_count


def commit_loss(k, c_z, mask=None):
    """mean_{b,t}(mask * sum_heads ||k - sg(c_z)||^2), divided by the number of unmasked tokens."""
    dt = float_dtype(k)
    e = jnp.sum(jnp.square(k.astype(dt) - sg(c_z).astype(dt)), axis=(1, 3))  # [B, T]
    if mask is None:
        return jnp.mean(e)
    m = mask.astype(dt)
    return jnp.sum(e * m) / jnp.maximum(jnp.sum(m), 1.0)


# ----------------------------------------------------------------------------- implementations
@dataclasses.dataclass(frozen=True)
class Reference(dispatch.Runner):
    """``reference``: the quadratic form (``reference.py``; it reads no execution setting); with segment ids a
    packed row (``reference.packed``: §2.8), causal ones from and to a carried state (``state.packed_final_state``)."""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x, state = call.inputs, call.state
        v, segment_ids = x["v"], x["segment_ids"]
        k_hat, z, err2, c_z = reference.stvq(x["k"], x["C"])
        dt = float_dtype(x["q_v"], x["r"])
        bd = reference.band_scores(x["q_v"].astype(dt), x["r"].astype(dt))
        new = None
        if segment_ids is not None:
            carried = (state, x["seen"], x["continues"]) if core.causal else None
            o = reference.packed(x["q_u"], bd, k_hat, v, L=core.L, M=core.M, causal=core.causal,
                                 band=core.cfg.encoder_band, segment_ids=segment_ids, C=x["C"], carried=carried)
            if core.causal:
                dt = float_dtype(x["q_u"], v)
                new = packed_final_state(cast_state(state, dt), x["seen"], x["continues"], k_hat.astype(dt), z,
                                         v.astype(dt), segment_ids, M=core.M, S=core.S)
        elif core.causal:
            o, new = reference.causal(x["q_u"], bd, k_hat, z, v, x["C"], state, L=core.L, M=core.M)
        else:
            o = reference.bidirectional(x["q_u"], bd, k_hat, v, L=core.L, M=core.M, band=core.cfg.encoder_band)
        return xla.result(o, new, (z, err2, c_z), code_sums=code_sums)


# 'auto' tries the reference only for a packed row (segment ids) that the linear packed forms refuse (a causal row of
# a block or more with a band longer than a block; xla.causal_packed), and only on a CPU: its O(T²) memory at a GPU's
# or TPU's training lengths is not a default to fall into there (name impl='reference')
REFERENCE = dispatch.Implementation("reference", config={"impl": "reference"},
                                    auto={"cpu": 99}, prefer=lambda platform, segments=False, **_: segments,
                                    code=Reference)


@functools.cache
def _declared(causal: bool | None):
    """The reference, then this package's declarations (read once: every call's selection asks for them)."""
    return dispatch.declared(__package__, first=(REFERENCE,), causal=causal)


# ----------------------------------------------------------------------------- the core
class TransformerVQAttention(AttentionCore):
    """Transformer-VQ core. Inside the standard multi-head ``TransformerBlock`` it is the release's
    throughput variant (MHA, one codebook per head); inside ``GAUBlock`` the paper's single-head GAU.

    Owns: the codebook statistics (``c_sum`` [H,S,Dk], ``c_count`` [H,S]; :class:`NonGradState`), and the
    Transformer-XL relative-bias parameters ``u``, ``v`` ([H, Dk], zero-init) and ``W_R`` [rel_dim, H*Dk].
    """

    takes_token_mask = True  # mask=[B, T]: tokens that count in the commit loss and codebook statistics
    # the reference, 'parallel', 'blocks', 'stream', 'encoder' and the XLA:CPU implementation (xla.attend_packed),
    # §2.8; the kernel refuses them
    takes_segments = True

    name = METHOD
    EXECUTION_KEYS = ("impl", "reduction", "keep_budget", "tiled_min_scores", "search_chunk")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """The reference first (the quadratic form, ``reference.py``), then what the modules of this package
        declare (``dispatch.declared``, modules in name order). Causal: pallas (the §9 kernel; interpret mode on a
        CPU), parallel (the block-parallel form, the kernel's reference, under autodiff), blocks (its tiled form
        with a recomputing backward), stream (block by block, as decoding runs; any band), the XLA:CPU
        implementation (those forms laid out for XLA:CPU, by call size). Bidirectional: encoder (§2.5), the XLA:CPU
        implementation."""
        return _declared(causal)

    # Rotary embeddings would rotate keys before quantization (not the paper's model); the position
    # signal is the XL relative bias inside the core, optionally with absolute embeddings.
    allowed_positions = ("none", "learned", "sinusoidal")

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                "codebook_size": 512,  # S
                "block_len": 512,  # L
                "mem_len": 0,  # M, the exact band carrying the bias; 0 means M = block_len
                "beta": 1e-4,  # commit-loss weight (reported already multiplied)
                "gamma": 0.99,  # EMA decay of the codebook statistics
                "qk_norm": True,  # RMS-normalize q, k and scale each by Dk^-1/4 (False: caller did it)
                "rel_dim": 0,  # width of the sinusoid table e(d) (d_model); 0 means num_heads*head_dim
                "rel_base": 1e5,  # lambda of the sinusoids
                "p_dropsin": 0.0,  # dropout on the sinusoid table (training only)
                "encoder_band": True,  # bidirectional: keep the exact symmetric band (False: Thm 3.5)
                # -- execution settings (execution.attention.transformer_vq) --
                # an implementation (reference | parallel | blocks | stream | pallas | the XLA:CPU one;
                # bidirectional: reference | encoder | the XLA:CPU one: implementations()), an ordered list 'a,b',
                # or 'auto': the XLA:CPU implementation on a CPU, elsewhere the kernel where it serves the call, then
                # the form the size rule gives the call (stream for calls shorter than a block, blocks for calls of
                # at least tiled_min_scores scores, else parallel: xla.form_for)
                "impl": "auto",
                # the one-shot block-parallel form's cross-block scan, read by parallel and the XLA:CPU
                # implementation (xla.REDUCTIONS): 'serial' | 'matmul' | 'assoc'; blocks and pallas compute 'serial'
                "reduction": "serial",
                # The numeric knobs below default to dispatch.PLATFORM_DEFAULT (0): the value the implementation
                # that reads them declares for the platform the call runs on (xla.DEFAULTS, xla_cpu.DEFAULTS, the
                # kernel's search_chunk in pallas.py; a value written here runs as written on every platform).
                # The tiled causal form keeps its attention weights for the backward when a call has at most this
                # many scores B*H*T*(S+2L) (fp32 entries, held from each layer's forward to its backward unless
                # model.remat recomputes the block); larger calls recompute them; -1 always recomputes
                "keep_budget": dispatch.PLATFORM_DEFAULT,
                # the size rule ('auto', the XLA:CPU implementation) takes the tiled form for calls with at least
                # this many scores B*H*T*(S+2L) (1: every call of at least a block); below it the one-shot form
                "tiled_min_scores": dispatch.PLATFORM_DEFAULT,
                # keys per step of the nearest-code search (a [chunk, S] distance tile per batch row and head)
                "search_chunk": dispatch.PLATFORM_DEFAULT,
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = f"attention.{METHOD}"
        require(cfg.codebook_size >= 1, f"{p}.codebook_size={cfg.codebook_size}; must be >= 1")
        require(cfg.block_len >= 1, f"{p}.block_len={cfg.block_len}; must be >= 1")
        require(cfg.mem_len >= 0, f"{p}.mem_len={cfg.mem_len}; must be >= 0 (0 means mem_len = block_len)")
        M = cfg.mem_len or cfg.block_len
        require(cfg.reduction in xla.REDUCTIONS,
                f"{p}.reduction={cfg.reduction!r}; allowed: {', '.join(xla.REDUCTIONS)}")
        require(0.0 <= cfg.gamma < 1.0, f"{p}.gamma={cfg.gamma}; allowed: 0 <= gamma < 1")
        require(cfg.beta >= 0.0, f"{p}.beta={cfg.beta}; must be >= 0")
        require(0.0 <= cfg.p_dropsin < 1.0, f"{p}.p_dropsin={cfg.p_dropsin}; allowed: 0 <= p < 1")
        require(cfg.rel_dim >= 0 and cfg.rel_dim % 2 == 0, f"{p}.rel_dim={cfg.rel_dim}; must be even and >= 0")
        require(cfg.keep_budget >= -1, f"{p}.keep_budget={cfg.keep_budget}; must be >= -1 (0: the platform's "
                "default; -1: always recompute)")
        require(cfg.tiled_min_scores >= 0, f"{p}.tiled_min_scores={cfg.tiled_min_scores}; must be >= 0 (0: the "
                "platform's default; 1: every call of at least a block is tiled)")
        require(cfg.search_chunk >= 0, f"{p}.search_chunk={cfg.search_chunk}; must be >= 0 (0: the platform's "
                "default)")
        require(cfg.rel_base > 1.0, f"{p}.rel_base={cfg.rel_base}; must be > 1")
        # impl: this direction's implementations
        names = tuple(i.name for i in cls.implementations(causal=causal))
        why = dispatch.impl_problem(cfg.impl, names)
        require(why is None, f"{p}.{why}")
        impls = dispatch.parse_impl(cfg.impl)
        if {"parallel", "blocks"} & set(impls) or not causal:
            require(M <= cfg.block_len, f"{p}: the block-parallel{'' if causal else ' encoder'} form needs "
                    f"mem_len <= block_len (got {M} > {cfg.block_len}); use impl='stream' or a smaller mem_len")
        require("blocks" not in impls or cfg.reduction == "serial",
                f"{p}.impl='blocks' computes the serial reduction; set {p}.reduction='serial'")
        # impl='pallas' runs the §9 Pallas kernel (pallas_kernels/vq_cache.py), which computes the serial
        # reduction; 'auto' picks it or XLA by the shared rule of longctx/attention/dispatch.py.
        require(impls != ("pallas",) or cfg.reduction == "serial",
                f"{p}.impl='pallas' runs the serial reduction; set {p}.reduction='serial'")

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None, platform=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim,
                         platform=platform)
        self.cfg = ml_collections.FrozenConfigDict(self.cfg)  # hashable, so the module's graphdef is a jit key
        c = self.cfg
        H, Dk, S = num_heads, head_dim, c.codebook_size
        self.S, self.L = S, c.block_len
        self.M = c.mem_len or c.block_len
        rel_dim = c.rel_dim or H * Dk
        require(rel_dim % 2 == 0, f"attention.{METHOD}.rel_dim={rel_dim} must be even" if c.rel_dim else
                f"attention.{METHOD}.rel_dim=0 takes num_heads x head_dim = {H} x {Dk} = {rel_dim}, which is odd; "
                "set an even rel_dim")
        self.rel_dim = rel_dim
        # Flax variance scaling, fan-in, on [H, S, Dk]: fan_in = S*H, so var = 1/(S*H).
        self.c_sum = NonGradState(jax.random.normal(rngs.params(), (H, S, Dk), jnp.float32) / math.sqrt(S * H),
                                  **axes("heads", "codebook", "head_dim"))
        self.c_count = NonGradState(jnp.ones((H, S), jnp.float32), **axes("heads", "codebook"))
        self.u = nnx.Param(jnp.zeros((H, Dk), jnp.float32), **axes("heads", "head_dim"))
        self.v = nnx.Param(jnp.zeros((H, Dk), jnp.float32), **axes("heads", "head_dim"))
        self.W_R = nnx.Param(jax.random.normal(rngs.params(), (rel_dim, H * Dk), jnp.float32) / math.sqrt(rel_dim),
                             **axes(None, "qkv"))

    @classmethod
    def configure_for_block(cls, cfg, *, normalizes_qk, d_model):
        cfg = ml_collections.ConfigDict(cfg.to_dict())
        if normalizes_qk:  # the GAU normalizes q and k itself (§2.1)
            cfg.qk_norm = False
        if not cfg.rel_dim:  # the sinusoid table has width d_model
            cfg.rel_dim = d_model
        return cfg

    @classmethod
    def kernel_benches(cls):
        # the kernel computes the block-parallel form's serial reduction: time it against that XLA form
        return {"vq_cache": KernelBench(xla={"impl": "parallel"}, pallas={"impl": "pallas"}, directions=("causal",)),
                # the Hopper kernels (Mosaic GPU) beside the Triton one, on a GPU only
                "vq_cache_mgpu": KernelBench(xla={"impl": "parallel"}, pallas={"impl": "mosaic_gpu"},
                                             directions=("causal",), platforms=("cuda",))}

    @classmethod
    def drop_in(cls):
        return DropIn(
            "qk_norm=False with q·Dk^-1/2, Transformer-XL bias off (W_R=u=v=0), codebook = per-head k-means "
            "(10 iterations) of held-out keys",
            {"qk_norm": False},
            _drop_in_setup,
        )

    @classmethod
    def contract_cases(cls):
        # block 8, codebook 16, 48 tokens = 6 blocks: the compressive cache holds 4 blocks when the last is read
        small = {"codebook_size": 16, "block_len": 8}
        cpu_auto = dispatch.auto_order(cls.implementations(causal=True), "cpu")[0]  # what 'auto' runs on a CPU
        case = functools.partial(ContractCase, length=48, atol=5e-5, rtol=5e-5)
        return {
            "serial": case(cfg=small),  # impl='auto': on a CPU the XLA:CPU implementation's one-shot form
            # the XLA:CPU implementation's tiled form with its recomputing backward (its size rule takes it for
            # large calls only: tiled_min_scores=1 makes every call of a block or more tiled); on other platforms the
            # portable tiled form
            "blocks": case(cfg={**small, "impl": cpu_auto + ",blocks", "tiled_min_scores": 1},
                           directions=("causal",)),
            "matmul": case(cfg={**small, "reduction": "matmul"}, directions=("causal",)),
            "assoc": case(cfg={**small, "reduction": "assoc"}, directions=("causal",), slow=True),
            "stream_short_band": case(cfg={**small, "mem_len": 3, "impl": "stream"}, directions=("causal",),
                                      slow=True),
            "stream_long_band": case(cfg={**small, "mem_len": 12, "impl": "stream"}, directions=("causal",),
                                     slow=True),
            # the reference: its carried state (decoding, split calls) is the others'
            "reference": case(cfg={**small, "impl": "reference"}, slow=True),
            "portable_blocks": case(cfg={**small, "impl": "blocks"}, directions=("causal",), slow=True),
            # the Pallas kernel (interpret mode on CPU) serves the causal block-parallel form; the encoder is XLA
            "pallas": case(cfg={**small, "impl": "pallas"}, directions=("causal",), slow=True),  # interpret mode
        }

    # -- state ---------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError(f"{METHOD}: a bidirectional core has no prefix state")
        # no document yet (state.py: DOCUMENT); one buffer each: the scoring forward donates the state, and a
        # buffer under two leaves is donated twice (XLA refuses the call)
        return {**empty_state(batch_size, self.num_heads, self.M, self.S, self.head_dim, self.value_dim),
                "segment": jnp.zeros((batch_size,), jnp.int32), "seen": jnp.zeros((batch_size,), jnp.int32)}

    # -- sequence parallelism: the band is the newest M tokens, the cache a count-weighted merge --
    def sequence_refusal(self, slice_len: int) -> str | None:
        if slice_len < self.M:
            return f"a slice of {slice_len} tokens is shorter than the band of mem_len={self.M} tokens"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return self.init_state(batch_size, max_len)  # the cache is position-free: a true empty state

    def compose_states(self, a, b):
        return compose(a, b, M=self.M, S=self.S)

    def codebook(self):
        return codebook_from_stats(self.c_sum[...], self.c_count[...])

    def apply_stats(self, stats) -> None:
        st = stats.get("codebook", stats) if isinstance(stats, dict) else stats
        c_sum, c_count = ema_update(self.c_sum[...], self.c_count[...], st, self.cfg.gamma)
        self.c_sum[...] = c_sum
        self.c_count[...] = c_count

    # -- forward -------------------------------------------------------------
    def project(self, q, k, *, deterministic=True, key=None):
        """Normalized q, k, (u', v') and the projected sinusoid table r'. Returns a dict: ``q``, ``k`` (the keys the
        codebook quantizes), ``q_u`` = q + u', ``q_v`` = q + v', ``r`` [n, H, Dk]."""
        H, Dk = self.num_heads, self.head_dim
        dt = compute_dtype(q, k)  # the matmul operands (the norms' statistics are float32 inside rms_normalize)
        tau_m14 = Dk ** -0.25  # tau^-1/2 with tau = sqrt(Dk)
        q, k = q.astype(dt), k.astype(dt)
        if self.cfg.qk_norm:
            flat = flattens_rows(self.platform)
            q, k = tau_m14 * rms_normalize(q, flat=flat), tau_m14 * rms_normalize(k, flat=flat)
        drop_key = None if (deterministic or key is None) else key
        r = rel_table(self.W_R[...], self.M, signed=not self.causal, base=self.cfg.rel_base, scale=tau_m14,
                      dtype=dt, dropout_key=drop_key, p_drop=self.cfg.p_dropsin).reshape(-1, H, Dk)
        u = tau_m14 * self.u[...].astype(dt)
        vb = tau_m14 * self.v[...].astype(dt)
        return {"q": q, "k": k, "q_u": q + u[None, :, None], "q_v": q + vb[None, :, None], "r": r}

    def _shapes(self, *, B: int, T: int, dtype, segments: bool = False, carried: bool = False) -> dict:
        """What the selection hands every declaration's ``reasons`` and ``prefer`` for a call of B x T tokens."""
        return dict(B=B, H=self.num_heads, T=T, L=self.L, M=self.M, S=self.S, Dk=self.head_dim, Dv=self.value_dim,
                    dtype=dtype, reduction=self.cfg.reduction, tiled_min_scores=self.cfg.tiled_min_scores,
                    segments=segments, carried=carried, causal=self.causal)

    def implementation_for(self, *, B: int, T: int, dtype, segments: bool = False,
                           carried: bool = False) -> dispatch.Choice:
        """The implementation a call of B x T tokens takes (the base's :meth:`runner`, which selects ``impl`` over
        :meth:`implementations`), given the call's shapes, ``reduction`` (which the kernel and the tiled form refuse
        but for 'serial'), ``tiled_min_scores`` (which the forms' ``prefer`` reads: ``xla.preferred_form``),
        ``segments`` (a packed row: 'parallel' and the reference serve it) and ``carried`` (a state given to the call)."""
        return self.runner(**self._shapes(B=B, T=T, dtype=dtype, segments=segments, carried=carried))[1]

    def prepare(self, q, k, v, state, *, deterministic=True, key=None, mask=None, segment_ids=None):
        """The call every implementation takes: ``inputs`` = :meth:`project`'s ``q``, ``k``, ``q_u``, ``q_v``, ``r``;
        ``v`` (the values in the compute dtype), ``C`` (the codebook), ``mask``, ``segment_ids`` and ``out_dtype``
        (the values' dtype, the output's); ``state``: the carried state (a causal call without one: the empty
        state). mask: optional [B, T] bool; False tokens are excluded from the commit loss and EMA statistics (they
        still take part in attention, as in the release). segment_ids: optional [B, T] int32, a packed row: each
        document (a run of equal ids) computed as if alone; with a carried state the call's leading tokens under the
        state's ``segment`` (``continues_state``) continue its document, and the call returns the state of its last
        document (docs/methods/transformer_vq.md §2.8). ``inputs`` also holds the carried document's ``segment``
        and ``seen`` [B] and, for a packed call, ``continues`` [B, T] (None where they do not apply); ``state``
        goes to the implementation without them."""
        check_segments(self, q, segment_ids)
        B, _, T, _ = q.shape
        pre = self.project(q, k, deterministic=deterministic, key=key)
        C = self.codebook()
        vv = v.astype(compute_dtype(v, pre["q"]))
        packed, carried = segment_ids is not None, state is not None
        doc = {"segment": None, "seen": None, "continues": None}
        if self.causal:
            # a call without a state starts from the empty one, behind an optimization barrier (the same values):
            # as constants, its all-masked band and cache made XLA constant-fold row maxima over [B, H, R, L, L + S]
            # at compile time (seconds for a call of one block of 512, with a slow_operation_alarm)
            state = jax.lax.optimization_barrier(self.init_state(B)) if state is None else state
            # the forms take the state without the core's document counters (state.py: DOCUMENT); a state made by
            # empty_state alone (no document: one row-long document of pos tokens) takes the empty document's
            doc["segment"] = state.get("segment", jnp.zeros((B,), jnp.int32))
            doc["seen"] = state.get("seen", jnp.broadcast_to(state["pos"], (B,)).astype(jnp.int32))
            state = {name: x for name, x in state.items() if name not in DOCUMENT}
            if packed:
                doc["continues"] = continues_state(doc["segment"], segment_ids.astype(jnp.int32))
        elif state is not None:
            raise ValueError(f"{METHOD}: a bidirectional core takes no state")
        inputs = {**pre, "v": vv, "C": C, "mask": mask, "segment_ids": segment_ids, "out_dtype": v.dtype, **doc}
        call = dispatch.Call(inputs, state, key=key)
        return call, self._shapes(B=B, T=T, dtype=vv.dtype, segments=packed, carried=carried)

    def finish(self, call, result, *, aux=None):
        """The output in the values' dtype and the new state; with ``aux`` the commit loss, the codebook statistics
        (summed by the running implementation's ``code_sums``) and the relative quantization error, from the codes
        the implementation returns (``result.extras``)."""
        x, e = call.inputs, result.extras
        if aux is not None:
            aux.add_loss("commit", self.cfg.beta * commit_loss(x["k"], e["c_z"], x["mask"]))
            aux.add_stats("codebook", vq_stats(x["k"], e["z"], self.S, x["mask"], e["code_sums"]))
            aux.add_metric("vq_rel_err", jnp.mean(jnp.sqrt(e["err2"])) / jnp.maximum(
                jnp.mean(jnp.linalg.norm(sg(x["k"]), axis=-1)), 1e-12))
        return result.out.astype(x["out_dtype"]), _with_document(x, result.state)


def _with_document(x, state):
    """The core's state (state.py: ``DOCUMENT``) from a form's: a packed call's (its ``seen`` from
    ``packed_final_state``) under the id of the call's last document; a call without segment ids keeps its state's
    document and adds its length to ``seen``."""
    if state is None:  # bidirectional
        return None
    if x["segment_ids"] is not None:
        return {**state, "segment": x["segment_ids"][:, -1].astype(jnp.int32)}
    return {**state, "segment": x["segment"], "seen": x["seen"] + x["v"].shape[2]}


def kmeans(x, S: int, *, iters: int = 10, seed: int = 0):
    """Per-head Lloyd k-means. x [H, N, D] -> centroids [H, S, D] (init: S points sampled from x)."""
    H, N, D = x.shape
    idx = jax.random.choice(jax.random.key(seed), N, (S,), replace=N < S)
    c = x[:, idx]

    @jax.jit
    def step(c):
        d = jnp.sum(x * x, -1)[..., None] - 2 * jnp.einsum("hnd,hsd->hns", x, c) + jnp.sum(c * c, -1)[:, None]
        z = jnp.argmin(d, axis=-1)
        onehot = jax.nn.one_hot(z, S, dtype=x.dtype)
        cnt = jnp.sum(onehot, axis=1)
        sums = jnp.einsum("hns,hnd->hsd", onehot, x)
        return jnp.where(cnt[..., None] > 0, sums / jnp.maximum(cnt, 1.0)[..., None], c)

    for _ in range(iters):
        c = step(c)
    return c


def _drop_in_setup(core, q, k, v, k_fit, seed):
    """Training-free setting: no learned position bias (W_R = u = v = 0), qk_norm off with q pre-scaled
    by Dk^-1/2 (logits q·k/sqrt(Dk) as in exact attention), codebook = per-head k-means (10 Lloyd
    iterations) of held-out keys ``k_fit`` (same distribution, different sample)."""
    D = q.shape[-1]
    for name in ("W_R", "u", "v"):
        var = getattr(core, name)
        var[...] = jnp.zeros_like(var[...])
    H = k_fit.shape[1]
    x = jnp.moveaxis(k_fit.astype(jnp.float32), 1, 0).reshape(H, -1, D)
    cents = kmeans(x, int(core.cfg.codebook_size), seed=seed)
    core.c_sum[...] = cents.astype(core.c_sum[...].dtype)
    core.c_count[...] = jnp.ones_like(core.c_count[...])
    return q * D**-0.5, k, v


__all__ = ["TransformerVQAttention", "codebook_from_stats", "commit_loss", "ema_update", "kmeans", "rel_table",
           "rms_normalize", "sinusoid", "vq_stats"]

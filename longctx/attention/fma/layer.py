"""The FMA and FMA-linear cores (docs/methods/fma.md): parameters, config, validation, the decoding state, and
the call's two ends: :meth:`FMAAttention.prepare` (the inputs every implementation takes and what the selection
reads) and :meth:`FMAAttention.finish` (the state after a full pass, the output's dtype); ``AttentionCore.__call__``
selects the implementation for the core's platform, builds its runner and runs it between them.

Implementations (reference first, :meth:`FMAAttention.implementations`): the layer declares the reference, each
implementation module its own (``IMPLEMENTATIONS``, collected by ``dispatch.declared``; where ``impl='auto'``
tries it and what computes it, its ``code``: a runner, a subclass of :class:`~longctx.attention.fma.state.Blocked`
whose fields are the knobs it reads):

* ``reference`` -- the paper's n x n matrix C~ (``reference.py``; O(n^2), tests and checks);
* ``xla`` -- the blocked path, portable (``xla.py``);
* the XLA:CPU implementation -- the blocked path with XLA:CPU's forms of its products and summaries (the
  CPU-tuned implementation, its own file, which declares its name; ``impl='auto'`` on a CPU);
* ``pallas`` -- the blocked path with the Pallas block kernel (``pallas.py``, ``pallas_kernels/fma_blocks.py``;
  FMA only; ``impl='auto'`` on GPU and TPU where it serves the call, else ``xla``);
* ``mosaic_gpu`` -- the blocked path with the Mosaic GPU kernels (``mosaic_gpu.py``; FMA only; where named).

The decoding state and the streamed step (``state.py``) are shared: each runner runs a call with a state as the
streamed step with its own block function (the reference's: the portable one). The old values of ``impl`` keep
their meaning: ``'xla'`` the blocked XLA path, ``'pallas'`` the kernel, ``'auto'`` the platform's choice.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from longctx.attention import dispatch
from longctx.attention.base import AttentionCore, ContractCase, DropIn, KernelBench, check_segments, logical, require
from longctx.attention.fma import packed, reference, xla
from longctx.attention.fma.options import RING, FMAOptions
from longctx.attention.fma.state import Blocked, empty_state, state_from_forward
from longctx.errors import ConfigError

BENCH_MAX_LEN = 131072  # the benchmarks' longest sequence: their untrained cores build levels for it


def _uniform(bound: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class Downsample(nnx.Module):
    """One level's strided conv for one of K, V, Q: ``kernel`` [m_l, f, p] (depthwise) or
    [m_l, f, f, p] (dense_conv), with a leading heads axis when not shared; ``bias`` [f, p]."""

    def __init__(self, kind: str, ml: int, f: int, p: int, *, heads: int | None, init: str, feat_axis: str,
                 rngs: nnx.Rngs):
        if kind == "depthwise_conv":
            shape, names, fan_in = (ml, f, p), ("kernel_size", feat_axis, None), ml
        else:
            shape, names, fan_in = (ml, f, f, p), ("kernel_size", None, feat_axis, None), ml * f
        bshape, bnames = (f, p), (feat_axis, None)
        if heads is not None:
            shape, names = (heads,) + shape, ("heads",) + names
            bshape, bnames = (heads,) + bshape, ("heads",) + bnames
        if init == "subinterval_mean":
            t = np.arange(ml)
            w = ((t[:, None] * p) // ml == np.arange(p)[None, :]).astype(np.float32) * (p / ml)  # [ml, p]
            if kind == "depthwise_conv":
                w = np.broadcast_to(w[:, None, :], (ml, f, p))
            else:
                w = w[:, None, None, :] * np.eye(f, dtype=np.float32)[None, :, :, None]
            w = np.broadcast_to(w, shape).copy()
            kinit = lambda key, s, dt=jnp.float32: jnp.asarray(w, dt)  # noqa: E731
            binit = nnx.initializers.zeros
        else:  # PyTorch Conv1d defaults (the release): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for W and c
            kinit = binit = _uniform(1.0 / math.sqrt(fan_in))
        self.kernel = nnx.Param(logical(kinit, *names)(rngs.params(), shape, jnp.float32))
        self.bias = nnx.Param(logical(binit, *bnames)(rngs.params(), bshape, jnp.float32))

    def params(self):
        return {"kernel": self.kernel[...], "bias": self.bias[...]}


def _dense_forward(q, k, v, ds, opts, drop_key=None):
    return reference.fma_dense_reference(q, k, v, ds, opts)


@dataclasses.dataclass(frozen=True)
class Reference(Blocked):
    """The implementation ``reference``: the dense C~ (:func:`reference.fma_dense_reference`; no dropout) for a
    full pass; streamed steps run the portable block function (``xla.attend``), which reads ``logit_budget``."""

    def forward(self, call):
        return _dense_forward

    def attend(self, call):
        return xla.attend

    def packed(self, call):
        """A packed row's full pass: the paper's matrix of every document alone (:func:`reference.fma_packed_reference`;
        no dropout)."""
        return lambda q, k, v, ds, opts, segment_ids, drop_key=None: reference.fma_packed_reference(
            q, k, v, ds, opts, segment_ids)


# ---------------------------------------------------------------------------
# the cores
# ---------------------------------------------------------------------------


class FMAAttention(AttentionCore):
    """Fast Multipole Attention core (see the module docstring)."""

    name = "fma"
    # packed rows (§2.7): the reference's packed matrix; the blocked paths lay the documents out again (packed.py);
    # the kernels refuse them (their reasons); the state restarts at a boundary (``segment``, ``doc_len``)
    takes_segments = True
    EXECUTION_KEYS = ("impl", "logit_budget", "kernel_warps_per_64_rows", "kernel_stages", "blocks_per_program")
    linear = False

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """reference (the dense C~; no dropout; declared here), then what the implementation modules of this
        folder declare for this method (``dispatch.declared``): xla (the blocked path), its XLA:CPU form and, for
        FMA, pallas (the block kernel; interpret mode on a CPU), the kernel last. A declaration with ``methods``
        serves only the methods it names. See the module docstring."""
        def no_dropout(platform, *, dropout=0.0, **_):
            return ["no attention dropout in the reference (a call with a dropout key)"] if dropout > 0 else []

        # its streamed steps run the portable block function, which reads logit_budget (xla.py's table)
        ref = dispatch.Implementation("reference", reasons=no_dropout, config={"impl": "reference"},
                                      code=Reference, defaults={"logit_budget": xla.LOGIT_BUDGET})
        impls = [i for i in dispatch.declared(__package__, first=(ref,), causal=causal)
                 if cls.name in (getattr(i, "methods", None) or (cls.name,))]
        return tuple(sorted(impls, key=lambda i: i.kernel))  # stable: the portable ones as declared, kernels last

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        c = {
            "m": 64,  # fine block size (group size of level 1)
            "p": 4,  # summary rows per group (p | m)
            # the training length n: fixes the levels L = log2(max_len/m) - 1 and the parameters
            # (2 p d (max_len/2 - m) + 2 L p d per layer). 0 (default) = the training length, resolved where the
            # model is built (:meth:`resolve_max_len`); a layer built with 0 unresolved refuses, because levels
            # above the training length get no gradient and would run untrained at a longer length
            "max_len": 0,
            "num_levels": None,  # k = L + 1 (paper's "k lev", fine level included); None = derived
            "downsample": "depthwise_conv",  # 'depthwise_conv' (paper) | 'dense_conv' | 'avgpool' (tests)
            "share_downsample_across_heads": True,
            "downsample_init": "torch_default",  # 'torch_default' | 'subinterval_mean'
            "multiplicity_weighting": True,  # beta_l = ln(m_l / p) on summary scores
            # n > max_len: only L levels; each query then sees back 1/2..1 x max_len tokens (not more)
            "allow_truncated_window": False,
            "attn_dropout": 0.0,
            # 'reference' | 'xla' | the XLA:CPU implementation's name (its own file) | 'pallas' (FMA) | 'auto' (the
            # XLA:CPU implementation on a CPU; pallas, else xla, on GPU/TPU) | a list 'a,b' (the first that serves)
            "impl": "auto",
            # max materialised scores per lax.map step of the blocked path; 0 (dispatch.PLATFORM_DEFAULT) = the
            # value the chosen implementation declares for the platform the call runs on (xla.py: LOGIT_BUDGET)
            "logit_budget": 0,
        }
        if not cls.linear:
            # the Pallas kernel's GPU lowering (pallas.py declares the per-platform values; 0 = the platform's):
            # warps per 64 query rows of a program (a program works on one fine block of m rows at a time), pipeline
            # stages, and the fine blocks one program loops over (a power of two)
            c["kernel_warps_per_64_rows"] = 0
            c["kernel_stages"] = 0
            c["blocks_per_program"] = 0
            # the release's zero-padded coarse (and first fine block's) slots left unmasked: score 0, weight
            # m_l/p each (a "null" sink over the first half of every sequence); causal only, no decoding
            c["release_zero_slots"] = False
        if cls.linear:
            c["fma_linear_normalization"] = "joint"  # 'joint' | 'per_level' (paper eq. 11)
            # 'lagged' (leak-free) | 'paper_leaky' (reproduction only). The lag has an accuracy cost: on smooth
            # inputs causal joint+lagged FMA-linear was 40.6 % (relative) from exact attention where FMA was
            # 3.2 % and the paper's leaky form 9.0 % (docs/methods/fma.md §2.5)
            c["causal_query_summary"] = "lagged"
            c["allow_paper_leaky"] = False  # causal 'paper_leaky' must be asked for explicitly
        return ml_collections.ConfigDict(c)

    @classmethod
    def derived_levels(cls, cfg) -> int:
        return (cfg.max_len // cfg.m).bit_length() - 2  # log2(max_len/m) - 1

    @classmethod
    def exact_len(cls, cfg, *, causal: bool) -> int:
        """Two fine blocks: a query's own block and its neighbour are attended exactly, every farther key through
        the coarse levels (both directions, FMA and FMA-linear)."""
        return 2 * cfg.m

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        pre = f"attention.{cls.name}"
        m, p, n = cfg.m, cfg.p, cfg.max_len
        require(m > 0 and p > 0, f"{pre}: m={m} and p={p} must be positive")
        require(m % p == 0, f"{pre}: p={p} must divide m={m}")
        require(n == 0 or (n >= m and n % m == 0 and ((n // m) & (n // m - 1)) == 0),
                f"{pre}: max_len/m must be a power of two (max_len={n}, m={m}; 0 = the training length)")
        rz = not cls.linear and cfg.release_zero_slots  # FMA only
        require(not (rz and not causal), f"{pre}.release_zero_slots: the release is causal only")
        L = cls.derived_levels(cfg)
        if cfg.num_levels is not None and n > 0:
            require(1 <= cfg.num_levels <= max(L, 0) + 1,
                    f"{pre}.num_levels={cfg.num_levels}; allowed 1..{max(L, 0) + 1} (= log2(max_len/m))")
            require(cfg.num_levels == max(L, 0) + 1 or cfg.allow_truncated_window,
                    f"{pre}.num_levels={cfg.num_levels} < log2(max_len/m) truncates the receptive field; "
                    "set allow_truncated_window=True to ask for it")
        for key, allowed in (
            ("downsample", ("depthwise_conv", "dense_conv", "avgpool")),
            ("downsample_init", ("torch_default", "subinterval_mean")),
        ):
            require(cfg[key] in allowed, f"{pre}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
        why = dispatch.impl_problem(cfg.impl, [i.name for i in cls.implementations(causal=causal)])
        require(why is None, f"{pre}.{why}")
        require(0.0 <= cfg.attn_dropout < 1.0, f"{pre}.attn_dropout={cfg.attn_dropout}; must be in [0, 1)")
        require(not (cfg.impl == "pallas" and cfg.attn_dropout > 0),
                f"{pre}: the Pallas kernel has no attention dropout; use impl='xla' or attn_dropout=0")
        require(cfg.logit_budget >= 0, f"{pre}.logit_budget must be positive (0: the platform's default)")
        for key in ("kernel_warps_per_64_rows", "kernel_stages", "blocks_per_program"):
            if key in cfg:
                require(cfg[key] >= 0, f"{pre}.{key} must be positive (0: the platform's default)")
        bpp = 0 if cls.linear else cfg.blocks_per_program  # FMA only (the kernel's)
        require(bpp & (bpp - 1) == 0, f"{pre}.blocks_per_program={bpp} must be a power of two (0: the platform's)")
        if cls.linear:
            for key, allowed in (("fma_linear_normalization", ("joint", "per_level")),
                                 ("causal_query_summary", ("lagged", "paper_leaky"))):
                require(cfg[key] in allowed, f"{pre}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
            require(not (causal and cfg.causal_query_summary == "paper_leaky" and not cfg.allow_paper_leaky),
                    f"{pre}.causal_query_summary='paper_leaky' lets future tokens change past outputs (the "
                    "paper's causal FMA-linear); it exists to reproduce Table 1 only. Use 'lagged', or set "
                    "allow_paper_leaky=True to ask for it explicitly")

    @classmethod
    def resolve_max_len(cls, cfg, *, seq_len: int):
        """``cfg`` with ``max_len`` 0 (the default: "the training length") replaced by the training length
        ``seq_len`` rounded up to m 2^k (the levels a ``seq_len``-token row uses, and only those); an explicit
        ``max_len`` is kept. For the code that builds a model from a run's config (``train.seq_len``)."""
        cfg = ml_collections.ConfigDict(cfg.to_dict())
        if cfg.max_len == 0:
            nb = max(1, -(-int(seq_len) // cfg.m))
            cfg.max_len = cfg.m << (nb - 1).bit_length()
        return cfg

    @classmethod
    def resolve_for_run(cls, cfg, *, seq_len: int):
        return cls.resolve_max_len(cfg, seq_len=seq_len)

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None, platform=None):
        if cfg.max_len == 0:
            raise ConfigError(
                f"attention.{self.name}.max_len=0 means the training length and is not resolved here: set "
                f"attention.{self.name}.max_len to the training length (its levels get gradients only up to the "
                "length they train at), or resolve it with resolve_max_len(cfg, seq_len=...)")
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim,
                         platform=platform)
        c = self.cfg
        L = self.derived_levels(c) if c.num_levels is None else c.num_levels - 1
        L = max(L, 0)
        self.opts = FMAOptions(
            causal=causal, m=c.m, p=c.p, L=L, max_len=c.max_len, linear=self.linear,
            multiplicity=c.multiplicity_weighting,
            normalization=c.fma_linear_normalization if self.linear else "joint",
            query_summary=c.causal_query_summary if self.linear else "lagged",
            downsample=c.downsample, shared=c.share_downsample_across_heads,
            allow_truncated=c.allow_truncated_window, attn_dropout=float(c.attn_dropout),
            release_zero_slots=False if self.linear else bool(c.release_zero_slots),
            logit_budget=int(c.logit_budget),
        )
        heads = None if c.share_downsample_across_heads else num_heads
        names = (("k", head_dim, "head_dim"), ("v", self.value_dim, "value_dim"))
        if self.linear:
            names = names + (("q", head_dim, "head_dim"),)
        if c.downsample != "avgpool":
            for nm, f, ax in names:
                for l in range(1, L + 1):
                    setattr(self, f"ds_{nm}_{l}", Downsample(c.downsample, self.opts.m_l(l), f, c.p, heads=heads,
                                                             init=c.downsample_init, feat_axis=ax, rngs=rngs))

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        # m=4, p=2, max_len=64: L = 3 levels (groups of 4, 8, 16); 56 tokens populate every level
        # (the top level's partners start at position 32) and leave room for the suite's +5 tokens.
        base = {"m": 4, "p": 2, "max_len": 64}  # impl 'auto': the platform's production path
        return {
            "auto": ContractCase(cfg=base, length=56, num_heads=2, head_dim=8, value_dim=6),
            "per_head_dense_conv": ContractCase(
                cfg={**base, "share_downsample_across_heads": False, "downsample": "dense_conv"},
                length=40, num_heads=2, head_dim=4, directions=("causal",), slow=True),
            # the Pallas kernel in interpret mode (full passes; streaming steps use the reference)
            "pallas": ContractCase(cfg={**base, "impl": "pallas"}, length=56, num_heads=2, head_dim=8, value_dim=6,
                                   slow=True),
        }

    @classmethod
    def kernel_benches(cls):
        # untrained timing cores: levels for the benchmarks' longest sequence
        return {"fma_blocks": KernelBench(xla={"impl": "xla", "max_len": BENCH_MAX_LEN},
                                          pallas={"impl": "pallas", "max_len": BENCH_MAX_LEN}),
                # the Hopper kernel (Mosaic GPU) beside the Triton one, on a GPU only
                "fma_blocks_mgpu": KernelBench(xla={"impl": "xla", "max_len": BENCH_MAX_LEN},
                                               pallas={"impl": "mosaic_gpu", "max_len": BENCH_MAX_LEN},
                                               platforms=("cuda",))}

    @classmethod
    def bench_variants(cls, platform: str) -> dict[str, dict]:
        return {"": {"max_len": BENCH_MAX_LEN}}  # untrained timing cores: levels for the longest sequence

    @classmethod
    def drop_in(cls) -> DropIn:
        # parameter-free summaries (mean of each sub-interval of m_l/p tokens): FMA on given q, k, v, untrained
        return DropIn(description="summaries = sub-interval means (downsample='avgpool'), no training",
                      overrides={"downsample": "avgpool", "max_len": BENCH_MAX_LEN})

    # -- helpers ----------------------------------------------------------------
    def ds_params(self):
        out = {}
        for nm in ("k", "v") + (("q",) if self.linear else ()):
            out[nm] = [getattr(self, f"ds_{nm}_{l}").params() if self.opts.downsample != "avgpool" else None
                       for l in range(1, self.opts.L + 1)]
        return out

    def _shapes(self, dropout: bool, segments: bool = False, dtype=None) -> dict:
        """What the selection reads of a call (``dispatch.select``'s shapes): ``dropout`` where the call drops,
        ``segments`` where it is a packed row, ``dtype`` the inputs'."""
        out = {"m": self.opts.m, "d": self.head_dim, "dv": self.value_dim, "dtype": dtype,
               "coarse_kind": "stats" if self.linear else "packed",
               "dropout": self.opts.attn_dropout if dropout else 0.0,
               "release_zero_slots": self.opts.release_zero_slots}
        if segments:
            out["segments"] = True
        return out

    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError(f"{self.name}: bidirectional attention has no prefix state")
        if self.opts.leaky:
            raise ValueError(f"{self.name}: causal_query_summary='paper_leaky' cannot be decoded; use 'lagged'")
        if self.opts.release_zero_slots:
            raise ValueError(f"{self.name}: release_zero_slots=True (a reproduction of the release) cannot be decoded")
        if max_len is not None and max_len > self.opts.max_len and not self.opts.allow_truncated:
            raise ValueError(
                f"{self.name}: a state for {max_len} tokens exceeds the layer's max_len={self.opts.max_len} "
                f"(the levels it was built for): build it with a larger attention.{self.name}.max_len, or set "
                f"attention.{self.name}.allow_truncated_window=True (each query then reaches back "
                f"{self.opts.max_len // 2} to {self.opts.max_len} tokens; a trained run takes it for evaluation and "
                "sampling)"
            )
        return empty_state(batch_size, self.num_heads, self.head_dim, self.value_dim, self.opts)

    # -- sequence parallelism: rings of the newest groups per level, a window of the newest keys --
    def sequence_refusal(self, slice_len: int) -> str | None:
        if self.opts.leaky:
            return "causal_query_summary='paper_leaky' cannot be streamed"
        if self.opts.release_zero_slots:
            return "release_zero_slots=True cannot be streamed"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return {**self.init_state(batch_size, max_len), "pos": jnp.asarray(start, jnp.int32)}

    def compose_states(self, a, b):
        # b ran from zeros at a's end: its window and rings hold zeros where a's newest keys and groups
        # belong, and the group open at a's end lacks a's part of its (linear) conv sum, a's acc
        def newest(old, new, shift):
            n = old.shape[2]
            padded = jnp.concatenate([old, jnp.zeros_like(old)], axis=2)
            return new + jax.lax.dynamic_slice_in_dim(padded, jnp.minimum(shift, n), n, axis=2)

        out = dict(b)
        out["doc_len"] = a["doc_len"] + b["doc_len"]  # one sequence: its length so far
        for name in ("win_k", "win_v"):
            out[name] = newest(a[name], b[name], b["pos"] - a["pos"])
        for name in a:
            if not name.startswith("ring_"):
                continue
            acc_name = "acc_" + name[len("ring_"):]
            rings, accs = [], []
            for l, (ra, rb, acc_a, acc_b) in enumerate(zip(a[name], b[name], a[acc_name], b[acc_name])):
                ml = self.opts.m_l(l + 1)
                shift = b["pos"] // ml - a["pos"] // ml  # groups finished by b's tokens
                ring = newest(ra, rb, shift)
                # the group open at a's end finished in b: it sits at ring slot RING - shift (if still kept)
                at = (jnp.arange(RING) == RING - shift).astype(ring.dtype)
                rings.append(ring + at[None, None, :, None, None] * acc_a[:, :, None])
                accs.append(acc_b + jnp.where(shift == 0, acc_a, 0.0))
            out[name], out[acc_name] = tuple(rings), tuple(accs)
        return out

    # -- the call (AttentionCore.__call__: prepare -> select -> run -> finish) ------------------------
    def prepare(self, q, k, v, state, *, deterministic, key, segment_ids=None):
        """The call every implementation takes (:class:`~longctx.attention.fma.state.Blocked`): inputs ``q, k, v``,
        ``ds`` (:meth:`ds_params`) and ``opts`` (the layer's options; the runner sets its ``logit_budget``), the
        carried ``state`` (causal only), the attention dropout's key as ``key`` (None unless the call drops), and
        ``segment_ids`` [B, T] int32 (a packed row, §2.7; None: one sequence)."""
        check_segments(self, q, segment_ids)
        if segment_ids is not None and (self.opts.release_zero_slots or self.opts.leaky):
            raise ConfigError(self._packed_refusal_line())
        drop_key = None
        if not deterministic and self.opts.attn_dropout > 0.0:
            if key is None:
                raise ValueError(f"{self.name}: attn_dropout > 0 with deterministic=False needs a PRNG `key`")
            drop_key = key
        if state is not None:
            if not self.causal:
                raise ValueError(f"{self.name}: a bidirectional core takes no state (state=None only)")
            if not isinstance(state, dict) or "pos" not in state:
                raise ValueError(f"{self.name}: state must come from init_state() or a previous call")
        inputs = {"q": q, "k": k, "v": v, "ds": self.ds_params(), "opts": self.opts, "segment_ids": segment_ids}
        return dispatch.Call(inputs, state, key=drop_key), self._shapes(drop_key is not None, segment_ids is not None,
                                                                        q.dtype)

    def finish(self, call, result, *, aux=None):
        """The output in the values' dtype, and the state: the streamed step's, or after a full pass (causal, where
        the call can be continued) :func:`state_from_forward` of its inputs."""
        x = call.inputs
        if call.state is not None:
            return result.out.astype(x["v"].dtype), result.state
        new_state = None
        if self.causal and not self.opts.leaky and not self.opts.release_zero_slots:
            if x["segment_ids"] is not None:  # a packed row: the state of its last document (§2.7)
                new_state = packed.last_document_state(x["q"], x["k"], x["v"], x["ds"], self.opts, x["segment_ids"],
                                                       x["q"].shape[2])
            else:
                new_state = state_from_forward(x["q"], x["k"], x["v"], x["ds"], self.opts)
        return result.out.astype(x["v"].dtype), new_state


    @classmethod
    def _packed_refusal_line(cls) -> str:
        return (f"{cls.name}: packed rows (segment ids) with release_zero_slots or paper_leaky: a reproduction of "
                "the paper's single sequence; use data.packing='document'")

    @classmethod
    def packed_refusal(cls, cfg):
        leaky = cls.linear and cfg.causal_query_summary == "paper_leaky"
        release = not cls.linear and bool(cfg.release_zero_slots)
        return cls._packed_refusal_line() if leaky or release else None


class FMALinearAttention(FMAAttention):
    """FMA-linear (paper App. A.1): queries are summarised too, so the coarse part is O(n)."""

    name = "fma_linear"
    EXECUTION_KEYS = ("impl", "logit_budget")  # no kernel knobs
    linear = True  # no pallas implementation: the block kernel computes FMA's packed slots, not these statistics

    @classmethod
    def kernel_benches(cls):
        return {}  # the fma_blocks kernel computes FMA's packed coarse slots, not FMA-linear's statistics

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        base = {"m": 4, "p": 2, "max_len": 64}
        return {
            "auto": ContractCase(cfg=base, length=56, num_heads=2, head_dim=8, value_dim=6),
            "per_level": ContractCase(cfg={**base, "fma_linear_normalization": "per_level"}, length=40,
                                          num_heads=1, head_dim=4, directions=("causal",), slow=True),
        }


__all__ = ["Downsample", "FMAAttention", "FMALinearAttention"]

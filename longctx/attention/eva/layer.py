"""The EVA core (docs/methods/eva.md): parameters, configuration, decoding state, and the call's inputs and
result around one of the implementations:

* ``reference`` (reference.py): the paper's computation over the whole sequence, plain autodiff, O(L²);
* ``xla`` (xla.py): XLA tiles with plain einsums (portable);
* the same tiles tuned for XLA:CPU (the CPU-tuned implementation, its own file; 'auto' on a CPU);
* ``pallas`` (pallas.py): the Phase A and Phase B kernels ('auto' on a GPU / TPU where they serve, then ``xla``).

Each implementation module declares itself (its ``IMPLEMENTATIONS``: platforms, limits, where 'auto' tries it, and
its ``code``, a ``dispatch.Runner`` whose fields are the execution settings it reads); the layer declares only the
reference. The base class's call runs :meth:`EVAAttention.prepare` (the inputs every runner takes and the shapes the
selection reads), the runner ``dispatch.select`` chooses, and :meth:`EVAAttention.finish` (a causal full pass's
state from the forward's extras). A runner looks at the call itself: without a carried state it runs its full pass,
with one its stream (the XLA tiles; the CPU-tuned ones with their ops; the kernels' with Phase A in the kernel; the
reference's are the portable ones); a packed row (``segment_ids``) runs the reference's packed form or, in the
tiles and the kernels, the documents laid out again on the block grid (packed.py), after a carried state too.
"""

from __future__ import annotations

import dataclasses
import functools

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
    axes,
    check_segments,
    require,
)
from longctx.attention.eva import reference, xla
from longctx.attention.eva.common import (
    EVAOptions,
    empty_state,
    geometry,
    rpe_num_buckets,
    run_pass,
    state_from_forward,
)
from longctx.attention.eva.packed import grid_block, layout_size
from longctx.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Reference(dispatch.Runner):
    """``reference``: the paper's computation over the whole row (``reference.eva_reference``); a packed row
    (``segment_ids`` given) by ``reference.eva_reference_packed``, from a carried state too (a causal one returns
    the state of each row's last document); an unpacked stream after a carried state has no O(L²) form of its own
    and runs the portable tiles (``xla.eva_stream``, with their logit budget)."""

    logit_budget: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        return run_pass(self, core, call, reference.eva_reference, xla.eva_stream, reference.eva_reference_packed)


# not in 'auto' (the tiles serve every call, packed rows too)
REFERENCE = dispatch.Implementation(
    "reference", config={"impl": "reference"}, defaults={"logit_budget": xla.LOGIT_BUDGET},  # its stream's tiles
    code=Reference)


@functools.cache
def _declared(causal: bool | None) -> tuple[dispatch.Implementation, ...]:
    """The reference, then each module's declarations, the kernels last (the order the names were listed in before
    the modules declared themselves)."""
    found = dispatch.declared(__package__, first=(REFERENCE,), causal=causal)
    return tuple(sorted(found, key=lambda i: i.kernel))  # stable: declared order within each kind


class EVAAttention(AttentionCore):
    """EVA attention core (causal: App. D; bidirectional: eq. 16). See module docstring."""

    name = "eva"
    EXECUTION_KEYS = ("impl", "logit_budget", "keep_budget", "query_tile", "key_tile", "chunk_tile", "num_warps")
    randomized = True  # one ω sample per chunk and attention dropout when deterministic=False
    takes_segments = True  # every implementation: the reference, the tiles and the kernels (packed.py's layout)

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """reference (the paper's math, first), xla (portable tiles), the tiles tuned for XLA:CPU and pallas (the
        Phase A and Phase B kernels; interpret mode on a CPU when named): each declared by its own module."""
        return _declared(causal)

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                "window_size": 128,  # W: local block (|E| = W + overlap); 0 = no local part (test-only)
                "chunk_size": 8,  # P (causal; bidirectional when num_chunks == 0); W % P == 0
                "num_chunks": 0,  # C (bidirectional only; >0 overrides chunk_size; needs C | W); causal rejects it
                "overlap_window": False,  # causal: window extends W to the left; bidirectional: W/2 each side
                "partition": "full",  # 'full' (released: chunks may overlap the block, double count) | 'disjoint'
                "chunk_logit": "rep",  # 'rep' (eq. 16: s q·k̂_c) | 'exact_lse' (eq. 13, test-only, O(L²))
                "chunk_rep": "learned",  # 'learned' (Linear(+LN) of the chunk mean) | 'identity' (mean, test-only)
                "adaptive_proj": "qk",  # 'qk' (Linear+LN) | 'no-ln' (Linear) | 'none' (µ = 0, bidirectional only)
                "mu_mode": "auto",  # 'auto' (causal q̂+k̂, bidirectional ½(q̂+k̂)) | 'sum' | 'half'
                "rf_scale": "released",  # 'released' s(ω·k−½‖k‖²) | 'principled' √s ω·k − (s/2)‖k‖²
                "use_rpe": True,  # T5 relative position bias inside the local block
                "attn_dropout": 0.0,  # on the joint attention weights, only when not deterministic
                # a name from implementations(), an ordered list ('pallas,xla') or 'auto' (the CPU-tuned tiles on a
                # CPU; pallas where it serves, then xla, elsewhere): longctx/attention/dispatch.py
                "impl": "auto",
                # max materialized logits per lax.map step (memory knob): larger is faster (fewer, bigger calls) and
                # takes more memory. 0 (dispatch.PLATFORM_DEFAULT): the value the implementation declares for the
                # platform it runs on (xla.py, xla_cpu.py, pallas.py; XLA:CPU 2^25)
                "logit_budget": dispatch.PLATFORM_DEFAULT,
                # max attention weights (fp32 entries, all tiles of a full pass) kept from the forward for the
                # backward by xla_cpu, which then recomputes no logits; larger passes recompute them. 0
                # (dispatch.PLATFORM_DEFAULT): xla_cpu's declared value (2^28 = 1 GiB per layer); a negative value
                # always recomputes (what 0 meant before the platform defaults). Per layer: a deep model holds one
                # set per layer from its forward to its backward unless model.remat recomputes each block
                "keep_budget": dispatch.PLATFORM_DEFAULT,
                # pallas, Phase B: the query sub-tile and local key sub-tile (each divides window_size), the chunk
                # tile (a power of two >= 16) and the GPU warps. 0 (dispatch.PLATFORM_DEFAULT): the kernel's plan for
                # the platform (eva_attend.gpu_plan on a GPU, whole windows on a TPU); written: that value (sweeps)
                "query_tile": dispatch.PLATFORM_DEFAULT,
                "key_tile": dispatch.PLATFORM_DEFAULT,
                "chunk_tile": dispatch.PLATFORM_DEFAULT,
                "num_warps": dispatch.PLATFORM_DEFAULT,
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = "attention.eva"
        W, P, C = cfg.window_size, cfg.chunk_size, cfg.num_chunks
        require(W >= 0, f"{p}.window_size={W}; must be >= 0 (0 disables the local block, test-only)")
        require(C >= 0, f"{p}.num_chunks={C}; must be >= 0")
        if causal:
            require(C == 0, f"{p}.num_chunks={C}: a causal EVA layer needs a fixed chunk_size (num_chunks makes "
                            "the partition depend on the total length and leaks the future); set num_chunks=0")
            require(P > 0, f"{p}.chunk_size={P}; must be > 0")
            require(W == 0 or W % P == 0, f"{p}: window_size={W} must be a multiple of chunk_size={P}")
        else:
            if C > 0:
                require(W == 0 or W % C == 0, f"{p}: num_chunks={C} must divide window_size={W} "
                                              "(so P = L_pad / C is an integer)")
            else:
                require(P > 0, f"{p}.chunk_size={P}; must be > 0 when num_chunks == 0")
                require(W == 0 or W % P == 0, f"{p}: window_size={W} must be a multiple of chunk_size={P}")
        require(not (cfg.overlap_window and W == 0), f"{p}.overlap_window needs window_size > 0")
        require(not (cfg.overlap_window and not causal and W % 2), f"{p}: bidirectional overlap needs an even window_size")
        for key, allowed in (
            ("partition", ("full", "disjoint")),
            ("chunk_logit", ("rep", "exact_lse")),
            ("chunk_rep", ("learned", "identity")),
            ("adaptive_proj", ("qk", "no-ln", "none")),
            ("mu_mode", ("auto", "sum", "half")),
            ("rf_scale", ("released", "principled")),
        ):
            require(cfg[key] in allowed, f"{p}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
        require(not (causal and cfg.adaptive_proj == "none"),
                f"{p}.adaptive_proj='none' exists only for bidirectional layers; use 'qk' or 'no-ln'")
        require(0.0 <= cfg.attn_dropout < 1.0, f"{p}.attn_dropout={cfg.attn_dropout}; must be in [0, 1)")
        why = dispatch.impl_problem(cfg.impl, [i.name for i in cls.implementations(causal=causal)])
        require(why is None, f"{p}.{why}")
        require(cfg.logit_budget >= 0, f"{p}.logit_budget={cfg.logit_budget}; must be positive, or "
                                       f"{dispatch.PLATFORM_DEFAULT} for the platform's default")
        require(isinstance(cfg.keep_budget, int), f"{p}.keep_budget={cfg.keep_budget!r}; an integer (0: the "
                                                  "platform's default; negative: always recompute)")
        for key in ("query_tile", "key_tile", "chunk_tile", "num_warps"):
            require(cfg[key] >= 0 or cfg[key] == -1, f"{p}.{key}={cfg[key]}; must be positive, 0 (the platform's "
                                                       "default) or -1 (the kernel's plan)")
        require(cfg.chunk_tile <= 0 or (cfg.chunk_tile >= 16 and not cfg.chunk_tile & (cfg.chunk_tile - 1)),
                f"{p}.chunk_tile={cfg.chunk_tile}; a power of two >= 16")
        for key in ("query_tile", "key_tile"):
            require(cfg[key] <= 0 or (W > 0 and W % cfg[key] == 0), f"{p}.{key}={cfg[key]} must divide window_size={W}")

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None, platform=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim,
                         platform=platform)
        c = self.cfg
        d = head_dim
        W = c.window_size
        e = (W if causal else W // 2) if c.overlap_window else 0
        mu_mode = c.mu_mode if c.mu_mode != "auto" else ("sum" if causal else "half")
        self.opts = EVAOptions(
            causal=causal, W=W, e_l=e, e_r=0 if causal else e, partition=c.partition, chunk_logit=c.chunk_logit,
            chunk_rep=c.chunk_rep, adaptive_proj=c.adaptive_proj, mu_mode=mu_mode, rf_scale=c.rf_scale,
            use_rpe=c.use_rpe and W > 0, rpe_buckets=rpe_num_buckets(W, e), rpe_max_distance=max(W + e, 1),
            attn_dropout=float(c.attn_dropout), logit_budget=int(c.logit_budget), keep_budget=int(c.keep_budget),
        )
        # released inits (§3.1): causal Xavier-uniform gain 2^-1/2, bidirectional trunc-normal 0.02; biases 0
        if causal:
            w_init = nnx.initializers.variance_scaling(0.5, "fan_avg", "uniform")
        else:
            w_init = nnx.initializers.truncated_normal(0.02)
        mat, vec = axes(None, "head_dim"), axes("head_dim")  # shared by all heads: [d_in, d_out], [d]
        self.q_w = nnx.Param(w_init(rngs.params(), (d, d), jnp.float32), **mat)
        self.k_w = nnx.Param(w_init(rngs.params(), (d, d), jnp.float32), **mat)
        self.q_b, self.k_b = nnx.Param(jnp.zeros((d,)), **vec), nnx.Param(jnp.zeros((d,)), **vec)
        self.q_ln_scale, self.k_ln_scale = nnx.Param(jnp.ones((d,)), **vec), nnx.Param(jnp.ones((d,)), **vec)
        self.q_ln_bias, self.k_ln_bias = nnx.Param(jnp.zeros((d,)), **vec), nnx.Param(jnp.zeros((d,)), **vec)
        if self.opts.use_rpe:
            shape = (self.opts.rpe_buckets,) if causal else (self.opts.rpe_buckets, num_heads)
            names = (None,) if causal else (None, "heads")
            self.rpe_table = nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32), **axes(*names))
        else:
            self.rpe_table = None

    @classmethod
    def kernel_benches(cls):
        # impl='pallas' runs both kernels (chunk statistics and the chunk + local attention); impl='mosaic_gpu' the
        # Hopper kernels of the chunk + local attention beside them, on a GPU only
        return {"eva_chunk_stats+eva_attend": KernelBench(xla={"impl": "xla"}, pallas={"impl": "pallas"}),
                "eva_attend_mgpu": KernelBench(xla={"impl": "xla"}, pallas={"impl": "mosaic_gpu"},
                                               platforms=("cuda",))}

    @classmethod
    def drop_in(cls):
        return DropIn(
            "chunk_rep='identity' (k̂_c = chunk mean of k, µ_c from chunk means of q and k; no learned projection), "
            "use_rpe=False (no learned position bias); other options default",
            {"chunk_rep": "identity", "use_rpe": False},
        )

    @classmethod
    def contract_cases(cls):
        # window 8, chunk 4, 48 tokens: the carried state holds 8+ finished chunks beyond the window
        small = {"window_size": 8, "chunk_size": 4, "attn_dropout": 0.0}
        return {
            "auto": ContractCase(cfg={**small, "impl": "auto"}, length=48),  # the CPU-tuned tiles on a CPU
            "reference": ContractCase(cfg={**small, "impl": "reference"}, length=48, slow=True),
            "xla": ContractCase(cfg={**small, "impl": "xla"}, length=48, slow=True),
            "auto_overlap_disjoint": ContractCase(cfg={**small, "overlap_window": True, "partition": "disjoint"},
                                                  length=48, directions=("causal",), slow=True),
            # the paper's overlapping windows, the exact chunk log-sum-exp and attention dropout: every law on them
            # (the streamed and decoded laws run training mode with a key: ω draws and dropout masks included)
            "overlap_lse_dropout": ContractCase(cfg={**small, "overlap_window": True, "chunk_logit": "exact_lse",
                                                     "attn_dropout": 0.3}, length=48, directions=("causal",)),
            # Phase A and Phase B through the Pallas kernels (interpret mode on CPU)
            "pallas": ContractCase(cfg={**small, "impl": "pallas"}, length=48, slow=True),  # interpret mode
        }

    # -- helpers --------------------------------------------------------------------
    def chunk_params(self):
        names = ("q_w", "q_b", "q_ln_scale", "q_ln_bias", "k_w", "k_b", "k_ln_scale", "k_ln_bias")
        return {n: getattr(self, n)[...] for n in names}

    def call_shapes(self, L: int, *, streaming: bool, deterministic: bool = True, segments: bool = False,
                    state=None, dtype=None) -> dict:
        """The keywords the selection hands every declaration's ``reasons`` and ``prefer`` for a call over L tokens
        (``streaming``: after a carried state, ``state``; ``deterministic`` False: a training call, with attention
        dropout when ``attn_dropout > 0``; ``segments``: a packed row, whose chunks ``C`` are its layout's and the
        carried state's, packed.py; ``dtype``: the inputs', where known); the kernels declare their limits
        (pallas.unsupported_reasons).
        ``core.runner(**core.call_shapes(...))`` is the call's implementation."""
        o, c = self.opts, self.cfg
        P, C = (c.chunk_size, 0) if streaming else geometry(o, L, c.chunk_size, c.num_chunks)[1:3]
        if segments:
            P, G = c.chunk_size, grid_block(o, c.chunk_size)
            prefix, held = 0, 0
            if state is not None:
                prefix, held = -(-state["win_k"].shape[2] // G) * G + G - 1, state["mem_khat"].shape[2]
            C = layout_size(L, G, P, prefix, causal=o.causal) // P + held
        return dict(P=P, d=self.head_dim, dv=self.value_dim, W=o.W, C=C, e_l=o.e_l, e_r=o.e_r,
                    chunk_logit=o.chunk_logit, full=not streaming, dropout=not deterministic and o.attn_dropout > 0.0,
                    segments=segments, dtype=dtype)

    def _keys(self, deterministic, key):
        if deterministic:
            return None, None
        if key is None:
            raise ValueError("eva: deterministic=False needs a PRNG `key` (one ω sample per chunk, dropout)")
        noise_key, drop_key = jax.random.split(key)
        return noise_key, drop_key

    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("eva: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("eva: init_state needs max_len (tokens; sizes the finished-chunk memory)")
        P = self.cfg.chunk_size
        R = self.opts.W + self.opts.e_l
        return empty_state(batch_size, self.num_heads, self.head_dim, self.value_dim, R, P, -(-max_len // P),
                           self.opts.chunk_logit == "exact_lse")

    # -- sequence parallelism: chunk summaries sit at absolute slots, the window is the newest R --
    def sequence_refusal(self, slice_len: int) -> str | None:
        if slice_len % self.cfg.chunk_size:
            return f"a slice of {slice_len} tokens is not a multiple of chunk_size={self.cfg.chunk_size}"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        # "origin" marks it (a call from it returns a state without the mark): a packed slice refuses it (prepare)
        return {**self.init_state(batch_size, max_len), "pos": jnp.asarray(start, jnp.int32),
                "origin": jnp.ones((), bool)}

    def compose_states(self, a, b):
        # b ran from an empty state at a's end (a chunk border): its finished chunks occupy slots a's
        # are zero in, its window holds zeros where a's newest tokens belong, its chunk buffer is current
        out = dict(b)
        for name in a:
            if name.startswith("mem_"):
                out[name] = a[name] + b[name]
        R = a["win_k"].shape[2]
        shift = jnp.minimum(b["pos"] - a["pos"], R)
        for name in ("win_k", "win_v"):
            padded = jnp.concatenate([a[name], jnp.zeros_like(a[name])], axis=2)
            out[name] = b[name] + jax.lax.dynamic_slice_in_dim(padded, shift, R, axis=2)
        return out

    def prepare(self, q, k, v, state, *, deterministic, key, segment_ids=None):
        """``segment_ids`` [B, T] int32 (optional): a packed row, each document (a run of equal ids) computed as if
        alone (the reference; the tiles by a layout on the block grid); a causal packed call returns the state of each
        row's last document, and one given a state continues its document for the tokens ``base.continues_state``
        marks (docs/methods/eva.md).

        The inputs every runner takes: ``q``, ``k``, ``v``; ``params`` (:meth:`chunk_params`); ``rpe`` (the
        relative-position table, None without one); ``noise_key``, ``drop_key`` (the split of ``key``; None when
        deterministic); ``segment_ids`` (None: one sequence)."""
        check_segments(self, q, segment_ids)
        c = self.cfg
        if segment_ids is not None and not self.causal and c.num_chunks > 0:
            raise ConfigError(f"eva: packed rows need a fixed chunk_size (num_chunks={c.num_chunks} sizes each "
                              "document's chunks by its length); set num_chunks=0")
        if segment_ids is not None and state is not None and "origin" in state:
            raise ConfigError("eva: packed rows cannot run sequence-parallel by composed states (a document that "
                              "crosses a slice continues its chunk grid, noise draws and window there); set "
                              "mesh.sequence=1 or data.packing='document'")
        noise_key, drop_key = self._keys(deterministic, key)
        if state is not None and not self.causal:
            raise ValueError("eva: a bidirectional core takes no state")
        rpe = self.rpe_table[...] if self.rpe_table is not None else None
        inputs = {"q": q, "k": k, "v": v, "params": self.chunk_params(), "rpe": rpe, "noise_key": noise_key,
                  "drop_key": drop_key, "segment_ids": segment_ids}
        shapes = self.call_shapes(q.shape[2], streaming=state is not None, deterministic=deterministic,
                                  segments=segment_ids is not None, state=state, dtype=q.dtype)
        return dispatch.Call(inputs, state, key=key), shapes

    def finish(self, call, result, *, aux=None):
        """The output in the values' dtype; the state: a stream's or a packed call's (its runner's), or a causal full
        pass's from the forward's extras (``state_from_forward``); none for a bidirectional core."""
        x = call.inputs
        out = result.out.astype(x["v"].dtype)
        if call.state is not None or not self.causal or x["segment_ids"] is not None:
            return out, result.state
        o = self.opts
        return out, state_from_forward(result.extras, x["q"].shape[2], o.W + o.e_l, o.chunk_logit == "exact_lse")

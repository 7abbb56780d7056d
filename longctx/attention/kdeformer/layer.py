"""KDEformer (Zandieh, Han, Daliri, Karbasi, ICML 2023; arXiv 2302.02451): the attention core. Method notes:
``docs/methods/kdeformer.md``; the section numbers (§) below are its sections.

Softmax attention ``D⁻¹AV`` (``A = exp(σQKᵀ)``) is estimated as an exact "heavy" part on the
(query, key) pairs an angular LSH puts together, plus an importance-sampled estimate of the
residual ``A − A_spar`` from ``m`` i.i.d. key columns weighted ``1/(m p_j)``. The normaliser
``D̃`` is estimated by the same estimator (the released code's ones column appended to ``V``), so
every output row is a softmax over the union of its heavy, local and sampled entries (§2.3h).
The math is ``reference.py`` (bidirectional §2.3, causal §4.1); the shared hash, Gray order and
samplers are ``common.py``; the tiled forms are ``xla.py`` (portable) and the XLA:CPU implementations (their
own file).

The theoretical estimator (§2.2, paper Alg. 1–3: ``D̃`` and the sampling probabilities from weighted
exponential KDEs reduced to Gaussian KDE, Eq. 7–8) has data-dependent control flow and sizes; the
released code does not run it either (§2.3). An O(n²) oracle of ``WExpKDE`` lives in the tests only.

Implementations (``implementations()``; ``impl`` names one, a list, or 'auto'): the reference (declared here),
then those each implementation module declares (``IMPLEMENTATIONS``, collected by ``dispatch.declared``):
    bidirectional: xla (portable), the XLA:CPU implementation (CPU).  causal: xla (its route by ``heavy_impl``),
    gather, scores, band (CPU: one per heavy route, with XLA:CPU's products), pallas (cuda; interpret mode on a CPU
    when named: the 'band' route's heavy part by the Pallas kernel ``pallas_kernels/kde_band.py``, ``pallas.py``).
    'auto' is the declarations': on a CPU the XLA:CPU implementation / the route for the cache length; on cuda
    ``pallas`` for the full passes whose route is 'band', else ``xla``; on other accelerators ``xla``;
    ``heavy_impl`` is the route ``xla`` takes (``auto``: by the cache length).
Each declaration's ``code`` is a ``dispatch.Runner`` whose fields are the execution knobs it reads (``tile_budget``,
``heavy_scores_max_len``, ``heavy_band_block``, and ``heavy_impl`` for ``xla``); the base class's call selects it
for the core's platform and builds it, each numeric knob left at ``dispatch.PLATFORM_DEFAULT`` taking the value its
declaration gives that platform (``xla.DEFAULTS``: the CPU's tuning on a CPU, budgets sized for an 80 GB
accelerator on a GPU or TPU; a value written in the config runs as written), and the runner puts its fields into
the core's options before calling the math. :meth:`KDEformerAttention.prepare` draws the projections and the
samples' key and checks the state's capacity; :meth:`KDEformerAttention.finish` builds the next state.

Packed rows (``segment_ids``, §4.6): every implementation, both directions, computes each document as if alone,
every index and draw counted from its first token. The state then holds the last document's id and start, and the
next call's leading tokens with that id continue it.

Decoding state (causal): the KV cache, the code cache, the projections ``W``, the token count and the carried
document (``segment``, ``start``: 0 without segment ids) (``init_state(batch, max_len)``; ``common.next_state``). A call with a state treats the cache as the
sequence so far, so any split into consecutive chunks equals one full pass. Feeding more tokens than
``max_len`` raises (host check when the count is concrete, ``jax.debug.callback`` under jit).

Gradient policy (§6): the draws (hashes, permutations, samples, log-weights, masks) are frozen; gradients are
those of the estimator with its draws fixed (``p`` is frozen too: differentiating through ``ω`` alone adds a
biased term).

Randomness (§2.4): only from the explicit ``key``: ``k_W, k_S = split(key)``; ``W`` from
``k_W`` (or from ``PRNGKey(lsh_seed)`` when ``fixed_projections``), samples from ``k_S``.
``deterministic=True`` (evaluation, decoding) uses the fixed key ``PRNGKey(eval_rng_seed)``:
the same estimator with frozen draws, never exact attention.

Departures from the paper, the released code and the method notes, named:
* ``fixed_projections`` derives ``W`` from ``PRNGKey(lsh_seed)`` only (the core does not know its
  layer index, so all layers share it), and likewise the deterministic key is shared by layers.
* A causal state keeps the projections ``W`` of the first call of its stream (the token count is
  0 then); later calls of that stream hash with it whatever their key, so windowed training with
  a fresh key per window keeps the code cache consistent. Samples use the current call's key.
* ``sampling='paper_mc'`` (§2.3i, optional) is not implemented.
* Cross-attention (``Nq ≠ Nk``) is not offered: the contract is self-attention.
* Packed rows (§4.6) are ours; a packed document's ``ref`` sampler computes its ``λ`` over other arrays than alone
  (equal up to the order of the sums), the one draw input that is not exact.
* Masked logits use a finite ``-1e30`` and an explicit mask (``where``) in the tiled forms, and a row without
  any finite entry outputs 0 (only padded rows can be such), instead of ``-inf``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from longctx.attention import dispatch
from longctx.attention.base import (
    AttentionCore,
    CapacityError,
    ContractCase,
    KernelBench,
    LayerOfStack,
    check_capacity,
    check_segments,
    require,
)
from longctx.attention.kdeformer import reference
from longctx.attention.kdeformer.common import (
    BidirOptions,
    CausalOptions,
    draw_projections,
    next_state,
    one_token_applies,
)

ROUTES = ("gather", "scores", "band")  # the causal heavy routes (xla.py), each a CPU implementation

CAPACITY_MESSAGE = ("kdeformer: the decoding state holds {capacity} tokens but {needed} were fed; build it with "
                    "core.init_state(batch_size, max_len) with a larger max_len")


@dataclasses.dataclass(frozen=True)
class Reference(dispatch.Runner):
    """The estimator as math (``reference.py``), either direction; it reads no execution knob."""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        if core.causal:  # in a scanned stack, the layer's state (finish sets the next one back)
            state = call.state.get() if isinstance(call.state, LayerOfStack) else call.state
            return dispatch.Result(reference.causal(x["q"], x["k"], x["v"], x["W"], call.key, core.causal_opts,
                                                    state, x["segment_ids"]))
        return dispatch.Result(reference.bidirectional(x["q"], x["k"], x["v"], x["W"], call.key, core.bidir_opts,
                                                       x["segment_ids"]))


REFERENCE = dispatch.Implementation("reference", config={"impl": "reference"}, code=Reference)


class KDEformerAttention(AttentionCore):
    """KDEformer attention core (bidirectional: the released estimator; causal: §4)."""

    name = "kdeformer"
    EXECUTION_KEYS = ("impl", "heavy_impl", "heavy_scores_max_len", "heavy_band_block", "tile_budget")
    randomized = True
    takes_segments = True  # every implementation, both directions: each document as if alone (§4.6)

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """The reference (``reference.py``) first, then the tiled forms each implementation module declares for
        the direction (``dispatch.declared``): ``xla`` (portable), and the XLA:CPU implementations: bidirectional
        one, causal ``gather``, ``scores``, ``band`` (CPU, one per heavy route; ``band`` gathers in a call with a
        state), and causal ``pallas`` (the band kernel; cuda)."""
        return dispatch.declared(__package__, first=(REFERENCE,), causal=causal)

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                # bidirectional (§2.3; our encoder defaults r=7, b=32, m=96, §3)
                "bucket_size": 32,  # b: keys (and queries) per sorted block
                "num_samples": 96,  # m: sampled key columns per (batch, head); 0 = block attention only
                "num_projs": 7,  # r: hash bits
                "gray_order": "inverse",  # 'inverse' (paper, G⁻¹) | 'forward' (released code, G)
                "sampling": "ref",  # 'ref' (1/N + ‖ṽ‖/‖Ṽ‖²_op) | 'uniform'
                "residual": "sampled",  # 'sampled' | 'exact' (debug: all non-block columns = dense, O(N²))
                "power_iters": 20,
                # shared
                "fixed_projections": False,  # W from PRNGKey(lsh_seed), shared by batch, heads and calls
                "lsh_seed": 0,
                "logit_scale": 0.0,  # σ; 0 -> head_dim^-1/2
                "eval_rng_seed": 0,  # deterministic=True uses PRNGKey(eval_rng_seed)
                # execution: the implementation (a name, 'a,b' or 'auto'; module docstring)
                "impl": "auto",
                # the numeric knobs below default to dispatch.PLATFORM_DEFAULT (0): each implementation that reads
                # one declares its value per platform (xla.DEFAULTS: CPU 2^22 / 1024 / 64; GPU, TPU sized for an
                # 80 GB accelerator), resolved for the platform a call runs on; a value written here runs as written
                "tile_budget": dispatch.PLATFORM_DEFAULT,  # tiled causal: logits materialized per lax.map step
                # causal heavy logits' route of the tiled forms (xla.py): 'gather' the ≤ b_h keys of every query
                # (O(N b_h d)); 'scores': one [c, M] matmul per chunk kept only on the heavy set (same entries,
                # quadratic); 'band' (full passes; calls with a state gather): tiles of code-sorted queries against
                # blocks of code-sorted keys (same entries, as matmuls, O(N (b_h + block) d)); 'auto': 'scores'
                # while the cache has ≤ heavy_scores_max_len, else 'band' for a full pass and 'gather' for a call
                # with a state. Without ``impl``, a route here also selects that CPU implementation.
                "heavy_impl": "auto",
                "heavy_scores_max_len": dispatch.PLATFORM_DEFAULT,
                "heavy_band_block": dispatch.PLATFORM_DEFAULT,  # 'band': sorted queries per tile = keys per block
                # causal (§4)
                "causal": ml_collections.ConfigDict({
                    "chunk_size": 128,  # c
                    "local_chunks": 2,  # nl: exact window = the own chunk and nl-1 before it
                    "heavy_capacity": 64,  # b_h: most recent same-code keys before the window
                    "num_projs": 6,
                    "num_samples": 128,  # m per chunk
                    "sampling": "uniform",  # 'uniform' | 'ref'
                    "residual": "sampled",  # 'sampled' | 'exact' (debug: all non-heavy prefix keys = dense)
                }),
            }
        )

    @classmethod
    def exact_len(cls, cfg, *, causal: bool) -> int | None:
        """Causal: the exact window (``local_chunks`` chunks of ``chunk_size``) holding every key before the
        heavy set and the samples come in; bidirectional: one sorted block holding every key. The debug
        ``residual='exact'`` weighs every other key at 1: exact at every length."""
        c = cfg.causal if causal else cfg
        if c.residual == "exact":
            return None
        return cfg.causal.chunk_size * cfg.causal.local_chunks if causal else cfg.bucket_size

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = "attention.kdeformer"
        require(cfg.bucket_size > 0, f"{p}.bucket_size={cfg.bucket_size}; must be > 0")
        require(cfg.num_samples >= 0, f"{p}.num_samples={cfg.num_samples}; must be >= 0")
        require(0 <= cfg.num_projs <= 16, f"{p}.num_projs={cfg.num_projs}; must be in [0, 16]")
        require(cfg.power_iters >= 1, f"{p}.power_iters must be >= 1")
        require(cfg.logit_scale >= 0.0, f"{p}.logit_scale={cfg.logit_scale}; must be >= 0 (0 = head_dim^-1/2)")
        for key in ("tile_budget", "heavy_scores_max_len", "heavy_band_block"):
            require(cfg[key] >= 0, f"{p}.{key}={cfg[key]}; must be > 0, or 0 (dispatch.PLATFORM_DEFAULT): the "
                                   "platform's default")
        problem = dispatch.impl_problem(cfg.impl, [i.name for i in cls.implementations(causal=causal)])
        require(problem is None, f"{p}.{problem}")
        require(cfg.heavy_impl in ("auto",) + ROUTES,
                f"{p}.heavy_impl={cfg.heavy_impl!r}; allowed: auto, {', '.join(ROUTES)}")
        for key, allowed in (("gray_order", ("inverse", "forward")), ("sampling", ("ref", "uniform")),
                             ("residual", ("sampled", "exact"))):
            require(cfg[key] in allowed, f"{p}.{key}={cfg[key]!r}; allowed: {', '.join(allowed)}")
        cc = cfg.causal
        require(cc.chunk_size > 0, f"{p}.causal.chunk_size={cc.chunk_size}; must be > 0")
        require(cc.local_chunks >= 1, f"{p}.causal.local_chunks={cc.local_chunks}; must be >= 1")
        require(cc.heavy_capacity >= 0, f"{p}.causal.heavy_capacity={cc.heavy_capacity}; must be >= 0")
        require(0 <= cc.num_projs <= 12, f"{p}.causal.num_projs={cc.num_projs}; must be in [0, 12]")
        require(cc.num_samples >= 0, f"{p}.causal.num_samples={cc.num_samples}; must be >= 0")
        for key, allowed in (("sampling", ("uniform", "ref")), ("residual", ("sampled", "exact"))):
            require(cc[key] in allowed, f"{p}.causal.{key}={cc[key]!r}; allowed: {', '.join(allowed)}")

    @classmethod
    def kernel_benches(cls):
        # the band kernel against the XLA form of the same route ('band'; both take 'band' for every full pass)
        return {"kde_band": KernelBench(xla={"impl": "xla", "heavy_impl": "band"}, pallas={"impl": "pallas"},
                                        directions=("causal",)),
                # the Hopper kernels (Mosaic GPU) beside the Triton one, on a GPU only
                "kde_band_mgpu": KernelBench(xla={"impl": "xla", "heavy_impl": "band"}, pallas={"impl": "mosaic_gpu"},
                                             directions=("causal",), platforms=("cuda",))}

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        small = {"chunk_size": 8, "local_chunks": 2, "heavy_capacity": 4, "num_projs": 3, "num_samples": 8}
        return {
            "causal_uniform": ContractCase(cfg={"causal": dict(small)}, length=64, directions=("causal",)),
            # the 'band' route (the CPU default beyond heavy_scores_max_len) at a length the tests can afford
            "causal_band": ContractCase(cfg={"causal": dict(small), "impl": "band", "heavy_band_block": 8},
                                        length=64, directions=("causal",), slow=True),
            "causal_ref": ContractCase(cfg={"causal": dict(small, sampling="ref")}, length=64, directions=("causal",),
                                       slow=True),
            # the band kernel (pallas_kernels/kde_band.py) in interpret mode: full passes; calls with a state gather
            "causal_pallas": ContractCase(cfg={"causal": dict(small), "impl": "pallas", "heavy_band_block": 8},
                                          length=64, directions=("causal",), slow=True),
            "bidirectional": ContractCase(cfg={"bucket_size": 8, "num_samples": 8, "num_projs": 3}, length=64,
                                          directions=("bidirectional",)),
        }

    def __init__(self, cfg, *, num_heads, head_dim, causal, rngs, value_dim=None, platform=None):
        super().__init__(cfg, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim,
                         platform=platform)
        c = self.cfg
        scale = float(c.logit_scale) if c.logit_scale > 0 else head_dim**-0.5
        self.bidir_opts = BidirOptions(
            bucket_size=c.bucket_size, num_samples=c.num_samples, num_projs=c.num_projs, gray_order=c.gray_order,
            sampling=c.sampling, residual=c.residual, power_iters=c.power_iters, scale=scale)
        cc = c.causal
        # the execution knobs stay unresolved here: the runner that computes a call puts in its fields (a tiled
        # form that reads one left at PLATFORM_DEFAULT raises)
        self.causal_opts = CausalOptions(
            chunk_size=cc.chunk_size, local_chunks=cc.local_chunks, heavy_capacity=cc.heavy_capacity,
            num_projs=cc.num_projs, num_samples=cc.num_samples, sampling=cc.sampling, residual=cc.residual,
            power_iters=c.power_iters, scale=scale, tile_budget=dispatch.PLATFORM_DEFAULT, heavy_impl="auto",
            heavy_scores_max_len=dispatch.PLATFORM_DEFAULT, band_block=dispatch.PLATFORM_DEFAULT)

    # -- implementations -------------------------------------------------------------
    def selection_shapes(self, dtype, *, cache_len: int = 0, full_pass: bool = True) -> dict:
        """The keywords the selection hands the declarations' ``reasons`` and ``prefer`` (:meth:`prepare`'s
        ``shapes``): ``cache_len`` the keys a causal call sees (a full pass: its length rounded up to whole chunks;
        with a state: the cache's capacity), ``full_pass`` whether it has no state, and the configured
        ``heavy_scores_max_len`` (the CPU routes' ``prefer`` resolves it for the platform); the head widths and
        the configured ``heavy_band_block`` (the kernel ``pallas``'s limits, its ``reasons``)."""
        return {"dtype": dtype, "cache_len": cache_len, "full_pass": full_pass,
                "heavy_scores_max_len": self.cfg.heavy_scores_max_len, "head_dim": self.head_dim,
                "value_dim": self.value_dim, "heavy_band_block": self.cfg.heavy_band_block}

    def implementation_for(self, dtype, *, cache_len: int = 0, full_pass: bool = True) -> str:
        """The name of the implementation a call runs on the core's platform (the base class's :meth:`runner` on
        :meth:`selection_shapes`)."""
        return self.runner(**self.selection_shapes(dtype, cache_len=cache_len, full_pass=full_pass))[1].name

    # -- randomness -----------------------------------------------------------------
    def _keys(self, deterministic, key):
        if deterministic:
            key = jax.random.PRNGKey(self.cfg.eval_rng_seed)
        elif key is None:
            raise ValueError("kdeformer: deterministic=False needs a PRNG `key` (hash projections and samples)")
        return jax.random.split(key)

    def _projections(self, k_w, batch):
        r = self.causal_opts.num_projs if self.causal else self.bidir_opts.num_projs
        if self.cfg.fixed_projections:
            W = draw_projections(jax.random.PRNGKey(self.cfg.lsh_seed), 1, 1, self.head_dim, r)
            return jnp.broadcast_to(W, (batch, self.num_heads, self.head_dim, r))
        return draw_projections(k_w, batch, self.num_heads, self.head_dim, r)

    # -- contract -------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("kdeformer: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("kdeformer: init_state needs max_len (the KV / code cache capacity in tokens)")
        B, H, D, Dv = batch_size, self.num_heads, self.head_dim, self.value_dim
        return {
            "k": jnp.zeros((B, H, max_len, D), self.cache_dtype),
            "v": jnp.zeros((B, H, max_len, Dv), self.cache_dtype),
            "codes": jnp.zeros((B, H, max_len), jnp.int32),
            "proj": jnp.zeros((B, H, D, self.causal_opts.num_projs), jnp.float32),
            "length": jnp.zeros((), jnp.int32),
            "segment": jnp.zeros((B,), jnp.int32),  # the id of the document the state continues (0: none)
            "start": jnp.zeros((B,), jnp.int32),  # the cache position of that document's first token
        }

    def prepare(self, q, k, v, state, *, deterministic: bool, key, segment_ids=None):
        """The call every implementation takes: inputs ``q``, ``k``, ``v``, ``W`` (the stream's projections:
        drawn from the call's key, or the state's once its stream has begun) and ``segment_ids`` (a packed row's
        documents, or None), ``key`` the samples' key, ``state`` the carried one; the capacity of the state checked
        before any work."""
        check_segments(self, q, segment_ids)
        if v.shape[-1] != self.value_dim or q.shape[-1] != self.head_dim or q.shape[1] != self.num_heads:
            raise ValueError(f"kdeformer: expected {self.num_heads} heads, head_dim {self.head_dim}, value_dim "
                             f"{self.value_dim}; got q {q.shape}, v {v.shape}")
        k_w, k_s = self._keys(deterministic, key)
        W = self._projections(k_w, q.shape[0])
        if not self.causal:
            if state is not None:
                raise ValueError("kdeformer: a bidirectional core takes no state")
            shapes = self.selection_shapes(q.dtype)
        elif state is None:
            T, c = q.shape[2], self.causal_opts.chunk_size
            shapes = self.selection_shapes(q.dtype, cache_len=-(-T // c) * c)
        else:
            # a scanned stack's states (steps_in_stack): its layer's count and projections, the caches left there
            at = ((lambda a: jax.lax.dynamic_index_in_dim(a, state.layer, keepdims=False))
                  if isinstance(state, LayerOfStack) else (lambda a: a))
            st = state.stack if isinstance(state, LayerOfStack) else state
            T, M, length = q.shape[2], st["k"].shape[-2], at(st["length"])
            if T > M:  # static: more new tokens than the whole state holds
                raise CapacityError(CAPACITY_MESSAGE.format(capacity=M, needed=T))
            check_capacity(length + T, M, CAPACITY_MESSAGE)  # eager, or a host callback under jit
            W = jnp.where(length > 0, at(st["proj"]), W)  # the stream keeps its first call's projections
            shapes = self.selection_shapes(q.dtype, cache_len=M, full_pass=False)
        inputs = {"q": q, "k": k, "v": v, "W": W, "segment_ids": segment_ids}
        return dispatch.Call(inputs, state, key=k_s), shapes

    def finish(self, call: dispatch.Call, result: dispatch.Result, *, aux=None):
        """The output in the values' dtype and, causal, the next state: the one the implementation wrote (the
        one-token decoding step, ``xla.one_token``), else ``common.next_state``'s."""
        x = call.inputs
        out = result.out.astype(x["v"].dtype)
        if not self.causal:
            return out, None
        if result.state is not None:
            return out, result.state
        if isinstance(call.state, LayerOfStack):  # an implementation that took the layer's state (the reference)
            return out, call.state.put(next_state(call.state.get(), x["k"], x["v"], x["W"], x["q"].dtype,
                                                  x["segment_ids"]))
        return out, next_state(call.state, x["k"], x["v"], x["W"], x["q"].dtype, x["segment_ids"],
                               cache_dtype=self.cache_dtype)

    def steps_in_stack(self, q, *, segment_ids=None, **extra) -> bool:
        """§4.4's decoding step (``common.one_token_applies``) writes its token into its layer's slot of a scanned
        stack's states and reads the caches there (``xla.one_token``)."""
        return self.causal and one_token_applies(q.shape[2], self.causal_opts)


__all__ = ["CAPACITY_MESSAGE", "REFERENCE", "ROUTES", "KDEformerAttention", "Reference"]

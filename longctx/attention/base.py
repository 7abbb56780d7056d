"""The attention-core contract shared by every method (DESIGN.md section 2).

A core maps per-head queries, keys and values to outputs and carries a ``state``
that summarizes the prefix seen so far (causal cores)::
    out, state = core(q, k, v, state=None, deterministic=True, key=None, aux=None)

    q, k: [B, H, T, Dk]    v: [B, H, T, Dv]    out: [B, H, T, Dv]

``state=None`` means "no prefix". ``core.init_state(batch_size, max_len)`` gives the
empty prefix state explicitly, with room for ``max_len`` tokens where a method's
state grows (dense KV cache); methods with constant-size state ignore ``max_len``.

Packed rows (``data.packing='segments'``): a core that declares ``takes_segments`` also takes
``segment_ids=[B, T] int32`` (the document of each of the call's tokens) and attends only within a token's
document, its carried state starting afresh at each boundary; a block passes the keyword only when it has
segment ids (:func:`segment_kwargs`), and a core without the capability refuses them in one line.

A scanned stack of layers (``model.scan_layers='on'``) decodes with the layers' states stacked on a leading axis
and carried through the scan: each layer's core gets a :class:`LayerOfStack` (the stack and its layer's index).
A core whose :meth:`AttentionCore.steps_in_stack` says so for a call reads and writes its slot of the stack
itself (a decoding step that writes one token and reads the cache by slices: nothing copied); for every other
call the block slices the layer's state out and sets the new one back (:func:`longctx.models.sequence_shard.call_core`).

Auxiliary outputs (extra losses, non-gradient statistics such as VQ codebook
counts) are reported through an optional :class:`Aux` collector, so the
two-value return of the contract holds for every method.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx.attention import dispatch
from longctx.attention.dispatch import Implementation
from longctx.errors import ConfigError


@dataclasses.dataclass
class Aux:
    """Collects a core's auxiliary outputs during one call.

    ``losses``: scalars added to the training loss (already weighted).
    ``stats``:  pytrees consumed after the optimizer step by
                ``core.apply_stats(stats)`` (non-gradient updates).
    ``metrics``: scalars only logged.
    """

    losses: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: dict[str, jax.Array] = dataclasses.field(default_factory=dict)

    def add_loss(self, name: str, value: jax.Array) -> None:
        self.losses[name] = self.losses.get(name, 0.0) + value

    def add_stats(self, name: str, value: Any) -> None:
        if name in self.stats:
            self.stats[name] = jax.tree.map(lambda a, b: a + b, self.stats[name], value)
        else:
            self.stats[name] = value

    def add_metric(self, name: str, value: jax.Array) -> None:
        self.metrics[name] = value

    def as_dict(self) -> dict[str, Any]:
        return {"losses": self.losses, "stats": self.stats, "metrics": self.metrics}


class NonGradState(nnx.Variable):
    """Variables updated outside the optimizer (e.g. EMA codebook statistics).

    The trainer splits parameters by ``nnx.Param``; this type is neither trained
    nor weight-decayed, but it is saved in checkpoints.
    """


@dataclasses.dataclass(frozen=True)
class DropIn:
    """A method's training-free setting for the quality benchmark (see ``AttentionCore.drop_in``).

    overrides: method-config overrides.  setup: optional ``(core, q, k, v, k_fit, seed) -> (q, k, v)``
    that adjusts the built core in place (e.g. fits a codebook on held-out keys ``k_fit``)."""

    description: str
    overrides: dict = dataclasses.field(default_factory=dict)
    setup: Any = None


@dataclasses.dataclass(frozen=True)
class KernelBench:
    """How ``longctx-bench kernels`` times one Pallas kernel of a method (``AttentionCore.kernel_benches``):
    config overrides that route the core through the kernel (``pallas``) and through the XLA path the
    kernel must match (``xla``), and the directions the kernel serves. Both cores are built with the same
    seed, so they hold the same parameters. ``platforms``: where the benchmark times it (None: everywhere, in
    interpret mode on a CPU; a Mosaic GPU kernel, whose CPU interpret mode simulates every copy and barrier, is
    timed on its GPU only)."""

    xla: dict
    pallas: dict
    directions: tuple[str, ...] = ("causal", "bidirectional")
    platforms: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ContractCase:
    """A small configuration at which the shared contract suite
    (``tests/attention/test_contract.py``) runs a method. A method contributes
    these through ``AttentionCore.contract_cases()``, never test code.

    cfg:        overrides of ``default_config()`` (keep shapes small: the suite compiles each once).
    length:     tokens per test sequence; long enough that every part of the carried state is
                populated, i.e. at least three blocks / chunks / levels beyond the local window.
    directions: which of ``("causal", "bidirectional")`` this case runs in.
    num_heads, head_dim, value_dim: the core's shape (value_dim None means head_dim).
    atol, rtol: fp32 tolerance of the equalities (streamed = full, decoded = full); a wrong
                implementation must not be able to meet it.
    level:      'core' (the q/k/v suite, tests/attention/test_contract.py) or 'model': the laws are
                checked on a tiny model built with the case's config (tests/models/test_model_contract.py),
                for methods whose core runs only inside their stack wrapper (``stack_wrapper``).
    """

    cfg: dict = dataclasses.field(default_factory=dict)
    length: int = 64
    directions: tuple[str, ...] = ("causal", "bidirectional")
    num_heads: int = 2
    head_dim: int = 8
    value_dim: int | None = None
    atol: float = 2e-5
    rtol: float = 2e-5
    slow: bool = False
    level: str = "core"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerOfStack:
    """One layer's carried state inside a scanned stack's: ``stack`` (every layer's state, each leaf with a leading
    layer axis) and ``layer`` (int32 scalar, traced: the scan's step). A core that steps in the stack
    (:meth:`AttentionCore.steps_in_stack`) writes and reads ``stack`` at ``layer`` itself; :meth:`get` / :meth:`put`
    are the copying form every other call takes."""

    stack: Any
    layer: Any

    def get(self):
        """The layer's state (a copy of its slot)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False), self.stack)

    def put(self, state) -> LayerOfStack:
        """The stack with the layer's slot set to ``state``."""
        return LayerOfStack(jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype),
                                                                                         self.layer, 0),
                                         self.stack, state), self.layer)


class AttentionCore(nnx.Module):
    """Base class of every attention core. Subclasses set ``name`` and implement
    ``__call__`` and ``init_state``; they validate their config in
    ``validate_config`` (raise :class:`ConfigError`)."""

    name: str = "base"
    supports_causal: bool = True
    supports_bidirectional: bool = True
    allowed_positions: tuple[str, ...] | None = None  # model.positions this core works with (None: any)
    # Uses ``key`` when ``deterministic=False`` (samples, hashes). The contract suite then checks that the
    # same key reproduces, another key differs, and that streaming with one key equals the full pass.
    randomized: bool = False
    # -- capabilities: what a core needs from its block, model and tools (asked, never its name) --
    exact: bool = False  # computes exact softmax attention: the reference benchmarks compare against
    # exact softmax attention over a sliding window of ``window`` keys (its config key): the local baseline every
    # efficient method must beat, and the local layer of a local/global pattern
    sliding_window: bool = False
    # keys a query sees at most, itself included (a sliding window: the contract checks that nothing older reaches
    # it); 0: unbounded. An instance attribute where it depends on the config.
    receptive_window: int = 0
    takes_token_mask: bool = False  # __call__ accepts mask=[B, T] bool: tokens that count in aux losses/stats
    # __call__ accepts segment_ids=[B, T] int32 (a packed row's documents): a query sees only its own document, and
    # the carried state starts afresh at every boundary (inside a call and across calls)
    takes_segments: bool = False
    # the trainer's mesh.sequence_mode='auto' takes composed states for this core (when it composes);
    # False where XLA's partitioner splits the row better (measured: README, sequence parallelism)
    sequence_compose_in_training: bool = True
    # composed states (sequence parallelism's 'compose') keep packed rows' document boundaries across the slices:
    # proven at model level against one device (tests/models/test_packed.py); a core without it runs packed rows
    # split by XLA's partitioner instead, and a composed packed call is refused in one line
    sequence_compose_packed: bool = False
    # the dtype a causal state keeps the keys and values it was given in (a KV cache): the model's compute dtype,
    # which ``attention.build`` sets (``cache_dtype``); float32 for a core built without one. Its statistics and
    # summaries stay float32 whatever it is.
    cache_dtype: Any = jnp.float32
    # -- execution: keys of default_config() that choose how the method is computed (implementation, tiles,
    # budgets), never what: they live in the config's ``execution.attention.<name>`` section, apart from the
    # model's hyperparameters, and changing one changes no result beyond floating-point rounding
    EXECUTION_KEYS: tuple[str, ...] = ()

    def __init__(
        self,
        cfg: ml_collections.ConfigDict,
        *,
        num_heads: int,
        head_dim: int,
        causal: bool,
        rngs: nnx.Rngs,
        value_dim: int | None = None,
        platform: str | None = None,
    ):
        self.cfg = ml_collections.ConfigDict(cfg.to_dict())
        # where the core runs ('cpu', 'cuda', 'rocm', 'tpu'): what its implementations are selected for, given by
        # whoever builds it (None: the default backend at build time); tests build cores for another platform
        self.platform = platform or dispatch.current_platform()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.value_dim = value_dim or head_dim
        self.causal = causal

    # -- contract -----------------------------------------------------------
    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict()

    @classmethod
    def model_config(cls) -> ml_collections.ConfigDict:
        """The hyperparameters of ``default_config()``: what the method computes (``model.attention.<name>``)."""
        c = cls.default_config()
        for key in cls.EXECUTION_KEYS:
            del c[key]
        return c

    @classmethod
    def execution_config(cls) -> ml_collections.ConfigDict:
        """The execution settings of ``default_config()`` (``execution.attention.<name>``)."""
        c = cls.default_config()
        return ml_collections.ConfigDict({key: c[key] for key in cls.EXECUTION_KEYS})

    @classmethod
    def implementations(cls, *, causal: bool = True) -> tuple:
        """The method's named implementations in order (``longctx.attention.dispatch.Implementation``), each
        with the execution settings that select it (``config``); the first is the reference every other one
        must equal (tests/attention/test_implementations.py). Default: one, the method's own code."""

        return (Implementation("reference"),)

    @classmethod
    def resolve_for_run(cls, cfg: ml_collections.ConfigDict, *, seq_len: int) -> ml_collections.ConfigDict:
        """``cfg`` with the settings that default to the run's training length (``seq_len``) filled in, for the
        config a run saves (``config.validate``). Default: unchanged."""
        return cfg

    @classmethod
    def validate_config(cls, cfg: ml_collections.ConfigDict, *, causal: bool) -> None:
        """Raise ConfigError naming what is wrong and what is allowed."""

    @classmethod
    def exact_len(cls, cfg: ml_collections.ConfigDict, *, causal: bool) -> int | None:
        """The longest row (from its start) this method computes as exact softmax attention over every key it
        sees, with ``cfg`` (its config resolved for the run): no key summarised, sampled or quantised. None where
        it is exact at every length (exact attention, a sliding window); 0 where it approximates at every length.
        The trainer notes a run whose rows are no longer (its approximation would never be trained);
        ``tests/attention/test_exact_len.py`` holds every method's value to its outputs. Default: 0."""
        return 0

    @classmethod
    def configure_for_block(cls, cfg: ml_collections.ConfigDict, *, normalizes_qk: bool,
                            d_model: int) -> ml_collections.ConfigDict:
        """Adjust the method config to the block it sits in: ``normalizes_qk`` when the block
        RMS-normalizes and scales q and k itself (the GAU); ``d_model`` the model width.
        Default: nothing to adjust."""
        return cfg

    @classmethod
    def bench_variants(cls, platform: str) -> dict[str, dict]:
        """Variants the benchmarks time on ``platform``: label suffix -> config overrides ('' is the default
        config)."""
        return {"": {}}

    @classmethod
    def kernel_benches(cls) -> dict[str, KernelBench]:
        """Pallas kernels of this method the kernels benchmark times against their XLA path: kernel name
        -> :class:`KernelBench`. Default: none."""
        return {}

    @classmethod
    def packed_refusal(cls, cfg: ml_collections.ConfigDict) -> str | None:
        """Why this method's settings ``cfg`` (its ``model.attention.<name>`` section) cannot take packed rows
        (``data.packing='segments'``), in one line, or None: config validation asks before any work. Default:
        None (a method without ``takes_segments`` is refused by :func:`segments_refusal`)."""
        return None

    @classmethod
    def drop_in(cls) -> "DropIn | None":
        """Training-free setting in which the quality benchmark compares this method with exact
        attention on the same q, k, v; None when the method has learned parts and no such setting
        (a parameter-free method runs as it is)."""
        return None

    @classmethod
    def stack_wrapper(cls, *, causal: bool) -> str | None:
        """``"module:Class"`` of a stack wrapper that replaces the backbone's plain loop over its
        blocks, for a method that acts on whole layers (DESIGN §2; VCC's compression). The wrapper
        runs the same blocks (same parameter tree); None (default): the plain loop."""
        return None

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        """Named small configurations for the shared contract suite. Every registered method
        must return at least one; each ``impl`` the method offers on CPU gets its own case."""
        return {}

    # -- the call: prepare -> select -> run -> finish, the same for every method ------------------
    def __call__(self, q, k, v, state=None, *, deterministic: bool = True, key=None, aux: Aux | None = None,
                 **extra):
        """Attention of q [B, H, T, d] over k, v (and the carried ``state``): the method's :meth:`prepare` makes the
        :class:`dispatch.Call` every implementation takes and the shapes the selection reads; :meth:`runner`
        selects an implementation for the core's platform and builds it with its settings; the runner computes a
        :class:`dispatch.Result`; :meth:`finish` turns it into ``(out, new_state)`` (and adds aux losses and
        statistics). ``extra``: the method's own keywords (``segment_ids``, ``mask``, ``key_bias``), which its
        ``prepare`` names (an unknown one is a TypeError there)."""
        check_qkv(q, k, v)
        call, shapes = self.prepare(q, k, v, state, deterministic=deterministic, key=key, **extra)
        runner, choice = self.runner(**shapes)
        result = runner(self, dataclasses.replace(call, platform=choice.platform, interpret=choice.interpret))
        return self.finish(call, result, aux=aux)

    def prepare(self, q, k, v, state, *, deterministic: bool, key, **extra) -> tuple[dispatch.Call, dict]:
        """``(call, shapes)``: the call's inputs as every implementation of the method takes them (the
        :class:`dispatch.Call`; its ``platform`` and ``interpret`` are filled in after the selection) and the
        keywords :func:`dispatch.select` hands every candidate's ``reasons`` and ``prefer``."""
        raise NotImplementedError

    def select(self, **shapes) -> dispatch.Choice:
        """The implementation a call with ``shapes`` takes on the core's platform: :func:`dispatch.select` of the
        configured ``impl`` over :meth:`implementations`. A method whose calls differ in kind may widen the
        candidates for one kind here, still through :func:`dispatch.select` (dense: a decoding step of a model
        configured with a fused kernel, which serves full passes only, takes the XLA forms)."""
        return dispatch.select(self.cfg.impl, self.implementations(causal=self.causal), method=self.name,
                               platform=self.platform, **shapes)

    def runner(self, **shapes) -> tuple[dispatch.Runner, dispatch.Choice]:
        """The implementation :meth:`select` picks for a call with ``shapes``, built with its settings as they run
        on the platform the selection ran on, and the choice."""
        choice = self.select(**shapes)
        return dispatch.built(self.implementations(causal=self.causal), choice, self.cfg), choice

    def steps_in_stack(self, q, *, segment_ids=None, **extra) -> bool:
        """Whether this call (queries ``q``, the call's keywords) takes its state as a :class:`LayerOfStack` and
        writes and reads its layer's slot of the stack in place, returning the stack (``prepare`` / ``finish``
        handle it); else the block hands it the layer's state sliced out and sets the new one back. Default:
        never."""
        return False

    def finish(self, call: dispatch.Call, result: dispatch.Result, *, aux: Aux | None = None):
        """``(out, new_state)`` from an implementation's result (a method that builds its state, or adds aux
        losses, from ``result.extras`` overrides it). Default: the output in the values' dtype and the result's
        state."""
        return result.out.astype(call.inputs["v"].dtype), result.state

    # -- sequence parallelism by composed states (longctx/models/sequence_shard.py) --------------
    def sequence_refusal(self, slice_len: int) -> str | None:
        """None when a row split into slices of ``slice_len`` tokens can run with composed states
        (``sequence_origin`` + ``compose_states``); otherwise why not. Asked of causal cores only (a
        bidirectional one carries no state). Default: not declared."""
        return "its carried state declares no composition (sequence_origin / compose_states)"

    def sequence_origin(self, batch_size: int, max_len: int, start):
        """The state from which a slice starting at absolute position ``start`` (traced int32)
        summarizes only its own tokens."""
        raise NotImplementedError

    def compose_states(self, a, b):
        """The state after ``a``'s tokens then ``b``'s (``b`` run from the origin at ``a``'s end).
        Associative; the empty state is a left identity."""
        raise NotImplementedError

    def init_state(self, batch_size: int, max_len: int | None = None):
        raise NotImplementedError

    def apply_stats(self, stats: dict[str, Any]) -> None:
        """Apply non-gradient updates from statistics gathered in ``Aux.stats``
        (summed over the global batch). Default: nothing to update."""


# -- logical axis names ---------------------------------------------------------
# Every parameter and non-gradient state of every core, block and model names its axes with
# these logical names (``out_sharding`` metadata, no eager sharding); the mesh placement lives
# only in the rules table of ``longctx/train/sharding.py``. Vocabulary:
#   'embed' (d_model), 'mlp' (hidden of the MLP), 'vocab', 'heads', 'head_dim' (per-head q/k width),
#   'value_dim' (per-head v width), 'qkv' (a fused projection's output), 'codebook', 'norm' (vectors
#   of a norm), 'position' (position tables), 'kernel_size' (conv taps), None (never sharded).
# State convention: every array leaf of a carried attention state has the batch on axis 0 (and
# the heads on axis 1 where it has heads); scalar leaves (token counters) are shared by the batch.
LOGICAL_AXES = ("embed", "mlp", "vocab", "heads", "head_dim", "value_dim", "qkv", "codebook", "norm",
                "position", "kernel_size", "layers")


def logical(init, *names):
    """Wrap an initializer so the variable it makes carries logical axis ``names``."""
    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


def axes(*names) -> dict:
    """Metadata for a variable built directly: ``nnx.Param(value, **axes('heads', None))``."""
    return {"out_sharding": tuple(names), "eager_sharding": False}


class CapacityError(ValueError):
    """A static-capacity state was given more tokens than it holds."""


_TRACED_CHECKS = contextvars.ContextVar("longctx_traced_capacity_checks", default=True)


@contextlib.contextmanager
def capacity_guaranteed_by_caller():
    """Skip the traced (host-callback) branch of :func:`check_capacity` while tracing inside this
    block: for a caller that sizes every state for the tokens it feeds by construction (the
    sequence-parallel train step) and runs where host callbacks cannot lower (a shard_map that is
    manual over some mesh axes only). Concrete checks still raise."""
    token = _TRACED_CHECKS.set(False)
    try:
        yield
    finally:
        _TRACED_CHECKS.reset(token)


def check_capacity(needed, capacity: int, message: str) -> None:
    """Refuse to overflow a static-capacity state (DESIGN §2: never drop silently).

    ``needed`` (tokens or slots the state must hold after this call) may be a Python int, a
    concrete array or a tracer. Concrete: raise :class:`CapacityError` here. Traced (under jit,
    scan, vmap): a host callback raises the same error when the compiled program runs, so the
    run stops with ``message`` instead of returning a silently different answer.
    ``message`` may use ``{needed}`` and ``{capacity}``.
    """
    if not isinstance(needed, jax.core.Tracer):
        n = int(needed) if getattr(needed, "ndim", 0) == 0 else int(max(needed.tolist() if hasattr(needed, "tolist") else needed))
        if n > capacity:
            raise CapacityError(message.format(needed=n, capacity=capacity))
        return

    if not _TRACED_CHECKS.get():
        return

    def _host(n):
        n = int(jax.numpy.max(n)) if getattr(n, "ndim", 0) else int(n)
        if n > capacity:
            raise CapacityError(message.format(needed=n, capacity=capacity))

    jax.debug.callback(_host, needed)


def require(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond holds."""
    if not cond:
        raise ConfigError(message)


def segments_refusal(method: str) -> str:
    """The one line a method without ``takes_segments`` answers packed rows with."""
    return f"{method}: packed rows (data.packing='segments') are not supported yet; use data.packing='document'"


def document_starts(segment_ids):
    """int32 [B, T]: the row position of the first token of each token's document in a packed row (a document is a
    maximal run of equal segment ids: an id that comes back after another is a new document). Methods whose
    packed form restarts every index at a document's first token count from it."""
    T = segment_ids.shape[1]
    at = jnp.arange(T, dtype=jnp.int32)
    opens = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return jax.lax.cummax(jnp.where(opens, at, 0), axis=1)


def continues_state(state_segment, segment_ids):
    """bool [B, T]: the tokens of a packed call that continue the document its carried state summarizes: the
    call's leading run of tokens whose id equals ``state_segment`` [B] int32 (the id of the state's document; 0 for
    ``init_state``'s and after calls without segment ids, whose tokens count as id 0: a packed call whose first id
    is 0 continues them, as the KV caches' runs of equal ids do, and continuing an empty state is starting afresh).
    Every other document of the call starts afresh, whatever its id. A causal core that carries state across
    packed calls returns the state of the call's last document, with that document's id (``segment_ids[:, -1]``)
    as the state's ``segment``."""
    same = segment_ids == state_segment[:, None]
    return jax.lax.cummin(same.astype(jnp.int32), axis=1).astype(bool)


def check_segments(core, q, segment_ids) -> None:
    """Refuse ``segment_ids`` where ``core`` does not take them (:class:`ConfigError`, one line), and check their
    shape [B, T] against q [B, H, T, D]. None: nothing to check."""
    if segment_ids is None:
        return
    if not core.takes_segments:
        raise ConfigError(segments_refusal(core.name))
    if segment_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"{core.name}: segment_ids {segment_ids.shape} must be [batch, length] = "
                         f"{(q.shape[0], q.shape[2])}")


def segment_kwargs(core, segment_ids) -> dict:
    """The keyword a block hands ``core`` for ``segment_ids``: none without them; a one-line
    :class:`ConfigError` (:func:`segments_refusal`) where the core does not take them."""
    if segment_ids is None:
        return {}
    if not core.takes_segments:
        raise ConfigError(segments_refusal(core.name))
    return {"segment_ids": segment_ids}


def check_qkv(q, k, v) -> None:
    """Shape checks shared by all cores (trace-time, so free under jit)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, heads, length, dim]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"q, k, v disagree on batch/heads/length: {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")

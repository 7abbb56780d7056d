"""The dense core: configuration, implementations, the KV-cache state, and the call (``AttentionCore.__call__``):
``prepare`` builds the inputs every implementation takes (the cache's keys and values then the call's, with their
positions: :func:`prepared_call`), ``select`` picks the implementation (:func:`select_for`, :func:`choose`:
``dispatch.select`` with a named fused kernel's KV-cache rule), the base builds its runner, ``finish`` builds the new
KV cache.
:func:`attend` runs the same path without a core (exact attention for other code).

The state is a KV cache of fixed capacity (``init_state(batch, max_len)``), a ring: slot s of a cache of capacity M
that has seen ``length`` tokens holds the newest position p < ``length`` with p = s (mod M) (:func:`slot_positions`;
empty, zeros, while p < 0). A decoding step (one token, with or without segment ids) writes the token into its
slot and attends to the written cache, so XLA writes it in place into a donated state (a read of the state before
the write, or a shifted cache, copies the whole cache every token); a call of several tokens attends to the cache
in position order and then the call's keys (:func:`in_order`), as the cache's keys before the call's.
Feeding more than ``max_len`` tokens in total raises :class:`CapacityError` (under jit too), unless
``kv_window=True`` names the sliding-window cache as a feature: then the cache keeps the newest ``max_len`` keys and
older ones are dropped by design (Transformer-XL-style memory, not exact attention). The state is the layer's
(the keys and values it was given), the same whichever implementation attends.

A sliding window W > 0 (:attr:`DenseAttention.window`; the method of ``sliding.py``, 0 here) is exact attention
over the keys fewer than W positions away (causal: itself and the W - 1 before it) in training, evaluation and
decoding alike, on every implementation (the tiles skip the key blocks wholly outside it; cuDNN and splash take
their own local masks). Its decoding state is the window (``init_state`` holds W keys whatever ``max_len``): a
bounded state that drops only keys no later query can see.

Packed rows (``segment_ids`` [B, T] int32, ``data.packing='segments'``): a query sees only the keys of its own
document (``takes_segments``), on every implementation that serves them (the reference's mask, the tiles'
position-general loop, splash's ``SegmentIds``, cuDNN's packed layout on Hopper up to ``auto_threshold`` scores,
past which 'auto' takes the tiles on a GPU: ``platform.cudnn_packed_attention``). The KV
cache keeps each key's segment id beside it (``state['segment_ids']`` [B, M], in the keys' slots; 0 where the call
had none), so a window or a decoding step carried across a document boundary starts that document
afresh: the keys of earlier documents stay in the cache but no later query sees them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections

from longctx.attention import dispatch
from longctx.attention.base import (
    AttentionCore,
    ContractCase,
    DropIn,
    LayerOfStack,
    check_capacity,
    check_segments,
    require,
)
from longctx.attention.dense import platform as kernels
from longctx.attention.dense.reference import naive_attention

METHOD = "dense"


def slot_positions(length, M: int):
    """[M] int32: the position slot s of a ring cache of capacity M holds after ``length`` tokens, the newest
    p < length with p = s (mod M); < 0 where the slot is still empty."""
    s = jnp.arange(M, dtype=jnp.int32)
    return length - 1 - jnp.mod(length - 1 - s, M)


def in_order(x, length, axis: int):
    """A ring cache's slots in position order, the oldest first: slot j of the result holds position
    ``length - M + j`` (:func:`slot_positions`; < 0: empty)."""
    return jnp.roll(x, -jnp.mod(length, x.shape[axis]), axis=axis)


def to_ring(x, length, axis: int):
    """The inverse of :func:`in_order`: keys in position order (the last at ``length - 1``) into their slots."""
    return jnp.roll(x, jnp.mod(length, x.shape[axis]), axis=axis)


@dataclasses.dataclass(frozen=True)
class Reference(dispatch.Runner):
    """The reference's runner: :func:`naive_attention` of ``call.inputs`` (dense's ``prepare``). ``auto_threshold``
    is the knob of its declaration (the Tq*Tk up to which 'auto' prefers the one softmax, ``_short_rows``): the
    selection reads it before the call (:func:`select_for`); the computation does not."""

    auto_threshold: int

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        k, v, k_pos, k_valid, k_seg = x["k"], x["v"], x["k_pos"], x["k_valid"], x["k_segment_ids"]
        if x.get("layer") is not None:  # a decoding step in a scanned stack's cache: the layer's slot
            k, v = (jax.lax.dynamic_index_in_dim(a, x["layer"], keepdims=False) for a in (k, v))
        if "written" in x and k_seg is not None:  # a packed decoding step's ring: the keys in position order (its
            order = jnp.argsort(k_pos)  # documents are runs of ids in that order; the query's key is the newest)
            k, v, k_pos, k_valid, k_seg = (jnp.take(a, order, axis=a.ndim - (2 if a.ndim == 4 else 1))
                                           for a in (k, v, k_pos, k_valid, k_seg))
        return dispatch.Result(naive_attention(x["q"], k, v, x["q_pos"], k_pos, k_valid,
                                               causal=x["causal"], window=x["window"],
                                               q_segment_ids=x["q_segment_ids"], k_segment_ids=k_seg))


def _short_rows(platform: str, *, large: bool = False, narrow_window: bool = False, one_query: bool = False,
                **_) -> bool:
    """'auto' takes the reference's one softmax up to auto_threshold scores (Tq*Tk), the tiles past it, and the
    tiles too for a sliding window that leaves key blocks out (``narrow_window``: the tiles skip them, the one
    softmax would score every key) and for a decoding step (``one_query``: the tiles read the cache in place,
    ``xla.one_query_attention``)."""
    return not (large or narrow_window or one_query)


# 'auto' on every platform: last, for the calls the tiles are not preferred for (Tq*Tk <= auto_threshold, the
# reference's limit: it materialises the [Tq, Tk] scores). On a CPU the tuned tiles overtake it near 512 tokens
# (`longctx-bench compare --measure --methods dense --contexts 256,512,1k --seeds 1 --nohybrids --needle ''`, with
# and without `--config.execution.attention.dense.impl=xla_cpu`; a shared 2-core machine): a training update of
# 2 x 1024 tokens (4 layers, 2 heads of 32) took 0.74 s with the tiles against 2.18 s with the one softmax, at 512
# tokens 0.44 s against 0.41 s, at 256 0.30 s against 0.20 s. Not yet measured on a GPU or TPU.
REFERENCE = dispatch.Implementation("reference", config={"impl": "reference"},
                                    auto={p: 3 for p in dispatch.ALL_PLATFORMS}, prefer=_short_rows, code=Reference,
                                    defaults={"auto_threshold": {"default": 4096 * 4096, "cpu": 512 * 512}})


@functools.lru_cache(maxsize=None)  # the declarations are module constants: collected once
def implementations(causal: bool | None = None):
    """dense's implementations, the reference first, then each implementation module's declarations
    (``dispatch.declared``), the platforms' fused kernels last (``DenseAttention.implementations``)."""
    impls = dispatch.declared(__package__, first=(REFERENCE,), causal=causal)
    return tuple(sorted(impls, key=lambda i: i.name in kernels.FAST_IMPLS))  # stable: declared order otherwise


def _xla_forms(impls, platform: str, **shapes) -> tuple[str, ...]:
    """The 'auto' list on ``platform`` without the fused kernels: the tiles once Tq*Tk exceeds auto_threshold
    (``large``; on a CPU its tuned form first), else the reference's one softmax."""
    return tuple(n for n in dispatch.auto_order(impls, platform, **shapes) if n not in kernels.FAST_IMPLS)


def choose(impl, *, dtype, head_dim: int, value_dim: int | None = None, kv_cache: bool = False, large: bool = False,
           k_dtype=None, v_dtype=None, platform: str, sequence_slice: int | None = None,
           causal: bool = True, window: int = 0, segments: bool = False, narrow_window: bool = False,
           one_query: bool = False) -> dispatch.Choice:
    """The implementation of one dense call: ``dispatch.select`` over :func:`implementations` ('auto': the
    declarations' order on the platform; ``large``: Tq*Tk > auto_threshold; ``sequence_slice``: the tokens per
    device where the row is split over the mesh's ``sequence`` axis, which a fused kernel may refuse: 'auto' then
    takes the XLA path with one log line, a kernel named alone raises). A KV-cache step (``kv_cache``) is no
    call for a fused kernel (their declarations' reasons say so): the candidates of a list that names one are the
    list and then the 'auto' list without the kernels, so the selection passes the kernel over for the rest of the
    list, or for the XLA forms (one log line, the selection's), unless it cannot serve even a full pass here and
    nothing else is named (then the error lists its reasons). ``segments``: a packed row (segment ids), which cuDNN
    serves through its packed layout where ``platform.cudnn_packed_reasons`` has none (Hopper, not ``large``).
    ``narrow_window``: a sliding window of at most half the keys, for which 'auto' prefers the tiles (they skip the
    key blocks outside it) as it does for ``large`` calls, and ``one_query``: a KV-cache step of one query (a
    decoding step), for which 'auto' prefers the tiles too (they read the cache in place)."""
    plat = platform
    impls = implementations()
    table = dispatch.by_name(impls)
    names = dispatch.parse_impl(impl)
    shapes = dict(dtype=dtype, head_dim=head_dim, value_dim=value_dim, k_dtype=k_dtype, v_dtype=v_dtype,
                  causal=causal, window=window)
    if segments:
        shapes.update(segments=True)
    if narrow_window:
        shapes.update(narrow_window=True)
    if one_query:
        shapes.update(one_query=True)
    if sequence_slice is not None:
        shapes.update(sequence_slice=sequence_slice)
    if kv_cache and names != ("auto",) and set(names) & set(kernels.FAST_IMPLS):
        if set(names) <= set(kernels.FAST_IMPLS):  # the kernels alone: each must serve this model's full passes
            for n in names:
                cand = table[n]
                static = cand.unsupported_reasons("interpret" if cand.kernel and plat == "cpu" else plat, **shapes)
                if static:
                    raise dispatch.KernelUnsupportedError(
                        f"{METHOD}: impl={impl!r} cannot use {kernels.KERNEL_NAMES[n]} on {plat}: "
                        + "; ".join(static + [kernels.KV_CACHE_REASON])
                        + ". Use impl='auto' (falls back to the XLA path) or impl='reference' / 'blockwise'.")
            names += _xla_forms(impls, plat, kv_cache=kv_cache, large=large, **shapes)
    try:
        return dispatch.select(",".join(names), impls, method=METHOD, platform=plat, kv_cache=kv_cache, large=large,
                               **shapes)
    except dispatch.KernelUnsupportedError as e:
        raise dispatch.KernelUnsupportedError(f"{e}. Use impl='auto' (falls back to the XLA path) or "
                                              "impl='reference' / 'blockwise'.") from None


def prepared_call(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, full_pass: bool, window: int, q_segment_ids,
                  k_segment_ids, state=None, layer=None) -> tuple[dispatch.Call, dict]:
    """``(call, shapes)`` of one dense call: the :class:`dispatch.Call` every implementation takes (``inputs``: q, k,
    v, ``q_pos``, ``k_pos``, ``k_valid``, ``q_segment_ids``, ``k_segment_ids``, ``full_pass``, ``window``, ``causal``,
    ``layer`` and ``mesh``: the mesh whose ``sequence`` axis splits a full pass's row, ``platform.active_sequence_mesh``,
    or None) and the keywords of :func:`select_runner` (those of :func:`choose`, with ``scores`` = Tq*Tk in place of
    ``large``). ``layer`` (int32, a decoding step in a scanned stack's cache): k and v are every layer's caches
    [L, B, H, M, .] and the call attends to this layer's; None: k, v are the call's [B, H, Tk, .]."""
    mesh = kernels.active_sequence_mesh(q.shape[2]) if full_pass else None
    split = None if mesh is None else q.shape[2] // mesh.shape[kernels.SEQUENCE_AXIS]
    inputs = dict(q=q, k=k, v=v, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, q_segment_ids=q_segment_ids,
                  k_segment_ids=k_segment_ids, full_pass=full_pass, window=window, causal=causal, mesh=mesh, layer=layer)
    shapes = dict(dtype=q.dtype, k_dtype=k.dtype, v_dtype=v.dtype, head_dim=q.shape[-1], value_dim=v.shape[-1],
                  kv_cache=not full_pass, scores=q.shape[2] * k.shape[-2], keys=k.shape[-2], sequence_slice=split,
                  causal=causal,
                  window=window, segments=q_segment_ids is not None)
    return dispatch.Call(inputs, state), shapes


def select_for(impl, cfg, platform: str, *, scores: int, keys: int | None = None, **shapes) -> dispatch.Choice:
    """The :func:`choose` choice of one dense call for ``impl``, ``shapes``, ``large`` = ``scores`` past
    ``cfg['auto_threshold']`` as it runs on ``platform`` (the reference's declared default) and ``narrow_window``
    = a sliding window (``shapes['window']``) of at most half the call's ``keys``; ``one_query`` = a KV-cache call
    of one query (``scores`` = ``keys``)."""
    large = scores > REFERENCE.setting("auto_threshold", cfg["auto_threshold"], platform)
    window = shapes.get("window", 0)
    narrow = bool(window) and keys is not None and 2 * window <= keys
    one = bool(shapes.get("kv_cache")) and keys is not None and scores == keys
    return choose(impl, platform=platform, large=large, narrow_window=narrow, one_query=one, **shapes)


def select_runner(impl, cfg, platform: str, **shapes) -> tuple[dispatch.Runner, dispatch.Choice]:
    """The runner of one dense call without a core (its declaration's ``code`` built from ``cfg``, the execution
    settings, for the selection's platform) and the :func:`select_for` choice."""
    choice = select_for(impl, cfg, platform, **shapes)
    return dispatch.built(implementations(), choice, cfg), choice


def attend(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, impl, block_q: int, block_k: int, auto_threshold: int,
           full_pass: bool = False, platform: str, window: int = 0, q_segment_ids=None,
           k_segment_ids=None):
    """Exact attention of q [B,H,Tq,D], k, v [B,H,Tk,.] with explicit positions, by the implementation
    :func:`choose` picks for ``impl`` on ``platform``, run through its declaration's runner (the path the core
    takes: :func:`prepared_call`, :func:`select_runner`; no core needed). ``full_pass`` (static): q_pos = k_pos =
    arange(T) and every key valid (no cache): the fused kernels and the unrolled tiles serve only that. A full pass
    traced with its row split over a mesh's ``sequence`` axis (``platform.sequence_mesh``, or jax's ambient mesh)
    runs a fused kernel in a ``shard_map`` over the mesh (``platform.sequence_parallel_attention``); the XLA paths
    are left to the partitioner. ``window`` > 0: a sliding window of that many keys (the reference's
    ``positions_mask``). ``q_segment_ids`` [B, Tq] / ``k_segment_ids`` [B, Tk]: a packed row's documents (a query
    sees only its own document's keys; None: one document)."""
    call, shapes = prepared_call(q, k, v, q_pos, k_pos, k_valid, causal=causal, full_pass=full_pass, window=window,
                                 q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids)
    settings = {"block_q": block_q, "block_k": block_k, "auto_threshold": auto_threshold}
    runner, choice = select_runner(impl, settings, platform, **shapes)
    return runner(None, dataclasses.replace(call, platform=choice.platform, interpret=choice.interpret)).out


class DenseAttention(AttentionCore):
    """Exact softmax attention; causal state = fixed-capacity KV cache."""

    name = "dense"
    exact = True
    takes_segments = True
    # composed KV caches are exact but attend each slice to a whole-row buffer without the causal
    # skip; XLA's partitioner splits the queries and gathers K/V instead, which plans a fraction of the
    # temporaries per device (compare both with `--dry_run` and mesh.sequence > 1)
    sequence_compose_in_training = False
    sequence_compose_packed = True  # the cache keeps every key's segment id (tests/models/test_packed.py)
    EXECUTION_KEYS = ("impl", "block_q", "block_k", "auto_threshold")

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """reference (one masked softmax), blockwise (the portable tiled online softmax, ``xla.py``), the XLA:CPU
        implementation (the same tiles with XLA:CPU's ops, its own file), cudnn (GPU) and splash (TPU; interpret
        mode on CPU) for full passes (``platform.py``). ``impl='auto'``: the platform's fused kernel where it serves
        the call, else once Tq*Tk > auto_threshold the tiles (the CPU-tuned ones first on a CPU), else reference;
        each implementation's file declares where 'auto' takes it."""
        return implementations(causal=causal)

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                # 'reference' | 'blockwise' | the XLA:CPU tiles (named in their own file) | 'cudnn'
                # (GPU) | 'splash' (TPU), a list of them ('cudnn,blockwise'), or 'auto': the platform's fused kernel
                # where it serves the call, else the tiles when Tq*Tk > auto_threshold (the CPU-tuned ones on a
                # CPU), else reference
                "impl": "auto",
                # query / key block sizes of the tiles, and the Tq*Tk past which 'auto' takes the tiles: 0 = the
                # platform's default, declared beside the implementation that reads it (xla.py, xla_cpu.py, the
                # reference above)
                "block_q": 0,
                "block_k": 0,
                "auto_threshold": 0,
                # False: the KV cache is exact and refuses to overflow. True: a sliding window of the
                # newest init_state(max_len) keys (older keys are dropped on purpose).
                "kv_window": False,
            }
        )

    @classmethod
    def exact_len(cls, cfg, *, causal: bool) -> None:
        """Exact attention at every length (a sliding window: over the keys it sees)."""
        return None

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        allowed = tuple(i.name for i in implementations())
        problem = dispatch.impl_problem(cfg.impl, allowed)
        require(problem is None, f"attention.dense.{problem}")
        require(cfg.block_q >= 0 and cfg.block_k >= 0,
                "attention.dense.block_q/block_k must be positive (0: the platform's default)")
        require(cfg.auto_threshold >= 0, "attention.dense.auto_threshold must be positive (0: the platform's default)")

    @classmethod
    def bench_variants(cls, platform: str):
        """naive: the reference; blockwise: the platform's tiled form ('auto''s first for long rows: the CPU-tuned
        tiles on a CPU); its fused kernel by name (an error, never a fallback, where it refuses)."""
        plat = platform
        impls = implementations()
        tiles = _xla_forms(impls, plat, large=True)
        out = {"naive": {"impl": "reference"}, "blockwise": {"impl": tiles[0]}}
        for kernel in [n for n in dispatch.auto_order(impls, plat, large=True) if n in kernels.FAST_IMPLS][:1]:
            out[kernel] = {"impl": kernel}
        return out

    @classmethod
    def drop_in(cls):
        return DropIn("parameter-free: used as is")

    @classmethod
    def contract_cases(cls):
        tiles = {"block_q": 8, "block_k": 8}
        # each tiled implementation (blockwise, the CPU-tuned tiles: the declarations with small test tiles), causal
        tiled = {i.name: ContractCase(cfg={**i.config, **i.test_config}, length=40, directions=("causal",))
                 for i in implementations() if i.test_config}
        return {
            "reference": ContractCase(cfg={"impl": "reference"}, length=40),
            **tiled,
            "blockwise_bidirectional": ContractCase(cfg={"impl": "blockwise", **tiles}, length=40,
                                                    directions=("bidirectional",), slow=True),
            # the TPU kernel in Pallas interpret mode: full passes by splash, KV-cache steps by the XLA path
            "splash": ContractCase(cfg={"impl": "splash"}, length=40),
        }

    @property
    def window(self) -> int:
        """The sliding window W of keys a query sees (0: the whole row): none for exact attention; the sliding-window
        core (``sliding.py``) has one."""
        return 0

    @property
    def receptive_window(self) -> int:
        return self.window

    def init_state(self, batch_size: int, max_len: int | None = None):
        """The empty KV cache: ``max_len`` keys, or with a sliding window the window's (whatever ``max_len``), and
        their segment ids (0: no packed row)."""
        if not self.causal:
            raise ValueError("dense: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("dense: init_state needs max_len (the KV-cache capacity in tokens)")
        if self.window:
            max_len = self.window
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        return {
            "k": jnp.zeros((batch_size, H, max_len, D), self.cache_dtype),
            "v": jnp.zeros((batch_size, H, max_len, Dv), self.cache_dtype),
            "segment_ids": jnp.zeros((batch_size, max_len), jnp.int32),
            "length": jnp.zeros((), jnp.int32),
        }

    # -- sequence parallelism: the KV cache composes by concatenation --------------------------
    def sequence_refusal(self, slice_len: int) -> str | None:
        if self.cfg.kv_window:
            return "kv_window=True keeps only the newest max_len keys; composition needs the whole cache"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return {**self.init_state(batch_size, max_len), "length": jnp.asarray(start, jnp.int32)}

    def compose_states(self, a, b):
        # both caches are rings (slot_positions); b began at a's length and holds its own tokens only: a slot
        # whose newest position after b is one of b's takes b's key, the others keep a's (each the newest of its
        # slot before b, still within the newest M: an exact concatenation; a window's state keeps the newest M)
        M = a["k"].shape[2]
        from_b = slot_positions(b["length"], M) >= a["length"]
        pick = lambda x, y, at: jnp.where(at, y, x)  # noqa: E731
        return {"k": pick(a["k"], b["k"], from_b[:, None]), "v": pick(a["v"], b["v"], from_b[:, None]),
                "segment_ids": pick(a["segment_ids"], b["segment_ids"], from_b), "length": b["length"]}

    # -- the call: prepare -> select -> run -> finish (AttentionCore.__call__) --------------------------------
    def prepare(self, q, k, v, state, *, deterministic, key, segment_ids=None):
        """The call's inputs (:func:`prepared_call`): a full pass (no state) over the row, or the KV cache's keys and
        values then the call's, with their absolute positions (module docstring). ``segment_ids`` [B, T] int32
        (optional): the documents of a packed row; a query sees only its own document's keys, in the call and in
        the cache."""
        check_segments(self, q, segment_ids)
        T = q.shape[2]
        pos = jnp.arange(T, dtype=jnp.int32)
        seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
        common = dict(causal=self.causal, window=self.window, q_segment_ids=seg, state=state)
        if state is None:
            return prepared_call(q, k, v, pos, pos, jnp.ones((T,), bool), full_pass=True, k_segment_ids=seg, **common)
        if not self.causal:
            raise ValueError("dense: a bidirectional core takes no state")
        layer = None
        if isinstance(state, LayerOfStack):  # a decoding step in a scanned stack's caches (steps_in_stack)
            layer, state = state.layer, state.stack
            common.update(state=state)
        M = state["k"].shape[-2]
        length = state["length"] if layer is None else state["length"][layer]
        if k.shape[-1] != state["k"].shape[-1] or v.shape[-1] != state["v"].shape[-1]:
            raise ValueError(f"dense: keys of width {k.shape[-1]} and values of width {v.shape[-1]} for a KV cache "
                             f"of widths {state['k'].shape[-1]} and {state['v'].shape[-1]}")
        if not (self.cfg.kv_window or self.window):  # a window's state holds every key a later query sees
            check_capacity(length + T, M, "dense: the KV cache holds {capacity} tokens (init_state max_len) but "
                           "{needed} were fed; build it with a larger max_len, or set attention.dense.kv_window=True "
                           "for a sliding window that drops the oldest keys")
        q_pos = length + pos
        if self._writes_first(T, seg):  # the token into its slot, then the written cache (module docstring)
            written = self._written(state, k, v, jnp.zeros((q.shape[0], 1), jnp.int32) if seg is None else seg,
                                    length, layer)
            k_pos = slot_positions(length + 1, M)
            k_seg = None  # a packed call's keys' ids in their slots (the layer's: a small copy of int32 ids)
            if seg is not None:
                k_seg = written["segment_ids"] if layer is None else jax.lax.dynamic_index_in_dim(
                    written["segment_ids"], layer, keepdims=False)
            # the cache as stored (cache_dtype, float32 for a core built alone): each implementation casts what it
            # reads to the compute dtype (q's), the tiles block by block; a whole-cache cast here would be a copy of
            # the cache every token
            call, shapes = prepared_call(q, written["k"], written["v"], q_pos, k_pos, k_pos >= 0, full_pass=False,
                                         k_segment_ids=k_seg, layer=layer, **common)
            call.inputs.update(written=written, out_dtype=v.dtype)
            return call, shapes
        if layer is not None:
            raise ValueError("dense: only a decoding step takes a scanned stack's caches (steps_in_stack)")
        k_pos = jnp.concatenate([length - M + jnp.arange(M, dtype=jnp.int32), q_pos])
        k_all = jnp.concatenate([in_order(state["k"], length, 2).astype(q.dtype), k], axis=2)
        v_all = jnp.concatenate([in_order(state["v"], length, 2).astype(v.dtype), v], axis=2)
        k_seg = None if seg is None else self._cache_segments(state, seg)
        return prepared_call(q, k_all, v_all, q_pos, k_pos, k_pos >= 0, full_pass=False, k_segment_ids=k_seg, **common)

    def _writes_first(self, T: int, seg) -> bool:
        """Whether a call of T tokens after a state writes them into the cache before attending: one token (with
        segment ids too: the keys of its document are those after the newest key of another id, whatever their
        slots), its cache exact or the window's (``kv_window``'s query sees the M cached keys and itself: the slot
        it would overwrite)."""
        return T == 1 and not self.cfg.kv_window

    def steps_in_stack(self, q, *, segment_ids=None, **extra) -> bool:
        """A decoding step (:meth:`_writes_first`) writes its token into its layer's slot of a scanned stack's
        caches and attends to them there."""
        return self.causal and self._writes_first(q.shape[2], segment_ids)

    @staticmethod
    def _written(state, k, v, seg, length, layer=None):
        """``state`` with one token's key, value and segment id written into its slot (``length``: the tokens the
        cache has seen); ``layer``: ``state`` is a scanned stack's caches and the token goes into that layer's."""
        M = state["k"].shape[-2]
        slot = jnp.mod(length, M)

        def put(a, x):  # x: the token's [B, H, 1, .] key or value, or its [B, 1] segment id
            at = (0, 0, slot, 0) if x.ndim == 4 else (0, slot)
            if layer is not None:
                x, at = x[None], (layer, *at)
            return jax.lax.dynamic_update_slice(a, x.astype(a.dtype), at)

        new_length = length + 1 if layer is None else state["length"].at[layer].set(length + 1)
        return {"k": put(state["k"], k), "v": put(state["v"], v), "segment_ids": put(state["segment_ids"], seg),
                "length": new_length}

    def select(self, **shapes):
        """:func:`select_for`: the base's selection, with :func:`choose`'s KV-cache rule for a named fused kernel
        and ``auto_threshold`` resolved for the platform."""
        return select_for(self.cfg.impl, self.cfg, self.platform, **shapes)

    @staticmethod
    def _cache_segments(state, kept):
        """The segment ids of the cache's keys in position order then the call's (``kept``: the call's, or zeros
        without a packed row)."""
        return jnp.concatenate([in_order(state["segment_ids"], state["length"], 1), kept], axis=1)

    def finish(self, call, result, *, aux=None):
        """The output and the new KV cache (None for a bidirectional core): the keys and values the layer was given,
        with their segment ids (0 where the call had none), in their ring slots (a decoding step's: the cache it
        wrote, ``prepare``); a window's state keeps the newest W."""
        x, state = call.inputs, call.state
        q = x["q"]
        T = q.shape[2]
        seg = x["q_segment_ids"]
        kept_seg = jnp.zeros((q.shape[0], T), jnp.int32) if seg is None else seg  # what the cache keeps
        if state is None:
            if not self.causal:
                return result.out, None
            k, v = x["k"], x["v"]
            W = self.window
            if W:  # the window's state: the newest W keys (zeros before the first), in their slots
                edge = lambda a: jnp.pad(a, ((0, 0), (0, 0), (max(W - T, 0), 0), (0, 0)))[:, :, -W:]  # noqa: E731
                k, v = to_ring(edge(k), T, 2), to_ring(edge(v), T, 2)
                kept_seg = to_ring(jnp.pad(kept_seg, ((0, 0), (max(W - T, 0), 0)))[:, -W:], T, 1)
            return result.out, {"k": k.astype(self.cache_dtype), "v": v.astype(self.cache_dtype),
                                "segment_ids": kept_seg, "length": jnp.asarray(T, jnp.int32)}
        if "written" in x:
            written = x["written"] if x["layer"] is None else LayerOfStack(x["written"], x["layer"])
            return result.out.astype(x["out_dtype"]), written
        M, length = state["k"].shape[2], state["length"] + T
        seg_all = self._cache_segments(state, kept_seg)
        return result.out, {
            "k": to_ring(x["k"][:, :, -M:], length, 2).astype(state["k"].dtype),
            "v": to_ring(x["v"][:, :, -M:], length, 2).astype(state["v"].dtype),
            "segment_ids": to_ring(seg_all[:, -M:], length, 1),
            "length": length,
        }


__all__ = ["REFERENCE", "DenseAttention", "Reference", "attend", "choose", "implementations", "prepared_call",
           "select_runner"]

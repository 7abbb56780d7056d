"""Sequence (context) parallelism: one long row split over the ``sequence`` mesh axis.

Device ``i`` of the ``sequence`` axis holds tokens ``[i*T/D, (i+1)*T/D)`` of every row, so the
activations of a row too long for one device are spread over ``D`` devices. The prefix state a
device needs is the carried attention state of all tokens before its slice. Two ways to get it:

* ``compose`` (every core of the model declares state composition,
  ``AttentionCore.sequence_refusal``): layer by layer, each device summarizes its own slice, the
  summaries are combined by a prefix scan over the devices (``1 + ceil(log2 D)`` ``ppermute``
  exchanges) and each slice runs from its prefix (``longctx/models/sequence_shard.py``): one extra
  state summary per slice and layer, whatever ``D``.
* ``ring`` (any causal model): states are passed around the ring: in round ``r`` every device runs
  its slice from the state it holds and sends the resulting state to its right neighbour; device
  ``i``'s input state is exact from round ``i`` on. ``D`` rounds: the ring buys memory, not time.

``mode='auto'`` takes ``compose`` where every core accepts the slice length, else ``ring``
(:func:`plan` says why). Autodiff goes through the exchanges, so gradients are exact either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from longctx.attention import AttentionCore
from longctx.attention.base import capacity_guaranteed_by_caller
from longctx.attention.row_split import sequence_mesh
from longctx.errors import ConfigError
from longctx.models.sequence_shard import SequenceShard, refusal

AXIS = "sequence"
MODES = ("auto", "compose", "ring")


def attention_cores(model) -> list[AttentionCore]:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, AttentionCore)]


def plan(model, slice_len: int, mode: str = "auto") -> tuple[str, list[str]]:
    """(the mode that runs, the reasons ``compose`` is refused: one line per refusing core)."""
    if mode not in MODES:
        raise ValueError(f"sequence parallelism: mode={mode!r}; allowed: {', '.join(MODES)}")
    reasons = []
    for core in attention_cores(model):
        why = refusal(core, slice_len)
        if why is not None and f"{core.name}: {why}" not in reasons:
            reasons.append(f"{core.name}: {why}")
    if getattr(model, "stack", None) is not None:
        reasons.append("the model's blocks run inside a stack wrapper")
    if mode == "compose" and reasons:
        raise ValueError("sequence parallelism: mode='compose' refused: " + "; ".join(reasons))
    if mode == "auto":
        mode = "ring" if reasons else "compose"
    return mode, reasons


def _ring_shift(tree, n: int):
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), tree)


def hidden(graphdef, variables, tokens, mesh, *, max_len: int | None = None, mode: str = "auto"):
    """Deterministic final hidden states [B, T, d] of ``tokens`` [B, T] with the row split over
    ``mesh``'s ``sequence`` axis (T divisible by its size). ``variables``: ``nnx.split`` state of the
    model (replicated). Equals ``model.hidden(tokens)`` up to float rounding."""
    D = mesh.shape[AXIS]
    B, T = tokens.shape
    if T % D:
        raise ValueError(f"sequence parallelism: the row length {T} must be divisible by mesh.sequence={D}")
    n, cap = T // D, max_len or T
    mode, _ = plan(nnx.merge(graphdef, variables), n, mode)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P(None, AXIS),
                       check_vma=False)
    def run(variables, local):
        model = nnx.merge(graphdef, variables)
        me = jax.lax.axis_index(AXIS)
        if mode == "compose":
            shard = SequenceShard(axis=AXIS, size=D, batch_size=B, slice_len=n, max_len=cap)
            state = {"pos": (me * n).astype(jnp.int32), "layers": [shard] * len(model.blocks)}
            return model.hidden(local, state, deterministic=True)[0]
        empty = model.init_state(B, cap)
        state = empty
        out = None
        for r in range(D):
            h, new_state, _ = model.hidden(local, state, deterministic=True)
            out = h if out is None else jnp.where(me == r, h, out)
            if r + 1 < D:
                received = _ring_shift(new_state, D)
                state = jax.tree.map(lambda e, x: jnp.where(me == 0, e, x), empty, received)
        return out

    return run(variables, tokens)


TRAIN_MODES = ("auto", "compose", "xla")


def packed_refusals(model) -> list[str]:
    """Why composed states cannot split a packed row (``data.packing='segments'``): one line per core that does not
    declare ``sequence_compose_packed``."""
    out = []
    for core in attention_cores(model):
        line = (f"{core.name}: its composed states are not proven to keep packed rows' document boundaries "
                "(sequence_compose_packed)")
        if not core.sequence_compose_packed and line not in out:
            out.append(line)
    return out


def train_plan(model, mesh, window, mode: str = "auto", *, packed: bool = False) -> str:
    """How the train step splits a row over ``mesh.sequence`` (``window``: the row length the step
    sees, or a tuple of them): 'compose' (the composed-state hook of
    :func:`make_hidden`) or 'xla' (tokens constrained to the axis, XLA's partitioner moves the data).
    'auto' takes 'compose' for a causal model whose cores all compose; 'compose' where they do not is
    a ConfigError naming each core and its reason. 'auto' also takes 'xla' where a core says the
    partitioner splits it better (``AttentionCore.sequence_compose_in_training``). ``packed``: the rows are packed
    documents, which compose only where every core declares ``sequence_compose_packed`` (:func:`packed_refusals`)."""

    return train_decision(model, mesh, window, mode, packed=packed)[0]


def train_decision(model, mesh, window, mode: str = "auto", *, packed: bool = False) -> tuple[str, str]:
    """:func:`train_plan`'s mode and, in a few words, why (what the trainer's start line says)."""
    if mode not in TRAIN_MODES:
        raise ConfigError(f"mesh.sequence_mode={mode!r}; allowed: {', '.join(TRAIN_MODES)}")
    if mesh is None or mesh.shape[AXIS] == 1:
        return "xla", "one device on the sequence axis: nothing to split"
    if mode == "xla":
        return "xla", "mesh.sequence_mode='xla'"
    reasons = []
    for length in ((window,) if isinstance(window, int) else window):  # every row length the step sees
        reasons += [r for r in plan(model, length // mesh.shape[AXIS])[1] if r not in reasons]
    if packed:
        reasons += [r for r in packed_refusals(model) if r not in reasons]
    if mode == "auto" and not reasons:
        prefer_xla = sorted({c.name for c in attention_cores(model) if not c.sequence_compose_in_training})
        if prefer_xla:  # e.g. exact attention: the partitioner's split of the queries is the better one
            return "xla", (f"auto: XLA's partitioner splits {', '.join(prefer_xla)} with less memory than composed "
                           "states")
    if reasons and mode == "compose":
        raise ConfigError("mesh.sequence_mode='compose' cannot run: " + "; ".join(reasons)
                          + " (use mesh.sequence_mode=auto or xla)")
    if reasons:
        return "xla", "auto: " + "; ".join(reasons)
    return "compose", f"{mode}: every layer's state composes"


def train_hidden(model, mesh, *, window, seq_len: int, mode: str = "auto", fold_key: bool = True,
                 packed: bool = False):
    """(the mode, the ``hidden`` hook for ``make_train_step`` or None): what the trainer calls
    (``window``: the row length(s) the step sees, ``seq_len``: the longest, which sizes the states; ``packed``:
    packed rows, :func:`train_plan`)."""
    mode = train_plan(model, mesh, window, mode, packed=packed)
    if mode == "compose":
        return mode, make_hidden(mesh, seq_len, fold_key=fold_key)
    return mode, (xla_hidden(mesh) if mesh is not None and mesh.shape[AXIS] > 1 else None)


def xla_hidden(mesh):
    """``model.hidden`` traced with the row split over ``mesh.sequence`` by XLA's partitioner (mode 'xla'), under
    ``longctx.attention.row_split.sequence_mesh``: a fused attention kernel (a custom call the partitioner
    cannot split along the row) runs in a ``shard_map`` over the mesh; everything else is unchanged."""

    def hidden(model, tokens, state=None, **kw):
        with sequence_mesh(mesh):
            return model.hidden(tokens, state, **kw)

    return hidden


def make_hidden(mesh, max_len: int, *, fold_key: bool = True):
    """``hidden(model, tokens, state, *, deterministic, key, positions=None, segment_ids=None) -> (h, new_state,
    aux)`` for the train step, equal to ``model.hidden`` with the row split over ``mesh.sequence`` by composed
    states. Packed rows (``positions`` / ``segment_ids`` [B, T], ``data.packing='segments'``) are split with the
    tokens: each device's slice reads its own positions, and the composed prefix keeps every key's segment id
    (a core's state does where it takes segment ids), so no document sees another across the slices.
    Only ``sequence`` is manual inside (``shard_map(axis_names={'sequence'})``): the batch and the
    parameters keep their data/fsdp/tensor shardings. ``fold_key``: the key is folded with the device
    index, so dropout masks differ between slices (False: every slice gets the step's key, which
    reproduces the single-device step exactly where randomness is keyed by absolute position, as
    per-chunk samples keyed by the chunk index are, and dropout is off; with dropout on, masks would
    repeat per slice);
    aux losses and metrics are averaged over the devices (equal token counts), statistics summed;
    the new state is the last device's."""
    D = mesh.shape[AXIS]

    def hidden(model, tokens, state=None, *, deterministic: bool = True, key=None, positions=None,
               segment_ids=None):
        B, T = tokens.shape
        n = T // D
        if T % D or T > (max_len or T):
            raise ValueError(f"sequence parallelism: a window of {T} tokens over mesh.sequence={D} with states "
                             f"for {max_len} tokens")
        if segment_ids is not None and packed_refusals(model):
            raise ConfigError("sequence parallelism by composed states cannot split packed rows: "
                              + "; ".join(packed_refusals(model)) + " (use mesh.sequence_mode=xla)")
        graphdef, variables = nnx.split(model)
        has_key = key is not None
        packed = {name: x for name, x in (("positions", positions), ("segment_ids", segment_ids)) if x is not None}

        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, AXIS), P(), P(), P(None, AXIS)),
                           out_specs=(P(None, AXIS), P(), P()), axis_names={AXIS}, check_vma=False)
        def run(variables, local, state, key, packed):
            model = nnx.merge(graphdef, variables)
            me = jax.lax.axis_index(AXIS)
            offset = jnp.zeros((), jnp.int32) if state is None else state["pos"]
            layers = [None] * len(model.blocks) if state is None else state["layers"]
            shards = [SequenceShard(axis=AXIS, size=D, batch_size=B, slice_len=n, max_len=max_len or T,
                                    initial=st, offset=offset) for st in layers]
            with capacity_guaranteed_by_caller():  # states sized for max_len >= offset + T by the step
                h, new_state, aux = model.hidden(local, {"pos": offset + me * n, "layers": shards},
                                                 deterministic=deterministic,
                                                 key=(jax.random.fold_in(key, me) if fold_key else key)
                                                 if has_key else None, **packed)
            last = me == D - 1
            new_state = jax.tree.map(lambda x: jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), AXIS),
                                     {**new_state, "pos": offset + T})
            aux = {"losses": jax.tree.map(lambda x: jax.lax.pmean(x, AXIS), aux["losses"]),
                   "stats": jax.tree.map(lambda x: jax.lax.psum(x, AXIS), aux["stats"]),
                   "metrics": jax.tree.map(lambda x: jax.lax.pmean(x, AXIS), aux["metrics"])}
            return h, new_state, aux

        return run(variables, tokens, state, key if has_key else jnp.zeros((), jnp.uint32), packed)

    return hidden

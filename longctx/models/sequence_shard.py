"""Sequence parallelism by composed states: the per-layer hook, generic over cores (DESIGN §5).

A row split over a mesh axis of size ``D`` puts tokens ``[i*n, (i+1)*n)`` on device ``i``. A core
whose causal carried state *composes* declares three capabilities (``AttentionCore``):

* ``sequence_refusal(slice_len)``: ``None`` when it can run this way with slices of ``slice_len``
  tokens, else the reason (the default: it declares no composition);
* ``sequence_origin(batch_size, max_len, start)``: the state from which a slice that starts at
  absolute position ``start`` summarizes *only its own tokens* (an empty state, placed at
  ``start`` where the state is indexed by absolute position);
* ``compose_states(a, b)``: the state after the tokens of ``a`` then those of ``b`` (``b`` run
  from the origin at ``a``'s end); associative, with the empty state as a left identity.

Then one layer on device ``i`` is: run the slice from its origin (its *delta* state; the output is
discarded), shift the deltas one device to the right, take an inclusive prefix scan with
``compose_states`` over the devices (``ceil(log2 D)`` ``ppermute`` exchanges, Hillis-Steele, as
MaxText's context-parallel gated delta net does), and run the slice once more from the composed
prefix. The first run's attention output is unused, so XLA drops it: what each slice pays extra per
layer is its state summary and the exchanges. The layers stay exact, since the layer above sees
exact activations; autodiff goes through the exchanges, so gradients are exact too.

The hook is selected by the layer state: a block that receives a :class:`SequenceShard` in place
of a carried state calls :func:`call_core`, which does the above. Outside ``shard_map`` nothing
changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longctx.attention.base import LayerOfStack


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceShard:
    """Stands for a layer's state inside ``shard_map`` over ``axis`` (``size`` devices, each holding
    ``slice_len`` tokens of every row; states sized for ``max_len`` tokens). ``initial``: the layer's
    state before the row (None: empty); ``offset``: the absolute position of the row's first token."""

    axis: str
    size: int
    batch_size: int
    slice_len: int
    max_len: int
    initial: object = None
    offset: object = 0


def _shift(tree, axis: str, size: int, offset: int):
    """Device i receives device i-offset's leaves (zeros where i < offset)."""
    perm = [(i, i + offset) for i in range(size - offset)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def exclusive_prefix(core, delta, shard: SequenceShard):
    """Device i's prefix state: ``compose(initial, delta_0, ..., delta_{i-1})`` (``initial``: the
    shard's, else the empty state)."""
    me = jax.lax.axis_index(shard.axis)
    first = core.init_state(shard.batch_size, shard.max_len) if shard.initial is None else shard.initial
    acc = _select(me == 0, first, _shift(delta, shard.axis, shard.size, 1))
    offset = 1
    while offset < shard.size:
        received = _shift(acc, shard.axis, shard.size, offset)
        acc = _select(me >= offset, core.compose_states(received, acc), acc)
        offset *= 2
    return acc


def refusal(core, slice_len: int) -> str | None:
    """Why ``core`` cannot run this way with slices of ``slice_len`` tokens (None: it can)."""
    if not core.causal:
        return "bidirectional attention carries no state"
    return core.sequence_refusal(slice_len)


def call_core(core, q, k, v, state, **kwargs):
    """``core(q, k, v, state, **kwargs)``; with a :class:`SequenceShard` as ``state``, the composed
    sequence-parallel call described in the module docstring; with a :class:`LayerOfStack` (a scanned stack's
    decoding state), the core's own step in the stack where it takes one (``core.steps_in_stack``), else the
    layer's state sliced out, the call, and its new state set back."""
    if isinstance(state, LayerOfStack):
        extra = {name: val for name, val in kwargs.items() if name not in ("deterministic", "key", "aux")}
        if core.steps_in_stack(q, **extra):
            return core(q, k, v, state, **kwargs)
        out, new = core(q, k, v, state.get(), **kwargs)
        return out, state.put(new)
    if not isinstance(state, SequenceShard):
        return core(q, k, v, state, **kwargs)
    reason = refusal(core, state.slice_len)
    if reason is not None:
        raise ValueError(f"{core.name}: cannot run sequence-parallel by composed states: {reason}")
    if q.shape[2] != state.slice_len:
        raise ValueError(f"sequence parallelism: a slice of {q.shape[2]} tokens, expected {state.slice_len}")
    me = jax.lax.axis_index(state.axis)
    origin = core.sequence_origin(state.batch_size, state.max_len, state.offset + me * state.slice_len)
    delta_kwargs = {name: val for name, val in kwargs.items() if name != "aux"}  # no losses/stats twice
    _, delta = core(q, k, v, origin, **delta_kwargs)
    prefix = exclusive_prefix(core, delta, state)
    return core(q, k, v, prefix, **kwargs)


__all__ = ["SequenceShard", "call_core", "exclusive_prefix", "refusal"]

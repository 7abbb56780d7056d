"""Sequence (context) parallelism: one long row split over the ``sequence`` mesh axis.

Device ``i`` of the ``sequence`` axis holds tokens ``[i*T/D, (i+1)*T/D)`` of every row, so the
activations of a row too long for one device are spread over ``D`` devices. The prefix state a
device needs is the carried attention state (``model.init_state``) of all tokens before its
slice. This module composes it generically, for every causal method and block type, by passing
states around the ring: in round ``r`` every device runs its slice from the state it holds and
sends the resulting state to its right neighbour (``ppermute``); device ``i``'s input state is
exact from round ``i`` on, and its output of that round is kept. ``D`` rounds, ``D - 1`` state
exchanges; autodiff goes through the exchanges, so gradients are exact too.

Cost: every device computes its slice ``D`` times, so the ring buys memory (activations and
KV split ``D`` ways), not time. Methods whose state summaries compose associatively (VQ cache
sums and counts, EVA chunk summaries, FMA level summaries, KV concatenation) can replace the
ring by a prefix scan over devices (``log2 D`` exchanges, each slice computed twice); that
composition is per method and not written yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

AXIS = "sequence"


def _ring_shift(tree, n: int):
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), tree)


def hidden(graphdef, variables, tokens, mesh, *, max_len: int | None = None):
    """Deterministic final hidden states [B, T, d] of ``tokens`` [B, T] with the row split over
    ``mesh``'s ``sequence`` axis (T divisible by its size). ``variables``: ``nnx.split`` state of the
    model (replicated). Equals ``model.hidden(tokens)`` up to float rounding."""
    D = mesh.shape[AXIS]
    B, T = tokens.shape
    if T % D:
        raise ValueError(f"sequence parallelism: the row length {T} must be divisible by mesh.sequence={D}")
    cap = max_len or T

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P(None, AXIS),
                       check_vma=False)
    def run(variables, local):
        model = nnx.merge(graphdef, variables)
        me = jax.lax.axis_index(AXIS)
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

"""Which mesh splits the rows of the call being traced (``mesh.sequence_mode='xla'``): the train step names it
(:func:`sequence_mesh`) and an attention implementation that cannot be split by XLA's partitioner (a fused
kernel: a custom call) asks for it (:func:`active_sequence_mesh`) to run itself in a ``shard_map`` over it."""

from __future__ import annotations

import contextlib
import contextvars

import jax

SEQUENCE_AXIS = "sequence"  # the mesh axis a row is split over (longctx.train.sequence_parallel.AXIS)
_SEQUENCE_MESH: contextvars.ContextVar = contextvars.ContextVar("longctx_sequence_mesh", default=None)


@contextlib.contextmanager
def sequence_mesh(mesh):
    """Within: full passes are traced with their rows split over ``mesh``'s ``sequence`` axis (the train
    step's ``mesh.sequence_mode='xla'``), so a fused kernel runs in a ``shard_map`` over ``mesh``
    (exact attention's cuDNN and splash paths do)."""
    token = _SEQUENCE_MESH.set(mesh)
    try:
        yield
    finally:
        _SEQUENCE_MESH.reset(token)


def active_sequence_mesh(seq_len: int):
    """The mesh splitting a row of ``seq_len`` tokens over its ``sequence`` axis in the call being traced, or None:
    the one :func:`sequence_mesh` names, else jax's ambient mesh (``jax.set_mesh``); None where the axis has size
    1, does not divide ``seq_len``, or is already manual (inside a ``shard_map`` over it)."""
    mesh = _SEQUENCE_MESH.get()
    ambient = jax.sharding.get_abstract_mesh()
    if mesh is None and not ambient.empty:
        mesh = ambient
    if mesh is None or SEQUENCE_AXIS not in mesh.axis_names:
        return None
    n = mesh.shape[SEQUENCE_AXIS]
    if n == 1 or seq_len % n or SEQUENCE_AXIS in getattr(ambient, "manual_axes", ()):
        return None
    return mesh


__all__ = ["SEQUENCE_AXIS", "active_sequence_mesh", "sequence_mesh"]

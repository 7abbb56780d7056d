"""Which mesh splits the rows of the call being traced (``mesh.sequence_mode='xla'``): the train step names it
(:func:`sequence_mesh`) and an attention implementation that cannot be split by XLA's partitioner (a fused
kernel: a custom call) asks for it (:func:`active_sequence_mesh`) to run itself in a ``shard_map`` over it.

A kernel that runs per shard of the batch and heads (the rows over ``data`` x ``fsdp``, the heads over
``tensor``, as the activations are) asks :func:`active_mesh` for the mesh of the call being traced and
:func:`batch_heads_specs` for the ``PartitionSpec`` entries of those two dimensions."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import numpy as np

BATCH_AXES = ("data", "fsdp")  # the activations' row axes (longctx.train.sharding.BATCH_AXES)
HEADS_AXES = ("tensor",)  # the heads axis
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


def active_mesh(*arrays):
    """The mesh the call being traced runs on, for a kernel run per shard of the batch and heads: the one
    :func:`sequence_mesh` names, else jax's ambient mesh, else the mesh the traced ``arrays``' types carry (a jit
    whose inputs are placed on a mesh). None where there is none or none of its batch / heads axes
    (:data:`BATCH_AXES`, :data:`HEADS_AXES`) has size > 1 and is not already manual."""
    mesh = _SEQUENCE_MESH.get()
    ambient = jax.sharding.get_abstract_mesh()
    if mesh is None and not ambient.empty:
        mesh = ambient
    for x in arrays if mesh is None else ():
        if isinstance(x, jax.core.Tracer):
            m = getattr(jax.typeof(x).sharding, "mesh", None)
            if m is not None and not m.empty:
                mesh = m
                break
    if mesh is None:
        return None
    manual = set(getattr(ambient, "manual_axes", ()))
    if not any(a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual for a in BATCH_AXES + HEADS_AXES):
        return None
    return mesh


def _axes_entry(mesh, names, size: int):
    manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual)
    count = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or size % count:
        return None
    return axes[0] if len(axes) == 1 else axes


def batch_heads_specs(mesh, batch: int, heads: int):
    """The ``PartitionSpec`` entries (rows, heads) of a [batch, heads, ...] operand in a ``shard_map`` over
    ``mesh``: the batch axes and the heads axis of size > 1, each None where its product does not divide the
    dimension (that dimension is then whole on every device)."""
    return _axes_entry(mesh, BATCH_AXES, batch), _axes_entry(mesh, HEADS_AXES, heads)


__all__ = ["BATCH_AXES", "HEADS_AXES", "SEQUENCE_AXIS", "active_mesh", "active_sequence_mesh", "batch_heads_specs",
           "sequence_mesh"]

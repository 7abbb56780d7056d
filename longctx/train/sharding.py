"""Device mesh and shardings (data parallelism across devices and hosts).

The mesh has axes ('data', 'fsdp', 'tensor'); ``mesh.data = -1`` takes every
device. Parameters, optimizer and model state are replicated; the batch is split
over 'data'. Under jit the global-batch reductions (loss means, VQ codebook
statistics) are therefore global sums, with no explicit psum.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.errors import ConfigError


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    data = mesh_cfg.data if mesh_cfg.data > 0 else len(devices) // (mesh_cfg.fsdp * mesh_cfg.tensor)
    shape = (data, mesh_cfg.fsdp, mesh_cfg.tensor)
    if int(np.prod(shape)) != len(devices):
        raise ConfigError(f"mesh {shape} (data, fsdp, tensor) does not use the {len(devices)} available devices")
    return Mesh(np.asarray(devices).reshape(shape), ("data", "fsdp", "tensor"))


def replicate(mesh: Mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def shard_batch(mesh: Mesh, array: np.ndarray):
    """Global batch [B, ...] split over the data axis (B must divide evenly)."""
    n = mesh.shape["data"]
    if array.shape[0] % n:
        raise ConfigError(f"train.batch_size={array.shape[0]} must be a multiple of the {n} data-parallel devices")
    sharding = NamedSharding(mesh, P("data"))
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_process_local_data(sharding, array)

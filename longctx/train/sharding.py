"""Device mesh, logical-axis rules and shardings (DESIGN §5).

The mesh has four axes, ``('data', 'fsdp', 'tensor', 'sequence')`` (sizes may be 1;
``mesh.data = -1`` takes the devices the other axes leave). Every parameter and
non-gradient variable names its logical axes (``longctx.attention.base.LOGICAL_AXES``);
the rules below map those names to mesh axes, and this table is the only place that
knows mesh placement:

* parameters and optimizer moments: ``embed`` over ``fsdp`` (ZeRO-3 style: each device holds
  a slice, XLA all-gathers for the matmul), ``mlp`` / ``qkv`` / ``heads`` / ``vocab`` over
  ``tensor`` (Megatron-style split of the projections);
* the batch: rows over ``('data', 'fsdp')``; inside the step the token axis of the inputs is
  constrained to ``sequence`` (XLA's SPMD partitioner inserts the communication a method's
  computation needs along the row).

A logical axis whose mesh axes do not divide the dimension is a ConfigError naming the
variable, its dimension and the mesh axis. ``mesh.rules`` overrides rules with
``"name=axis,name=axis+axis,name="`` (empty: never sharded).

Under jit the global-batch reductions (loss means, VQ codebook statistics) are global sums
whatever the mesh, with no explicit psum.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.errors import ConfigError

AXES = ("data", "fsdp", "tensor", "sequence")
BATCH_AXES = ("data", "fsdp")

# logical name -> mesh axes (a tuple; () = replicated)
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "qkv": ("tensor",),
    "heads": ("tensor",),
    "vocab": ("tensor",),
    "value_dim": (),
    "head_dim": (),
    "codebook": (),
    "norm": (),
    "position": (),
    "kernel_size": (),
    "layers": (),
}


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    sizes = {a: int(mesh_cfg.get(a, 1)) for a in AXES}
    for a in AXES[1:]:
        if sizes[a] < 1:
            raise ConfigError(f"mesh.{a}={sizes[a]} must be >= 1")
    rest = sizes["fsdp"] * sizes["tensor"] * sizes["sequence"]
    if sizes["data"] <= 0:
        if n_devices % rest:
            raise ConfigError(f"mesh fsdp*tensor*sequence = {rest} does not divide the {n_devices} devices")
        sizes["data"] = n_devices // rest
    shape = tuple(sizes[a] for a in AXES)
    if int(np.prod(shape)) != n_devices:
        raise ConfigError(f"mesh {shape} {AXES} uses {int(np.prod(shape))} devices; {n_devices} are available")
    return shape


def device_grid(mesh_cfg, devices) -> np.ndarray:
    """``devices`` (in ``jax.devices()`` order: a multi-process job lists process 0's first) as the
    mesh's array of shape (data, fsdp, tensor, sequence), the last axis varying fastest: an axis
    crosses the process boundary where its size times the sizes of the axes after it exceeds the
    devices of one process (e.g. sequence 8 over 2 processes x 4 devices; not data 2 x sequence 4)."""
    devices = list(devices)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return grid.reshape(mesh_shape(mesh_cfg, len(devices)))


def check_layout(cfg, n_devices: int, *, here: bool = True) -> None:
    """Refuse, before any work, a batch the batch-parallel devices (mesh.data x mesh.fsdp) do not divide and, where
    the job runs ``here`` (the trainer), a mesh that does not use the ``n_devices`` devices (what :func:`make_mesh`
    and :func:`shard_batch` would refuse once the data is prepared and the model built). ``here=False``
    (``--check`` of a config meant for another machine): the batch against the mesh as configured, its
    ``mesh.data=-1`` filled from ``n_devices`` where they divide."""
    if here:
        shape = dict(zip(AXES, mesh_shape(cfg.mesh, n_devices)))
    else:
        shape = {a: int(cfg.mesh.get(a, 1)) for a in AXES}
        rest = shape["fsdp"] * shape["tensor"] * shape["sequence"]
        if shape["data"] <= 0:
            if rest <= 0 or n_devices % rest:
                return
            shape["data"] = n_devices // rest
    dp = shape["data"] * shape["fsdp"]
    if cfg.train.batch_size % dp:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be a multiple of the {dp} batch-parallel "
                          f"devices (mesh.data={shape['data']} x mesh.fsdp={shape['fsdp']}"
                          + (f" of {n_devices} devices)" if here else ")"))


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    return Mesh(device_grid(mesh_cfg, jax.devices() if devices is None else devices), AXES)


def parse_rules(text: str) -> dict[str, tuple[str, ...]]:
    """``"embed=fsdp,mlp=tensor+sequence,vocab="`` -> rules over DEFAULT_RULES."""
    rules = dict(DEFAULT_RULES)
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        if "=" not in item:
            raise ConfigError(f"mesh.rules item {item!r}: expected name=axis[+axis] (axis one of {', '.join(AXES)})")
        name, _, rhs = item.partition("=")
        if name not in DEFAULT_RULES:
            raise ConfigError(f"mesh.rules: unknown logical axis {name!r}; allowed: {', '.join(DEFAULT_RULES)}")
        axes = tuple(a for a in rhs.split("+") if a)
        for a in axes:
            if a not in AXES:
                raise ConfigError(f"mesh.rules: {name}={rhs}: unknown mesh axis {a!r}; allowed: {', '.join(AXES)}")
        rules[name] = axes
    return rules


def _spec_for(var_path: str, names, shape, mesh: Mesh, rules) -> P:
    parts, used = [], set()
    for dim, name in zip(shape, names):
        axes = tuple(a for a in rules.get(name, ()) if mesh.shape[a] > 1 and a not in used) if name else ()
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if dim % size:
            raise ConfigError(
                f"{var_path}: dimension {name!r} of size {dim} is not divisible by mesh axes "
                f"{'x'.join(axes)} = {size}; change the mesh or the model size, or map {name!r} elsewhere in mesh.rules")
        used.update(axes)
        parts.append(axes if len(axes) > 1 else (axes[0] if axes else None))
    return P(*parts)


def state_specs(state, mesh: Mesh, rules=None):
    """PartitionSpec per variable of an ``nnx.State`` of annotated variables: the same tree, each
    variable holding its spec (so optimizer states built from the params match it)."""
    rules = DEFAULT_RULES if rules is None else rules

    def one(path, var):
        pstr = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if not isinstance(var, nnx.Variable):
            if getattr(var, "ndim", 0) == 0:
                return P()
            raise ConfigError(f"{pstr}: an array that is not an annotated variable")
        names = var.get_metadata().get("out_sharding")
        value = var.get_value()
        if names is None:
            if getattr(value, "ndim", 0) == 0:
                return var.replace(P())
            raise ConfigError(f"{pstr}: variable has no logical axis names (see longctx.attention.base.axes)")
        return var.replace(_spec_for(pstr, names, value.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def opt_state_specs(tx: optax.GradientTransformation, opt_state, param_specs):
    """Optimizer moments follow their parameters; counters and other leaves are replicated."""
    return optax.tree_map_params(tx, lambda _, spec: spec, opt_state, param_specs,
                                 transform_non_params=lambda _: P())


class Plan:
    """Shardings of everything a train step touches, for one mesh and one set of rules."""

    def __init__(self, mesh: Mesh, params, nongrad, rest, tx=None, opt_state=None, rules=None):
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.params = named(mesh, state_specs(params, mesh, self.rules))
        self.nongrad = named(mesh, state_specs(nongrad, mesh, self.rules))
        self.rest = replicated(mesh, rest)
        self.opt_state = None
        if opt_state is not None:
            pspecs = state_specs(params, mesh, self.rules)
            self.opt_state = named(mesh, opt_state_specs(tx, opt_state, pspecs))
        self.batch = NamedSharding(mesh, P(BATCH_AXES))
        self.scalar = NamedSharding(mesh, P())

    def constrain(self, x):
        """Token arrays inside the step: rows over the batch axes, tokens over 'sequence'."""
        return constrain_tokens(x, self.mesh)

    def jit_step(self, step_fn, *, donate: bool = True):
        """jax.jit of ``step(params, nongrad, rest, opt_state, tokens, key) -> (params, nongrad, opt_state,
        metrics)`` with explicit in/out shardings (metrics replicated)."""
        return jax.jit(step_fn,
                       in_shardings=(self.params, self.nongrad, self.rest, self.opt_state, self.batch, self.scalar),
                       out_shardings=(self.params, self.nongrad, self.opt_state, self.scalar),
                       donate_argnums=(0, 1, 3) if donate else ())

    def put(self, params, nongrad, rest, opt_state=None):
        out = (jax.device_put(params, self.params), jax.device_put(nongrad, self.nongrad),
               jax.device_put(rest, self.rest))
        if opt_state is not None:
            out = out + (jax.device_put(opt_state, self.opt_state),)
        return out


def replicated(mesh: Mesh, tree):
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def replicate(mesh: Mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def shard_batch(mesh: Mesh, array: np.ndarray):
    """Global batch [B, ...] split over the batch axes (data x fsdp); B must divide evenly."""
    n = data_parallel_size(mesh)
    rows = array.shape[0] * n // _local_batch_groups(mesh)  # this process's share (host_shard) of the rows
    if rows % n:
        raise ConfigError(f"train.batch_size={rows} must be a multiple of the {n} batch-parallel devices "
                          "(mesh.data x mesh.fsdp)")
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_process_local_data(sharding, array, (rows, *array.shape[1:]))


def _local_batch_groups(mesh: Mesh) -> int:
    """How many positions of the batch axes (data x fsdp) this process's devices take."""
    me = jax.process_index()
    return len({idx[:2] for idx in np.ndindex(mesh.devices.shape) if mesh.devices[idx].process_index == me})


def host_shard(mesh: Mesh, batch_size: int) -> tuple[int, int]:
    """(k, n): this process holds rows [k * B / n, (k + 1) * B / n) of every global batch of ``batch_size``
    rows split over the batch axes -- the slice its batcher reads. (0, 1) in a single-process job, and
    where each process's devices hold every row (e.g. data 1 x sequence 8 over two processes: the
    processes then hold different tokens of the same rows). Processes may share a slice (n below the
    number of processes)."""
    n = jax.process_count()
    if n == 1:
        return 0, 1
    dp = data_parallel_size(mesh)
    if batch_size % dp:
        raise ConfigError(f"train.batch_size={batch_size} must be a multiple of the {dp} batch-parallel devices "
                          "(mesh.data x mesh.fsdp)")
    index = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map((batch_size,))
    rows = sorted({(sl[0].start or 0, batch_size if sl[0].stop is None else sl[0].stop) for sl in index.values()})
    lo, hi = rows[0][0], rows[-1][1]
    covered = sum(b - a for a, b in rows)
    if covered != hi - lo or batch_size % (hi - lo) or lo % (hi - lo):
        raise ConfigError(f"the mesh gives process {jax.process_index()} rows {rows} of each batch, not one equal "
                          f"contiguous share of {batch_size} rows; order the mesh's batch axes by process")
    return lo // (hi - lo), batch_size // (hi - lo)


def constrain_tokens(x, mesh: Mesh | None):
    """Inside a jitted step: [B, T] (or [B, T, ...]) activations split rows over the batch axes
    and tokens over 'sequence'. No-op without a mesh or with sequence = 1 and batch axes = 1."""
    if mesh is None:
        return x
    seq = "sequence" if mesh.shape["sequence"] > 1 and x.shape[1] % mesh.shape["sequence"] == 0 else None
    spec = P(BATCH_AXES, seq, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def is_sharded(array) -> bool:
    """True when no single device holds the whole array."""
    shard = array.addressable_shards[0].data
    return shard.shape != array.shape

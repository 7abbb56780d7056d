"""The attention-core contract shared by every method (DESIGN.md section 2).

A core maps per-head queries, keys and values to outputs and carries a ``state``
that summarizes the prefix seen so far (causal cores)::

    out, state = core(q, k, v, state=None, deterministic=True, key=None, aux=None)

    q, k: [B, H, T, Dk]    v: [B, H, T, Dv]    out: [B, H, T, Dv]

``state=None`` means "no prefix". ``core.init_state(batch_size, max_len)`` gives the
empty prefix state explicitly, with room for ``max_len`` tokens where a method's
state grows (dense KV cache); methods with constant-size state ignore ``max_len``.

Auxiliary outputs (extra losses, non-gradient statistics such as VQ codebook
counts) are reported through an optional :class:`Aux` collector, so the
two-value return of the contract holds for every method.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
from flax import nnx

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


class AttentionCore(nnx.Module):
    """Base class of every attention core. Subclasses set ``name`` and implement
    ``__call__`` and ``init_state``; they validate their config in
    ``validate_config`` (raise :class:`ConfigError`)."""

    name: str = "base"
    supports_causal: bool = True
    supports_bidirectional: bool = True
    allowed_positions: tuple[str, ...] | None = None  # model.positions this core works with (None: any)

    def __init__(
        self,
        cfg: ml_collections.ConfigDict,
        *,
        num_heads: int,
        head_dim: int,
        causal: bool,
        rngs: nnx.Rngs,
        value_dim: int | None = None,
    ):
        self.cfg = ml_collections.ConfigDict(cfg.to_dict())
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.value_dim = value_dim or head_dim
        self.causal = causal

    # -- contract -----------------------------------------------------------
    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict()

    @classmethod
    def validate_config(cls, cfg: ml_collections.ConfigDict, *, causal: bool) -> None:
        """Raise ConfigError naming what is wrong and what is allowed."""

    def __call__(self, q, k, v, state=None, *, deterministic: bool = True, key=None, aux: Aux | None = None):
        raise NotImplementedError

    def init_state(self, batch_size: int, max_len: int | None = None):
        raise NotImplementedError

    def apply_stats(self, stats: dict[str, Any]) -> None:
        """Apply non-gradient updates from statistics gathered in ``Aux.stats``
        (summed over the global batch). Default: nothing to update."""


def require(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond holds."""
    if not cond:
        raise ConfigError(message)


def check_qkv(q, k, v) -> None:
    """Shape checks shared by all cores (trace-time, so free under jit)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, heads, length, dim]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"q, k, v disagree on batch/heads/length: {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")

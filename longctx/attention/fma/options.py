"""The static options every FMA implementation reads, and the length rule (docs/methods/fma.md §2.6)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

RING = 4  # finished groups kept per level (the decoding state): a query in group a reads a-2, a-3; the lagged query
# row a-1


@dataclasses.dataclass(frozen=True)
class FMAOptions:
    """Static (hashable) options of the pure functions."""

    causal: bool
    m: int
    p: int
    L: int  # coarse levels that have parameters (L_max)
    max_len: int
    linear: bool = False
    multiplicity: bool = True
    normalization: str = "joint"  # FMA-linear: 'joint' | 'per_level'
    query_summary: str = "lagged"  # FMA-linear causal: 'lagged' | 'paper_leaky'
    downsample: str = "depthwise_conv"  # 'depthwise_conv' | 'dense_conv' | 'avgpool'
    shared: bool = True  # downsampling weights shared across heads
    allow_truncated: bool = False
    release_zero_slots: bool = False  # FMA causal: the release's unmasked zero-padded slots (docs §9.3)
    attn_dropout: float = 0.0
    logit_budget: int = 1 << 24

    def m_l(self, l: int) -> int:
        return self.m << (l - 1)

    def beta(self, l: int) -> float:
        return math.log(self.m_l(l) / self.p) if self.multiplicity else 0.0

    @property
    def leaky(self) -> bool:
        return self.linear and self.causal and self.query_summary == "paper_leaky"


def levels_used(n: int, opts: FMAOptions) -> int:
    """Coarse levels a full pass over n tokens uses (§2.6); raises past max_len unless truncation is allowed."""
    nb = -(-n // opts.m)
    need = max(0, (nb - 1).bit_length() - 1)  # ceil(log2(nb)) - 1
    if need > opts.L:
        if not opts.allow_truncated:
            raise ValueError(
                f"fma: a sequence of {n} tokens needs {need} coarse levels but the layer has {opts.L} "
                f"(max_len={opts.max_len}); set attention.fma.max_len >= {n} or allow_truncated_window=True"
            )
        return opts.L
    return need


def acc_type(x):
    """The accumulation dtype of products of x: at least float32 (float64 stays float64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def f32(x):
    """Compute dtype: f32 (bf16/f16 inputs are upcast; f64 stays f64 for finite-difference tests)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def pad_to(x, mult: int, axis: int = 2):
    """``x`` zero-padded at the end of ``axis`` to a multiple of ``mult``."""
    n = x.shape[axis]
    pad = (-n) % mult
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


__all__ = ["FMAOptions", "f32", "levels_used", "pad_to"]

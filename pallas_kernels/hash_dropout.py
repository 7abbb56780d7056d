"""Counter-based attention-dropout mask: one keep bit per (seed, row, query index, key index) from an integer hash,
so a Pallas kernel body (forward and backward alike) and plain JAX draw the same mask from the same indices without
storing it. This module imports only JAX.

The hash (uint32 arithmetic, carried in int32 bit patterns so that it lowers for Mosaic and Triton alike: wrapping
multiplies, xors and logical shifts; no unsigned type in a kernel):

* ``row_seed(seed, row) = fmix32(fmix32(seed) ^ (row·M_ROW + 1))``: one seed per batch × head row (``row = b·H + h``
  over the whole batch, so a sharded call draws what one device would);
* ``bits(rs, n, m) = fmix32(fmix32(rs ^ n·GOLD) ^ (m·M_KEY + ADD_KEY))`` for query index ``n`` and key index ``m``;
* keep iff ``bits >= rate·2^32`` (as unsigned), kept weights scaled by ``1 / (1 − rate)``.

``fmix32`` is MurmurHash3's 32-bit finalizer. Index spaces: a local key is its absolute position ``m >= 0``; chunk
``c`` is ``CHUNK_KEY_BASE + c`` (``2^31 + c``), distinct from every position, whatever the sequence length.

EVA's attention dropout draws its mask here (docs/methods/eva.md §9.12): a departure from the release's torch
dropout, the same law (independent keeps with probability ``1 − rate``, to 2^-32) from a different random stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _i32(x: int) -> int:
    """The int32 bit pattern of a uint32 constant."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


M1, M2 = _i32(0x85EBCA6B), _i32(0xC2B2AE35)  # fmix32's multipliers
GOLD, M_ROW, M_KEY, ADD_KEY = _i32(0x9E3779B1), _i32(0x27D4EB2F), _i32(0x165667B1), _i32(0x61C88647)
CHUNK_KEY_BASE = _i32(1 << 31)  # key index of chunk 0 (int32 bit pattern of 2^31)
SIGN = _i32(1 << 31)


def _srl(x, n: int):
    return jax.lax.shift_right_logical(x, jnp.full(x.shape, n, jnp.int32))


def fmix32(x):
    """MurmurHash3's finalizer on int32 arrays holding uint32 bits."""
    x = x ^ _srl(x, 16)
    x = x * M1
    x = x ^ _srl(x, 13)
    x = x * M2
    return x ^ _srl(x, 16)


def threshold(rate: float) -> int:
    """The unsigned threshold ``round(rate·2^32)`` (at most 2^32 − 1): bits below it drop."""
    return min(int(round(rate * 2.0**32)), (1 << 32) - 1)


def seed_from_key(key):
    """One int32 seed from a PRNG key (the layer's dropout key)."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32)


def row_seeds(seed, rows):
    """int32 seeds of the rows ``rows`` (int array, e.g. ``b·H + h``)."""
    rows = jnp.asarray(rows, jnp.int32)
    s = fmix32(jnp.broadcast_to(jnp.asarray(seed, jnp.int32), rows.shape))
    return fmix32(s ^ (rows * M_ROW + 1))


def keep(row_seed, q_idx, k_idx, rate: float):
    """bool: keep the weight of query ``q_idx`` on key ``k_idx`` (int32 arrays, broadcast together; ``row_seed``
    from :func:`row_seeds`). The row part is hashed at its own shape, the element part at the broadcast shape."""
    a = fmix32(row_seed ^ (q_idx.astype(jnp.int32) * GOLD))
    b = k_idx.astype(jnp.int32) * M_KEY + ADD_KEY
    bits = fmix32(a ^ b)
    return (bits ^ SIGN) >= threshold(rate) - (1 << 31)  # unsigned bits >= threshold, as a signed comparison


def multiplier(row_seed, q_idx, k_idx, rate: float):
    """float32: ``1 / (1 − rate)`` where kept, 0 where dropped."""
    return jnp.where(keep(row_seed, q_idx, k_idx, rate), jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


__all__ = ["CHUNK_KEY_BASE", "fmix32", "keep", "multiplier", "row_seeds", "seed_from_key", "threshold"]

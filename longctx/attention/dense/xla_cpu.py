"""``xla_cpu``: the blockwise algorithm of ``xla.py`` with the XLA:CPU forms of its ops (the CPU's ``auto`` path).

The same tiled code (the unrolled full pass where whole blocks tile it, else the position-general loop), run with:

* ``rowdot``, ``transposed``, ``rows_dot`` from :mod:`longctx.xla_cpu`: the backward's rowsum(dO * O) as a dot, and
  the key-side gradients as plain ``[D, bq] x [bq, bk]`` products from operands transposed once per pass (contracting
  the row axis of both operands as laid out, XLA:CPU falls back to a generic dot at about half the rate; see
  docs/DESIGN.md "Where the time goes");
* in the position-general loop, a key block wholly after every query of a block is skipped by a ``lax.cond`` (a
  branch costs little on a CPU; the portable path computes such a block under its mask instead).

Declares ``xla_cpu`` (:data:`IMPLEMENTATIONS`, CPU only): ``impl='auto'`` on a CPU takes it first once Tq*Tk exceeds
``auto_threshold`` (``xla.prefers_long_rows``), then ``blockwise``; shorter calls take the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.dense import xla
from longctx.attention.dispatch import Implementation
from longctx.xla_cpu import rowdot, rows_dot, transposed


def _visit(step, causal: bool, qpi, kmi, carry, skipped):
    """Run ``step(carry)`` unless the key block lies wholly after every query of the block (causal)."""
    if not causal:
        return step(carry)
    return jax.lax.cond(kmi <= jnp.max(qpi), step, skipped, carry)


CPU = xla.TileOps(rowsum_product=rowdot, swap_last=transposed, matmul_tn=rows_dot, visit=_visit)


def attend(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_q: int, block_k: int, full_pass: bool = False,
           window: int = 0, q_segment_ids=None, k_segment_ids=None, layer=None):
    """The ``xla_cpu`` implementation: :func:`xla.tiled` with the :data:`CPU` ops (a packed row's segment ids:
    the position-general loop, as ``blockwise``)."""
    return xla.tiled(q, k, v, q_pos, k_pos, k_valid, causal=causal, block_q=block_q, block_k=block_k,
                     full_pass=full_pass, ops=CPU, window=window, q_segment_ids=q_segment_ids,
                     k_segment_ids=k_segment_ids, layer=layer)


class Tiles(xla.Tiles):
    """The ``xla_cpu`` runner: ``blockwise``'s (the same knobs and inputs) calling :func:`attend`."""

    tiled = staticmethod(attend)


IMPLEMENTATIONS = (
    Implementation("xla_cpu", platforms=("cpu",), config={"impl": "xla_cpu"}, test_config={"block_q": 8, "block_k": 8},
                   auto={"cpu": xla.TILES_RANK - 1}, prefer=xla.prefers_long_rows, code=Tiles,
                   defaults={key: {"cpu": table["cpu"]} for key, table in xla.BLOCKS.items()}),
)


__all__ = ["CPU", "IMPLEMENTATIONS", "Tiles", "attend"]

"""The layout of row-wise layers (norms, projections), chosen per platform: the model's one platform choice
outside the attention implementations.

:func:`rows_apply` runs ``fn`` over the rows of ``x [..., d]``. On a CPU host the rows are flattened to
``[N, d]`` first and the output reshaped back, which takes two XLA:CPU costs away: (1) the weight gradient of a
dot over ``[B, T, d]`` contracts two axes, which XLA:CPU lays out with a transposing copy of the incoming
gradient per consumer, where ``[B*T, d]`` needs none; (2) a row norm's gradient sums ``g * x`` over the last axis,
and with a size-1 leading dimension (batch 1, one head) XLA:CPU runs that multiply-and-reduce on a slow path.
On GPUs and TPUs ``fn(x)`` runs as it is: there merging the batch axis with a sequence-sharded token axis
(``mesh.sequence_mode='xla'``) would make the partitioner move the activations. The arithmetic is the same either
way (``longctx-bench profile`` shows the fusions on a CPU).
"""

from __future__ import annotations

import math


def flattens_rows(platform: str) -> bool:
    """Whether row-wise layers flatten their rows on ``platform`` (a CPU host: yes)."""
    return platform in ("cpu", "interpret")


def rows_apply(fn, x, *, flat: bool):
    """``fn`` applied to the rows of ``x [..., d]``: flattened to ``[N, d]`` when ``flat`` (the layer was built for
    a CPU host: :func:`flattens_rows` of its platform), as it is otherwise."""
    if x.ndim <= 2 or not flat:
        return fn(x)
    lead = x.shape[:-1]
    y = fn(x.reshape(math.prod(lead), x.shape[-1]))
    return y.reshape(*lead, *y.shape[1:])


__all__ = ["flattens_rows", "rows_apply"]

"""Exact softmax attention, the baseline every method is compared with (method notes: docs/methods/dense.md).

One function, named implementations (``DenseAttention.implementations()``, the reference first):

* ``reference`` (``reference.py``): one masked softmax over the [Tq, Tk] score matrix;
* ``blockwise`` (``xla.py``): online softmax over key blocks, FlashAttention-2's backward; portable;
* the XLA:CPU implementation (its own file): the same tiles with XLA:CPU's ops (the CPU's ``auto`` path for long
  rows);
* ``cudnn`` (GPU), ``splash`` (TPU) (``platform.py``): the platforms' fused kernels, full passes only.

``sliding.py``: the same core over a sliding window of keys, the method ``swa`` (sliding-window attention).

Each implementation module declares its own (``IMPLEMENTATIONS``: platforms, where ``auto`` takes it, and its
runner, a ``dispatch.Runner`` whose fields are the knobs it reads); ``layer.py`` holds the core (config, state, the
reference's declaration, ``prepare`` / ``finish`` of the call, and the selection with the KV-cache rule for a named
fused kernel, ``choose``), and ``attend``, the same path without a core.
"""

from longctx.attention.dense.layer import DenseAttention, attend, choose, implementations
from longctx.attention.dense.reference import NEG_INF, naive_attention, positions_mask
from longctx.attention.dense.sliding import SlidingWindowAttention
from longctx.attention.dense.xla import (
                                         MAX_UNROLLED_BLOCKS,
                                         blockwise_attention,
                                         self_blocks_apply,
                                         self_blockwise_attention,
)

__all__ = ["MAX_UNROLLED_BLOCKS", "NEG_INF", "DenseAttention", "SlidingWindowAttention", "attend", "blockwise_attention",
           "choose", "implementations", "naive_attention", "positions_mask", "self_blocks_apply",
           "self_blockwise_attention"]

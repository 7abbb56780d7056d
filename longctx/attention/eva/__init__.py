"""EVA: efficient attention via control variates (Zheng et al., ICLR 2023; arXiv 2302.04542).

Method notes: ``docs/methods/eva.md``. Each query ``n`` sees

* a local block ``E_n`` (exact softmax terms, T5 relative-position bias), and
* ``C`` contiguous chunks ``P_c`` summarized by a representative key ``k̂_c = LN(Linear(mean_{P_c} k))`` (chunk
  logit ``s q_n·k̂_c``) and a query-independent control-variate coefficient ``β_c`` = a one-sample RFA over the
  chunk (Phase A, §2.3),

combined by one log-sum-exp normalised softmax over ``[local logits ; chunk logits]`` (eq. 16, Phase B, §2.4).

The package: ``reference.py`` (the paper's computation, the implementation every other one must equal),
``xla.py`` (portable XLA tiles), the tiles tuned for XLA:CPU (the CPU-tuned implementation, its own file),
``pallas.py`` (the kernels), ``packed.py`` (a packed row in the tiles: the documents laid out again on the block
grid), each declaring itself (``IMPLEMENTATIONS``, its code a ``dispatch.Runner``),
``common.py`` (options, geometry, masks, bias, random draws and decoding state they share, and the runners' shared
call) and ``layer.py`` (:class:`EVAAttention`: parameters, configuration, state, a call's inputs and its result).
Checked against the release (HKUNLP/efficient-attention at 531ff51, ``tests/fidelity/test_eva_release.py``):
both directions equal a port of the released forward with the release's draws and options (``partition='full'``,
``rf_scale='released'``). Remaining differences: with ``overlap_window`` the release indexes the relative bias by
position inside the widened window (longctx: by offset; equal without overlap); the release's bidirectional
overlap also widens the chunks (no option here); chunks made only of padding stay visible in the release (masked
here); the release masks with -5e4 and pads before its projections (longctx: -1e30, zero-padded q, k, v).
"""

from longctx.attention.eva.common import (
    EVAOptions,
    chunk_beta,
    chunk_noise,
    chunk_summaries,
    rf_log_feature,
    t5_bucket,
)
from longctx.attention.eva.layer import EVAAttention
from longctx.attention.eva.reference import eva_reference
from longctx.attention.eva.xla import attend_tile, eva_forward, eva_stream, tile_groups

__all__ = [
    "EVAAttention",
    "EVAOptions",
    "attend_tile",
    "chunk_beta",
    "chunk_noise",
    "chunk_summaries",
    "eva_forward",
    "eva_reference",
    "eva_stream",
    "rf_log_feature",
    "t5_bucket",
    "tile_groups",
]

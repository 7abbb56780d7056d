"""Transformer-VQ attention (Lingle 2023, arXiv 2309.16354; method notes: docs/methods/transformer_vq.md).

Keys are vector-quantized per head onto an EMA codebook with a straight-through estimator (STVQ). Because every
quantized key is one of S codewords, softmax attention over an arbitrary prefix factorizes into S code logits plus
per-code (mean value, count) summaries: a lossless compressed cache *for the quantized keys*.

* ``reference.py`` -- the paper's computation (quadratic in the call's length): the implementation ``reference``
* ``layer.py``     -- the core :class:`TransformerVQAttention`: parameters, codebook learning, the call's
  ``prepare`` and ``finish`` (the base class selects and runs the implementation between them)
* ``state.py``     -- the carried decoding state every implementation returns (empty state, composition)
* ``xla.py``       -- the portable linear-time forms, one implementation each: ``parallel``, ``blocks``, ``stream``,
  ``encoder``
* the XLA:CPU implementation (its own file) -- those forms laid out for XLA:CPU (what ``impl='auto'`` runs on a
  CPU)
* ``pallas.py``    -- the §9 kernel (``pallas_kernels/vq_cache.py``): ``pallas``

Each implementation module declares its implementations (``IMPLEMENTATIONS``), which the core collects; each one's
``code`` is a ``dispatch.Runner`` (its fields: the execution settings it reads), called as ``runner(core, call) ->
Result(out, state, extras)`` with the codes ``z``, errors ``err2``, codewords ``c_z`` and its per-code sums
``code_sums`` in ``extras``.
Checked against the release (transformer-vq/transformer_vq at 21943e4, ``tests/fidelity/test_transformer_vq_release.py``):
output, codes and final cache equal a port of the released attention (``agg_cache=1``, sinusoid dropout included),
in one call and block by block. Remaining differences: the initial band codes (code S in the release, 0 here;
both slots are invalid by position); the cache is kept in float32 (the release: the activation dtype).
"""

from longctx.attention.transformer_vq.layer import (
    TransformerVQAttention,
    codebook_from_stats,
    commit_loss,
    ema_update,
    kmeans,
    rel_table,
    rms_normalize,
    sinusoid,
    vq_stats,
)
from longctx.attention.transformer_vq.state import DOCUMENT, empty_state, packed_final_state
from longctx.attention.transformer_vq.xla import (
    band_scores,
    causal_blocks,
    causal_parallel,
    causal_stream,
    encoder_parallel,
    stvq,
)
from pallas_kernels.vq_cache_ref import code_summary, code_sums, merge, prefix_reduce

__all__ = [
    "TransformerVQAttention",
    "band_scores",
    "causal_blocks",
    "causal_parallel",
    "causal_stream",
    "code_summary",
    "code_sums",
    "codebook_from_stats",
    "commit_loss",
    "ema_update",
    "DOCUMENT",
    "empty_state",
    "packed_final_state",
    "encoder_parallel",
    "kmeans",
    "merge",
    "prefix_reduce",
    "rel_table",
    "rms_normalize",
    "sinusoid",
    "stvq",
    "vq_stats",
]

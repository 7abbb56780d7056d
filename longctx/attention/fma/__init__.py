"""Fast Multipole Attention (Kang, Tran, De Sterck 2023; arXiv 2310.11960): FMA and FMA-linear.

Method notes: ``docs/methods/fma.md`` (section numbers in the code refer to it). Registered twice: ``fma``
(:class:`FMAAttention`) and ``fma_linear`` (:class:`FMALinearAttention`, paper App. A.1).

The method (§1). The sequence is cut into fine blocks of ``m`` tokens. A query attends exactly to
the keys of its own fine block and of the adjacent blocks (the previous one only, when causal). For
each coarse level l = 1..L (group size m_l = 2^(l-1) m), a learned strided depthwise 1-D convolution
(kernel = stride = m_l, separate weights for K and V, shared across heads, with a bias) turns every
group of keys and of values into ``p`` summary rows. A query attends to the summaries of the level-l
groups that are well separated at level l but neighbours at level l+1 (the FMM interaction list: 2 or
3 groups per level). All fine and coarse scores of a query share one softmax; each summary score gets
the log-multiplicity offset beta_l = ln(m_l / p), because in the paper's dense view (eqs. 5-7) a
summary column is repeated m_l/p times.

The partition (§2.2). I_0 = {D_1 <= 1}; I_l = {D_l >= 2 and D_{l+1} <= 1} for l = 1..L, where
D_l(i,j) = |floor(i/m_l) - floor(j/m_l)|. **Paper eq. (4) as printed keeps only D_l in {2, 3} and
drops the parent condition D_{l+1} <= 1; then I_l and I_{l+1} overlap and pairs are double-covered**
(e.g. for an even query group a, group a-3 lies inside a level-(l+1) partner). We implement the
corrected set (= the official release, = the paper's Figure 1b), which covers every pair exactly once;
``tests/attention/test_fma.py`` checks both facts. In code this is the parity rule of
:func:`pallas_kernels.fma_blocks_ref.level_partners`.

Files: ``reference.py`` (the paper's dense C~, the implementation ``reference``), ``xla.py`` (the blocked
path), its XLA:CPU form (the CPU-tuned implementation, its own file), ``pallas.py`` and ``mosaic_gpu.py`` (the
block kernels), ``coarse_stats.py`` (FMA-linear's coarse statistics), ``packed.py`` (packed rows, ``segment_ids``:
the documents laid out again on the block grid, and the carried state of packed calls; docs §2.7), ``state.py``
(the causal decoding state, §4, and ``Blocked``, the runner every implementation subclasses), ``layer.py`` (the
cores: parameters, config, the call's ``prepare`` and ``finish``), ``options.py``, ``partition.py``. Each
implementation module declares its implementation (``IMPLEMENTATIONS``: platforms, where ``impl='auto'`` tries it,
its runner); the layer declares only the reference.

Causal decoding / streaming state (§4, our extension; the paper has no KV cache): the last ``2m`` raw
keys and values, and per level the partial conv sums of the open group plus a ring of the last 4 finished
group summaries. The state is O(m d + p d L); streaming in any split equals the full pass.

Lengths and padding (§2.6, documented rule). ``max_len`` (the training length n, default 0 = resolved from it; ``max_len/m`` a
power of two) fixes the number of levels L = log2(max_len/m) - 1 and so the parameters. A sequence of
n <= max_len tokens uses the levels L_n = ceil(log2(ceil(n/m))) - 1 <= L (levels above L_n have no
partners). Queries and fine keys are right-padded to a multiple of m (padded keys masked). Causal:
partners are always complete groups, so padding never touches a real position. Bidirectional (our
extension; the paper uses fixed-length unpadded chunks): a group that straddles the end is summarised
over its zero-padded tokens and keeps its full multiplicity (the C~ of the zero-padded sequence with
padded fine keys masked); groups lying wholly in the padding are masked. For n = m 2^k nothing is
padded. n > max_len raises unless ``allow_truncated_window`` (our extension): then only L levels
exist and each query sees a window reaching back max_len/2 .. max_len tokens (meaningful with
relative or no positions; use it to stream past the training length).

Departures from the paper, all named:

* corrected partition (above); multiplicity offset beta_l on by default (``multiplicity_weighting``;
  the release's ``scale_attn``); zero-padded slots of the release are masked; ``release_zero_slots=True``
  (causal FMA; reference and XLA paths; no decoding) reproduces the release's "null slot" behaviour (§9.3);
* FMA-linear: joint normalisation by default (paper eq. 11 normalises each level separately and sums:
  ``fma_linear_normalization='per_level'``); causal FMA-linear uses **lagged** query summaries by
  default (query i reads the summary of its sub-interval slot in group a-1, fully in the past): the
  paper's own summaries mix in future tokens of i's group and leak the future (``paper_leaky``, for
  reproducing Table 1 only; rejected in causal configs unless ``allow_paper_leaky=True``; it cannot be
  streamed or decoded);
* the attention dropout of FMA-linear is applied to the per-row (shared) coarse weights;
* bidirectional padding as described above.
Checked against the release (yanmingk/FMA at 66c689a, ``tests/fidelity/test_fma_release.py``): causal FMA with
``release_zero_slots=True``, depthwise downsampling shared over heads and ``multiplicity_weighting`` = the release's
``scale_attn`` equals a port of the released forward, also on inputs shorter than ``max_len``. Remaining
difference: the mask value (the release: d·(-65504)/(d+1); longctx: -1e30; both give those slots weight 0).
"""

from __future__ import annotations

from longctx.attention.fma.layer import Downsample, FMAAttention, FMALinearAttention
from longctx.attention.fma.options import FMAOptions, levels_used
from longctx.attention.fma.partition import cover_count, level_matrix_parity
from longctx.attention.fma.reference import fma_dense_reference, level_matrix, summarize
from longctx.attention.fma.state import fma_stream, state_from_forward
from longctx.attention.fma.xla import fma_forward

__all__ = [
    "Downsample",
    "FMAAttention",
    "FMALinearAttention",
    "FMAOptions",
    "cover_count",
    "fma_dense_reference",
    "fma_forward",
    "fma_stream",
    "level_matrix",
    "level_matrix_parity",
    "levels_used",
    "state_from_forward",
    "summarize",
]

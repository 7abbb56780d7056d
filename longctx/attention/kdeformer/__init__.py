"""KDEformer attention (docs/methods/kdeformer.md): the core (``layer.py``), the estimator as math
(``reference.py``), the draws every implementation shares (``common.py``) and the tiled forms (``xla.py``,
portable; the XLA:CPU implementations in their own file; ``pallas.py``, the 'band' route's heavy part by the
Pallas kernel ``pallas_kernels/kde_band.py``). Each implementation module declares its implementations
(``IMPLEMENTATIONS``); the layer collects them (``dispatch.declared``).
Checked against the release (majid-daliri/kdeformer at 427df2d, ``tests/fidelity/test_kdeformer_release.py``):
hash codes, bucket order, heavy part and output equal a port of the released (bidirectional) forward given its
draws, with ``gray_order='forward'``. Remaining differences: the sampling probabilities round each norm up to a
multiple of 1/64 (integer weights, exact prefix sums; pinned by the test); samples come from a JAX key, not
``torch.multinomial``; the power method starts from a fixed vector and returns a Rayleigh quotient (the release: a
random start and ||Gx||); a length that is not a multiple of the bucket is padded (the release lets blocks
straddle rows).
"""

from longctx.attention.kdeformer.common import (
                                                BidirOptions,
                                                CausalOptions,
                                                draw_projections,
                                                draw_samples,
                                                gray_rank,
                                                lsh_codes,
                                                power_lambda,
)
from longctx.attention.kdeformer.layer import KDEformerAttention
from longctx.attention.kdeformer.xla import (
                                                bidir_apply,
                                                bidir_forward,
                                                bidir_plan,
                                                causal_apply,
                                                causal_forward,
                                                causal_plan,
)

__all__ = [
    "BidirOptions",
    "CausalOptions",
    "KDEformerAttention",
    "bidir_apply",
    "bidir_forward",
    "bidir_plan",
    "causal_apply",
    "causal_forward",
    "causal_plan",
    "draw_projections",
    "draw_samples",
    "gray_rank",
    "lsh_codes",
    "power_lambda",
]

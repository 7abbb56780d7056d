"""KDEformer attention (docs/methods/kdeformer.md): the core (``layer.py``), the estimator as math
(``reference.py``), the draws every implementation shares (``common.py``) and the tiled forms (``xla.py``,
portable; the XLA:CPU implementations in their own file). Each implementation module declares its implementations
(``IMPLEMENTATIONS``); the layer collects them (``dispatch.declared``)."""

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

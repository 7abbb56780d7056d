"""KDEformer attention (docs/methods/kdeformer.md): the core (``layer.py``), the estimator as math
(``reference.py``), the draws every implementation shares (``common.py``) and the tiled forms (``xla.py``,
portable; ``xla_cpu.py``, XLA:CPU)."""

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

"""Recall benchmark (configs/recall/_common.py) with a hybrid stack: layer 1 is exact (dense), layer 2 runs fma_linear
with configs/recall/fma_linear.py's settings, ``model.attention.pattern = ('dense',
'fma_linear')``. d_ff is trimmed so the parameter count matches the dense run's (182,016).

    longctx-train  --config configs/recall/hybrid_fma_linear.py --workdir runs/recall/hybrid_fma_linear
    longctx-recall --workdir runs/recall/hybrid_fma_linear
"""

from configs.recall import _common, fma_linear

VARIANTS = ("tiny",)

D_FF = 344


def get_config(arg=None):
    return _common.hybrid(fma_linear.get_config(arg), "fma_linear", D_FF)

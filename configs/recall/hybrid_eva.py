"""Recall benchmark (configs/recall/_common.py) with a hybrid stack: layer 1 is exact (dense), layer 2 runs eva
with configs/recall/eva.py's settings, ``model.attention.pattern = ('dense',
'eva')``. d_ff is trimmed so the parameter count matches the dense run's (182,016).

    longctx-train  --config configs/recall/hybrid_eva.py --workdir runs/recall/hybrid_eva
    longctx-recall --workdir runs/recall/hybrid_eva
"""

from configs.recall import _common, eva

VARIANTS = ("tiny",)

D_FF = 503


def get_config(arg=None):
    return _common.hybrid(eva.get_config(arg), "eva", D_FF)

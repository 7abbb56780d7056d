"""Recall benchmark (configs/recall/_common.py) with a hybrid stack: layer 1 is exact (dense), layer 2 runs fma
with configs/recall/fma.py's settings, ``model.attention.pattern = ('dense',
'fma')``. d_ff is trimmed so the parameter count matches the dense run's (182,016).

    longctx-train  --config configs/recall/hybrid_fma.py --workdir runs/recall/hybrid_fma
    longctx-recall --workdir runs/recall/hybrid_fma
"""

from configs.recall import _common, fma

VARIANTS = ("tiny",)

D_FF = 400


def get_config(arg=None):
    return _common.hybrid(fma.get_config(arg), "fma", D_FF)

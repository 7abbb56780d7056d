"""Recall benchmark (configs/recall/_common.py) with a hybrid stack: layer 1 is exact (dense), layer 2 runs kdeformer
with configs/recall/kdeformer.py's settings, ``model.attention.pattern = ('dense',
'kdeformer')``. KDEformer has no parameters, so d_ff stays 512 (the dense run's parameter count, 182,016).

    longctx-train  --config configs/recall/hybrid_kdeformer.py --workdir runs/recall/hybrid_kdeformer
    longctx-recall --workdir runs/recall/hybrid_kdeformer
"""

from configs.recall import _common, kdeformer

VARIANTS = ("tiny",)

D_FF = 512


def get_config(arg=None):
    return _common.hybrid(kdeformer.get_config(arg), "kdeformer", D_FF)

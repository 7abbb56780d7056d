"""Recall benchmark (configs/recall/_common.py) with a local/global stack: layer 1 is exact (dense), layer 2 runs
sliding-window attention with configs/recall/swa.py's window, ``model.attention.pattern = ('dense', 'swa')``. No
parameters in the window, so the dense run's d_ff and parameter count (182,016).

    longctx-train  --config configs/recall/hybrid_swa.py --workdir runs/recall/hybrid_swa
    longctx-recall --workdir runs/recall/hybrid_swa
"""

from configs.recall import _common, swa

VARIANTS = ("tiny",)

D_FF = 512


def get_config(arg=None):
    return _common.hybrid(swa.get_config(arg), "swa", D_FF)

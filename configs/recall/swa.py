"""Recall benchmark (configs/recall/_common.py) with sliding-window attention (exact attention over the 128 most
recent keys; no parameters, so the dense run's parameter count): the local baseline, which can recall only what
lies inside its window.

    longctx-train  --config configs/recall/swa.py --workdir runs/recall/swa
    longctx-recall --workdir runs/recall/swa
"""

from configs.recall import _common

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = _common.recall(arg)
    c.model.attention.name = "swa"
    c.model.attention.swa.window = 128 if arg != "tiny" else 16
    return c

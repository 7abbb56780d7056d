"""Recall benchmark (configs/recall/_common.py): exact (dense) attention, the reference.

    longctx-train  --config configs/recall/dense.py --workdir runs/recall/dense
    longctx-recall --workdir runs/recall/dense
"""

from configs.recall import _common

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = _common.recall(arg)
    c.model.attention.name = "dense"
    return c

"""Recall benchmark (configs/recall/_common.py): exact (dense) attention, the reference.

    longctx-train  --config configs/recall/dense.py --workdir runs/recall/dense
    longctx-recall --workdir runs/recall/dense
"""

from longctx.config import load_sibling


def get_config(arg=None):
    c = load_sibling(__file__, "_common.py").recall(arg)
    c.model.attention.name = "dense"
    return c

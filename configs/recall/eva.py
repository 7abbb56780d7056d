"""Recall benchmark (configs/recall/_common.py) with causal EVA: exact local block of 128 tokens,
chunks of 8 tokens summarised beyond it (the paper's causal LM setting), T5 relative bias in the
block. The chunk representatives have no parameters here beyond the bias table, so d_ff is trimmed
to the dense run's parameter count.

    longctx-train  --config configs/recall/eva.py --workdir runs/recall/eva
    longctx-recall --workdir runs/recall/eva
"""

from configs.recall import _common

VARIANTS = ("tiny",)

D_FF = 494


def get_config(arg=None):
    c = _common.recall(arg)
    c.model.attention.name = "eva"
    e = c.model.attention.eva
    e.window_size = 128 if arg != "tiny" else 16
    e.chunk_size = 8 if arg != "tiny" else 4
    e.partition = "full"
    e.use_rpe = True
    c.model.d_ff = D_FF
    return c

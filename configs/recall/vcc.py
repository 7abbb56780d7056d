"""Recall benchmark (configs/recall/_common.py) with VCC-LM (causal VIP-token centric compression,
docs/methods/vcc.md §4.2; no parameters, so the dense run's parameter count): queries in
windows of 64 tokens read the 64 tokens before the window and the window exactly, 4 older 8-token
blocks (chosen by the queries of the 32 tokens before the window) at token resolution, and every
other older block as one mean key.

    longctx-train  --config configs/recall/vcc.py --workdir runs/recall/vcc
    longctx-recall --workdir runs/recall/vcc
"""

from configs.recall import _common

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = _common.recall(arg)
    c.model.attention.name = "vcc"
    lc = c.model.attention.vcc.causal
    if arg == "tiny":
        lc.window, lc.local, lc.block_size, lc.num_fine_blocks, lc.anchors = 16, 16, 4, 2, 8
    else:
        lc.window, lc.local, lc.block_size, lc.num_fine_blocks, lc.anchors = 64, 64, 8, 4, 32
    return c

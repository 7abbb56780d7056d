"""The exact-attention baseline (configs/default.py: byte-level decoder on the built-in corpus, same sizes and
schedule) with every attention layer replaced by causal EVA (docs/methods/eva.md):
local block 128, chunks of 8 tokens (C = 32 at the 256-token training length), T5 relative
position bias inside the block, the released 'full' partition.

    longctx-train --config configs/builtin/eva.py --workdir runs/eva
"""

from configs import default


def get_config():
    c = default.get_config()
    c.model.attention.name = "eva"
    e = c.model.attention.eva
    e.window_size = 128
    e.chunk_size = 8
    e.partition = "full"
    e.use_rpe = True
    return c

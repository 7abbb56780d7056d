"""The exact-attention baseline (configs/default.py: byte-level decoder on the built-in corpus, same sizes, schedule
and context, hence the same parameter count: VCC adds no parameters) with VCC-LM, our causal
extension of VIP-token centric compression (docs/methods/vcc.md §4.2). Each attention layer
reads, for a query in window j (32 bytes), the 32 bytes before the window and the window itself
exactly (causal), and the older history at two resolutions: 4 of its 8-byte blocks, chosen by the
queries of the 16 bytes before the window (past anchors: no look-ahead), at byte resolution, every
other old block as one mean key with a +log 8 logit bias. At the last window of a 256-byte row that
is 64 band + 32 fine + 20 coarse keys instead of up to 256. Training explores a random selection
with probability 0.1 and trains the selection through the straight-through gate.

    longctx-train --config configs/builtin/vcc.py --workdir runs/vcc
    longctx-eval  --workdir runs/vcc --split test

``--config configs/builtin/vcc.py:tiny`` is a 2-layer smoke run (d_model 64, 128-byte context, windows
and band of 16, blocks of 4, 2 fine).
"""

from configs import default

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    c = default.get_config()
    c.model.attention.name = "vcc"
    lc = c.model.attention.vcc.causal
    lc.window, lc.local, lc.block_size, lc.num_fine_blocks, lc.anchors = 32, 32, 8, 4, 16
    if arg == "tiny":
        default.tiny(c)
        lc.window, lc.local, lc.block_size, lc.num_fine_blocks, lc.anchors = 16, 16, 4, 2, 8
    elif arg:
        raise ValueError(f"configs/builtin/vcc.py: unknown variant {arg!r}; allowed: tiny")
    return c

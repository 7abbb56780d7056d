"""Masked-LM encoder with VCC, VIP-token centric compression (docs/methods/vcc.md §4.1), at
configs/builtin/mlm_dense.py's size, data and schedule, hence its parameter count (VCC adds no
parameters: it wraps the same pre-LN blocks). The VIP tokens are the masked positions, drawn by
VCC's clustered masking (docs/methods/vcc.md §3.2) at the same 15 % rate (38 of 256 bytes per row).

Layer 1 is a plain layer on 64-byte segments; layers 2-4 are VCC layers: 48 VIP slots (38 VIPs +
the earliest other bytes), the other 208 bytes in 26 blocks of 8, of which the 8 blocks the VIP
rows attend to most stay at byte resolution, so each VCC layer runs on 48 + 26 + 64 = 138 rows
instead of 256. Training explores a random selection with probability 0.1 and trains the selection
through the straight-through gate; evaluation selects deterministically.

    longctx-train --config configs/builtin/mlm_vcc.py --workdir runs/mlm_vcc
    longctx-eval  --workdir runs/mlm_vcc --split test

The dense encoder on the same task (clustered masking) for a comparison at equal parameters, steps
and context:  longctx-train --config configs/builtin/mlm_dense.py --config.mlm.masking=clustered ...

``--config configs/builtin/mlm_vcc.py:tiny`` is a 2-layer smoke run (64-byte rows: 16 VIP slots,
6 blocks of 8, 2 refined).
"""

from configs import default
from configs.builtin import mlm_dense

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = default.get_config()
    c.model.attention.name = "vcc"
    c = mlm_dense.encoder(c, arg)
    c.mlm.masking = "clustered"
    v = c.model.attention.vcc
    v.num_vip, v.block_size, v.num_fine_blocks = 48, 8, 8
    v.num_dense_layers, v.dense_segment_len = 1, 64
    v.explore_prob = 0.1
    if arg == "tiny":
        v.num_vip, v.block_size, v.num_fine_blocks = 16, 8, 2
        v.num_dense_layers, v.dense_segment_len = 1, 32
    return c

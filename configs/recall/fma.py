"""Recall benchmark (configs/recall/_common.py) with causal Fast Multipole Attention: fine blocks of
m = 64 tokens, p = 1 summary row per group, levels built for the 1,024-token rows (max_len). The
learned downsampling adds parameters; d_ff is trimmed to the dense run's parameter count.

    longctx-train  --config configs/recall/fma.py --workdir runs/recall/fma
    longctx-recall --workdir runs/recall/fma
"""

from configs.recall import _common

VARIANTS = ("tiny",)

D_FF = 288


def get_config(arg=None, name="fma"):
    c = _common.recall(arg)
    c.model.attention.name = name
    f = c.model.attention[name]
    f.m = 64 if arg != "tiny" else 8
    f.p = 1
    f.max_len = c.train.seq_len
    c.model.d_ff = D_FF
    return c

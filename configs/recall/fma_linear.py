"""Recall benchmark (configs/recall/_common.py) with causal FMA-linear (fma's linear-attention
variant, paper App. A.1): configs/recall/fma.py's levels (m = 64, p = 1, max_len 1,024); its
downsampling has more parameters, so d_ff is trimmed further to the dense run's parameter count.

    longctx-train  --config configs/recall/fma_linear.py --workdir runs/recall/fma_linear
    longctx-recall --workdir runs/recall/fma_linear
"""

from configs.recall import fma

VARIANTS = ("tiny",)

D_FF = 176


def get_config(arg=None):
    c = fma.get_config(arg, name="fma_linear")
    c.model.d_ff = D_FF
    return c

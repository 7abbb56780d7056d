"""Masked-LM encoder (configs/builtin/mlm_dense.py's size, data, masking and schedule) with every
attention layer replaced by bidirectional EVA, its settings from configs/builtin/eva.py (local
blocks of 128, chunks of 8, relative position bias, the 'full' partition). EVA's learned chunk
representatives add 8,704 parameters per layer; d_ff 512 -> 478 takes as many out of the MLPs,
so the model has mlm_dense's parameter count (within 1 %).

    longctx-train --config configs/builtin/mlm_eva.py --workdir runs/mlm_eva
    longctx-eval  --workdir runs/mlm_eva --split test

``:tiny`` (``--config configs/builtin/mlm_eva.py:tiny``): a 2-layer smoke run, local blocks of 32.
"""

from configs.builtin import eva, mlm_dense

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = eva.get_config()
    c = mlm_dense.encoder(c, arg)
    if arg == "tiny":
        c.model.attention.eva.window_size = 32
    else:
        c.model.d_ff = 478
    return c

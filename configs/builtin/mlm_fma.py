"""Masked-LM encoder (configs/builtin/mlm_dense.py's size, data, masking and schedule) with every
attention layer replaced by bidirectional Fast Multipole Attention, its settings from
configs/builtin/fma.py (fine blocks m = 32, p = 4 summary rows, levels built for the 256-token
rows). The learned downsampling adds parameters; d_ff 512 -> D_FF takes as many out of the MLPs,
so the model has mlm_dense's parameter count (within 1 %).

    longctx-train --config configs/builtin/mlm_fma.py --workdir runs/mlm_fma
    longctx-eval  --workdir runs/mlm_fma --split test

``:tiny``: a 2-layer smoke run (64-byte rows, m = 16).
"""

from configs.builtin import fma, mlm_dense

VARIANTS = ("tiny",)

D_FF = 317


def get_config(arg=None):
    c = fma.get_config()
    c = mlm_dense.encoder(c, arg)
    f = c.model.attention.fma
    f.max_len = c.train.seq_len
    if arg == "tiny":
        f.m = 16
    else:
        c.model.d_ff = D_FF
    return c

"""Masked-LM encoder (configs/builtin/mlm_dense.py's size, data, masking and schedule) with every
attention layer replaced by bidirectional linear Fast Multipole Attention (``fma_linear``,
docs/methods/fma.md). Its multilevel settings are configs/builtin/fma.py's, as in the decoder
configs/builtin/fma_linear.py (fine blocks m = 32, p = 4, levels built for the 256-token rows). The
learned downsampling adds parameters; d_ff 512 -> D_FF takes as many out of the MLPs, so the
model has mlm_dense's parameter count (within 1 %).

    longctx-train --config configs/builtin/mlm_fma_linear.py --workdir runs/mlm_fma_linear
    longctx-eval  --workdir runs/mlm_fma_linear --split test

``:tiny``: a 2-layer smoke run (64-byte rows, m = 16).
"""

from configs.builtin import fma, mlm_dense

VARIANTS = ("tiny",)

D_FF = 219


def get_config(arg=None):
    c = fma.get_config()
    c.model.d_ff = 1024
    c = mlm_dense.encoder(c, arg)
    fc, f = c.model.attention.fma, c.model.attention.fma_linear
    c.model.attention.name = "fma_linear"
    f.m, f.p = fc.m, fc.p
    f.max_len = c.train.seq_len
    if arg == "tiny":
        f.m = 16
    else:
        c.model.d_ff = D_FF
    return c

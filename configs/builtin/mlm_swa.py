"""Masked-language-model encoder (configs/builtin/mlm_dense.py's recipe) with sliding-window attention: each byte
sees the bytes fewer than 64 positions away on either side (configs/builtin/swa.py's window). No parameters, so
the dense encoder's parameter count.

    longctx-train --config configs/builtin/mlm_swa.py --workdir runs/mlm_swa

``:tiny``: a 2-layer smoke run (a window of 16).
"""

from configs.builtin import mlm_dense, swa

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = mlm_dense.encoder(swa.get_config(), arg)
    if arg == "tiny":
        c.model.attention.swa.window = 16
    return c

"""Masked-LM encoder (configs/builtin/mlm_dense.py's size, data, masking and schedule, hence its
parameter count: the core has none) with every attention layer replaced by bidirectional KDEformer
(docs/methods/kdeformer.md): the attention settings of configs/builtin/kdeformer.py, whose
bidirectional part is the method's defaults (LSH heavy blocks of 32 keys with 7-bit codes, 96
importance-weighted uniform samples of the rest per query block).

    longctx-train --config configs/builtin/mlm_kdeformer.py --workdir runs/mlm_kdeformer
    longctx-eval  --workdir runs/mlm_kdeformer --split test

``:tiny``: a 2-layer smoke run (buckets of 8, 8 samples, 3-bit codes).
"""

from configs.builtin import kdeformer, mlm_dense

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = kdeformer.get_config()
    c = mlm_dense.encoder(c, arg)
    if arg == "tiny":
        k = c.model.attention.kdeformer
        k.bucket_size, k.num_samples, k.num_projs = 8, 8, 3
    return c

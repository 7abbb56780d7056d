"""Masked-LM encoder (configs/builtin/mlm_dense.py's data, masking and schedule) with
Transformer-VQ: GAU blocks and the transformer_vq core, its settings from
configs/builtin/transformer_vq.py (64 codes, blocks of 64, no absolute positions: the relative bias
lives in the core). As there, num_layers counts GAUs (8 GAUs ~ 4 dense layers); the value width
(gau_expansion * d_model = 128; the core's relative-bias projection is 128 x 128) is chosen so
the parameter count matches mlm_dense's (within 1 %).

    longctx-train --config configs/builtin/mlm_transformer_vq.py --workdir runs/mlm_transformer_vq
    longctx-eval  --workdir runs/mlm_transformer_vq --split test

``:tiny``: a 4-GAU smoke run (64-byte rows, 16 codes, blocks of 16).
"""

from configs.builtin import mlm_dense, transformer_vq

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = transformer_vq.get_config()
    c = mlm_dense.encoder(c, arg)
    m = c.model
    m.num_heads = 1
    if arg == "tiny":
        m.num_layers, m.head_dim, m.gau_expansion = 4, 16, 1.5
        vq = m.attention.transformer_vq
        vq.codebook_size, vq.block_len = 16, 16
    else:
        m.num_layers, m.head_dim, m.gau_expansion = 8, 128, 1.0
    return c

"""Recall benchmark (configs/recall/_common.py) with Transformer-VQ: GAU blocks (two GAUs per
layer, so 4 GAUs for the 2 layers; one head of 32, value width set so the parameter count matches
the dense run's), the transformer_vq core with 64 codes, blocks of 64 tokens, its own XL relative
bias (no rotary).

    longctx-train  --config configs/recall/transformer_vq.py --workdir runs/recall/transformer_vq
    longctx-recall --workdir runs/recall/transformer_vq
"""

from configs.recall import _common

VARIANTS = ("tiny",)

GAU_EXPANSION = 2.859375  # value width 183


def get_config(arg=None):
    c = _common.recall(arg)
    c.model.block = "gau"
    c.model.num_layers = 4  # GAUs (= 2 layers)
    c.model.num_heads = 1
    c.model.head_dim = 32
    c.model.gau_expansion = GAU_EXPANSION
    c.model.norm = "rmsnorm"
    c.model.positions = "none"
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 64 if arg != "tiny" else 16
    vq.block_len = 64 if arg != "tiny" else 16
    vq.mem_len = 0
    return c

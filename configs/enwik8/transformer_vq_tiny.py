"""enwik8, byte level, a tiny Transformer-VQ (4 GAUs, S = L = M = 32) that trains on a 2-core CPU.

    longctx-train --config configs/enwik8/transformer_vq_tiny.py --config.data.path=/data/enwik8.zip --workdir runs/vq_tiny
"""

from longctx.config import load_sibling


def dense_tiny():
    """The sibling config this one starts from, loaded by path (works from any working directory)."""
    return load_sibling(__file__, "dense_tiny.py").get_config()


def get_config():
    c = dense_tiny()
    c.model.block = "gau"
    c.model.num_layers = 4  # GAUs
    c.model.num_heads = 1
    c.model.head_dim = 64
    c.model.gau_expansion = 2
    c.model.norm = "rmsnorm"
    c.model.positions = "none"
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 32
    vq.block_len = 32
    vq.mem_len = 0
    c.train.window = 64  # seq_len 128 in two windows, cache carried
    c.eval.reset = "row"
    c.eval.row_len = 0  # = train.seq_len
    return c

"""Transformer-VQ on the built-in corpus: configs/default.py's model size (d_model 256), with GAU blocks
(two GAUs per paper layer, so num_layers counts GAUs: 8 GAUs ~ the 4-layer dense default;
value width 1.5 * d_model so the parameter count matches the dense default's) and the
transformer_vq core (S = 64 codes, L = M = 64, serial reduction)."""

from configs import default


def get_config():
    c = default.get_config()
    c.model.block = "gau"
    c.model.num_layers = 8  # GAUs (= 4 paper layers)
    c.model.num_heads = 1
    c.model.head_dim = 128
    c.model.gau_expansion = 1.5  # H*Dv = 384: matches the dense default's parameter count
    c.model.norm = "rmsnorm"
    c.model.positions = "none"  # the XL relative bias lives inside the core
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 64
    vq.block_len = 64
    vq.mem_len = 0  # = block_len
    # Same tokens per update as the dense default; --config.train.window=128 trains in windows
    # that carry the compressed cache under stop-gradient (the paper's recipe).
    return c

"""The exact-attention baseline (configs/default.py) with every attention layer replaced by causal *linear* Fast Multipole
Attention (``fma_linear``, docs/methods/fma.md: the coarse levels' softmax terms become linear-attention
sums in the leak-free ``lagged`` form). Its multilevel settings are configs/builtin/fma.py's: fine blocks
m = 32, p = 4 summary rows per group, levels built for the training length (max_len follows train.seq_len,
256).
The method's default max_len (0) means the training length; setting it here makes the config build the same
levels wherever it is loaded. The lagged causal form costs accuracy against FMA (docs/methods/fma.md §2.5).

    longctx-train --config configs/builtin/fma_linear.py --workdir runs/fma_linear
    longctx-eval  --workdir runs/fma_linear --split test
"""

from configs.builtin import fma


def get_config():
    c = fma.get_config()
    fc, f = c.model.attention.fma, c.model.attention.fma_linear
    c.model.attention.name = "fma_linear"
    f.m, f.p, f.allow_truncated_window = fc.m, fc.p, fc.allow_truncated_window
    f.max_len = c.train.get_ref("seq_len") * 1  # follows train.seq_len, as in fma.py
    return c

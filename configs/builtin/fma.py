"""The exact-attention baseline (configs/default.py: byte-level decoder on the built-in corpus, same context, steps and
schedule) with every attention layer replaced by causal Fast Multipole Attention (docs/methods/fma.md):
fine blocks m = 32, p = 4 summary rows per group, max_len = train.seq_len (256), so 3 levels in the
paper's count (fine + 2 coarse: groups of 32 and 64 tokens), as in the paper's n/m = 8 setting (Table 1,
n = 512, m = 64). The learned downsampling convolutions add 50,176 parameters per layer; d_ff 1024 -> 926
takes the same number out of the MLPs, so the model has the dense default's parameter count (within 0.01%).

    longctx-train --config configs/builtin/fma.py --workdir runs/fma
    longctx-eval  --workdir runs/fma --split test
"""

from configs import default


def get_config():
    c = default.get_config()
    c.model.attention.name = "fma"
    f = c.model.attention.fma
    f.m = 32
    f.p = 4
    # the levels (and parameters) are built for the training length: a reference that follows train.seq_len
    # (an override of seq_len, e.g. `longctx-bench train --seq_len`, rebuilds them; setting max_len replaces it)
    f.max_len = c.train.get_ref("seq_len") * 1
    # sampling past the training length (longctx-sample) keeps the 2 levels: a window of 1/2..1 x 256 tokens
    f.allow_truncated_window = True
    c.model.d_ff = 926  # compensates the 4 x 50,176 downsampling parameters
    return c

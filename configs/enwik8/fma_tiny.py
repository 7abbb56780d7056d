"""enwik8, byte level, a tiny causal-FMA decoder for a CPU smoke run (a couple of minutes): the sizes of
configs/enwik8/dense_tiny.py with FMA attention (m = 16, p = 4, n = 128: 3 levels, groups of 16 and 32).

    longctx-prepare --config configs/enwik8/fma_tiny.py --config.data.path=/data/enwik8.zip
    longctx-train   --config configs/enwik8/fma_tiny.py --config.data.path=/data/enwik8.zip --workdir runs/enwik8_fma_tiny
    longctx-eval    --workdir runs/enwik8_fma_tiny --split test --set eval.max_tokens=100000
"""

from longctx.config import load_sibling


def get_config():
    c = load_sibling(__file__, "dense_tiny.py").get_config()
    c.model.attention.name = "fma"
    f = c.model.attention.fma
    f.m = 16
    f.p = 4
    f.max_len = c.train.seq_len
    f.allow_truncated_window = True  # sampling past the training length
    return c

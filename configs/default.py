"""A small exact-attention byte-level decoder on the built-in corpus (the Python standard
library's sources), sized to train on a 2-core CPU; the dense baseline the configs/builtin/
methods are compared with.

    longctx-train --config configs/default.py --workdir runs/default
    longctx-train --config configs/default.py:tiny --workdir runs/tiny    # 2 layers, 40 steps
    longctx-eval  --workdir runs/default --split test
"""

from longctx.config import base_config as base

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "builtin"
    c.model.d_model = 256
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.head_dim = 64
    c.model.d_ff = 1024
    c.model.attention.name = "dense"
    c.train.steps = 400
    c.train.batch_size = 16
    c.train.seq_len = 256
    c.train.lr = 2e-3
    c.train.warmup_steps = 50
    c.train.eval_every = 200
    c.train.ckpt_every = 100
    # the test score: the first 262,144 scored bytes of the split, the same bytes for every lossless tokenizer
    c.eval.max_tokens, c.eval.max_bytes = 0, 262144
    if arg == "tiny":
        tiny(c)
    return c


def tiny(c):
    """Shrink a decoder config built from this one to a 2-layer smoke run (the ``:tiny`` variants)."""
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 64, 2, 2, 32, 256
    c.train.seq_len, c.train.batch_size, c.train.steps, c.train.warmup_steps = 128, 4, 40, 5
    c.train.log_every, c.train.eval_every, c.train.eval_tokens, c.train.ckpt_every = 10, 20, 4096, 20
    c.eval.max_tokens, c.eval.max_bytes, c.eval.batch_size = 0, 16384, 4
    return c

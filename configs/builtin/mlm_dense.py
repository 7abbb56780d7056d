"""Masked-language-model encoder with exact (dense) attention on the built-in corpus: bidirectional
blocks (model.kind='encoder'), BERT masking (15 % of each 256-byte row predicted, 80/10/10), loss
on the masked bytes only. Sized to train in a few minutes on a CPU: d_model 128, 4 layers, 2 heads
of 64, d_ff 512, rows of 256 bytes, batch 8, 200 steps. Every ``mlm_<method>.py`` starts from a
method's decoder config (its attention settings) and applies :func:`encoder` below, so all encoders
share the size, data, masking and schedule; those with learned attention parts trim ``d_ff`` to the
same parameter count (tests/models/test_encoder.py checks it to 1 %).

    longctx-train --config configs/builtin/mlm_dense.py --workdir runs/mlm_dense
    longctx-eval  --workdir runs/mlm_dense --split test
    longctx-fill  --workdir runs/mlm_dense --text='def f(x):\\n    return ____'

``--config configs/builtin/mlm_dense.py:tiny`` is a 2-layer smoke run (seconds).
"""

from configs import default

VARIANTS = ("tiny",)


def encoder(c, arg=None):
    """The shared encoder recipe applied to a decoder config ``c`` (its attention settings kept)."""
    c.model.kind = "encoder"
    c.model.d_model = 128
    c.model.num_layers = 4
    c.model.num_heads = 2
    c.model.head_dim = 64
    c.model.d_ff = 512
    c.train.seq_len = 256
    c.train.window = 0
    c.train.batch_size = 8
    c.train.steps = 200
    c.train.lr = 2e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 200
    c.train.eval_tokens = 16384
    c.train.ckpt_every = 100
    c.eval.max_tokens, c.eval.max_bytes = 65536, 0  # 256 rows of 256 bytes: 9,728 masked bytes scored
    c.mlm.masking = "bert"
    c.mlm.rate = 0.15
    if arg == "tiny":
        c.model.d_model = 32
        c.model.num_layers = 2
        c.model.num_heads = 2
        c.model.head_dim = 16
        c.model.d_ff = 64
        c.train.seq_len = 64
        c.train.batch_size = 4
        c.train.steps = 8
        c.train.warmup_steps = 2
        c.train.log_every = 1
        c.train.eval_every = 4
        c.train.eval_tokens = 512
        c.train.ckpt_every = 4
        c.eval.max_tokens = 1024
        c.eval.batch_size = 4
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; allowed: tiny")
    return c


def get_config(arg=None):
    return encoder(default.get_config(), arg)

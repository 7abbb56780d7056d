"""The main job: a small exact-attention byte-level decoder on the built-in corpus
(the Python standard library's sources). Trains in well under 15 minutes on a
2-core CPU."""

from longctx.config import base_config as base


def get_config():
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
    c.eval.max_tokens = 262144
    return c

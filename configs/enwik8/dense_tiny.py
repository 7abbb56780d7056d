"""enwik8, byte level, a tiny dense decoder that trains on a 2-core CPU in a couple of minutes.

data.path is not set here: give it on the command line (enwik8.zip, the unzipped enwik8,
or their folder), e.g.

    longctx-prepare --config configs/enwik8/dense_tiny.py --config.data.path=/data/enwik8.zip
    longctx-train   --config configs/enwik8/dense_tiny.py --config.data.path=/data/enwik8.zip --workdir runs/enwik8_tiny
    longctx-eval    --workdir runs/enwik8_tiny --split test --set eval.max_tokens=100000

Reports bits per byte (every byte scored); evaluation is limited to eval.max_tokens bytes.
"""

from longctx.config import base_config as base


def get_config():
    c = base()
    c.data.source = "enwik8"
    c.data.tokenizer = "bytes"
    c.data.path = ""  # required: --config.data.path=/path/to/enwik8.zip
    c.model.d_model = 128
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 64
    c.model.d_ff = 512
    c.train.seq_len = 128
    c.train.batch_size = 8
    c.train.steps = 300
    c.train.lr = 3e-3
    c.train.warmup_steps = 30
    c.train.log_every = 25
    c.train.eval_every = 150
    c.train.eval_tokens = 8192
    c.train.ckpt_every = 150
    c.eval.reset = "never"
    c.eval.max_tokens = 65536
    return c

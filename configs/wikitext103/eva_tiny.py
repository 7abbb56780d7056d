"""WikiText-103, word level, a tiny causal-EVA decoder for a CPU smoke run (a few minutes);
same sizes as configs/wikitext103/dense_tiny.py with EVA attention (block 32, chunks of 8,
so 64-token training samples have C = 8 chunks). data.path is not set here:

    longctx-prepare --config configs/wikitext103/eva_tiny.py --config.data.path=/data/wikitext-103
    longctx-train   --config configs/wikitext103/eva_tiny.py --config.data.path=/data/wikitext-103 --workdir runs/wt103_eva_tiny
    longctx-eval    --workdir runs/wt103_eva_tiny --split test --set eval.max_tokens=16384
"""

from longctx.config import base_config as base


def get_config():
    c = base()
    c.data.source = "wikitext103"
    c.data.tokenizer = "words"
    c.data.path = ""  # required: --config.data.path=/path/to/wikitext-103
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 32
    c.model.d_ff = 256
    c.model.attention.name = "eva"
    c.model.attention.eva.window_size = 32
    c.model.attention.eva.chunk_size = 8
    c.train.seq_len = 64
    c.train.batch_size = 4
    c.train.steps = 100
    c.train.lr = 3e-3
    c.train.warmup_steps = 10
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.eval_tokens = 2048
    c.train.ckpt_every = 50
    c.eval.reset = "never"
    c.eval.max_tokens = 16384
    c.eval.batch_size = 4
    return c

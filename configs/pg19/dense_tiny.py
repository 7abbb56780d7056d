"""PG-19, SentencePiece, a tiny dense decoder for a CPU smoke run (a couple of minutes
once the data are prepared).

data.path is not set here: give the folder holding metadata.csv, train/, validation/
and test/ on the command line. The tokenizer is trained once on the first
data.options.spm_max_chars characters of train (10^6 here, so preparing stays quick;
the full config uses the standard 10^9):

    longctx-prepare --config configs/pg19/dense_tiny.py --config.data.path=/data/pg19
    longctx-train   --config configs/pg19/dense_tiny.py --config.data.path=/data/pg19 --workdir runs/pg19_tiny
    longctx-eval    --workdir runs/pg19_tiny --split valid --set eval.max_tokens=32768

Reports word-level perplexity with the official word counts (on a max_tokens-limited
evaluation the number is not comparable: it divides a partial NLL by all words).
"""

from longctx.config import base_config as base


def get_config():
    c = base()
    c.data.source = "pg19"
    c.data.tokenizer = "sentencepiece"
    c.data.path = ""  # required: --config.data.path=/path/to/deepmind-gutenberg
    c.data.options.vocab_size = 4096
    c.data.options.spm_max_chars = 1_000_000
    c.model.d_model = 128
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 64
    c.model.d_ff = 512
    c.train.seq_len = 128
    c.train.batch_size = 8
    c.train.steps = 200
    c.train.lr = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    c.train.eval_tokens = 4096
    c.train.ckpt_every = 100
    c.eval.max_tokens = 32768
    return c

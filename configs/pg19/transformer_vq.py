"""PG-19, SentencePiece 32k, Transformer-VQ 1.3B (Lingle 2023; docs/methods/transformer_vq.md §4).

48 GAUs, d_model 2048, one head, Dk 128, Dv 4096, S = L = M = 512, T = 8192 in W = 2048 windows,
batch 128, 500k updates, lr 1e-2 peak with 10k warmup then cosine to 0.1, dropout 0.1 (residual,
sinusoid) and LayerDrop 0.1 (model.gau_layerdrop). Departures forced by the base config: the paper
uses Adafactor (no clip, no weight decay) and a tied, RMSNorm'd head scaled by 0.005; the base trainer
is AdamW, so this file uses AdamW with lr 4e-4 instead of Adafactor's 1e-2. Reported: 26.6 word ppl.

    longctx-train --config configs/pg19/transformer_vq.py --config.data.path=/data/pg19 --workdir runs/pg19_vq

``:tiny`` is a 4-GAU Transformer-VQ (S = L = M = 32) on configs/pg19/dense.py:tiny's data and schedule,
for a 2-core CPU smoke run.
"""

from configs.pg19 import dense
from longctx.config import base_config as base

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    if arg == "tiny":
        return tiny()
    c = base()
    c.data.source = "pg19"
    c.data.tokenizer = "sentencepiece"
    c.data.path = ""  # --config.data.path=/path/to/deepmind-gutenberg
    c.data.options.vocab_size = 32000
    c.model.block = "gau"
    c.model.d_model = 2048
    c.model.num_layers = 48
    c.model.num_heads = 1
    c.model.head_dim = 128
    c.model.gau_expansion = 2
    c.model.norm = "rmsnorm"
    c.model.positions = "none"
    c.model.dropout = 0.1
    c.model.gau_layerdrop = 0.1  # paper: LayerDrop 0.1
    c.model.tie_embeddings = True
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 512
    vq.block_len = 512
    vq.mem_len = 0
    vq.p_dropsin = 0.1
    c.train.seq_len = 8192
    c.train.window = 2048
    c.train.batch_size = 128
    c.train.steps = 500_000
    c.train.lr = 4e-4
    c.train.warmup_steps = 10_000
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.0
    c.train.b2 = 0.98
    c.train.eps = 1e-9
    c.train.grad_clip = 1.0
    c.train.eval_every = 5000
    c.train.ckpt_every = 5000
    c.eval.protocol = "stream"
    c.eval.reset = "row"
    c.eval.row_len = 8192
    return c


def tiny():
    c = dense.get_config("tiny")
    c.model.block = "gau"
    c.model.num_layers = 4
    c.model.num_heads = 1
    c.model.head_dim = 64
    c.model.gau_expansion = 2
    c.model.norm = "rmsnorm"
    c.model.positions = "none"
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 32
    vq.block_len = 32
    vq.mem_len = 0
    c.train.window = c.train.seq_len // 2
    c.eval.reset = "row"
    c.eval.row_len = 0
    return c

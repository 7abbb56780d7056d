"""PG-19, SentencePiece 32k, Transformer-VQ 1.3B (Lingle 2023; docs/methods/transformer_vq.md §4).

48 GAUs, d_model 2048, one head, Dk 128, Dv 4096, S = L = M = 512, T = 8192 in W = 2048 windows,
batch 128, 500k updates, lr 1e-2 peak with 10k warmup then cosine to 0.1, dropout 0.1 (residual,
sinusoid) and LayerDrop 0.1 (model.gau_layerdrop). Departures forced by the base config: the paper
uses Adafactor (no clip, no weight decay) and a tied, RMSNorm'd head scaled by 0.005; the base trainer
is AdamW, so this file uses AdamW with lr 4e-4 instead of Adafactor's 1e-2. Reported: 26.6 word ppl.

    longctx-train --config configs/pg19/transformer_vq.py --config.data.path=/data/pg19 --workdir runs/pg19_vq

``:tiny`` is a 4-GAU Transformer-VQ (S = L = M = 32) on configs/pg19/dense.py:tiny's data and schedule,
for a 2-core CPU smoke run.

One node of 8 GPUs of 80 GB (``:node8``, the paper's batch and rows: data = 8, 8 micro-batches, bf16,
scanned GAUs, remat nothing_saveable, loss_chunk 8000;
see node8() below):

    longctx-train --config configs/pg19/transformer_vq.py:node8 --config.data.path=/data/pg19 --workdir runs/pg19_vq_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/pg19/transformer_vq.py:node8 --dry_run
"""

from configs.base import gpu_node
from configs.pg19 import dense
from longctx.config import base_config as base

VARIANTS = ("tiny", "node8")


def get_config(arg: str | None = None):
    if arg == "tiny":
        return tiny()
    if arg == "node8":
        return node8(get_config())
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


def node8(c):
    """The launch on one node of 8 x 80 GB GPUs (``:node8``), same batch, rows and windows as the paper:
    bf16 activations over fp32 master weights, the 48 GAUs stacked and scanned, each GAU rematerialised
    with nothing saved, data parallel over the 8 GPUs (data = 8: the 1.3B fp32 parameters + AdamW moments,
    ~16 GB, replicated), the 128 rows of each update in 8 micro-batches (2 rows of each 2048-token window per
    device at a time), the 32k softmax NLL over vocabulary chunks. fsdp = 8 is not used: with the parameters
    sharded on d_model, XLA all-reduces whole-micro-batch activations instead of keeping the rows split
    (configs/enwik8/transformer_vq.py node8())."""
    return gpu_node(c, data=8, remat_policy="nothing_saveable", microbatches=8, loss_chunk=8000)
